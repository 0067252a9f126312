"""Pooling over pairs of neighbouring positions in one pass: Enformer's softmax attention pool and a max pool.

Enformer's ``AttentionPool`` (pool size 2) halves the sequence: for each channel and each pair of positions it
takes a softmax of the pair's two logits (a 1x1 convolution of the input) and the weighted sum of the pair's two
values. In PyTorch under autocast that is the convolution (with layout conversions around it), a float32 softmax,
a float32 product of the input's size and a reduction over it. :func:`softmax_pair_pool` reads the input and the
logits once and writes the float32 result, with the port's arithmetic: ``e_p = exp(l_p - max(l))``, ``a_p = e_p /
(e_0 + e_1)``, ``x_0 a_0 + x_1 a_1``, all in float32 (the exponential is the kernel's, within a few units in the
last place of the port's).

:func:`max_pair_pool` is ``nn.MaxPool1d(2)`` on the last dimension of a contiguous tensor: exact, NaN propagating.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbound.kernels._common import cdiv

__all__ = ["softmax_pair_pool", "max_pair_pool"]

# Pairs per program.
_PAIRS = 1024


@triton.jit
def _softmax_pair_pool_kernel(x_ptr, logits_ptr, out_ptr, pairs, PAIRS: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)
    mask = index < pairs
    l0 = tl.load(logits_ptr + 2 * index, mask=mask, other=0.0).to(tl.float32)
    l1 = tl.load(logits_ptr + 2 * index + 1, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x_ptr + 2 * index, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + 2 * index + 1, mask=mask, other=0.0).to(tl.float32)
    top = tl.maximum(l0, l1)  # a NaN logit makes its pair NaN through the exponentials either way
    e0 = tl.exp(l0 - top)
    e1 = tl.exp(l1 - top)
    total = e0 + e1
    tl.store(out_ptr + index, x0 * (e0 / total) + x1 * (e1 / total), mask=mask)


@triton.jit
def _max_pair_pool_kernel(x_ptr, out_ptr, pairs, PAIRS: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)
    mask = index < pairs
    x0 = tl.load(x_ptr + 2 * index, mask=mask)
    x1 = tl.load(x_ptr + 2 * index + 1, mask=mask)
    # max_pool1d's scan: the second replaces the first when larger, or NaN while the first is not; ties keep
    # the first (its sign of zero too). Compared in float32 (exact for every input dtype), selected as stored.
    a, b = x0.to(tl.float32), x1.to(tl.float32)
    second = (b > a) | ((b != b) & (a == a))
    tl.store(out_ptr + index, tl.where(second, x1, x0), mask=mask)


def _check_pairs(x: torch.Tensor, name: str) -> None:
    if x.dim() < 1 or x.shape[-1] % 2 or x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor whose last dimension is even, got shape {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {str(x.dtype).removeprefix('torch.')}")


def softmax_pair_pool(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``(x.unflatten(-1, (-1, 2)) * logits.unflatten(-1, (-1, 2)).float().softmax(-1)).sum(-1)`` in one pass:
    float32, the last dimension halved. ``x`` and ``logits`` of one shape (any float dtypes, one device)."""
    _check_pairs(x, "x")
    _check_pairs(logits, "logits")
    if logits.shape != x.shape or logits.device != x.device:
        raise ValueError(f"logits: expected x's shape {list(x.shape)} on {x.device}, got {list(logits.shape)} "
                         f"on {logits.device}")
    x, logits = x.contiguous(), logits.contiguous()
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.float32, device=x.device)
    pairs = out.numel()
    _softmax_pair_pool_kernel[(cdiv(pairs, _PAIRS),)](x, logits, out, pairs, PAIRS=_PAIRS)
    return out


def max_pair_pool(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool1d(x, 2)`` over the last dimension (even length) in one pass: the larger of each pair, NaN where
    either is NaN, in ``x``'s dtype."""
    _check_pairs(x, "x")
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    pairs = out.numel()
    _max_pair_pool_kernel[(cdiv(pairs, _PAIRS),)](x, out, pairs, PAIRS=_PAIRS)
    return out
