"""Inference BatchNorm followed by a GELU in one pass: the front of Enformer's and Borzoi's convolution blocks.

Both ports build their convolution towers from blocks ``BatchNorm1d -> GELU -> Conv1d`` (Enformer's GELU is
``sigmoid(1.702 x) * x``, Borzoi's ``nn.GELU(approximate="tanh")``). In PyTorch under autocast that is one
normalisation pass and two to four elementwise passes over the block's input, each reading and writing the whole
tensor, then the convolution casts the result to the autocast dtype. :func:`batch_norm_gelu` reads the input once,
normalises with the running statistics (``(x - mean) / sqrt(var + eps) * weight + bias``, read from the module's own
buffers at each call), applies the GELU, all in float32, and writes the dtype the convolution multiplies in.

The tanh GELU is computed as ``x * sigmoid(2 u)``, ``u = sqrt(2 / pi) (x + 0.044715 x^3)``, the same function as
``0.5 x (1 + tanh(u))`` without its cancellation for negative x. Infinite and NaN inputs give what the ports give
(``-inf`` -> NaN, ``+inf`` -> ``+inf``).

:func:`add_channel_bias_` adds a convolution's bias to its output in place, as PyTorch does after a cuDNN
convolution (``output.add_(bias)``, the bias rounded to the output's dtype first, as autocast casts it), in one
contiguous pass per channel row instead of the broadcasting elementwise kernel: the same values, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbound.kernels._common import cdiv

__all__ = ["ACTIVATIONS", "add_channel_bias_", "batch_norm_gelu"]

# The GELU forms: Enformer's sigmoid approximation and torch's tanh approximation.
ACTIVATIONS = ("sigmoid", "tanh")

# Positions per program.
_BLOCK = 1024
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _row_block(channels, length, BLOCK: tl.constexpr):
    """This program's row of ``[B, C, L]`` (grid axis 0: ``batch * C + channel``) and block of positions (axis 1):
    ``(batch, channel, offsets, mask)``."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row // channels, row % channels, offs, offs < length


@triton.jit
def _at(ptr, batch, channel, offs, stride_b, stride_c, stride_l):
    """Addresses of ``t[batch, channel, offs]`` for a ``[B, C, L]`` tensor at ``ptr`` with these strides."""
    return ptr + batch.to(tl.int64) * stride_b + channel.to(tl.int64) * stride_c + offs.to(tl.int64) * stride_l


@triton.jit
def _batch_norm_gelu_kernel(
    x_ptr,
    mean_ptr,
    var_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    channels,
    length,
    stride_b,
    stride_c,
    stride_l,
    stride_ob,
    stride_oc,
    eps,
    ACTIVATION: tl.constexpr,
    AFFINE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    batch, channel, offs, mask = _row_block(channels, length, BLOCK)
    x = tl.load(_at(x_ptr, batch, channel, offs, stride_b, stride_c, stride_l), mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + channel).to(tl.float32)
    inv_std = 1.0 / tl.sqrt_rn(tl.load(var_ptr + channel).to(tl.float32) + eps)
    y = (x - mean) * inv_std
    if AFFINE:
        y = y * tl.load(weight_ptr + channel).to(tl.float32) + tl.load(bias_ptr + channel).to(tl.float32)
    if ACTIVATION == 0:
        z = 1.702 * y
    else:
        z = 1.5957691216057308 * (y + 0.044715 * y * y * y)  # 2 u
    out = y / (1.0 + tl.exp(-z))
    out_ptrs = _at(out_ptr, batch, channel, offs, stride_ob, stride_oc, 1)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_channel_vector(t: torch.Tensor | None, name: str, channels: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor of {channels} channel values, got {type(t).__name__}")
    if t.shape != (channels,) or t.dtype not in _FLOATS or t.device != device:
        raise ValueError(
            f"{name}: expected shape [{channels}], a float32/float16/bfloat16 dtype, on {device}; got "
            f"{list(t.shape)}, {str(t.dtype).removeprefix('torch.')}, on {t.device}"
        )


def batch_norm_gelu(
    x: torch.Tensor,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    activation: str,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gelu(batch_norm(x, running_mean, running_var, weight, bias, training=False, eps=eps))`` in one pass.

    Args:
        x: ``[B, C, L]`` float32, float16 or bfloat16, any strides.
        running_mean, running_var: ``[C]`` (float dtypes, x's device), read in float32.
        weight, bias: ``[C]`` each, or both None (no affine step).
        eps: added to the variance.
        activation: ``"sigmoid"`` (``sigmoid(1.702 y) * y``) or ``"tanh"`` (``gelu(y, approximate="tanh")``).
        out_dtype: the output's dtype (default x's); float32, float16 or bfloat16.

    Returns:
        ``[B, C, L]`` contiguous, computed in float32 and rounded once to ``out_dtype``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x: expected a [B, C, L] tensor, got {got}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {str(x.dtype).removeprefix('torch.')}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype: expected float32, float16 or bfloat16, got {out_dtype}")
    if not isinstance(eps, float) or not eps >= 0.0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    b, c, n = x.shape
    _check_channel_vector(running_mean, "running_mean", c, x.device)
    _check_channel_vector(running_var, "running_var", c, x.device)
    if (weight is None) != (bias is None):
        raise ValueError("weight, bias: expected both tensors or both None")
    if weight is not None:
        _check_channel_vector(weight, "weight", c, x.device)
        _check_channel_vector(bias, "bias", c, x.device)
    out = torch.empty((b, c, n), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    affine = weight is not None
    grid = (b * c, cdiv(n, _BLOCK))
    _batch_norm_gelu_kernel[grid](
        x,
        running_mean,
        running_var,
        weight if affine else running_mean,
        bias if affine else running_mean,
        out,
        c,
        n,
        *x.stride(),
        *out.stride()[:2],
        eps,
        ACTIVATION=ACTIVATIONS.index(activation),
        AFFINE=affine,
        BLOCK=_BLOCK,
    )
    return out


@triton.jit
def _add_channel_bias_kernel(
    out_ptr,
    bias_ptr,
    residual_ptr,
    channels,
    length,
    stride_b,
    stride_c,
    stride_l,
    stride_rb,
    stride_rc,
    stride_rl,
    RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    batch, channel, offs, mask = _row_block(channels, length, BLOCK)
    ptrs = _at(out_ptr, batch, channel, offs, stride_b, stride_c, stride_l)
    # the bias rounded to the output's dtype, then the sum in float32 rounded once: torch's add_ on that dtype
    bias = tl.load(bias_ptr + channel).to(out_ptr.dtype.element_ty).to(tl.float32)
    value = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + bias).to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        # then the residual added to that rounded sum, rounded again: fn(x) + x after the convolution's add_
        r_ptrs = _at(residual_ptr, batch, channel, offs, stride_rb, stride_rc, stride_rl)
        residual = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        value = (value.to(tl.float32) + residual).to(out_ptr.dtype.element_ty)
    tl.store(ptrs, value, mask=mask)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without overlap (any order of dimensions)."""
    span = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1):
        if stride != span:
            return False
        span *= size
    return True


def add_channel_bias_(out: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out.add_(bias.to(out.dtype).view(1, -1, 1))`` for ``out`` ``[B, C, L]`` (float32/16, bfloat16, any
    non-overlapping strides) and ``bias`` ``[C]`` (a float dtype, out's device); returns ``out``. With ``residual``
    (out's shape and dtype, any strides) it then adds that too, in the same pass: ``out.add_(bias).add_(residual)``,
    each sum rounded to out's dtype, as ``fn(x) + x`` rounds after a convolution's bias."""
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.dtype not in _FLOATS:
        got = f"{list(out.shape)} {str(out.dtype).removeprefix('torch.')}" if isinstance(out, torch.Tensor) else out
        raise ValueError(f"out: expected a [B, C, L] float32, float16 or bfloat16 tensor, got {got}")
    if not _dense(out):
        raise ValueError(f"out: expected non-overlapping elements (written in place), got strides {out.stride()}")
    b, c, n = out.shape
    _check_channel_vector(bias, "bias", c, out.device)
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != out.shape or residual.dtype != out.dtype:
            got = (f"{list(residual.shape)} {str(residual.dtype).removeprefix('torch.')}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)  # fmt: skip
            raise ValueError(f"residual: expected out's shape {list(out.shape)} and dtype "
                             f"{str(out.dtype).removeprefix('torch.')}, got {got}")  # fmt: skip
        if residual.device != out.device:
            raise ValueError(f"residual: expected out's device {out.device}, got {residual.device}")
    if out.numel():
        grid = (b * c, cdiv(n, _BLOCK))
        r = out if residual is None else residual
        _add_channel_bias_kernel[grid](
            out, bias, r, c, n, *out.stride(), *r.stride(), RESIDUAL=residual is not None, BLOCK=_BLOCK
        )
    return out
