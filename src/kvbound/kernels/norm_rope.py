"""One pass of LayerNorm, rotary position embedding and the cast to the attention's operand dtype.

AlphaGenome's attention block normalises its projected queries, keys and values with its own ``LayerNorm`` (mean
and variance in float32, the centred values and the inverse deviation rounded to the input's dtype, then an affine
step in the parameters' dtype), rotates queries and keys (``apply_rope``, in the normalised tensor's dtype) and
hands them to attention in the matmul's dtype. In PyTorch that is about twenty elementwise kernels and reductions per
tensor; :func:`norm_rope` does it in one, rounding at the same points as the PyTorch ops (float32 products and sums
are not contracted into fused multiply-adds), so that its output equals theirs up to the order of the two row sums
and the last bits of the reciprocal square root.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbound.kernels._common import cdiv, interpreting, next_power_of_2

__all__ = ["norm_rope"]

_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# Elements of one program's tile: rows of the flattened [B * S * H, C] input times the padded width.
_TILE_ELEMENTS = 4096


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """``x`` (float32) rounded to ``DT`` and widened again: the value a PyTorch op in ``DT`` would hold."""
    if DT == tl.float32:
        return x
    return x.to(DT).to(tl.float32)


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    heads,
    seq,
    eps,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROWS: tl.constexpr,
    ROPE: tl.constexpr,
    IN_DT: tl.constexpr,
    NORM_DT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < n_rows
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # torch.mean: a float32 sum times 1 / C; x - mean in the input dtype.
    mean = tl.sum(x, 1) * (1.0 / C)
    centred = _rounded(x - _rounded(mean, IN_DT)[:, None], IN_DT)
    centred = tl.where(mask, centred, 0.0)
    variance = tl.sum(centred * centred, 1) * (1.0 / C)
    inverse = _rounded(tl.math.rsqrt(variance + eps), IN_DT)
    y = _rounded(centred * inverse[:, None], IN_DT)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = _rounded(_rounded(y * weight[None, :], NORM_DT) + bias[None, :], NORM_DT)
    if ROPE:
        # Pairs (2i, 2i + 1) of the row at position s = (row // H) % S:
        # (e cos - o sin, e sin + o cos), each product, sum and difference rounded to the normalised dtype.
        position = (rows // heads) % seq
        half = tl.arange(0, BLOCK_C // 2)
        table = position.to(tl.int64)[:, None] * (C // 2) + half[None, :]
        half_mask = row_ok[:, None] & (half < C // 2)[None, :]
        cos = tl.load(cos_ptr + table, mask=half_mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=half_mask, other=0.0)
        even, odd = tl.split(tl.reshape(y, [ROWS, BLOCK_C // 2, 2]))
        new_even = _rounded(_rounded(even * cos, NORM_DT) - _rounded(odd * sin, NORM_DT), NORM_DT)
        new_odd = _rounded(_rounded(even * sin, NORM_DT) + _rounded(odd * cos, NORM_DT), NORM_DT)
        y = tl.reshape(tl.join(new_even, new_odd), [ROWS, BLOCK_C])
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_vector(t: object, name: str, width: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != (width,) or t.dtype not in _TORCH_TO_TL or t.device != device:
        raise ValueError(
            f"{name}: expected shape [{width}], a float32/float16/bfloat16 dtype and device {device}, got "
            f"{list(t.shape)} {t.dtype} on {t.device}"
        )
    return t if t.is_contiguous() else t.contiguous()


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    out_dtype: torch.dtype,
    round_to_input: bool = True,
) -> torch.Tensor:
    """``LayerNorm`` over the last dimension (centred, affine), then rotary embedding, then a cast, in one kernel.

    Args:
        x: ``[B, S, H, C]`` contiguous, float32 / float16 / bfloat16 (a projection's output split into heads).
        weight, bias: ``[C]``, of one dtype; the normalised values are in ``torch.promote_types`` of x's and the
            parameters' dtypes (float32 for bfloat16 activations with float32 parameters), as
            ``x_norm * weight + bias`` is.
        eps: added to the variance.
        rope: ``(cos, sin)``, each ``[S, C / 2]`` float32 holding values of the normalised dtype: pair ``i`` of a row
            at position ``s`` becomes ``(e cos[s, i] - o sin[s, i], e sin[s, i] + o cos[s, i])``; None: no rotation.
        out_dtype: the output's dtype (float32, float16 or bfloat16).
        round_to_input: round the centred values and the inverse deviation to x's dtype, as AlphaGenome's
            ``LayerNorm`` does (the default); False keeps every step in float32 until the affine step, as torch's
            ``nn.LayerNorm`` under autocast does with a 16-bit input (it normalises ``x.float()``).

    Returns:
        ``[B, S, H, C]`` contiguous in ``out_dtype``.

    The float32 mean, the centred values and inverse deviation rounded to x's dtype, the affine step and the
    rotation rounded to the normalised dtype, and the final cast round at the same points as the PyTorch ops do;
    on the GPU float32 products are not fused into multiply-adds. What can differ is the order of the two row sums
    (float32) and the last bits of the reciprocal square root, before they are rounded to x's dtype.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dim() != 4 or x.dtype not in _TORCH_TO_TL or not x.is_contiguous() or x.numel() == 0:
        raise ValueError(
            f"x: expected a non-empty contiguous [B, S, H, C] float32/float16/bfloat16 tensor, got "
            f"{list(x.shape)} {x.dtype} (contiguous: {x.is_contiguous()})"
        )
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"x: expected a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors), got {x.device}")
    if out_dtype not in _TORCH_TO_TL:
        raise ValueError(f"out_dtype: expected float32, float16 or bfloat16, got {out_dtype}")
    b, s, h, c = x.shape
    weight = _check_vector(weight, "weight", c, x.device)
    bias = _check_vector(bias, "bias", c, x.device)
    if bias.dtype != weight.dtype:
        raise ValueError(f"bias: expected weight's dtype ({weight.dtype}), got {bias.dtype}")
    norm_dtype = torch.promote_types(x.dtype, weight.dtype)
    if rope is None:
        cos = sin = weight  # unread (ROPE is off)
    else:
        if c % 2:
            raise ValueError(f"x: rotary embedding needs an even last dimension, got C={c}")
        cos, sin = rope
        for name, t in (("rope cos", cos), ("rope sin", sin)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (s, c // 2) or t.dtype != torch.float32:
                raise ValueError(
                    f"{name}: expected a float32 tensor of shape [{s}, {c // 2}] on {x.device}, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"
                )
            if t.device != x.device:
                raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block_c = next_power_of_2(c)
    rows = max(1, _TILE_ELEMENTS // block_c)
    n_rows = b * s * h
    options = {} if interpreting() else {"enable_fp_fusion": False}
    _norm_rope_kernel[(cdiv(n_rows, rows),)](
        x, weight, bias, cos, sin, out, n_rows, h, s, float(eps),
        C=c, BLOCK_C=block_c, ROWS=rows, ROPE=rope is not None,
        IN_DT=_TORCH_TO_TL[x.dtype] if round_to_input else tl.float32, NORM_DT=_TORCH_TO_TL[norm_dtype],
        num_warps=4, **options,
    )  # fmt: skip
    return out
