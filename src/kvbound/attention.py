"""``kvbound.attention``: fused softmax attention over dense or compressed K/V.

The public function validates its inputs and dispatches to one of two ``torch.library`` custom ops
(``kvbound::attention_dense``, ``kvbound::attention_compressed``), each with a fake (meta) implementation
so that ``torch.compile`` traces through them. Both ops run Triton kernels (``kvbound.kernels``): on CUDA
tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before kvbound is
imported). There is no silent fallback to another implementation.
"""

from __future__ import annotations

import math

import torch

from kvbound._validate import check_finite_many, check_tensor
from kvbound.codec.format import CompressedKV

__all__ = ["attention"]

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BIAS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    *,
    scale: float | None = None,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``softmax(scale * q k^T + bias) v`` in one fused kernel.

    Args:
        q: ``[B, Hq, Nq, Dk]`` float16, bfloat16 or float32 (float32 for CPU tests), any strides.
        k: ``[B, Hkv, Nk, Dk]`` tensor of q's dtype, or a :class:`kvbound.CompressedKV` of that shape.
        v: ``[B, Hkv, Nk, Dv]`` tensor of q's dtype, or a :class:`kvbound.CompressedKV` (k and v are both
            compressed or both dense). ``Hq`` must be a multiple of ``Hkv`` (MHA, GQA, MQA): query head ``h``
            reads K/V head ``h // (Hq // Hkv)``. ``Dk`` and ``Dv`` may differ. Compressed K/V are read in
            place: every tile is rebuilt on chip, never expanded in memory.
        scale: logit scale, default ``1 / sqrt(Dk)``.
        causal: key ``j`` is visible to query ``i`` iff ``j <= i`` (top-left aligned, as torch SDPA's
            ``is_causal``).
        bias: additive logit bias of any float dtype, broadcastable to ``[B, Hq, Nq, Nk]`` (size-1 dimensions
            are read with stride 0, never materialised), added after scaling.
        softcap: if given (> 0), logits become ``softcap * tanh(logits / softcap)`` after the bias and before
            the causal mask.
        return_lse: also return the natural-log log-sum-exp of the final logits, ``[B, Hq, Nq]`` float32.

    Returns:
        ``out`` ``[B, Hq, Nq, Dv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.

    Raises:
        TypeError / ValueError naming the offending argument for wrong types, shapes, dtypes, devices and
        for NaN or Inf in any input.
    """
    check_tensor(q, "q", ndim=4, dtypes=_QUERY_DTYPES, check_finite=False)
    batch, q_heads, n_q, head_dim_k = q.shape
    compressed = isinstance(k, CompressedKV)
    if compressed != isinstance(v, CompressedKV):
        raise TypeError(
            "k, v: expected both torch.Tensor or both kvbound.CompressedKV, got "
            f"{type(k).__name__} and {type(v).__name__}"
        )
    if compressed:
        k_shape, v_shape = tuple(k.shape), tuple(v.shape)
        _check_compressed(k, q, "k")
        _check_compressed(v, q, "v")
    else:
        check_tensor(k, "k", ndim=4, dtypes=(q.dtype,), check_finite=False)
        check_tensor(v, "v", ndim=4, dtypes=(q.dtype,), check_finite=False)
        k_shape, v_shape = tuple(k.shape), tuple(v.shape)
        _check_device(k.device, q, "k")
        _check_device(v.device, q, "v")
    kv_heads, n_k = k_shape[1], k_shape[2]
    if k_shape[0] != batch or k_shape[3] != head_dim_k:
        raise ValueError(f"k: expected shape [{batch}, Hkv, Nk, {head_dim_k}] (B and Dk from q), got {list(k_shape)}")
    if v_shape[:3] != k_shape[:3]:
        raise ValueError(f"v: expected shape [{batch}, {kv_heads}, {n_k}, Dv] (from k), got {list(v_shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"q: expected a head count that is a multiple of k's {kv_heads}, got {q_heads}")
    if n_q < 1 or n_k < 1 or head_dim_k < 1 or v_shape[3] < 1:
        raise ValueError(
            f"q, k, v: expected non-empty sequences and head dims, got q {list(q.shape)}, "
            f"k {list(k_shape)}, v {list(v_shape)}"
        )
    if q.device.type == "cpu":
        from kvbound.kernels._common import interpreting

        if not interpreting():
            raise RuntimeError(
                "q: kvbound.attention runs Triton kernels; CPU tensors need Triton's interpreter "
                "(set TRITON_INTERPRET=1 before importing kvbound) or move the tensors to a CUDA device"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim_k)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        raise ValueError(f"softcap: expected a finite value > 0 or None, got {softcap!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    bias4 = None
    if bias is not None:
        bias4 = _broadcast_bias(bias, (batch, q_heads, n_q, n_k), q)

    softcap = None if softcap is None else float(softcap)
    if compressed:
        out, lse = torch.ops.kvbound.attention_compressed(
            q,
            k.coeffs,
            k.basis,
            k.mode,
            k.scale,
            k.bits,
            k.offset,
            k.codes,
            k.raw,
            v.coeffs,
            v.basis,
            v.mode,
            v.scale,
            v.bits,
            v.offset,
            v.codes,
            v.raw,
            bias4,
            float(scale),
            causal,
            softcap,
            k.config.block_size,
            v.config.block_size,
            k.shared_basis,
            v.shared_basis,
        )
    else:
        out, lse = torch.ops.kvbound.attention_dense(q, k, v, bias4, float(scale), causal, softcap)
    return (out, lse) if return_lse else out


def _check_device(device: torch.device, q: torch.Tensor, name: str) -> None:
    if device != q.device:
        raise ValueError(f"{name}: expected device {q.device} (q's), got {device}")


def _check_compressed(ckv: CompressedKV, q: torch.Tensor, name: str) -> None:
    """Shapes of the stored tensors against ``ckv.shape`` (the layout in ``kvbound.codec.format``)."""
    _check_device(ckv.device, q, name)
    b, h, n, d = ckv.shape
    nb, r = ckv.num_blocks, ckv.rank
    expected = {
        "coeffs": (b, h, n, r),
        "basis": (h, r, d) if ckv.shared_basis else (b, h, nb, r, d),
        "mode": (b, h, nb),
        "scale": (b, h, nb),
        "bits": (b, h, nb),
        "offset": (b, h, nb),
    }
    for field, shape in expected.items():
        got = tuple(getattr(ckv, field).shape)
        if got != shape:
            raise ValueError(
                f"{name}.{field}: expected shape {list(shape)} for a CompressedKV of shape "
                f"{list(ckv.shape)}, got {list(got)}"
            )
    if ckv.coeffs.dtype not in (torch.float16, torch.float32):
        raise TypeError(f"{name}.coeffs: expected float16 or float32, got {ckv.coeffs.dtype}")
    if ckv.basis.dtype != torch.float16:
        raise TypeError(f"{name}.basis: expected float16, got {ckv.basis.dtype}")


def _broadcast_bias(bias: object, shape: tuple[int, int, int, int], q: torch.Tensor) -> torch.Tensor:
    """A stride-0 view of ``bias`` with ``shape`` (no copy)."""
    check_tensor(bias, "bias", dtypes=_BIAS_DTYPES, check_finite=False)
    _check_device(bias.device, q, "bias")
    if bias.dim() > 4 or any(size not in (1, want) for size, want in zip(bias.shape[::-1], shape[::-1], strict=False)):
        raise ValueError(f"bias: expected a shape broadcastable to {list(shape)}, got {list(bias.shape)}")
    return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(shape)


# -------------------------------------------------------------------------------------------- custom ops
def _check_values(**tensors: torch.Tensor | None) -> None:
    check_finite_many(tensors)


@torch.library.custom_op("kvbound::attention_dense", mutates_args=())
def _attention_dense_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kvbound.kernels.attention_dense import attention_dense_fwd

    _check_values(q=q, k=k, v=v, bias=bias)
    return attention_dense_fwd(q, k, v, bias, scale, causal, softcap)


@_attention_dense_op.register_fake
def _attention_dense_fake(q, k, v, bias, scale, causal, softcap):
    b, hq, nq, _ = q.shape
    return q.new_empty(b, hq, nq, v.shape[3]), q.new_empty(b, hq, nq, dtype=torch.float32)


@torch.library.custom_op("kvbound::attention_compressed", mutates_args=())
def _attention_compressed_op(
    q: torch.Tensor,
    k_coeffs: torch.Tensor,
    k_basis: torch.Tensor,
    k_mode: torch.Tensor,
    k_scale: torch.Tensor,
    k_bits: torch.Tensor,
    k_offset: torch.Tensor,
    k_codes: torch.Tensor,
    k_raw: torch.Tensor,
    v_coeffs: torch.Tensor,
    v_basis: torch.Tensor,
    v_mode: torch.Tensor,
    v_scale: torch.Tensor,
    v_bits: torch.Tensor,
    v_offset: torch.Tensor,
    v_codes: torch.Tensor,
    v_raw: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    k_block_size: int,
    v_block_size: int,
    k_shared_basis: bool,
    v_shared_basis: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd

    _check_values(
        q=q,
        bias=bias,
        **{
            "k.coeffs": k_coeffs,
            "k.basis": k_basis,
            "k.scale": k_scale,
            "k.raw": k_raw,
            "v.coeffs": v_coeffs,
            "v.basis": v_basis,
            "v.scale": v_scale,
            "v.raw": v_raw,
        },
    )
    n_k = k_coeffs.shape[2]
    # The kernel indexes the small per-block tensors and the flat buffers as contiguous (no-op copies).
    k_op = CompressedOperand(
        k_coeffs,
        k_basis.contiguous(),
        k_mode.contiguous(),
        k_scale.contiguous(),
        k_bits.contiguous(),
        k_offset.contiguous(),
        k_codes.contiguous(),
        k_raw.contiguous(),
        seq_len=n_k,
        head_dim=k_basis.shape[-1],
        block_size=k_block_size,
        shared_basis=k_shared_basis,
    )
    v_op = CompressedOperand(
        v_coeffs,
        v_basis.contiguous(),
        v_mode.contiguous(),
        v_scale.contiguous(),
        v_bits.contiguous(),
        v_offset.contiguous(),
        v_codes.contiguous(),
        v_raw.contiguous(),
        seq_len=n_k,
        head_dim=v_basis.shape[-1],
        block_size=v_block_size,
        shared_basis=v_shared_basis,
    )
    return attention_compressed_fwd(q, k_op, v_op, bias, scale, causal, softcap)


@_attention_compressed_op.register_fake
def _attention_compressed_fake(
    q, k_coeffs, k_basis, k_mode, k_scale, k_bits, k_offset, k_codes, k_raw, v_coeffs, v_basis, *rest
):
    b, hq, nq, _ = q.shape
    return q.new_empty(b, hq, nq, v_basis.shape[-1]), q.new_empty(b, hq, nq, dtype=torch.float32)
