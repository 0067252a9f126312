"""``kvbound.attention``: fused softmax attention over dense or compressed K/V.

The public function validates its inputs and dispatches to one of two ``torch.library`` custom ops
(``kvbound::attention_dense``, ``kvbound::attention_compressed``), each with a fake (meta) implementation
so that ``torch.compile`` traces through them. Both ops run Triton kernels (``kvbound.kernels``): on CUDA
tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before kvbound is
imported). There is no silent fallback to another implementation.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch

from kvbound import _checks
from kvbound._validate import FLOAT_DTYPES_AND_64, check_finite_values, check_tensor
from kvbound.codec.format import CompressedKV, check_layout, decoded_magnitude, layout_violations, stored_shapes

__all__ = ["attention"]

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels form t = logit / softcap in float32; up to this cap every logit above 2**-62 gives a normal t.
_LARGEST_SOFTCAP = 2.0**64
_SMALLEST_SOFTCAP = 2.0**-64
# The kernels index tiles of the compact bias with 32-bit integers.
_LARGEST_BIAS_TILE = 2**30
_BIAS_DTYPES = FLOAT_DTYPES_AND_64


def attention(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    *,
    scale: float | None = None,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    bias_tile: int = 1,
    softcap: float | None = None,
    relative_keys: torch.Tensor | None = None,
    relative_content_bias: torch.Tensor | None = None,
    relative_position_bias: torch.Tensor | None = None,
    relative_runs: Sequence[int] | torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``softmax(scale * q k^T + bias) v`` in one fused kernel, optionally with
    Transformer-XL relative positions (Enformer, Borzoi).

    Args:
        q: ``[B, Hq, Nq, Dk]`` float16, bfloat16 (on CUDA devices: Triton's CPU interpreter multiplies bfloat16
            tiles wrongly) or float32, any strides.
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
        bias_tile: ``T``, a power of two. With ``T > 1``, ``bias`` is a pair bias constant over ``T x T`` tiles of
            (query, key) positions in its compact form, broadcastable to ``[B, Hq, ceil(Nq / T), ceil(Nk / T)]``:
            logit ``(i, j)`` gets ``bias[..., i // T, j // T]`` (AlphaGenome: ``T = 16``). The kernels read the
            compact tensor; it is never expanded. Without a bias it must be 1.
        softcap: if given (2**-64 to 2**64, with ``|scale| / softcap`` within float32's range), logits become
            ``softcap * tanh(logits / softcap)`` after the bias and before the causal mask. The kernels' tanh errs
            by a few 2**-24 of the cap where that is under a quarter of q's dtype's rounding of a unit logit (bf16
            caps up to 8192, fp16 up to 1024, fp32 up to 1/8), else by a few 2**-24 of each logit
            (``kernels._common.softcap_form``).
        relative_keys: ``R``, ``[Hq, Nq + Nk - 1, Dk]`` of q's dtype (``[H, 2N - 1, Dk]`` for self-attention); row
            ``m`` is the key of distance ``m - (Nq - 1)`` (key position minus query position). Dense or
            compressed K/V, ``Hq == Hkv`` only. The logits become (Transformer-XL; ``scale`` multiplies q only)::

                logit[i, j] = (scale q_i + u) . k_j + (scale q_i + w) . R[Nq - 1 + j - i]  (+ bias[i, j])

            The kernel forms each tile's relative term on chip from the ``BM + BN - 1`` rows of ``R`` it needs; no
            ``[Nq, Nk]`` or ``[Nq, Nq + Nk - 1]`` tensor exists.
        relative_content_bias: ``u``, ``[Hq, Dk]``, ``[Dk]`` or broadcastable to ``[1, Hq, 1, Dk]`` (the ports
            store ``[1, H, 1, Dk]``), any float dtype; default zero. Only with ``relative_keys``.
        relative_position_bias: ``w`` (Transformer-XL's ``v``), same shapes; default zero.
        relative_runs: optional, with ``relative_keys``: the first rows of runs of rows of ``R`` that are equal
            (increasing ints from 0; Borzoi's step-function features give at most 33 runs at any length). The
            kernel then reads one float32 value per query and run, ``(scale q_i + w) . R[run start]`` (each program
            writes its queries' values first), instead of the relative keys: the same logits without the per-tile
            product and skew. Checked in the call's host read (a row that differs from its run's first row raises
            ``ValueError``). ``relative_keys`` may then also hold one row per run, ``[Hq, len(relative_runs), Dk]``:
            row ``r`` is the key of every distance of run ``r`` (nothing to check, and none of the full rows to
            compute). Dense and compressed K/V alike, except where one kernel tile (``BM + BN - 1 <= 127``
            distances) spans more than 16 runs: compressed K/V then read ``R`` as without it (expanded to
            ``[Hq, Nq + Nk - 1, Dk]`` when given per run; the runs are still checked), dense K/V walk the runs in
            an inner loop.
        return_lse: also return the natural-log log-sum-exp of the final logits, ``[B, Hq, Nq]`` float32.

    Returns:
        ``out`` ``[B, Hq, Nq, Dv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``. ``out`` is laid out in
        q's memory order (as ``scaled_dot_product_attention`` does on cuDNN and FlashAttention): for a q that is a
        head-split view of ``[B, Nq, Hq * D]``, ``out.transpose(1, 2).reshape(B, Nq, Hq * Dv)`` is a view.

    Raises:
        TypeError / ValueError naming the offending argument for wrong types, shapes, dtypes, devices, for NaN
        or Inf in any input, for finite values so large that the kernels' float32 logits or sums would
        overflow, and for compressed K/V whose stored layout is broken (modes, code widths, or blocks that would
        be read outside ``codes`` or ``raw``: checked at an object's first call, or in every call where no record
        can be kept, under inference mode or when the op is dispatched). The kernels compute the forward only: a
        backward through the result raises ``RuntimeError``.
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
        if q.dtype == torch.bfloat16:
            raise TypeError(
                "q: expected float16 or float32 on the CPU, got torch.bfloat16: Triton's interpreter computes "
                "products of bfloat16 tiles wrongly; bfloat16 runs on a CUDA device"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim_k)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float or None, got {_type_name(scale)} (pass float(scale))")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        raise TypeError(f"softcap: expected a float or None, got {_type_name(softcap)} (pass float(softcap))")
    if softcap is not None and (not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap: expected a finite value > 0 or None, got {softcap!r}")
    if softcap is not None and softcap > _LARGEST_SOFTCAP:
        raise ValueError(
            f"softcap: expected at most 2**64 or None, got {softcap!r}: the kernels divide each logit by the cap in "
            "float32, so small logits would leave its normal range; a cap this large changes a logit x by about "
            "x**3 / (3 softcap**2): pass softcap=None"
        )
    if softcap is not None and not (softcap >= _SMALLEST_SOFTCAP and abs(scale) / softcap <= _FLOAT32_MAX):
        raise ValueError(
            f"softcap: expected at least 2**-64 and |scale| / softcap within float32's range, got softcap {softcap!r} "
            f"at scale {scale!r}: the kernels multiply logits by scale / softcap and the bias by 1 / softcap in float32"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected bool, got {type(return_lse).__name__}")
    if isinstance(bias_tile, bool) or not isinstance(bias_tile, int):
        raise TypeError(f"bias_tile: expected int, got {type(bias_tile).__name__}")
    if bias_tile < 1 or bias_tile & (bias_tile - 1) or bias_tile > _LARGEST_BIAS_TILE:
        raise ValueError(f"bias_tile: expected a power of two from 1 to 2**30, got {bias_tile}")
    if bias is None and bias_tile != 1:
        raise ValueError(f"bias_tile: expected 1 without a bias (it gives the tile size of bias), got {bias_tile}")
    bias4 = None
    if bias is not None:
        bias4 = _bias_4d(bias, (batch, q_heads, n_q, n_k), bias_tile, q)
    runs, dense_span, compressed_span = _relative_runs(relative_runs, relative_keys, n_q + n_k - 1, q)
    run_span = compressed_span if compressed else dense_span
    relative = _relative_operands(
        relative_keys, relative_content_bias, relative_position_bias, q, n_k, kv_heads,
        run_count=None if runs is None else runs.numel(),
    )  # fmt: skip

    softcap = None if softcap is None else float(softcap)
    if not compressed and _plain_eager((q, k, v, bias4, *relative)):
        # Same function the op runs, without the dispatcher's wrapping (nothing would observe the op).
        out, lse = _attention_dense(
            q, k, v, bias4, bias_tile, float(scale), causal, softcap, *relative, runs, run_span
        )
    elif compressed:
        known, shares, general = (-1, -1), (-1.0, -1.0), (-1, -1)
        largest, but_raw = (-1.0, -1.0), (-1.0, -1.0)
        # Under a profiler the op runs (the trace names it), with the objects' records as in plain eager mode.
        recorded = _plain_eager((q, bias4, *relative, *k._tensors().values(), *v._tensors().values()), profiled=True)
        plain = recorded and not torch.autograd.profiler._is_profiler_enabled
        if recorded:
            known_k, share_k, general_k = _recorded_residual(k, "k")
            known_v, share_v, general_v = _recorded_residual(v, "v")
            known, shares, general = (known_k, known_v), (share_k, share_v), (general_k, general_v)
            largest = tuple(-1.0 if m is None else m for m in (k._checked_magnitude(), v._checked_magnitude()))
            but_raw = tuple(-1.0 if m is None else m for m in (k._magnitude_but_raw(), v._magnitude_but_raw()))
        # In plain eager mode the op's implementation is called directly, as for dense K/V (see _plain_eager).
        run = _attention_compressed if plain else torch.ops.kvbound.attention_compressed
        out, lse = run(
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
            bias_tile,
            float(scale),
            causal,
            softcap,
            k.config.block_size,
            v.config.block_size,
            k.shared_basis,
            v.shared_basis,
            k.config.bits,
            v.config.bits,
            *relative,
            k_residual=known[0],
            v_residual=known[1],
            k_lowrank_share=shares[0],
            v_lowrank_share=shares[1],
            k_general=general[0],
            v_general=general[1],
            relative_runs=runs,
            relative_run_span=run_span,
            k_largest=largest[0],
            v_largest=largest[1],
            k_largest_but_raw=but_raw[0],
            v_largest_but_raw=but_raw[1],
        )
    else:
        out, lse = torch.ops.kvbound.attention_dense(
            q, k, v, bias4, bias_tile, float(scale), causal, softcap, *relative, runs, run_span
        )
    return (out, lse) if return_lse else out


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _type_name(value: object) -> str:
    """``float32`` as ``numpy.float32``: a type's module where it is not a builtin, so that it does not read as a
    torch dtype."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"


def _plain_eager(tensors: tuple, *, profiled: bool = False) -> bool:
    """Whether calling an op's implementation directly is indistinguishable from calling the op: eager mode
    (not traced by ``torch.compile``), no dispatch or function mode (fake tensors, ``FlopCounterMode``, device
    contexts), no functorch transform, no profiler (which records the op by name), plain tensors only (no
    subclass), and no input that requires grad while grad mode is on (the op gives those its autograd error).
    ``profiled``: a running profiler counts as plain eager too (it records the op but sees the same tensors, so
    what is recorded on them, such as a CompressedKV's checks, still holds)."""
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or (torch.autograd.profiler._is_profiler_enabled and not profiled)
    ):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TENSORS or t.is_meta or (grad and t.requires_grad)):
            return False  # meta tensors take the op's fake implementation
    return True


def _check_device(device: torch.device, q: torch.Tensor, name: str) -> None:
    if device != q.device:
        raise ValueError(f"{name}: expected device {q.device} (q's), got {device}")


# The floating tensors of a CompressedKV that a call checks for NaN/Inf.
_CHECKED_FIELDS = ("coeffs", "basis", "scale", "raw")


def _recorded_residual(ckv: CompressedKV, name: str) -> tuple[int, float, int]:
    """``(1 / 0, share, general)``: ``ckv``'s stored tensors are finite and some / no block holds a residual, the
    share of its blocks that use low rank only (-1.0 where unknown), and whether some block needs the compressed
    kernel's general loop (1 / 0; -1 where unknown: ``kernels.attention_compressed.general_blocks``), as recorded
    on the object (``CompressedKV._record_checked``) and unchanged since. The first call on an object without a
    record checks it here (one host synchronisation, under ``kvbound.deferred_checks()`` too) and records the
    result, so calls that reuse compressed K/V, and K/V fresh from the Triton encoder (which records what it
    certified), skip the check. ``(-1, -1.0, -1)``: no record can be kept (inference tensors); the op checks on
    every call."""
    from kvbound.kernels.attention_compressed import general_blocks

    residual = ckv._checked_residual()
    if residual is None:
        if ckv._stamps() is None:  # nothing could be recorded: the op checks these with the call's other checks
            return -1, -1.0, -1
        # The layout (modes, widths, every block's reads inside codes and raw), once per object and version, in the
        # same read as the finite values: the kernels index codes and raw by the stored offsets. A failed block
        # check is then named by check_layout (a second read, on that path only).
        check_layout(ckv, name, packed=False, values=False)
        count = layout_violations(ckv.mode, ckv.bits, ckv.offset, ckv.shape[2], ckv.shape[3], ckv.config.block_size,
                                  ckv.config.bits, ckv.codes.numel(), ckv.raw.numel())  # fmt: skip
        layout = f"{name}: expected the layout of kvbound.CompressedKV, got {{count}} failed block checks"
        tensors = {f"{name}.{field}": getattr(ckv, field) for field in _CHECKED_FIELDS}
        general = general_blocks(ckv.mode, ckv.bits, ckv.offset, ckv.config.bits, ckv.shape[3])
        peaks: dict[str, float] = {}
        try:  # with flags: never deferred
            share, no_general = _queue_checks(tensors, flags=(ckv.mode, general), conditions=((layout, count),),
                                              limit=_keep_peaks(peaks))()  # fmt: skip
        except ValueError as err:
            if str(err).startswith(layout.split("{")[0]):
                check_layout(ckv, name, packed=False)
            raise
        ckv._record_checked(share < 1, share, general=no_general < 1)
        ckv._record_magnitude(decoded_magnitude(ckv.rank, *(peaks.get(f"{name}.{f}", 0.0) for f in _CHECKED_FIELDS)))
        return int(share < 1), share, int(no_general < 1)
    share = ckv._checked_lowrank_share()
    general = ckv._checked_general()
    return int(residual), -1.0 if share is None else share, -1 if general is None else int(general)


def _keep_peaks(into: dict[str, float]) -> _checks.Limit:
    """A magnitude check that accepts everything and keeps the largest magnitudes it is given in ``into``."""

    def keep(peaks: dict[str, float]) -> None:
        into.update(peaks)

    return keep



def _check_compressed(ckv: CompressedKV, q: torch.Tensor, name: str) -> None:
    """Shapes of the stored tensors against ``ckv.shape`` (the layout in ``kvbound.codec.format``)."""
    _check_device(ckv.device, q, name)
    expected = stored_shapes(tuple(ckv.shape), ckv.num_blocks, ckv.rank, ckv.shared_basis)
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


def _relative_bias(t: object, name: str, heads: int, head_dim: int, q: torch.Tensor) -> torch.Tensor:
    """A Transformer-XL query bias as float32 ``[heads, head_dim]`` contiguous (a small copy)."""
    check_tensor(t, name, dtypes=_BIAS_DTYPES, check_finite=False)
    _check_device(t.device, q, name)
    shape = tuple(t.shape)
    if t.dim() == 1 and shape == (head_dim,):
        t = t[None, :]
    elif t.dim() == 2 and shape in ((heads, head_dim), (1, head_dim)):
        pass
    elif t.dim() == 4 and all(size in (1, want) for size, want in zip(shape, (1, heads, 1, head_dim), strict=True)):
        t = t.reshape(t.shape[1], head_dim) if shape[3] == head_dim else None
    else:
        t = None
    if t is None:
        raise ValueError(
            f"{name}: expected shape [{heads}, {head_dim}], [{head_dim}] or one broadcastable to "
            f"[1, {heads}, 1, {head_dim}] (Hq, Dk from q), got {list(shape)}"
        )
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    if tuple(t.shape) != (heads, head_dim):
        t = t.expand(heads, head_dim)
    return t if t.is_contiguous() else t.contiguous()


# Zero [H, Dk] float32 biases by (H, Dk, device): read-only kernel operands, so one per signature serves every call.
_ZERO_BIASES: dict[tuple, torch.Tensor] = {}


def _zero_bias(heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a cached tensor stored from a traced graph could live in its memory pool
        return torch.zeros(heads, head_dim, dtype=torch.float32, device=device)
    key = (heads, head_dim, device)
    zeros = _ZERO_BIASES.get(key)
    if zeros is None:
        zeros = _ZERO_BIASES[key] = torch.zeros(heads, head_dim, dtype=torch.float32, device=device)
    return zeros


def _relative_operands(
    relative_keys: object,
    content_bias: object,
    position_bias: object,
    q: torch.Tensor,
    n_k: int,
    kv_heads: int,
    run_count: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Validated ``(relative_keys, content_bias [Hq, Dk] float32, position_bias [Hq, Dk] float32)``, or three
    Nones without relative positions. ``run_count``: the number of runs when ``relative_runs`` is given, whose
    keys may then come one row per run."""
    if relative_keys is None:
        for name, t in (("relative_content_bias", content_bias), ("relative_position_bias", position_bias)):
            if t is not None:
                raise ValueError(f"{name}: given without relative_keys (it only applies to relative positions)")
        return None, None, None
    batch, heads, n_q, head_dim = q.shape
    if heads != kv_heads:
        raise ValueError(
            f"relative_keys: relative positions need one query head per K/V head, got Hq={heads}, Hkv={kv_heads}"
        )
    check_tensor(relative_keys, "relative_keys", ndim=3, dtypes=(q.dtype,), check_finite=False)
    _check_device(relative_keys.device, q, "relative_keys")
    expected = (heads, n_q + n_k - 1, head_dim)
    per_run = None if run_count is None else (heads, run_count, head_dim)
    if tuple(relative_keys.shape) not in (expected, per_run):
        also = "" if per_run is None else f" or, one row per run, [Hq, len(relative_runs), Dk] = {list(per_run)}"
        raise ValueError(
            f"relative_keys: expected shape [Hq, Nq + Nk - 1, Dk] = {list(expected)}{also}, "
            f"got {list(relative_keys.shape)}"
        )
    if content_bias is None:
        u = _zero_bias(heads, head_dim, q.device)
    else:
        u = _relative_bias(content_bias, "relative_content_bias", heads, head_dim, q)
    if position_bias is None:
        w = _zero_bias(heads, head_dim, q.device)
    else:
        w = _relative_bias(position_bias, "relative_position_bias", heads, head_dim, q)
    return relative_keys, u, w


# Device copies of run starts and their spans in the dense and the compressed kernel by (starts, device): a copy from
# host memory waits for the device's queued work, so each layout is copied once (a model calls with the same runs in
# every layer and forward).
_RUNS_ON_DEVICE: dict[tuple, tuple[torch.Tensor, int, int]] = {}


def _run_values(runs: object, rows: int) -> list[int]:
    """Run starts (a sequence of ints or a 1-D integer tensor, read to the host) as a list, checked: increasing
    from 0 and below ``rows`` (``Nq + Nk - 1`` relative rows)."""
    if isinstance(runs, torch.Tensor):
        if runs.dim() != 1 or runs.dtype.is_floating_point or runs.dtype.is_complex or runs.dtype == torch.bool:
            raise ValueError(f"relative_runs: expected a 1-D integer tensor, got {runs.dim()}-D {runs.dtype}")
        values = runs.tolist()  # a device tensor is read here: pass a list to avoid that read
    else:
        try:
            if any(isinstance(x, bool) for x in runs):
                raise TypeError
            values = [operator.index(x) for x in runs]  # ints, NumPy ints, range
        except TypeError:
            raise TypeError(
                f"relative_runs: expected a sequence of ints or a 1-D integer tensor, got {type(runs).__name__} "
                "holding other values"
            ) from None
    increasing = all(b > a for a, b in zip(values[:-1], values[1:], strict=True))
    if not values or values[0] != 0 or not increasing or values[-1] >= rows:
        shown = values if len(values) <= 8 else [*values[:4], "...", *values[-2:]]
        raise ValueError(
            f"relative_runs: expected increasing first rows of runs from 0, below {rows} (Nq + Nk - 1), got {shown}"
        )
    return values


def _relative_runs(
    runs: object, relative_keys: object, rows: int, q: torch.Tensor
) -> tuple[torch.Tensor | None, int, int]:
    """``relative_runs`` validated on the host as an int64 tensor on q's device, with the ``RUN_SPAN`` of the dense
    kernel and that of the compressed kernel for it (``relative_run_span`` over each kernel's window of distances,
    ``attention_dense.relative_window()`` and ``attention_compressed.RUNS_WINDOW``), all cached per layout; or
    ``(None, 0, 0)``."""
    if runs is None:
        return None, 0, 0
    if relative_keys is None:
        raise ValueError("relative_runs: given without relative_keys (it only describes relative keys)")
    values = _run_values(runs, rows)
    key = (tuple(values), q.device)
    found = _RUNS_ON_DEVICE.get(key)
    if found is None:
        if len(_RUNS_ON_DEVICE) >= 64:
            _RUNS_ON_DEVICE.clear()
        from kvbound.kernels.attention_compressed import COMPRESSED_RUN_SPAN, RUNS_WINDOW
        from kvbound.kernels.attention_dense import relative_run_span

        starts = torch.tensor(values, dtype=torch.int64, device=q.device)
        compressed_span = relative_run_span(values, rows, RUNS_WINDOW, COMPRESSED_RUN_SPAN)
        found = _RUNS_ON_DEVICE[key] = (starts, relative_run_span(values, rows), compressed_span)
    return found


def expand_run_keys(keys: torch.Tensor, starts: torch.Tensor | Sequence[int], rows: int, *,
                    checked: bool = False) -> torch.Tensor:  # fmt: skip
    """Relative keys given one row per run (``[H, R, Dk]``, runs starting at the rows ``starts``, increasing from
    0 and below ``rows``) as the full ``[H, rows, Dk]``: each run's row repeated over its rows. ``starts`` is
    checked (a tensor is read to the host for that) unless ``checked`` (``kvbound.attention``'s own runs, checked
    by ``_relative_runs``)."""
    if not checked:
        _run_values(starts, rows)
    if keys.shape[1] != len(starts):
        raise ValueError(f"relative_keys: expected one row per run ({len(starts)}), got {keys.shape[1]}")
    starts = torch.as_tensor(starts, dtype=torch.int64, device=keys.device)
    ends = torch.cat([starts[1:], starts.new_full((1,), rows)])
    return torch.repeat_interleave(keys, ends - starts, dim=1, output_size=rows)


def _bias_4d(bias: object, shape: tuple[int, int, int, int], bias_tile: int, q: torch.Tensor) -> torch.Tensor:
    """``bias`` as a 4-d view (leading size-1 dimensions added, no copy) after checking that it broadcasts to
    ``shape`` (or to the tile grid ``[B, Hq, ceil(Nq / T), ceil(Nk / T)]`` for ``bias_tile = T > 1``). The
    kernels read size-1 dimensions with stride 0, so the view is never expanded (nor is any finite check)."""
    check_tensor(bias, "bias", dtypes=_BIAS_DTYPES, check_finite=False)
    _check_device(bias.device, q, "bias")
    if bias_tile > 1:
        b, h, n_q, n_k = shape
        shape = (b, h, -(-n_q // bias_tile), -(-n_k // bias_tile))
    if bias.dim() > 4 or any(size not in (1, want) for size, want in zip(bias.shape[::-1], shape[::-1], strict=False)):
        if bias_tile > 1:
            raise ValueError(
                f"bias: expected a shape broadcastable to [B, Hq, ceil(Nq / {bias_tile}), ceil(Nk / {bias_tile})] = "
                f"{list(shape)} for bias_tile={bias_tile}, got {list(bias.shape)}"
            )
        raise ValueError(f"bias: expected a shape broadcastable to {list(shape)}, got {list(bias.shape)}")
    return bias if bias.dim() == 4 else bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))


# -------------------------------------------------------------------------------------------- custom ops
def _queue_checks(
    tensors: dict[str, torch.Tensor | None] | tuple[tuple[str, torch.Tensor | None], ...],
    flags: tuple[torch.Tensor, ...] = (),
    full_bias_shape: tuple[int, ...] | None = None,
    conditions: tuple[tuple[str, torch.Tensor], ...] = (),
    limit: _checks.Limit | None = None,
    label: object = None,
    call: bool = True,
) -> Callable[[], list[float]]:
    """Queue the call's checks on the device and return the function that reads them: the call's only host
    synchronisation. Reading raises ``ValueError`` (as ``check_finite_values``) for NaN or Inf in ``tensors``
    (name -> tensor, a dict or ``(name, tensor)`` pairs; None entries are skipped) and returns, for each
    nonnegative integer tensor in ``flags`` (modes), the share of its elements that are zero (low-rank blocks; 1.0
    for an empty tensor): below 1 exactly when it has a nonzero element.

    One float64 largest magnitude per tensor (``_checks.largest_magnitudes``, one multi-tensor call: NaN or
    Inf exactly when the tensor holds one; the element-wise check then names the first), plus one count per flag
    tensor, all in one tensor read back at once. The launchers read the result after their host-side preparation,
    so that the preparation overlaps the device work queued before it.
    ``full_bias_shape``: the shape ``bias`` broadcasts to, so that an error names the same index and count as
    for the expanded bias. ``conditions``: ``(message, count)`` pairs, a scalar that must be zero, else
    ``ValueError(message.format(count=...))`` after the finite checks (deferred with them). ``limit``: a check of
    the largest magnitudes once they are finite (``_Overflow``), raised as ``ValueError`` (deferred with them).
    ``label``: what a deferred error names the call by (default: q's shape, where q is among ``tensors``); ``call``:
    whether the deferred entry counts as an attention call (``DeferredChecks.queue``)."""
    pairs = tensors.items() if isinstance(tensors, dict) else tensors
    present = [(name, t) for name, t in pairs if t is not None and t.is_floating_point() and t.numel()]
    deferred = _checks.active()
    if deferred is not None and not flags:
        # Inside kvbound.deferred_checks(): queued on the device, read once at the block's end. The call's label
        # is only formatted for an error.
        q = next((t for name, t in present if name == "q"), None)
        if label is None:
            label = "" if q is None else _ShapeLabel("q", q.shape, deferred.layer)
        deferred.queue(label, present, conditions, limit, call=call)
        return _no_flags
    checks = [_checks.largest_magnitudes([t for _, t in present])] if present else []
    checks += [torch.count_nonzero(f).to(torch.float64).reshape(1) for f in flags]
    checks += [count.reshape(1).to(torch.float64) for _, count in conditions]
    stacked = (torch.cat(checks) if len(checks) > 1 else checks[0]) if checks else None

    def read() -> list[float]:
        if stacked is None:
            return []
        values = stacked.tolist()
        if not all(math.isfinite(x) for x in values[: len(present)]):
            for name, t in present:
                if name == "bias" and full_bias_shape is not None:
                    t = t.expand(full_bias_shape)
                check_finite_values(t, name)
        if limit is not None:
            message = limit({name: value for (name, _), value in zip(present, values, strict=False)})
            if message is not None:
                raise ValueError(message)
        nonzero = values[len(present) : len(present) + len(flags)]
        for (message, _), count in zip(conditions, values[len(present) + len(flags) :], strict=True):
            if count != 0:
                raise ValueError(message.format(count=round(count)))
        return [1 - count / max(1, f.numel()) for count, f in zip(nonzero, flags, strict=True)]

    return read


def _no_flags() -> list[float]:
    return []


# The kernels sum logits and the unnormalised P @ V in float32. A softmax weight is at most 1 with a running or
# bounded maximum, and at most 2**14 with the fixed maximum of a soft-cap (``kernels._common.fixed_softmax_max``).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
# Where the kernels multiply further (row scales, summed terms), float32's range over 2**8 leaves room for it.
_FLOAT32_ROOM = _FLOAT32_MAX / 2**8
_FIXED_MAX_WEIGHT = 2.0**14
_LOG2E = math.log2(math.e)


class _Overflow:
    """Whether a call's inputs keep the kernels' float32 sums finite, from the largest magnitudes its finite checks
    read (no device work): every logit is at most ``dk (|scale| max|q| + max|u|) max|k| + dk (|scale| max|q| +
    max|w|) max|R| + max|bias|`` (``u``, ``w``, ``R``: the relative content and position biases and keys, where
    given), and every running sum of weighted values at most ``Nk W max|v|`` (``W``: the largest softmax weight);
    the unscaled products at most ``dk max|q| max|k|`` (the dense kernel scales after the dot), and with a soft-cap
    each term over the cap, and each query row's ``|scale| max|q| / softcap``, within float32's range over 2**8.
    Finite inputs beyond these would give Inf or NaN outputs where the float64 reference is finite: they raise
    instead, naming the tensors. Both are sufficient conditions, met by anything but values near float32's range
    (``max|v|`` up to 3.4e32 for 10**6 keys). Compressed K/V (``ranks``: their ranks) are bounded from their stored
    tensors where the call checks them (``format.decoded_magnitude``), else by ``known`` (the bound recorded with the
    operand's check, or by the synchronous Triton encoder), else by ``but_raw`` plus the largest exact value read
    with the call's checks (the speculative encoder's output); -1.0 in both: not bounded."""

    __slots__ = ("head_dim_k", "n_k", "scale", "softcap", "weight", "ranks", "known", "but_raw", "v_bound")

    def __init__(
        self,
        head_dim_k: int,
        n_k: int,
        scale: float,
        softcap: float | None,
        ranks: tuple[int, int] | None = None,
        known: tuple[float, float] = (-1.0, -1.0),
        but_raw: tuple[float, float] = (-1.0, -1.0),
    ) -> None:
        self.head_dim_k, self.n_k, self.scale, self.ranks, self.known = head_dim_k, n_k, abs(scale), ranks, known
        self.but_raw, self.softcap = but_raw, softcap
        self.v_bound: float | None = None  # the bound on max|v| the last check found (None: not bounded)
        self.weight = 1.0
        if softcap is not None:
            from kvbound.kernels._common import fixed_softmax_max

            self.weight = 1.0 if fixed_softmax_max(softcap) is None else _FIXED_MAX_WEIGHT

    def _largest(self, peaks: dict[str, float], name: str, index: int) -> float | None:
        if self.ranks is None:
            return peaks.get(name)
        stored = [peaks.get(f"{name}.{field}") for field in _CHECKED_FIELDS]
        if all(value is not None for value in stored):
            return decoded_magnitude(self.ranks[index], *stored)
        if self.known[index] >= 0:
            return self.known[index]
        raw = peaks.get(f"{name}.raw")
        return self.but_raw[index] + raw if self.but_raw[index] >= 0 and raw is not None else None

    def __call__(self, peaks: dict[str, float]) -> str | None:
        q, k, v = peaks.get("q"), self._largest(peaks, "k", 0), self._largest(peaks, "v", 1)
        self.v_bound = v
        kind = "compressed, bounded from its stored tensors" if self.ranks else "dense"
        if q is not None and k is not None:
            query = self.scale * q
            terms = {
                "q, k": self.head_dim_k * (query + peaks.get("relative_content_bias", 0.0)) * k,
                "relative_keys": self.head_dim_k * (query + peaks.get("relative_position_bias", 0.0))
                * peaks.get("relative_keys", 0.0),
                "bias": peaks.get("bias", 0.0),
            }
            logit = sum(terms.values())
            if self.softcap is None:
                # The kernels work in log2 units: each logit is multiplied by log2(e) before the softmax.
                limit, why = _FLOAT32_MAX / _LOG2E, "float32's range over log2(e)"
            else:
                # Each term is divided by the cap before the tanh, each query row first multiplied by up to
                # |scale| max|q| / softcap (the compressed kernel's power-of-two row scale): room for both.
                limit, why = _FLOAT32_ROOM * self.softcap, "float32's range times the soft-cap over 2**8"
                if not query / self.softcap <= _FLOAT32_ROOM:
                    return (
                        f"q: expected |scale| max|q| / softcap below {_FLOAT32_ROOM:.3g} (float32's range over "
                        f"2**8: the kernels multiply query rows by scale / softcap), got {query / self.softcap:.3g}: "
                        f"largest magnitude {q:.3g} (q), scale {self.scale:.3g}, softcap {self.softcap:.3g}"
                    )
            if not logit <= limit:
                cause = max(terms, key=terms.get)
                return (
                    f"{cause}: expected magnitudes whose logits stay below {limit:.3g} ({why}), "
                    f"got logits of up to {logit:.3g}: largest magnitudes {q:.3g} (q) and {k:.3g} (k, "
                    f"{kind}) at head dim {self.head_dim_k} and scale {self.scale:.3g}"
                    + "".join(f", {peaks[name]:.3g} ({name})" for name in ("relative_keys", "bias") if name in peaks)
                )
            raw = self.head_dim_k * q * k
            if not raw <= _FLOAT32_ROOM:
                # The dense kernel forms q . k in float32 and scales it after: a tiny scale does not keep it finite.
                return (
                    f"q, k: expected dk max|q| max|k| below {_FLOAT32_ROOM:.3g} (float32's range over 2**8: the "
                    f"kernels form q . k before scaling it), got {raw:.3g}: largest magnitudes {q:.3g} (q) and "
                    f"{k:.3g} (k, {kind}) at head dim {self.head_dim_k}"
                )
        if v is not None:
            limit = _FLOAT32_MAX / (self.n_k * self.weight)
            if not v <= limit:
                return (
                    f"v: expected a largest magnitude of at most {limit:.3g} ({kind}), so that float32 sums over "
                    f"{self.n_k} keys stay finite, got {v:.3g}"
                )
        return None


class _OutputLabel:
    """``"the output of kvbound.attention call N: q [B, H, N, D]"``, formatted only when printed."""

    __slots__ = ("number", "shape")

    def __init__(self, number: int, shape: torch.Size) -> None:
        self.number, self.shape = number, shape

    def __str__(self) -> str:
        return f"the output of kvbound.attention call {self.number}: q {list(self.shape)}"


class _ShapeLabel:
    """``"q [B, H, N, D]"`` (``"layer: q [B, H, N, D]"`` for a call from a patched model's layer), formatted only
    when printed."""

    __slots__ = ("name", "shape", "layer")

    def __init__(self, name: str, shape: torch.Size, layer: str | None = None) -> None:
        self.name, self.shape, self.layer = name, shape, layer

    def __str__(self) -> str:
        return f"{self.layer + ': ' if self.layer else ''}{self.name} {list(self.shape)}"


def _full_bias_shape(bias: torch.Tensor | None, bias_tile: int, q: torch.Tensor, n_k: int) -> tuple | None:
    if bias is None or bias_tile > 1:
        return None
    return (q.shape[0], q.shape[1], q.shape[2], n_k)


# What _run_layout derives from one runs tensor, by (id, version, rows, Nq, Nk, span): the tensors that
# _relative_runs caches on the device come back in every layer of every forward.
_RUN_LAYOUTS: dict[tuple, tuple[torch.Tensor, tuple]] = {}


def _run_layout(
    relative_runs: torch.Tensor, rows: int, n_q: int, n_k: int, relative_run_span: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[tuple[str, torch.Tensor], ...]]:
    """For run starts ``relative_runs`` (int64, on the device) over ``rows`` relative rows: the starts clamped into
    range, the run of each row, the kernel's int32 buffer (run starts as distances, one past the last distance, the
    run of each distance) and the layout's conditions (increasing from 0 and below ``rows``; at most
    ``relative_run_span`` runs in any ``window`` consecutive distances, where that is nonzero), computed on the
    device: whatever the op is given, every index stays in range and a bad layout raises with the call's checks.
    Kept per tensor and version, so that a layout used by every layer is derived once."""
    key = (id(relative_runs), relative_runs._version, rows, n_q, n_k, relative_run_span, window, relative_runs.device)
    found = _RUN_LAYOUTS.get(key)
    if found is not None and found[0] is relative_runs:
        return found[1]
    with torch.inference_mode(False):  # kept across calls: also usable by a later call outside inference mode
        layout = _derive_run_layout(relative_runs, rows, n_q, n_k, relative_run_span, window)
    if len(_RUN_LAYOUTS) >= 64:
        _RUN_LAYOUTS.clear()
    _RUN_LAYOUTS[key] = (relative_runs, layout)
    return layout


def _derive_run_layout(
    relative_runs: torch.Tensor, rows: int, n_q: int, n_k: int, relative_run_span: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[tuple[str, torch.Tensor], ...]]:
    starts = relative_runs.clamp(0, rows - 1)
    rows_at = torch.arange(rows, device=relative_runs.device)
    run_of_row = (torch.searchsorted(starts, rows_at, right=True) - 1).clamp_(0)
    layout_errors = (relative_runs[0] != 0).to(torch.int64) + (relative_runs[-1] >= rows).to(torch.int64)
    layout_errors = layout_errors + (relative_runs[1:] <= relative_runs[:-1]).sum()
    conditions = (
        ("relative_runs: expected increasing first rows of runs from 0, below " + str(rows) + ", got {count} "
         "violations", layout_errors.to(torch.float64).reshape(1)),
    )  # fmt: skip
    if relative_run_span:
        # The most runs one kernel tile spans (relative_run_span's count, here on the device).
        ends = torch.clamp(rows_at + (window - 1), max=rows - 1)
        span = (run_of_row[ends] - run_of_row).max() + 1
        conditions += (
            ("relative_run_span: expected at least the most runs one tile spans, got " + str(relative_run_span)
             + " for runs whose tiles span {count:.0f}",
             torch.where(span > relative_run_span, span, 0).to(torch.float64).reshape(1)),
        )  # fmt: skip
    buffer = torch.cat([starts - (n_q - 1), starts.new_full((1,), n_k), run_of_row]).to(torch.int32)
    return starts, run_of_row, buffer, conditions


def _run_operands(
    q: torch.Tensor, relative_keys: torch.Tensor, relative_runs: torch.Tensor, n_q: int, n_k: int, run_span: int,
    window: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[tuple[str, torch.Tensor], ...]]:
    """The kernels' run operands ``(run_keys [H, R, Dk] contiguous in q's dtype, run layout buffer)`` and the
    conditions to check with the call's finite checks: the layout (``_run_layout``, at most ``run_span`` runs in
    ``window`` distances where ``run_span`` is nonzero) and, for relative keys of all
    ``n_q + n_k - 1`` rows, that every row equals its run's first. The kernels form the table of run logits
    themselves, in float32, from the runs' keys (``attention_dense_fwd``)."""
    if relative_keys.shape[1] not in (n_q + n_k - 1, relative_runs.numel()):
        raise ValueError(
            f"relative_keys: expected Nq + Nk - 1 = {n_q + n_k - 1} rows or one per run "
            f"({relative_runs.numel()}), got {relative_keys.shape[1]}"
        )
    starts, run_of_row, buffer, conditions = _run_layout(relative_runs, n_q + n_k - 1, n_q, n_k, run_span, window)
    if relative_keys.shape[1] == relative_runs.numel():  # one row per run (or every row its own run)
        first = relative_keys
    else:
        first = relative_keys[:, starts]  # [H, R, Dk]
        conditions = (
            *conditions,
            ("relative_runs: expected every row of relative_keys equal to its run's first row, got {count} "
             "(head, row) pairs that differ", (relative_keys != first[:, run_of_row]).any(dim=-1).sum()),
        )  # fmt: skip
    return (first.to(q.dtype).contiguous(), buffer), conditions


def _attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    bias_tile: int,
    scale: float,
    causal: bool,
    softcap: float | None,
    relative_keys: torch.Tensor | None = None,
    relative_content_bias: torch.Tensor | None = None,
    relative_position_bias: torch.Tensor | None = None,
    relative_runs: torch.Tensor | None = None,
    relative_run_span: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The implementation of ``kvbound::attention_dense`` (``kvbound.attention`` calls it directly in plain
    eager mode, see ``_plain_eager``). ``relative_runs``: validated first rows of runs (``_relative_runs``);
    ``relative_run_span``: the kernel's ``RUN_SPAN`` for them (checked here with the other conditions)."""
    from kvbound.kernels.attention_dense import attention_dense_fwd, relative_window

    conditions: tuple[tuple[str, torch.Tensor], ...] = ()
    runs = None
    if relative_runs is not None:
        runs, conditions = _run_operands(
            q, relative_keys, relative_runs, q.shape[2], k.shape[2], relative_run_span, relative_window()
        )
        runs = (*runs, relative_content_bias, relative_position_bias)
    read = _queue_checks(
        (
            ("q", q),
            ("k", k),
            ("v", v),
            ("bias", bias),
            ("relative_keys", relative_keys),
            ("relative_content_bias", relative_content_bias),
            ("relative_position_bias", relative_position_bias),
        ),
        full_bias_shape=None if bias is None or bias_tile > 1 else (*q.shape[:3], k.shape[2]),
        conditions=conditions,
        limit=_Overflow(q.shape[3], k.shape[2], scale, softcap),
    )
    relative = None
    if relative_keys is not None and runs is None:
        relative = (relative_keys, relative_content_bias, relative_position_bias)
    return attention_dense_fwd(
        q,
        k,
        v,
        bias,
        scale,
        causal,
        softcap,
        bias_tile=bias_tile,
        relative=relative,
        relative_runs=runs,
        run_span=relative_run_span if runs is not None else 0,
        before_launch=read,
    )


_attention_dense_op = torch.library.custom_op("kvbound::attention_dense", mutates_args=())(_attention_dense)


def _no_backward(ctx, *grads):
    raise RuntimeError(
        "kvbound.attention: expected no backward pass (its kernels compute the forward only); for gradients, run "
        "attention with PyTorch operations (kvbound.patch(model, compress=False, backend='eager'), or "
        "kvbound.reference_attention), or call it under torch.no_grad() for inference"
    )


def _keep_nothing(ctx, inputs, output) -> None:
    return None


_attention_dense_op.register_autograd(_no_backward, setup_context=_keep_nothing)


@_attention_dense_op.register_fake
def _attention_dense_fake(q, k, v, bias, bias_tile, scale, causal, softcap, *relative):
    from kvbound.kernels._common import empty_output  # the kernel's output layout: q's

    b, hq, nq, _ = q.shape
    return empty_output(q, v.shape[3]), q.new_empty(b, hq, nq, dtype=torch.float32)


def _attention_compressed(
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
    bias_tile: int,
    scale: float,
    causal: bool,
    softcap: float | None,
    k_block_size: int,
    v_block_size: int,
    k_shared_basis: bool,
    v_shared_basis: bool,
    k_packed_bits: int,
    v_packed_bits: int,
    relative_keys: torch.Tensor | None = None,
    relative_content_bias: torch.Tensor | None = None,
    relative_position_bias: torch.Tensor | None = None,
    k_residual: int = -1,
    v_residual: int = -1,
    k_lowrank_share: float = -1.0,
    v_lowrank_share: float = -1.0,
    k_general: int = -1,
    v_general: int = -1,
    relative_runs: torch.Tensor | None = None,
    relative_run_span: int = 0,
    k_largest: float = -1.0,
    v_largest: float = -1.0,
    k_largest_but_raw: float = -1.0,
    v_largest_but_raw: float = -1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_residual`` / ``v_residual``: -1, check that operand's stored tensors for NaN/Inf and read whether any
    block holds a residual (which kernel variant runs) and the share of low-rank-only blocks (whether the work is
    split over two launches); 1 / 0, already checked (``_recorded_residual``): with / without residual blocks, and
    ``k_lowrank_share`` / ``v_lowrank_share`` the share recorded then (-1.0: unknown, no split), and ``k_general`` /
    ``v_general`` whether some block needs the kernel's general loop (1 / 0; -1: unknown, read with the call's checks
    where it checks that operand, else taken as 1: the kernel correct for any blocks).
    ``relative_runs`` / ``relative_run_span``: as for ``_attention_dense``; the kernel reads the runs where no tile
    spans more than ``attention_compressed.COMPRESSED_RUN_SPAN`` of them (``relative_run_span`` from 1 to that), and
    the relative keys (expanded when given one per run) for a span of 0 (more); the runs are checked either way.
    ``k_largest`` / ``v_largest``: a bound on the operand's largest decoded magnitude recorded with its check
    (``CompressedKV._checked_magnitude``; -1.0: none), for the float32 range check (``_Overflow``).
    ``k_largest_but_raw`` / ``v_largest_but_raw``: where that is -1.0, a bound on the decoded magnitudes outside the
    exact values (``CompressedKV._magnitude_but_raw``, the speculative encoder's); the exact values' largest
    magnitude is then read with the call's checks (-1.0: none; the operand is not held to float32's range)."""
    from kvbound.kernels.attention_compressed import (
        COMPRESSED_RUN_SPAN,
        RUNS_WINDOW,
        CompressedOperand,
        attention_compressed_fwd,
        general_blocks,
    )

    n_k = k_coeffs.shape[2]
    n_q = q.shape[2]
    runs, conditions = None, ()
    if relative_runs is not None:
        if not 0 <= relative_run_span <= COMPRESSED_RUN_SPAN:
            raise ValueError(
                f"relative_run_span: expected 0 (more runs per tile than the compressed kernel unrolls) or at most "
                f"{COMPRESSED_RUN_SPAN}, got {relative_run_span}"
            )
        operands, conditions = _run_operands(
            q, relative_keys, relative_runs, n_q, n_k, relative_run_span, RUNS_WINDOW
        )
        if relative_run_span:
            runs = (*operands, relative_content_bias, relative_position_bias)
        elif relative_keys.shape[1] != n_q + n_k - 1:  # one key per run: the kernel reads all of them
            relative_keys = expand_run_keys(relative_keys, relative_runs, n_q + n_k - 1, checked=True)
    tensors = {"q": q, "bias": bias}
    flags = []
    for name, known, largest, but_raw, stored, layout in (
        ("k", k_residual, k_largest, k_largest_but_raw, (k_coeffs, k_basis, k_scale, k_raw),
         (k_mode, k_bits, k_offset, k_codes, k_block_size, k_packed_bits)),
        ("v", v_residual, v_largest, v_largest_but_raw, (v_coeffs, v_basis, v_scale, v_raw),
         (v_mode, v_bits, v_offset, v_codes, v_block_size, v_packed_bits)),
    ):  # fmt: skip
        if known >= 0 and largest < 0 <= but_raw:
            tensors[f"{name}.raw"] = stored[3]  # its largest magnitude, with the call's finite checks
        if known < 0:
            tensors.update({f"{name}.{field}": t for field, t in zip(_CHECKED_FIELDS, stored, strict=True)})
            mode, bits, offset, codes, block, packed_bits = layout
            flags += [mode, general_blocks(mode, bits, offset, packed_bits, stored[1].shape[-1])]
            # No checked record (inference tensors, or the op dispatched): the layout with this call's checks, read
            # before the kernel runs (flags are never deferred), so that no block is read outside codes or raw.
            count = layout_violations(mode, bits, offset, n_k, stored[1].shape[-1], block, packed_bits, codes.numel(),
                                      stored[3].numel())  # fmt: skip
            conditions += ((f"{name}: expected the layout of kvbound.CompressedKV, got {{count}} failed block checks "
                            f"(modes, code widths, or reads outside codes or raw; {name}.validate() names the first)",
                            count),)  # fmt: skip
    tensors.update(
        relative_keys=relative_keys,
        relative_content_bias=relative_content_bias,
        relative_position_bias=relative_position_bias,
    )
    # Finite checks and "does K / V have a block with a residual" in one sync (none when both are known and the
    # call is inside kvbound.deferred_checks()).
    limit = _Overflow(q.shape[3], n_k, scale, softcap, ranks=(k_coeffs.shape[3], v_coeffs.shape[3]),
                      known=(k_largest, v_largest), but_raw=(k_largest_but_raw, v_largest_but_raw))  # fmt: skip
    read = _queue_checks(
        tensors, flags=tuple(flags), full_bias_shape=_full_bias_shape(bias, bias_tile, q, n_k), conditions=conditions,
        limit=limit,
    )

    read_once: list[list[tuple[bool, float, bool]]] = []

    def checked() -> list[tuple[bool, float, bool]]:
        if not read_once:
            found, values = iter(read()), []
            for known, share, general in ((k_residual, k_lowrank_share, k_general),
                                          (v_residual, v_lowrank_share, v_general)):  # fmt: skip
                if known < 0:
                    share = next(found)
                    known = share < 1
                    general = int(next(found) < 1)
                values.append((bool(known), share, general != 0))
            read_once.append(values)
        return read_once[0]

    # The kernel indexes the small per-block tensors and the flat buffers as contiguous (no-op when they are).
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
        packed_bits=k_packed_bits,
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
        packed_bits=v_packed_bits,
    )
    relative = None
    if relative_keys is not None and runs is None:
        relative = (relative_keys, relative_content_bias, relative_position_bias)
    out, lse = attention_compressed_fwd(
        q,
        k_op,
        v_op,
        bias,
        scale,
        causal,
        softcap,
        residual=lambda: [residual for residual, _, _ in checked()],
        lowrank_share=lambda: [share for _, share, _ in checked()],
        general_runs=lambda: any(residual and general for residual, _, general in checked()),
        bias_tile=bias_tile,
        relative=relative,
        relative_runs=runs,
    )
    q_max = torch.finfo(q.dtype).max
    if torch.finfo(v_raw.dtype).max > q_max:
        # The output takes q's dtype; values decoded from V's wider dtype may lie beyond its range. Where the
        # call's checks bound V within it (read before the kernel, or recorded with V's check), nothing more;
        # else the output is checked after the kernel: read now (a second read), or queued in a
        # kvbound.deferred_checks() block under the call's number.
        v_bound = limit.v_bound if limit.v_bound is not None else (v_largest if v_largest >= 0 else None)
        if v_bound is None or not v_bound <= q_max:
            q_type, v_type = (str(t.dtype).removeprefix("torch.") for t in (q, v_raw))
            deferred = _checks.active()  # (the label names the entry in a deferred block only)
            label = None if deferred is None else _OutputLabel(deferred.calls, q.shape)
            _queue_checks(((f"output ({q_type} as q; v is a {v_type} CompressedKV whose values may exceed {q_type}'s "
                            "range: pass q in float32 or compress V in q's dtype)", out),),
                          label=label, call=False)()  # fmt: skip
    return out, lse


_attention_compressed_op = torch.library.custom_op("kvbound::attention_compressed", mutates_args=())(
    _attention_compressed
)


_attention_compressed_op.register_autograd(_no_backward, setup_context=_keep_nothing)


@_attention_compressed_op.register_fake
def _attention_compressed_fake(
    q, k_coeffs, k_basis, k_mode, k_scale, k_bits, k_offset, k_codes, k_raw, v_coeffs, v_basis, *rest
):
    from kvbound.kernels._common import empty_output  # the kernel's output layout: q's

    b, hq, nq, _ = q.shape
    return empty_output(q, v_basis.shape[-1]), q.new_empty(b, hq, nq, dtype=torch.float32)
