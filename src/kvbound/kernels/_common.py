"""Pieces shared by the dense and the compressed attention kernels.

Conventions used by both kernels:

* Query rows of one program are the G = Hq / Hkv query heads of one K/V head interleaved with the query
  index: row ``t`` of the flattened ``[Nq * G]`` axis is query ``t // G`` of head ``kv_head * G + t % G``.
  A program therefore loads each K/V tile once for all heads of its group (GQA/MQA), and the causal
  bounds of a tile stay contiguous in the query index.
* Logits live in "log2 units": ``x = logit * log2(e)`` so that the softmax uses ``exp2``. With a soft-cap the
  kernel first forms ``t = logit / softcap`` and then ``x = softcap * log2(e) * tanh(t)``.
* ``running_max`` is the row maximum of ``x`` seen so far; ``running_sum`` the sum of ``exp2(x - running_max)``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: jit code may read it


@triton.jit
def pow2_floor(x):
    """Largest power of two <= x for finite x > 0 (exact: keeps the float32 exponent bits only)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def row_normaliser(x):
    """Per-row power-of-two ``scale`` with ``|x / scale| < 256`` row-wise, so ``x / scale`` fits float16 with
    its full 11-bit precision (scaling by a power of two is exact). Returns ``(scale, 1 / scale)``."""
    row_max = tl.max(tl.abs(x), 1)
    row_max = tl.maximum(row_max, 1.0e-30)
    scale = pow2_floor(row_max) * (1.0 / 128.0)
    return scale, 1.0 / scale


@triton.jit
def load_bias_tile(bias_rows, start_n, offs_n, stride_bias_key, row_valid, N_K, MASK: tl.constexpr):
    """Bias values [BLOCK_M, BLOCK_N] as float32; ``bias_rows`` holds one pointer per query row (stride-0 along
    broadcast dimensions, so a broadcast bias is read, never expanded)."""
    ptrs = bias_rows[:, None] + start_n.to(tl.int64) * stride_bias_key + (offs_n * stride_bias_key)[None, :]
    if MASK:
        keep = row_valid[:, None] & ((start_n + offs_n) < N_K)[None, :]
    else:
        keep = row_valid[:, None]
    return tl.load(ptrs, mask=keep, other=0.0).to(tl.float32)


@triton.jit
def finish_logits(
    x,
    row_mult,
    bias_rows,
    start_n,
    offs_n,
    stride_bias_key,
    row_query,
    row_valid,
    N_K,
    bias_mult,
    softcap_log2,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
):
    """Turn raw dot products ``x`` (in units of ``row_mult``) into masked log2-unit logits."""
    x = x * row_mult[:, None]
    if HAS_BIAS:
        x += load_bias_tile(bias_rows, start_n, offs_n, stride_bias_key, row_valid, N_K, MASK) * bias_mult
    if SOFTCAP:
        # tanh(t) = 1 - 2 / (1 + e^(2t)); exp2 overflow to inf gives exactly 1, underflow to 0 gives -1.
        x = softcap_log2 * (1.0 - 2.0 / (1.0 + tl.math.exp2(x * (2.0 * 1.4426950408889634))))
    if MASK:
        key = start_n + offs_n
        keep = (key < N_K)[None, :]
        if CAUSAL:
            keep = keep & (key[None, :] <= row_query[:, None])
        x = tl.where(keep, x, float("-inf"))
    return x


@triton.jit
def softmax_step(
    x,
    row_mult,
    running_max,
    running_sum,
    bias_rows,
    start_n,
    offs_n,
    stride_bias_key,
    row_query,
    row_valid,
    N_K,
    bias_mult,
    softcap_log2,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
):
    """One online-softmax step over a tile of raw dot products ``x`` [BLOCK_M, BLOCK_N].

    Returns ``(p, alpha, new_max, new_sum)``: ``p = exp2(logits - new_max)`` (float32) and the factor
    ``alpha`` that rescales what was accumulated under the previous maximum.
    """
    if HAS_BIAS or SOFTCAP or MASK:
        x = finish_logits(
            x,
            row_mult,
            bias_rows,
            start_n,
            offs_n,
            stride_bias_key,
            row_query,
            row_valid,
            N_K,
            bias_mult,
            softcap_log2,
            HAS_BIAS,
            SOFTCAP,
            CAUSAL,
            MASK,
        )
        new_max = tl.maximum(running_max, tl.max(x, 1))
        # A row that has seen only masked keys keeps -inf; subtract 0 instead so that no inf - inf appears.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(x - safe_max[:, None])
    else:
        # Plain tile: fold the row multiplier into the subtraction (one FMA per element).
        new_max = tl.maximum(running_max, tl.max(x, 1) * row_mult)
        safe_max = new_max
        p = tl.math.exp2(x * row_mult[:, None] - safe_max[:, None])
    alpha = tl.math.exp2(running_max - safe_max)
    new_sum = running_sum * alpha + tl.sum(p, 1)
    return p, alpha, new_max, new_sum


@triton.jit
def key_loop_bounds(
    row_start, N_Q, N_K, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Key range of one program: tiles in ``[0, unmasked_end)`` need no mask, ``[unmasked_end, end)`` do
    (the ragged last tile, and with ``causal`` the tiles that cross the diagonal of any row)."""
    full_tiles_end = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        first_query = row_start // GROUP
        last_query = tl.minimum((row_start + BLOCK_M - 1) // GROUP, N_Q - 1)
        end = tl.minimum(N_K, last_query + 1)
        unmasked_end = tl.minimum(((first_query + 1) // BLOCK_N) * BLOCK_N, full_tiles_end)
    else:
        end = N_K
        unmasked_end = full_tiles_end
    return unmasked_end, end


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tma_allocator(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_ready(*tensors) -> bool:
    """Whether kernels may read these [..., rows, cols] tensors through tensor descriptors (bulk tensor copies):
    Hopper or newer (or the interpreter), unit stride on the last dimension, every other stride and the
    base address 16-byte aligned. Installs Triton's scratch allocator that device-side descriptors need."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    if interpreting():
        return True
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    triton.set_allocator(_tma_allocator)
    return True


def logit_multipliers(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """``(logit_mult, bias_mult, softcap_log2)``: multipliers from ``q . k`` and from ``bias`` to the kernels'
    logit units (log2 units without a soft-cap, ``logit / softcap`` before it with one)."""
    if softcap is None:
        return scale * LOG2E, LOG2E, 0.0
    return scale / softcap, 1.0 / softcap, softcap * LOG2E
