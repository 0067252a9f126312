"""Fused attention over compressed K/V (layout: ``kvbound.codec.format``), never expanding K/V in memory.

Each K/V tile is rebuilt on chip from the factors and the packed residual and consumed at once. The work per
tile follows what the tile holds:

* Logits through the basis. With a shared basis ``P_k`` ([Hkv, r, Dk]) the kernel forms ``Qp = Q P_k^T``
  once per query tile and then ``S = Qp C_tile^T`` per key tile (``r`` padded to 16 for ``tl.dot``): a rank-r
  product instead of a Dk-wide one. With per-block bases ``Qp`` is formed per tile from that block's ``P``
  (measured faster than rebuilding ``K_tile = C_tile P``; see kernels/README.md).
* Residual only where there is one. Each head's key blocks are walked as runs: runs of consecutive
  low-rank-only blocks first, with no residual code compiled into that loop (the rank-space fast path),
  then runs of blocks with a residual in K or V, where ``S += Q R_tile^T`` is added, then the masked tail.
  Residual runs come in two kinds (``block_runs``): uniform runs, where every block is low-rank or packed at
  the operand's configured width, are a branch-free loop with that width compiled in: each element's word is
  loaded in the tile's final [BLOCK_N, D] shape (neighbouring columns share a word), shifted out and turned
  into a float16 operand by a mantissa trick (no integer-to-float conversion); low-rank blocks there have
  step 0. General runs
  (other widths, promoted or exact blocks) branch per tile on the mode and gather codes with a run-time
  width. Packed codes are exact small integers, so the product uses them as float16 operands and applies
  the block's step once per tile. ``MODE_RAW`` tiles are the stored
  values themselves (their coefficients are zero), multiplied in float32 operands (exact for 16-bit data).
* Values in rank space. With a shared ``P_v``, ``acc_r += P_attn C_v_tile`` (r wide) and ``O = acc_r P_v``
  once at the end; the Dv-wide accumulator is touched only by tiles with a residual, and its rescaling by the
  running maximum is deferred until such a tile arrives. With per-block ``P_v`` each tile's ``P_attn C_v``
  is projected by its block's ``P_v`` at once.
* GQA/MQA: the G query heads of one K/V head are stacked into the rows of one program (see ``_common``), so
  each tile is decoded once for all of them.
* Bias, soft-cap and masks as in the dense kernel (``_common``): a full or broadcast bias, or a compact tile bias
  read at ``(query // T, key // T)``; under a small soft-cap a fixed softmax maximum, so neither the rank-space
  nor the Dv-wide accumulator is ever rescaled.
* Transformer-XL relative positions (``RELATIVE``, one query head per K/V head): the content query
  ``scale q + u`` is what goes through the basis and the residual codes, and every tile of every loop adds
  ``(scale q + w) . R[Nq - 1 + j - i]`` from ``_common.relative_logits_tile``, as the dense kernel does; with
  relative keys constant over runs of distances (``RELATIVE == 2``, ``relative_runs``), from the table of run
  logits that each program writes first (``_common.write_run_table``) and the runs each tile spans
  (``_common.relative_runs_tile``, unrolled up to ``COMPRESSED_RUN_SPAN``), with no window product.

Precision: for 16-bit inputs every product with the factors and codes runs on float16 operands with float32
accumulation. ``q`` is rescaled per row by a power of two before the float16 cast (exact for bfloat16 too);
``Qp`` is rescaled likewise and split into float16 ``hi + lo`` parts, so no operand overflows and the
rank-space logits keep about 22 bits even when logits are in the thousands. float32 inputs use the products
PyTorch's float32 setting asks for (``_common.float32_dot_precision``: full float32 by default).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from kvbound.codec.format import CompressedKV
from kvbound.config import CompressionConfig
from kvbound.kernels._common import (
    _KERNELS_INTERPRETED,
    BOUND_RETRY_SUM,
    LN2,
    RUN_CHUNK,
    bounded_by_default,
    broadcast_strides,
    cdiv,
    empty_output,
    fixed_softmax_max,
    float32_dot_precision,
    fold_scale_sign,
    interpreting,
    key_loop_bounds,
    launch_tuned,
    logit_multipliers,
    next_power_of_2,
    relative_logits_tile,
    relative_runs_bounds,
    relative_runs_first,
    relative_runs_tile,
    row_normaliser,
    run_logits_table,
    softcap_form,
    softmax_step,
    switch_setting,
    tma_ready,
    write_run_table,
)
from kvbound.kernels.attention_dense import dv_parts, dv_split_default, round_run_span

__all__ = ["attention_compressed_fwd", "compressed_configs", "CompressedOperand"]

# With relative keys constant over runs (RELATIVE == 2), the runs after a tile's first are unrolled up to this many:
# the launcher takes runs only where no tile of the relative tile shapes spans more (counted over ``RUNS_WINDOW``
# distances: ``attention_dense.relative_run_span(starts, rows, RUNS_WINDOW, COMPRESSED_RUN_SPAN)`` nonzero), otherwise
# the relative keys.
COMPRESSED_RUN_SPAN = 16
assert round_run_span(COMPRESSED_RUN_SPAN) == COMPRESSED_RUN_SPAN
_RUN_SPAN = tl.constexpr(COMPRESSED_RUN_SPAN)

# The byte decode of the uniform residual loop turns four codes into float16 with six PTX instructions (two PRMT,
# two LOP3, two HFMA2) instead of the compiler's per-element shifts and packs: checked tile by tile against float64
# and 7-11 % faster on 4-bit residual tiles on the H200 (kernels/README.md). On in compiled CUDA kernels;
# KVBOUND_ASM_DECODE=0 restores the compiler's decode (the interpreter and ROCm always use it). Part of every
# kernel's cache key (a module-level constexpr).
_ASM_DECODE = tl.constexpr(
    os.environ.get("KVBOUND_ASM_DECODE", "1").strip().lower() not in ("0", "false", "off", "no")
    and not _KERNELS_INTERPRETED
    and torch.version.hip is None
)


# ------------------------------------------------------------------------------------------- tile decoders
@triton.jit
def _to_operand(x, FP32: tl.constexpr):
    if FP32:
        return x.to(tl.float32)
    else:
        return x.to(tl.float16)


@triton.jit
def _split_float16(x):
    """``x`` (float32) as ``hi + lo`` in float16: about 22 bits of ``x`` instead of 11, for two cheap rank-16
    products in place of one (logits through the basis then keep float32-like precision even when they are
    in the thousands)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def _rank_logits(query_rank, query_rank_lo, coeffs, FP32: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """``Qp C^T`` [BLOCK_M, BLOCK_N] for coefficient tile ``coeffs`` [BLOCK_N, RANK_PAD]."""
    c = tl.trans(_to_operand(coeffs, FP32))
    x = tl.dot(query_rank, c, input_precision=PRECISION)
    if SPLIT:
        x = tl.dot(query_rank_lo, c, x)
    return x


@triton.jit
def _load_basis_twice(
    basis_ptr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    COL0: tl.constexpr = 0,
):
    """The projection ``P`` stacked on itself, [RANK_PAD, D_PAD] with rows ``r`` and ``RANK + r`` both ``P[r]``
    (zero from ``2 RANK`` on): the basis of packed coefficients ``[hi | lo]`` (``rank_accumulator`` then holds
    ``P hi`` and ``P lo`` side by side and one product with this sums them). Columns ``[COL0, COL0 + D_PAD)``."""
    offs_r = tl.arange(0, RANK_PAD)
    offs_d = COL0 + tl.arange(0, D_PAD)
    ptrs = basis_ptr + ((offs_r % RANK) * HEAD_DIM)[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=(offs_r < 2 * RANK)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_coeff_tile(
    coeff_head,
    coeff_desc,
    start_n,
    offs_n,
    stride_cn,
    stride_cr,
    N_K,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    MASK: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Coefficients [BLOCK_N, RANK_PAD] of keys ``start_n + offs_n`` (zero beyond ``RANK`` and ``N_K``)."""
    if USE_TMA:
        tile = coeff_desc.load([start_n, 0])
    else:
        offs_r = tl.arange(0, RANK_PAD)
        ptrs = coeff_head + start_n.to(tl.int64) * stride_cn + (offs_n * stride_cn)[:, None]
        ptrs += (offs_r * stride_cr)[None, :]
        if MASK:
            keep = ((start_n + offs_n) < N_K)[:, None] & (offs_r < RANK)[None, :]
            tile = tl.load(ptrs, mask=keep, other=0.0)
        elif RANK_PAD != RANK:
            tile = tl.load(ptrs, mask=(offs_r < RANK)[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _columns(HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PLANES: tl.constexpr, COL0: tl.constexpr = 0):
    """The head-dimension column that operand column ``c`` holds, for ``c`` in ``[COL0, COL0 + D_PAD)`` (a part of the
    value columns, ``dv_parts``; 0 and the whole padded width otherwise). ``PLANES`` <= 1: natural order.
    ``PLANES`` = p > 1 (codes of 8 / p bits, p to a byte): plane order, column ``c = i * (HEAD_DIM / p) + j``
    holds head dimension ``j * p + i``, so that the codes of one operand column run through consecutive bytes
    (``_load_codes_bytes``). Columns at or beyond ``HEAD_DIM`` keep their index (every load masks them). Dot
    products over the head dimension do not depend on its order; the kernel uses one order per operand (K
    side: queries, K basis, K codes and raw tiles; V side: V basis, codes, raw tiles, the Dv-wide accumulator
    and the output columns)."""
    offs = COL0 + tl.arange(0, D_PAD)
    if PLANES <= 1:
        return offs
    else:
        PLANE: tl.constexpr = HEAD_DIM // PLANES
        return tl.where(offs < HEAD_DIM, (offs % PLANE) * PLANES + offs // PLANE, offs)


@triton.jit
def _load_basis(
    basis_ptr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """One projection ``P`` [RANK_PAD, D_PAD] (row-major [RANK, HEAD_DIM] in memory; zero padding), its
    columns in ``_columns`` order from ``COL0``."""
    offs_r = tl.arange(0, RANK_PAD)
    offs_d = _columns(HEAD_DIM, D_PAD, PLANES, COL0)
    ptrs = basis_ptr + (offs_r * HEAD_DIM)[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=(offs_r < RANK)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_codes_tile(
    codes_ptr,
    word_offset,
    width,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """Integer residual codes q [BLOCK_N, D_PAD] (int32, zero outside the stored rows/columns, columns in
    ``_columns`` order from ``COL0``) of block rows ``first_row + offs_n``; the block's ``width``-bit codes start at
    word ``word_offset``. The width is a run-time value (blocks are promoted individually); the column-to-word map
    is a D-long vector, so a run-time width costs nothing per element."""
    per_word = 32 // width
    words_per_row = (HEAD_DIM + per_word - 1) // per_word
    offs_d = _columns(HEAD_DIM, D_PAD, PLANES, COL0)
    column_word = offs_d // per_word
    column_shift = (offs_d - column_word * per_word) * width
    keep = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = codes_ptr + word_offset + ((first_row + offs_n) * words_per_row)[:, None] + column_word[None, :]
    words = tl.load(ptrs, mask=keep, other=0)
    unsigned = (words >> column_shift[None, :]) & ((1 << width) - 1)
    return tl.where(keep, unsigned - (1 << (width - 1)), 0)


@triton.jit
def _exact_codes(unsigned, WIDTH: tl.constexpr, FP32: tl.constexpr):
    """Unsigned ``WIDTH``-bit fields ``u`` (int32) as the exact codes ``q = u - 2**(WIDTH - 1)`` in float16 (float32
    if ``FP32``), with no integer-to-float conversion instruction per code (I2F): ``u`` (< 2**10) is placed in
    the mantissa of 2**10 (float16) or 2**23 (float32) and the exact float value 2**10 + u (2**23 + u) is shifted
    by 2**10 + 2**(WIDTH - 1) (2**23 + ...)."""
    if FP32:
        magic = (unsigned | 0x4B000000).to(tl.float32, bitcast=True)
        return magic - (8388608.0 + (1 << (WIDTH - 1)))
    else:
        magic = (unsigned | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return (magic - (1024.0 + (1 << (WIDTH - 1)))).to(tl.float16)


@triton.jit
def _load_codes_uniform(
    codes_ptr,
    word_offset,
    first_row,
    offs_n,
    rows_ok,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32: tl.constexpr,
    COL0: tl.constexpr = 0,
):
    """Residual codes q [BLOCK_N, D_PAD] as exact float16 (float32 if ``FP32``) operands of block rows
    ``first_row + offs_n`` (columns ``COL0`` on), for a compile-time width.

    Element (n, d) is read from word ``d // PER_WORD`` of its row and shifted by ``(d % PER_WORD) * WIDTH``: the
    tile is loaded directly in its final shape (neighbouring columns read the same word, served by one cache
    line), so nothing is reshaped in registers. Rows outside ``rows_ok`` and columns at or beyond ``HEAD_DIM``
    read zero words (code ``-2**(WIDTH - 1)``; every caller multiplies them by zero steps or zero operand
    columns). A compact ``[BLOCK_N, words]`` load expanded in registers by join and reshape was tried first: on
    sm_90 with Triton 3.6 it miscompiled at d = 128 (wrong outputs, NaN, illegal addresses that depended on the
    tile shape; kernels/README.md)."""
    PER_WORD: tl.constexpr = 32 // WIDTH
    WORDS: tl.constexpr = (HEAD_DIM + PER_WORD - 1) // PER_WORD
    offs_d = COL0 + tl.arange(0, D_PAD)
    column_word = offs_d // PER_WORD
    column_shift = (offs_d % PER_WORD) * WIDTH
    ptrs = codes_ptr + word_offset + ((first_row + offs_n) * WORDS)[:, None] + column_word[None, :]
    if COL0 + D_PAD <= HEAD_DIM:
        words = tl.load(ptrs, mask=rows_ok[:, None], other=0)
    else:
        words = tl.load(ptrs, mask=rows_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0)
    return _exact_codes((words >> column_shift[None, :]) & ((1 << WIDTH) - 1), WIDTH, FP32)


@triton.jit
def _load_codes_bytes(
    codes_ptr,
    word_offset,
    first_row,
    offs_n,
    rows_ok,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32: tl.constexpr,
    COL0: tl.constexpr = 0,
):
    """Residual codes q [BLOCK_N, D_PAD] as exact float16 (float32 if ``FP32``) operands in plane order
    (``_columns`` with ``8 // WIDTH`` planes, from column ``COL0``) for a compile-time width of 2, 4 or 8 bits whose
    rows fill whole words (``HEAD_DIM`` a multiple of ``32 // WIDTH``).

    In memory (little-endian words) head dimension ``d`` of a row is bits ``(d % p) * WIDTH`` of byte ``d // p``
    (``p = 8 // WIDTH`` codes per byte). In plane order operand column ``c = i * (HEAD_DIM / p) + j`` is
    dimension ``j * p + i``: byte ``j``, shift ``i * WIDTH``. Each plane is a run of consecutive bytes, so the
    tile is one contiguous, vectorisable load per plane and needs no reshape in registers. The block's first
    word must be a multiple of 4 (16 bytes; ``block_runs`` sends other blocks to the general loop); rows outside
    ``rows_ok`` and columns at or beyond ``HEAD_DIM`` read zero bytes (code ``-2**(WIDTH - 1)``, multiplied by a
    zero step or a zero operand column by every caller)."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    PLANE: tl.constexpr = HEAD_DIM // PER_BYTE  # columns per plane, and bytes per row
    offs_c = COL0 + tl.arange(0, D_PAD)
    byte_column = offs_c % PLANE
    if (PLANE & (PLANE - 1)) == 0 and COL0 % PLANE == 0:
        byte_column = tl.max_contiguous(tl.multiple_of(byte_column, PLANE), PLANE)
    shift = (offs_c // PLANE) * WIDTH
    base = tl.multiple_of(word_offset * 4, 16)
    byte_ptr = codes_ptr.to(tl.pointer_type(tl.uint8)) + base
    ptrs = byte_ptr + ((first_row + offs_n) * PLANE)[:, None] + byte_column[None, :]
    if COL0 + D_PAD <= HEAD_DIM:
        raw = tl.load(ptrs, mask=rows_ok[:, None], other=0)
    else:
        raw = tl.load(ptrs, mask=rows_ok[:, None] & (offs_c < HEAD_DIM)[None, :], other=0)
    if _ASM_DECODE and not FP32:
        return _exact_codes_asm(raw, shift, WIDTH)
    return _exact_codes((raw.to(tl.int32) >> shift[None, :]) & ((1 << WIDTH) - 1), WIDTH, FP32)


@triton.jit
def _exact_codes_asm(raw, shift, WIDTH: tl.constexpr):
    """``_exact_codes`` of the ``WIDTH``-bit fields at bit ``shift[c]`` of the bytes ``raw`` [N, C] (uint8), as
    float16, four codes per six instructions: PRMT spreads two bytes into the low bytes of two half-words, LOP3
    keeps the field in place (mask ``(2**WIDTH - 1) << shift``) under the exponent of 2**10 (``0x6400``): the exact
    half ``1024 + 2**shift u``; HFMA2 scales by ``2**-shift`` and subtracts ``1024 * 2**-shift + 2**(WIDTH - 1)``,
    exactly (every value is a small integer times a power of two)."""
    mask = (((1 << WIDTH) - 1) << shift).to(tl.uint16)
    scale = tl.exp2(-shift.to(tl.float32))
    offset = -(1024.0 * scale + (1 << (WIDTH - 1)))
    _, mask = tl.broadcast(raw, mask[None, :])
    _, scale16 = tl.broadcast(raw, scale.to(tl.float16)[None, :])
    _, offset16 = tl.broadcast(raw, offset.to(tl.float16)[None, :])
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi;
        prmt.b32 lo, $2, 0, 0x4140;
        prmt.b32 hi, $2, 0, 0x4342;
        lop3.b32 lo, lo, $3, 0x64006400, 0xEA;
        lop3.b32 hi, hi, $4, 0x64006400, 0xEA;
        fma.rn.f16x2 $0, lo, $5, $7;
        fma.rn.f16x2 $1, hi, $6, $8;
        }
        """,
        constraints="=r,=r,r,r,r,r,r,r,r",
        args=[raw, mask, scale16, offset16],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _uniform_residual_tile(
    Scale,
    Offset,
    Codes,
    meta_index,
    first_row,
    offs_n,
    row_ok,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """``(codes, step)`` of a tile in a uniform run (every block ``MODE_LOWRANK`` or packed at ``WIDTH`` bits,
    see ``block_runs``), with no branch: a low-rank block (offset -1, scale 0) loads nothing and yields step 0,
    so its term vanishes. Straight-line code the software pipeliner can prefetch. ``PLANES`` >= 1: byte
    decode in plane order (``_load_codes_bytes``); 0: the word decode in natural order."""
    step = tl.load(Scale + meta_index)
    offset = tl.load(Offset + meta_index)
    # Compare a broadcast copy: a scalar-and-vector boolean mask trips Triton's interpreter.
    rows = row_ok & ((tl.zeros_like(offs_n) + offset) >= 0)
    if PLANES >= 1:
        codes = _load_codes_bytes(
            Codes, tl.maximum(offset, 0), first_row, offs_n, rows, WIDTH, HEAD_DIM, D_PAD, FP32, COL0
        )
    else:
        codes = _load_codes_uniform(
            Codes, tl.maximum(offset, 0), first_row, offs_n, rows, WIDTH, HEAD_DIM, D_PAD, FP32, COL0
        )
    return codes, tl.where(offset >= 0, step, 0.0)


@triton.jit
def _load_raw_tile(
    raw_ptr,
    element_offset,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """Exactly stored values [BLOCK_N, D_PAD] (input dtype, columns in ``_columns`` order from ``COL0``) of block
    rows ``first_row + offs_n``."""
    offs_d = _columns(HEAD_DIM, D_PAD, PLANES, COL0)
    keep = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = raw_ptr + element_offset + ((first_row + offs_n) * HEAD_DIM)[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=keep, other=0.0)


@triton.jit
def _query_operand(
    q_rows,
    stride_qd,
    row_valid,
    logit_mult,
    HEAD_DIM_K: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FP32: tl.constexpr,
    query_scale,
    content_bias_head,
    RELATIVE: tl.constexpr,
    PLANES: tl.constexpr = 0,
):
    """Load the query tile and return ``(q_op, q_res_mult)``: the operand of every product with K factors and
    codes (columns in ``_columns`` order), and the per-row multiplier from those products to log2-unit logits.
    For 16-bit queries ``q_op`` is float16 after a per-row power-of-two scaling, exact for float16 and bfloat16
    alike (no overflow). With ``RELATIVE`` the query is Transformer-XL's content query ``scale q + u`` rounded
    once to q's dtype (``u`` at ``content_bias_head``, float32), as the dense kernel forms it; the logit scale
    is then in it."""
    offs_dk = _columns(HEAD_DIM_K, DK_PAD, PLANES)
    q = tl.load(
        q_rows[:, None] + (offs_dk * stride_qd)[None, :],
        mask=row_valid[:, None] & (offs_dk < HEAD_DIM_K)[None, :],
        other=0.0,
    )
    if RELATIVE:
        content_bias = tl.load(content_bias_head + offs_dk, mask=offs_dk < HEAD_DIM_K, other=0.0)
        q = (q.to(tl.float32) * query_scale + content_bias[None, :]).to(q.dtype)
    if FP32:
        q_op = q.to(tl.float32)
        q_res_mult = tl.zeros([BLOCK_M], dtype=tl.float32) + logit_mult
    else:
        q_scale, q_inv = row_normaliser(q.to(tl.float32))
        q_op = (q.to(tl.float32) * q_inv[:, None]).to(tl.float16)
        q_res_mult = q_scale * logit_mult
    return q_op, q_res_mult


@triton.jit
def _key_residual_logits(
    x,
    q_op,
    q_res_mult,
    inv_row_mult,
    mode,
    meta_index,
    K_scale,
    K_bits,
    K_offset,
    K_codes,
    K_raw,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM_K: tl.constexpr,
    DK_PAD: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    PLANES: tl.constexpr = 0,
):
    """Add ``Q R_tile^T`` (in units of the tile's row multiplier) for a tile whose mode is not low-rank."""
    offset = tl.load(K_offset + meta_index)
    if mode == 3:
        # Exact tile, in float32 operands: float16/bfloat16 values (q_op and the stored ones) are exact in tf32,
        # so the products are exact, and no float16 cast can overflow on the large values such tiles hold.
        raw = _load_raw_tile(K_raw, offset, first_row, offs_n, row_ok, HEAD_DIM_K, DK_PAD, PLANES)
        dot = tl.dot(q_op.to(tl.float32), tl.trans(raw.to(tl.float32)), input_precision=PRECISION)
        x += dot * (q_res_mult * inv_row_mult)[:, None]
    else:
        step = tl.load(K_scale + meta_index)
        width = tl.load(K_bits + meta_index).to(tl.int32)
        codes = _load_codes_tile(K_codes, offset, width, first_row, offs_n, row_ok, HEAD_DIM_K, DK_PAD, PLANES)
        dot = tl.dot(q_op, tl.trans(_to_operand(codes, FP32)), input_precision=PRECISION)
        x += dot * (q_res_mult * (step * inv_row_mult))[:, None]
    return x


@triton.jit
def _packed_residual_tile(
    Scale,
    Bits,
    Offset,
    Codes,
    mode,
    meta_index,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """Codes of a packed tile as ``(codes, step)``, predicated instead of branched: a tile of another mode
    loads nothing and yields zero codes and step 0 (its stored scale). Straight-line loads can be prefetched
    by the software pipeliner, which loads inside a branch cannot."""
    is_packed = (mode == 1) | (mode == 2)
    step = tl.load(Scale + meta_index)
    width = tl.where(is_packed, tl.load(Bits + meta_index).to(tl.int32), 8)
    offset = tl.where(is_packed, tl.load(Offset + meta_index), 0)
    # Compare a broadcast copy of the mode: a scalar-and-vector boolean mask trips Triton's interpreter.
    mode_rows = tl.zeros_like(offs_n) + mode
    rows = row_ok & ((mode_rows == 1) | (mode_rows == 2))
    codes = _load_codes_tile(Codes, offset, width, first_row, offs_n, rows, HEAD_DIM, D_PAD, PLANES, COL0)
    return codes, tl.where(is_packed, step, 0.0)


@triton.jit
def _value_residual(
    accumulator,
    p,
    mode,
    meta_index,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    PLANES: tl.constexpr = 0,
    COL0: tl.constexpr = 0,
):
    """``accumulator += p @ R_tile`` for a V tile whose mode is not low-rank (accumulator columns in
    ``_columns`` order, ``[COL0, COL0 + DV_PAD)``)."""
    offset = tl.load(V_offset + meta_index)
    if mode == 3:
        raw = _load_raw_tile(V_raw, offset, first_row, offs_n, row_ok, HEAD_DIM_V, DV_PAD, PLANES, COL0)
        if FP32:
            raw = raw.to(tl.float32)
        accumulator = tl.dot(p.to(raw.dtype), raw, accumulator, input_precision=PRECISION)
    else:
        step = tl.load(V_scale + meta_index)
        width = tl.load(V_bits + meta_index).to(tl.int32)
        codes = _load_codes_tile(V_codes, offset, width, first_row, offs_n, row_ok, HEAD_DIM_V, DV_PAD, PLANES, COL0)
        accumulator += tl.dot(_to_operand(p, FP32), _to_operand(codes, FP32), input_precision=PRECISION) * step
    return accumulator


@triton.jit
def _basis_part(
    accumulator,
    partial_op,
    part_mult,
    basis_ptr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PLANES: tl.constexpr,
    COL0: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    TWICE: tl.constexpr,
):
    """``accumulator += (partial_op * part_mult) @ P[:, cols]`` for the value columns ``[COL0, COL0 + D_PAD)`` of the
    projection at ``basis_ptr`` (``partial_op``: float32, or float16 rows scaled by ``1 / part_mult``; ``TWICE``: the
    projection stacked on itself, ``_load_basis_twice``)."""
    if TWICE:
        basis = _load_basis_twice(basis_ptr, RANK, RANK_PAD, HEAD_DIM, D_PAD, COL0)
    else:
        basis = _load_basis(basis_ptr, RANK, RANK_PAD, HEAD_DIM, D_PAD, PLANES, COL0)
    if FP32:
        return tl.dot(partial_op, basis.to(tl.float32), accumulator, input_precision=PRECISION)
    else:
        return accumulator + tl.dot(partial_op, basis) * part_mult[:, None]


@triton.jit
def _basis_parts(
    accumulator,
    accumulator_hi,
    partial,
    basis_ptr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DV_PAD: tl.constexpr,
    DV_HI: tl.constexpr,
    PLANES: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    TWICE: tl.constexpr = False,
):
    """``O += partial @ P`` for the rank-space product ``partial`` (float32 [BLOCK_M, RANK_PAD]) into both value
    parts (``accumulator_hi`` only where ``DV_HI > 0``): in float32 operands, or as float16 rows scaled to their
    largest element."""
    if FP32:
        partial_op = partial
        part_mult = tl.full([partial.shape[0]], 1.0, tl.float32)
    else:
        part_mult, part_inv = row_normaliser(partial)
        partial_op = (partial * part_inv[:, None]).to(tl.float16)
    accumulator = _basis_part(
        accumulator, partial_op, part_mult, basis_ptr, RANK, RANK_PAD, HEAD_DIM, DV_PAD, PLANES, 0, FP32, PRECISION,
        TWICE,
    )  # fmt: skip
    if DV_HI > 0:
        accumulator_hi = _basis_part(
            accumulator_hi, partial_op, part_mult, basis_ptr, RANK, RANK_PAD, HEAD_DIM, DV_HI, PLANES, DV_PAD, FP32,
            PRECISION, TWICE,
        )  # fmt: skip
    return accumulator, accumulator_hi


@triton.jit
def _catch_up(accumulator, accumulator_hi, accumulator_max, running_max, DV_HI: tl.constexpr):
    """Deferred rescaling: both value parts brought from their reference maximum up to the running one (a row still
    at -inf takes 0, and an accumulator whose reference is -inf, still zero, a factor of 0). Returns the parts and
    the new reference maximum."""
    safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    factor = tl.math.exp2(accumulator_max - safe_max)
    accumulator = accumulator * factor[:, None]
    if DV_HI > 0:
        accumulator_hi = accumulator_hi * factor[:, None]
    return accumulator, accumulator_hi, safe_max


@triton.jit
def _value_residual_part(
    accumulator,
    p,
    p_op,
    mode,
    meta_index,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    PREDICATED: tl.constexpr,
    PLANES: tl.constexpr,
    COL0: tl.constexpr,
):
    """``accumulator += p @ R_tile`` over the value columns ``[COL0, COL0 + D_PAD)`` (one part, ``dv_parts``): a tile of
    a uniform run (``UNIFORM_BITS``: branch-free, a low-rank block adds zero), a predicated one (``PREDICATED``:
    packed codes loaded masked by ``mode``, an exact tile added after), or a tile whose ``mode`` is not low rank."""
    if UNIFORM_BITS > 0:
        codes_v, v_step = _uniform_residual_tile(
            V_scale, V_offset, V_codes, meta_index, first_row, offs_n, row_ok, UNIFORM_BITS, HEAD_DIM_V, D_PAD, FP32,
            PLANES, COL0,
        )  # fmt: skip
        accumulator += tl.dot(p_op, codes_v, input_precision=PRECISION) * v_step
    elif PREDICATED:
        codes_v, v_step = _packed_residual_tile(
            V_scale, V_bits, V_offset, V_codes, mode, meta_index, first_row, offs_n, row_ok, HEAD_DIM_V, D_PAD, PLANES,
            COL0,
        )  # fmt: skip
        accumulator += tl.dot(p_op, _to_operand(codes_v, FP32), input_precision=PRECISION) * v_step
        if mode == 3:
            accumulator = _value_residual(
                accumulator, p, mode, meta_index, V_scale, V_bits, V_offset, V_codes, V_raw, first_row, offs_n,
                row_ok, HEAD_DIM_V, D_PAD, FP32, PRECISION, PLANES, COL0,
            )  # fmt: skip
    else:
        accumulator = _value_residual(
            accumulator, p, mode, meta_index, V_scale, V_bits, V_offset, V_codes, V_raw, first_row, offs_n, row_ok,
            HEAD_DIM_V, D_PAD, FP32, PRECISION, PLANES, COL0,
        )  # fmt: skip
    return accumulator


@triton.jit
def _value_residual_parts(
    accumulator,
    accumulator_hi,
    p,
    p_op,
    mode,
    meta_index,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    first_row,
    offs_n,
    row_ok,
    HEAD_DIM_V: tl.constexpr,
    DV_PAD: tl.constexpr,
    DV_HI: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    PREDICATED: tl.constexpr,
    PLANES: tl.constexpr,
):
    """``_value_residual_part`` into both value parts (``accumulator_hi`` only where ``DV_HI > 0``)."""
    accumulator = _value_residual_part(
        accumulator, p, p_op, mode, meta_index, V_scale, V_bits, V_offset, V_codes, V_raw, first_row, offs_n, row_ok,
        HEAD_DIM_V, DV_PAD, FP32, PRECISION, UNIFORM_BITS, PREDICATED, PLANES, 0,
    )  # fmt: skip
    if DV_HI > 0:
        accumulator_hi = _value_residual_part(
            accumulator_hi, p, p_op, mode, meta_index, V_scale, V_bits, V_offset, V_codes, V_raw, first_row, offs_n,
            row_ok, HEAD_DIM_V, DV_HI, FP32, PRECISION, UNIFORM_BITS, PREDICATED, PLANES, DV_PAD,
        )  # fmt: skip
    return accumulator, accumulator_hi


# ---------------------------------------------------------------------------------------------- inner loop
@triton.jit
def _compressed_tile(
    start_n,
    accumulator,
    accumulator_hi,
    accumulator_max,
    rank_accumulator,
    running_sum,
    running_max,
    q_op,
    q_res_mult,
    query_rank,
    query_rank_lo,
    query_rank_mult,
    K_coeff_head,
    k_coeff_desc,
    K_basis,
    K_mode,
    K_scale,
    K_bits,
    K_offset,
    K_codes,
    K_raw,
    V_coeff_head,
    v_coeff_desc,
    V_basis,
    V_mode,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    stride_kcn,
    stride_kcr,
    stride_vcn,
    stride_vcr,
    k_meta_base,
    v_meta_base,
    bias_rows,
    stride_bias_key,
    row_query,
    row_valid,
    N_K,
    bias_mult,
    softcap_log2,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    RANK_K: tl.constexpr,
    RANK_V: tl.constexpr,
    RK_PAD: tl.constexpr,
    RV_PAD: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_V: tl.constexpr,
    K_PER_BLOCK: tl.constexpr,
    V_PER_BLOCK: tl.constexpr,
    K_RESIDUAL: tl.constexpr,
    V_RESIDUAL: tl.constexpr,
    SPLIT_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    PREDICATED: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    q_position,
    relative_head,
    stride_rel_row,
    stride_rel_d,
    row_start,
    N_Q,
    N_REL,
    logit_mult,
    RELATIVE: tl.constexpr,
    K_UNIFORM_BITS: tl.constexpr = 0,
    V_UNIFORM_BITS: tl.constexpr = 0,
    K_PLANES: tl.constexpr = 0,
    V_PLANES: tl.constexpr = 0,
    DV_HI: tl.constexpr = 0,
):
    """One key tile: logits through the basis (+ residual), online softmax, values in rank space (+ residual).
    ``K_RESIDUAL``/``V_RESIDUAL`` False compile the tile without any residual code."""
    offs_n = tl.arange(0, BLOCK_N)
    if MASK:
        row_ok = (start_n + offs_n) < N_K
    else:
        row_ok = offs_n < BLOCK_N
    # ---- logits: S = Q (C P + R)^T, in units of row_mult ----
    k_meta = k_meta_base + start_n // BLOCK_SIZE_K
    if RANK_K > 0:
        if K_PER_BLOCK:
            basis = _load_basis(
                K_basis + k_meta.to(tl.int64) * (RANK_K * HEAD_DIM_K), RANK_K, RK_PAD, HEAD_DIM_K, DK_PAD, K_PLANES
            )
            block_rank_f32 = tl.dot(q_op, tl.trans(_to_operand(basis, FP32)), input_precision=PRECISION)
            block_rank_f32 = block_rank_f32 * q_res_mult[:, None]
            if FP32:
                row_mult = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
                block_rank = block_rank_f32
                block_rank_lo = block_rank_f32
            else:
                row_mult, inv_mult = row_normaliser(block_rank_f32)
                block_rank, block_rank_lo = _split_float16(block_rank_f32 * inv_mult[:, None])
        else:
            row_mult = query_rank_mult
            block_rank = query_rank
            block_rank_lo = query_rank_lo
        coeffs = _load_coeff_tile(
            K_coeff_head, k_coeff_desc, start_n, offs_n, stride_kcn, stride_kcr, N_K, RANK_K, RK_PAD, MASK, USE_TMA
        )
        x = _rank_logits(block_rank, block_rank_lo, coeffs, FP32, SPLIT_RANK and not FP32, PRECISION)
    else:
        row_mult = q_res_mult
        x = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if K_RESIDUAL and K_UNIFORM_BITS > 0:
        codes, k_step = _uniform_residual_tile(
            K_scale,
            K_offset,
            K_codes,
            k_meta,
            start_n % BLOCK_SIZE_K,
            offs_n,
            row_ok,
            K_UNIFORM_BITS,
            HEAD_DIM_K,
            DK_PAD,
            FP32,
            K_PLANES,
        )
        dot = tl.dot(q_op, tl.trans(codes), input_precision=PRECISION)
        x += dot * (q_res_mult * (k_step / row_mult))[:, None]
    elif K_RESIDUAL:
        k_mode = tl.load(K_mode + k_meta).to(tl.int32)
        if PREDICATED:
            codes, k_step = _packed_residual_tile(
                K_scale,
                K_bits,
                K_offset,
                K_codes,
                k_mode,
                k_meta,
                start_n % BLOCK_SIZE_K,
                offs_n,
                row_ok,
                HEAD_DIM_K,
                DK_PAD,
                K_PLANES,
            )
            dot = tl.dot(q_op, tl.trans(_to_operand(codes, FP32)), input_precision=PRECISION)
            x += dot * (q_res_mult * (k_step / row_mult))[:, None]
            if k_mode == 3:
                x = _key_residual_logits(
                    x,
                    q_op,
                    q_res_mult,
                    1.0 / row_mult,
                    k_mode,
                    k_meta,
                    K_scale,
                    K_bits,
                    K_offset,
                    K_codes,
                    K_raw,
                    start_n % BLOCK_SIZE_K,
                    offs_n,
                    row_ok,
                    HEAD_DIM_K,
                    DK_PAD,
                    FP32,
                    PRECISION,
                    K_PLANES,
                )
        else:
            if k_mode != 0:
                x = _key_residual_logits(
                    x,
                    q_op,
                    q_res_mult,
                    1.0 / row_mult,
                    k_mode,
                    k_meta,
                    K_scale,
                    K_bits,
                    K_offset,
                    K_codes,
                    K_raw,
                    start_n % BLOCK_SIZE_K,
                    offs_n,
                    row_ok,
                    HEAD_DIM_K,
                    DK_PAD,
                    FP32,
                    PRECISION,
                    K_PLANES,
                )
    if RELATIVE == 2:
        # The runs (q_position: the run starts, then the run of each distance; N_REL runs): the tile's first run's
        # logit of each row plus the other runs' excess over it, in natural units, as the dense kernel's.
        first_run, last_run = relative_runs_bounds(q_position, row_start, start_n, N_Q, N_K, N_REL, BLOCK_M, BLOCK_N)
        first_value = relative_runs_first(relative_head, stride_rel_row, first_run, row_start, N_Q, BLOCK_M)
        relative = relative_runs_tile(
            relative_head,
            stride_rel_row,
            q_position,
            first_run,
            last_run,
            first_value,
            row_start,
            start_n,
            N_Q,
            BLOCK_M,
            BLOCK_N,
            _RUN_SPAN,
        )
        x += (relative + first_value[:, None]) * (logit_mult / row_mult)[:, None]
    elif RELATIVE:
        # (scale q_i + w) . R[N_Q - 1 + j - i] in natural units; x is in units of row_mult (log2 units / row_mult).
        relative = relative_logits_tile(
            q_position,
            relative_head,
            stride_rel_row,
            stride_rel_d,
            row_start,
            start_n,
            N_Q,
            N_REL,
            HEAD_DIM_K,
            DK_PAD,
            BLOCK_N,
            PRECISION,
        )
        x += relative * (logit_mult / row_mult)[:, None]
    p, alpha, running_max, running_sum = softmax_step(
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
        HAS_BIAS,
        SOFTCAP,
        CAUSAL,
        MASK,
        BIAS_TILE,
        FIXED_MAX,
    )
    # ---- values: O += P (C_v P_v + R_v) ----
    v_meta = v_meta_base + start_n // BLOCK_SIZE_V
    if V_coeff_head.dtype.element_ty == tl.bfloat16:
        # Bounded maximum (the launcher passes bfloat16 V coefficients only then): P spans far more than float16's
        # range, so P enters the product in bfloat16, against the coefficients as a bfloat16 pair [hi | lo]
        # (V_PACKED); there is no V residual in such a launch. In float32 P stays float32.
        tl.static_assert(not V_RESIDUAL and not V_PER_BLOCK and not FP32)
        p_op = p.to(tl.bfloat16)
    else:
        p_op = _to_operand(p, FP32)
    v_first = start_n % BLOCK_SIZE_V
    if V_PER_BLOCK:
        if not FIXED_MAX:
            accumulator = accumulator * alpha[:, None]
            if DV_HI > 0:
                accumulator_hi = accumulator_hi * alpha[:, None]
        if RANK_V > 0:
            coeffs_v = _load_coeff_tile(
                V_coeff_head, v_coeff_desc, start_n, offs_n, stride_vcn, stride_vcr, N_K, RANK_V, RV_PAD, MASK, USE_TMA
            )
            partial = tl.dot(p_op, _to_operand(coeffs_v, FP32), input_precision=PRECISION)
            accumulator, accumulator_hi = _basis_parts(
                accumulator, accumulator_hi, partial, V_basis + v_meta.to(tl.int64) * (RANK_V * HEAD_DIM_V), RANK_V,
                RV_PAD, HEAD_DIM_V, DV_PAD, DV_HI, V_PLANES, FP32, PRECISION,
            )  # fmt: skip
    elif RANK_V > 0:
        # With a packed pair (bounded launches) RANK_V here is twice the rank: [hi | lo] side by side.
        coeffs_v = _load_coeff_tile(
            V_coeff_head, v_coeff_desc, start_n, offs_n, stride_vcn, stride_vcr, N_K, RANK_V, RV_PAD, MASK,
            USE_TMA,
        )  # fmt: skip
        if not FIXED_MAX:
            rank_accumulator = rank_accumulator * alpha[:, None]
        if V_coeff_head.dtype.element_ty == tl.bfloat16:
            rank_accumulator = tl.dot(p_op, coeffs_v, rank_accumulator)
        else:
            rank_accumulator = tl.dot(p_op, _to_operand(coeffs_v, FP32), rank_accumulator, input_precision=PRECISION)
    if V_RESIDUAL:
        # Every tile of a uniform run, and every tile under PREDICATED with a shared basis, adds its (possibly zero)
        # residual; otherwise only tiles whose mode is not low rank. With a shared basis the Dv-wide accumulator is
        # brought up to the current maximum only here (deferred rescaling); per-block bases rescaled it above.
        EVERY_TILE: tl.constexpr = V_UNIFORM_BITS > 0 or (PREDICATED and not V_PER_BLOCK)
        if V_UNIFORM_BITS > 0:
            v_mode = 1  # unused: uniform tiles need no mode
        else:
            v_mode = tl.load(V_mode + v_meta).to(tl.int32)
        if EVERY_TILE:
            if not V_PER_BLOCK and not FIXED_MAX:
                accumulator, accumulator_hi, accumulator_max = _catch_up(
                    accumulator, accumulator_hi, accumulator_max, running_max, DV_HI
                )
            accumulator, accumulator_hi = _value_residual_parts(
                accumulator, accumulator_hi, p, p_op, v_mode, v_meta, V_scale, V_bits, V_offset, V_codes, V_raw,
                v_first, offs_n, row_ok, HEAD_DIM_V, DV_PAD, DV_HI, FP32, PRECISION, V_UNIFORM_BITS,
                PREDICATED and not V_PER_BLOCK, V_PLANES,
            )  # fmt: skip
        else:
            if v_mode != 0:
                if not V_PER_BLOCK and not FIXED_MAX:
                    accumulator, accumulator_hi, accumulator_max = _catch_up(
                        accumulator, accumulator_hi, accumulator_max, running_max, DV_HI
                    )
                accumulator, accumulator_hi = _value_residual_parts(
                    accumulator, accumulator_hi, p, p_op, v_mode, v_meta, V_scale, V_bits, V_offset, V_codes, V_raw,
                    v_first, offs_n, row_ok, HEAD_DIM_V, DV_PAD, DV_HI, FP32, PRECISION, 0, False, V_PLANES,
                )  # fmt: skip
    return accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max


@triton.jit
def _attention_compressed_inner(
    accumulator,
    accumulator_hi,
    accumulator_max,
    rank_accumulator,
    running_sum,
    running_max,
    q_op,
    q_res_mult,
    query_rank,
    query_rank_lo,
    query_rank_mult,
    K_coeff_head,
    k_coeff_desc,
    K_basis,
    K_mode,
    K_scale,
    K_bits,
    K_offset,
    K_codes,
    K_raw,
    V_coeff_head,
    v_coeff_desc,
    V_basis,
    V_mode,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    stride_kcn,
    stride_kcr,
    stride_vcn,
    stride_vcr,
    k_meta_base,
    v_meta_base,
    bias_rows,
    stride_bias_key,
    row_query,
    row_valid,
    lo,
    hi,
    N_K,
    bias_mult,
    softcap_log2,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    RANK_K: tl.constexpr,
    RANK_V: tl.constexpr,
    RK_PAD: tl.constexpr,
    RV_PAD: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_V: tl.constexpr,
    K_PER_BLOCK: tl.constexpr,
    V_PER_BLOCK: tl.constexpr,
    K_RESIDUAL: tl.constexpr,
    V_RESIDUAL: tl.constexpr,
    SPLIT_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    PREDICATED: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    q_position,
    relative_head,
    stride_rel_row,
    stride_rel_d,
    row_start,
    N_Q,
    N_REL,
    logit_mult,
    RELATIVE: tl.constexpr,
    K_UNIFORM_BITS: tl.constexpr = 0,
    V_UNIFORM_BITS: tl.constexpr = 0,
    K_PLANES: tl.constexpr = 0,
    V_PLANES: tl.constexpr = 0,
    DV_HI: tl.constexpr = 0,
):
    """Key tiles at offsets ``lo, lo + BLOCK_N, ... < hi`` (a plain range: the software pipeliner prefetches
    the next tiles' coefficients while this one computes)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = _compressed_tile(
            start_n,
            accumulator,
            accumulator_hi,
            accumulator_max,
            rank_accumulator,
            running_sum,
            running_max,
            q_op,
            q_res_mult,
            query_rank,
            query_rank_lo,
            query_rank_mult,
            K_coeff_head,
            k_coeff_desc,
            K_basis,
            K_mode,
            K_scale,
            K_bits,
            K_offset,
            K_codes,
            K_raw,
            V_coeff_head,
            v_coeff_desc,
            V_basis,
            V_mode,
            V_scale,
            V_bits,
            V_offset,
            V_codes,
            V_raw,
            stride_kcn,
            stride_kcr,
            stride_vcn,
            stride_vcr,
            k_meta_base,
            v_meta_base,
            bias_rows,
            stride_bias_key,
            row_query,
            row_valid,
            N_K,
            bias_mult,
            softcap_log2,
            HEAD_DIM_K,
            HEAD_DIM_V,
            DK_PAD,
            DV_PAD,
            RANK_K,
            RANK_V,
            RK_PAD,
            RV_PAD,
            BLOCK_SIZE_K,
            BLOCK_SIZE_V,
            K_PER_BLOCK,
            V_PER_BLOCK,
            K_RESIDUAL,
            V_RESIDUAL,
            SPLIT_RANK,
            BLOCK_M,
            BLOCK_N,
            HAS_BIAS,
            SOFTCAP,
            CAUSAL,
            MASK,
            FP32,
            PRECISION,
            USE_TMA,
            PREDICATED,
            BIAS_TILE,
            FIXED_MAX,
            q_position,
            relative_head,
            stride_rel_row,
            stride_rel_d,
            row_start,
            N_Q,
            N_REL,
            logit_mult,
            RELATIVE,
            K_UNIFORM_BITS,
            V_UNIFORM_BITS,
            K_PLANES,
            V_PLANES,
            DV_HI,
        )
    return accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max


# ----------------------------------------------------------------------------------------------- autotune
# Causal split launches (PASS 1 and 2) end their runs at a boundary of this many rows, whatever each pass's BLOCK_M
# (every tile shape's BLOCK_M divides it).
SPLIT_ROWS = tl.constexpr(128)

# Tile shapes of the relative-position variant, (BLOCK_M, BLOCK_N, warps, stages): its [BLOCK_M, 2 max(BLOCK_M,
# BLOCK_N)] float32 relative table and the live position query fit 64 rows on two warpgroups without spills
# (kernels/README.md has the register counts). Those not in the general list are relative-only.
_RELATIVE_SHAPES = frozenset({(64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 3), (64, 16, 8, 3)})
# The distances over which the runs are counted for this kernel: the most one tile of the relative shapes spans
# (BLOCK_M + BLOCK_N - 1).
RUNS_WINDOW = max(m + n - 1 for m, n, _, _ in _RELATIVE_SHAPES)
_GENERAL_SHAPES = (
    (64, 64, 4, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (64, 64, 8, 3),
    (64, 32, 4, 3),
    (64, 16, 4, 3),
)


def _shape_of(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def compressed_configs(interpret: bool) -> list[triton.Config]:
    """Tile shapes to search; BLOCK_N must divide the codec's block size (the prune function enforces it)."""
    if interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # The tile shapes that won on an H200 (Triton 3.6; kernels/README.md has the numbers). A key tile wider
    # than 64 was slower at every shape measured; narrower ones exist for codec blocks of 16 or 32 keys.
    # (BLOCK_M, BLOCK_N, warps, stages)
    shapes = list(_GENERAL_SHAPES) + sorted(_RELATIVE_SHAPES - set(_GENERAL_SHAPES), reverse=True)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _prune_compressed_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    block_size = min(args["BLOCK_SIZE_K"], args["BLOCK_SIZE_V"])
    dv_pad = args["DV_PAD"] + args.get("DV_HI", 0)  # both parts' width (dv_parts)
    residual = args["K_RESIDUAL"] or args["V_RESIDUAL"]
    # The widest key tile (up to 64) that divides the codec block; every block size is a power of two >= 16.
    block_n = min(64, block_size)
    relative = bool(args.get("RELATIVE"))
    uniform = bool(args.get("FAST_BITS_K") or args.get("FAST_BITS_V"))
    keep = []
    for config in configs:
        block_m = config.kwargs["BLOCK_M"]
        if config.kwargs["BLOCK_N"] != block_n:
            continue
        shape = _shape_of(config)
        if relative:
            # The interpreter's one configuration, or the relative shapes only.
            if _KERNELS_INTERPRETED or shape in _RELATIVE_SHAPES:
                keep.append(config)
            continue
        if not _KERNELS_INTERPRETED and shape not in _GENERAL_SHAPES:
            continue
        if block_m * dv_pad > 128 * 128 and config.num_warps < 8:
            continue
        if residual and block_m * dv_pad >= 128 * 64 and config.num_warps < 8 and block_m > 64:
            # Residual variants at 128 rows on 4 warps spill (sm_90, Triton 3.6: 760-2000 bytes of stack).
            continue
        if block_m == 64 and config.num_warps == 8 and not (residual and dv_pad >= 128):
            # 64 rows on two warpgroups: only for residual variants with a wide Dv accumulator, whose 4-warp
            # versions spill (d=128: 936 -> 16 bytes of stack; AlphaGenome's dv 192: 1520 -> 160).
            continue
        if block_m == 64 and config.num_warps == 8 and uniform:
            # Uniform runs on 64 rows over two warpgroups miscompile on sm_90 with Triton 3.6 (wrong values,
            # NaN, illegal addresses at dk >= 128; benchmarks/byte_decode_tiles.py, kernels/README.md).
            continue
        keep.append(config)
    if relative:
        return keep or [triton.Config({"BLOCK_M": 64, "BLOCK_N": block_n}, num_warps=8, num_stages=3)]
    return keep or [triton.Config({"BLOCK_M": 64, "BLOCK_N": block_n}, num_warps=4, num_stages=3)]


# The autotuner's key; the launcher keeps its own cache of the winners under the same values (plus the dtypes).
COMPRESSED_TUNE_KEY = [
    "TUNE_N_Q",
    "TUNE_N_K",
    "HEAD_DIM_K",
    "HEAD_DIM_V",
    "DV_HI",
    "GROUP",
    "RANK_K",
    "RANK_V",
    "BLOCK_SIZE_K",
    "BLOCK_SIZE_V",
    "K_PER_BLOCK",
    "V_PER_BLOCK",
    "K_RESIDUAL",
    "V_RESIDUAL",
    "SPLIT_RANK",
    "PREDICATED_RESIDUAL",
    "PASS",
    "FAST_BITS_K",
    "FAST_BITS_V",
    "K_PLANES",
    "V_PLANES",
    "GENERAL_RUNS",
    "HAS_BIAS",
    "BIAS_TILE",
    "SOFTCAP",
    "FIXED_MAX",
    "BOUNDED",
    "V_PACKED",
    "CAUSAL",
    "RELATIVE",
]


@triton.autotune(
    configs=compressed_configs(interpreting()),
    key=COMPRESSED_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_compressed_configs},
)
@triton.jit
def _attention_compressed_fwd(
    Q,
    Bias,
    Out,
    Lse,
    K_coeff,
    K_basis,
    K_mode,
    K_scale,
    K_bits,
    K_offset,
    K_codes,
    K_raw,
    V_coeff,
    V_basis,
    V_mode,
    V_scale,
    V_bits,
    V_offset,
    V_codes,
    V_raw,
    Runs,
    RunCounts,
    RelKeys,
    RelContentBias,
    RelPositionBias,
    KBound,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_bb,
    stride_bh,
    stride_bq,
    stride_bk,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_kcb,
    stride_kch,
    stride_kcn,
    stride_kcr,
    stride_vcb,
    stride_vch,
    stride_vcn,
    stride_vcr,
    stride_rh,
    stride_rh_row,
    stride_rh_d,
    N_Q,
    N_K,
    H_KV,
    NB_K,
    NB_V,
    NUM_SUPER,
    logit_mult,
    bias_mult,
    softcap_log2,
    fixed_max,
    query_scale,
    TUNE_N_Q,
    TUNE_N_K,
    RunKeys,
    RunStarts,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    DV_HI: tl.constexpr,
    RANK_K: tl.constexpr,
    RANK_V: tl.constexpr,
    RK_PAD: tl.constexpr,
    RV_PAD: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    BLOCK_SIZE_V: tl.constexpr,
    SUPER_BLOCK: tl.constexpr,
    K_PER_BLOCK: tl.constexpr,
    V_PER_BLOCK: tl.constexpr,
    K_RESIDUAL: tl.constexpr,
    V_RESIDUAL: tl.constexpr,
    SPLIT_RANK: tl.constexpr,
    PREDICATED_RESIDUAL: tl.constexpr,
    FAST_BITS_K: tl.constexpr,
    FAST_BITS_V: tl.constexpr,
    K_PLANES: tl.constexpr,
    V_PLANES: tl.constexpr,
    RUN_KINDS: tl.constexpr,
    GENERAL_RUNS: tl.constexpr,
    PASS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    BOUNDED: tl.constexpr,
    V_PACKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    RELATIVE: tl.constexpr,
    FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(PASS == 0 or PASS == 1 or PASS == 2)
    if BOUNDED:
        tl.static_assert(
            not (K_RESIDUAL or V_RESIDUAL or K_PER_BLOCK or V_PER_BLOCK or HAS_BIAS or SOFTCAP or RELATIVE)
            and RANK_K > 0
            and RANK_V > 0,
            "a bounded maximum needs a launch of shared-basis low-rank tiles without residual, bias, soft-cap or "
            "relative positions",
        )
    tl.static_assert(BOUNDED or not V_PACKED, "packed V coefficients belong to a bounded launch")
    tl.static_assert(PASS != 1 or not (K_RESIDUAL or V_RESIDUAL), "pass 1 is compiled without residual code")
    tl.static_assert(GENERAL_RUNS or RUN_KINDS == 3, "without general runs every residual run is a uniform one")
    if RELATIVE:
        tl.static_assert(GROUP == 1, "relative positions need one query head per K/V head")
    tl.static_assert(
        BLOCK_SIZE_K % BLOCK_N == 0 and BLOCK_SIZE_V % BLOCK_N == 0, "a key tile must lie inside one codec block"
    )
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and RK_PAD >= 16 and RV_PAD >= 16)
    tl.static_assert(SUPER_BLOCK % BLOCK_SIZE_K == 0 and SUPER_BLOCK % BLOCK_SIZE_V == 0)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    row_start = pid_m * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    row_head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
    row_valid = row_query < N_Q
    # Output columns in the V side's order (``_columns``): the Dv-wide accumulator holds them so. With DV_HI > 0 the
    # value columns are two parts (``dv_parts``): ``[0, DV_PAD)`` in ``accumulator``, ``[DV_PAD, DV_PAD + DV_HI)`` in
    # ``accumulator_hi`` (else an unused placeholder); every value product, rescaling and store is done per part.
    offs_dv = _columns(HEAD_DIM_V, DV_PAD, V_PLANES)

    # ---- queries: q_op is the operand of every product with K factors/codes ----
    q_rows = Q + batch * stride_qb + row_head * stride_qh + row_query.to(tl.int64) * stride_qn
    if RELATIVE:
        # Transformer-XL: q_op is built from the content query scale q + u (through the basis and the residual
        # codes alike), q_position = scale q + w reads the relative keys; both rounded once to q's dtype, as in
        # the dense kernel; the logit scale is in them (logit_mult holds log2(e) only).
        content_bias_head = RelContentBias + kv_head * HEAD_DIM_K
        offs_dk = tl.arange(0, DK_PAD)
        q_raw = tl.load(
            q_rows[:, None] + (offs_dk * stride_qd)[None, :],
            mask=row_valid[:, None] & (offs_dk < HEAD_DIM_K)[None, :],
            other=0.0,
        )
        position_bias = tl.load(RelPositionBias + kv_head * HEAD_DIM_K + offs_dk, mask=offs_dk < HEAD_DIM_K, other=0.0)
        if RELATIVE == 2:
            # Relative keys constant over runs of distances (as the dense kernel's RELATIVE == 2): this program
            # writes its queries' rows of the table of run logits (RelKeys, [B * H, runs, N_Q]) from the runs'
            # keys (RunKeys [H, R, Dk]) and w, then each tile reads the runs it spans (RunStarts: the run starts
            # and the run of each distance), passed to the tile step in q_position's place.
            relative_head = RelKeys + (batch * H_KV + kv_head) * stride_rh
            n_relative = stride_rh_d
            write_run_table(
                q_raw,
                RunKeys + kv_head.to(tl.int64) * n_relative * HEAD_DIM_K,
                position_bias,
                relative_head,
                stride_rh_row,
                row_query,
                row_valid,
                n_relative,
                query_scale,
                HEAD_DIM_K,
                DK_PAD,
                RUN_CHUNK,
                PRECISION,
            )
            q_position = RunStarts
        else:
            q_position = (q_raw.to(tl.float32) * query_scale + position_bias[None, :]).to(q_raw.dtype)
            relative_head = RelKeys + kv_head.to(tl.int64) * stride_rh
            n_relative = N_Q + N_K - 1
    else:
        content_bias_head = RelContentBias  # unused placeholders (None)
        q_position = RelKeys
        relative_head = RelKeys
        n_relative = N_Q + N_K - 1
    q_op, q_res_mult = _query_operand(
        q_rows,
        stride_qd,
        row_valid,
        logit_mult,
        HEAD_DIM_K,
        DK_PAD,
        BLOCK_M,
        FP32,
        query_scale,
        content_bias_head,
        RELATIVE,
        K_PLANES,
    )

    k_meta_base = (batch * H_KV + kv_head) * NB_K
    v_meta_base = (batch * H_KV + kv_head) * NB_V
    K_coeff_head = K_coeff + batch * stride_kcb + kv_head.to(tl.int64) * stride_kch
    V_coeff_head = V_coeff + batch * stride_vcb + kv_head.to(tl.int64) * stride_vch
    # Coefficient tiles through tensor descriptors: the rank is padded to RK_PAD/RV_PAD by zero fill.
    if USE_TMA and RANK_K > 0:
        k_coeff_desc = tl.make_tensor_descriptor(
            K_coeff_head, shape=[N_K, RANK_K], strides=[stride_kcn, 1], block_shape=[BLOCK_N, RK_PAD]
        )
    else:
        k_coeff_desc = K_coeff_head
    if USE_TMA and RANK_V > 0:
        if V_PACKED:
            v_coeff_desc = tl.make_tensor_descriptor(
                V_coeff_head, shape=[N_K, 2 * RANK_V], strides=[stride_vcn, 1], block_shape=[BLOCK_N, RV_PAD]
            )
        else:
            v_coeff_desc = tl.make_tensor_descriptor(
                V_coeff_head, shape=[N_K, RANK_V], strides=[stride_vcn, 1], block_shape=[BLOCK_N, RV_PAD]
            )
    else:
        v_coeff_desc = V_coeff_head

    # ---- shared K basis: Qp = Q P_k^T once per query tile ----
    query_rank_mult = q_res_mult
    if RANK_K > 0 and not K_PER_BLOCK:
        basis_k = _load_basis(
            K_basis + kv_head.to(tl.int64) * (RANK_K * HEAD_DIM_K), RANK_K, RK_PAD, HEAD_DIM_K, DK_PAD, K_PLANES
        )
        query_rank_f32 = tl.dot(q_op, tl.trans(_to_operand(basis_k, FP32)), input_precision=PRECISION)
        query_rank_f32 = query_rank_f32 * q_res_mult[:, None]
        if FP32:
            query_rank_mult = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
            query_rank = query_rank_f32
            query_rank_lo = query_rank_f32
        else:
            query_rank_mult, query_inv = row_normaliser(query_rank_f32)
            query_rank, query_rank_lo = _split_float16(query_rank_f32 * query_inv[:, None])
    else:
        query_rank = tl.zeros([BLOCK_M, RK_PAD], dtype=q_op.dtype)
        query_rank_lo = query_rank

    if HAS_BIAS:
        bias_row = (row_query // BIAS_TILE).to(tl.int64)
        bias_rows = Bias + batch * stride_bb + row_head * stride_bh + bias_row * stride_bq
    else:
        bias_rows = q_rows

    if BOUNDED:
        # A bound on every row's logits from the rank-space query and the box of the head's key coefficients
        # (Qp . c <= sum_r max(Qp_r cmax_r, Qp_r cmin_r)), used as a constant maximum: no row maximum is tracked
        # and nothing is rescaled. P = exp2(x - bound) may then lie far below 1, so it enters the value product in
        # bfloat16 (float32 with float32 operands), whose range holds it down to 2**-126 (BOUND_RETRY_SUM).
        offs_rk = tl.arange(0, RK_PAD)
        bound_head = KBound + (batch * H_KV + kv_head) * (2 * RANK_K)
        k_max = tl.load(bound_head + offs_rk, mask=offs_rk < RANK_K, other=0.0)
        k_min = tl.load(bound_head + RANK_K + offs_rk, mask=offs_rk < RANK_K, other=0.0)
        start_max = tl.sum(tl.maximum(query_rank_f32 * k_max[None, :], query_rank_f32 * k_min[None, :]), 1)
    elif FIXED_MAX:
        # The soft-cap bounds every logit: a constant maximum, nothing is ever rescaled.
        start_max = tl.zeros([BLOCK_M], dtype=tl.float32) + fixed_max
    else:
        start_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    running_max = start_max
    accumulator_max = start_max
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    accumulator_hi = tl.zeros([BLOCK_M, DV_HI], dtype=tl.float32) if DV_HI > 0 else accumulator
    rank_accumulator = tl.zeros([BLOCK_M, RV_PAD], dtype=tl.float32)
    # With BOUNDED a second attempt, with the running maximum, runs for a program in which some row's sum ended
    # below BOUND_RETRY_SUM: its bound overshot the true maximum by so much that terms of P could be lost.
    for attempt in tl.static_range(1 + BOUNDED):
        if attempt == 0:
            go = True
        else:
            go = tl.min(running_sum, 0) < BOUND_RETRY_SUM
        if go:
            if FIXED_MAX or (BOUNDED and attempt == 0):
                running_max = start_max
                accumulator_max = running_max
            else:
                running_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
                # Reference maximum of the deferred-rescaled accumulator: -inf until a residual V tile arrives, so
                # that the catch-up factor exp2(accumulator_max - max) is 0 (never inf) for an accumulator that is
                # still zero.
                accumulator_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            accumulator = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
            if DV_HI > 0:
                accumulator_hi = tl.zeros([BLOCK_M, DV_HI], dtype=tl.float32)
            rank_accumulator = tl.zeros([BLOCK_M, RV_PAD], dtype=tl.float32)

            # ---- key loops. Each head's super-blocks (SUPER_BLOCK keys, the larger codec block) form runs of
            # consecutive low-rank-only super-blocks and runs of super-blocks with a residual in K or V (Runs holds
            # the starts and ends of each kind, RunCounts the run counts; RUN_KINDS 3 splits residual runs into
            # uniform and general ones, see block_runs). Loop A walks the low-rank runs with no residual code
            # compiled in (the rank-space fast path); loop B1 the uniform runs (compile-time width, no branch per
            # tile); loop B2 the general residual runs; loop C the masked tail (ragged last tile, causal diagonal).
            # Softmax accumulation is order-independent, and each run is a plain range loop that the software
            # pipeliner can prefetch. PASS splits the work over two launches (``split`` in the launcher): 1 walks loop A
            # only, in a kernel compiled without residual code (its own tile shape and registers), 2 the other loops;
            # the launcher merges the two partial results by their log-sum-exp. 0: everything in one launch. ----
            unmasked_end, end = key_loop_bounds(row_start, N_Q, N_K, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
            if CAUSAL and PASS != 0:
                # The two passes of a split launch are tuned apart and may pick different BLOCK_M; where the runs end
                # and the masked tail begins must not depend on it, or a row would lose or repeat key tiles. So the
                # split passes take it from the row group of SPLIT_ROWS (a multiple of every BLOCK_M) holding the tile.
                tl.static_assert(SPLIT_ROWS % BLOCK_M == 0)
                unmasked_end, _ = key_loop_bounds(
                    (row_start // SPLIT_ROWS) * SPLIT_ROWS, N_Q, N_K, GROUP, BLOCK_M, BLOCK_N, CAUSAL
                )
            full_super = unmasked_end // SUPER_BLOCK
            runs_row = Runs + pid_bh.to(tl.int64) * (2 * RUN_KINDS * NUM_SUPER)
            counts_row = RunCounts + pid_bh.to(tl.int64) * RUN_KINDS
            if (K_RESIDUAL or V_RESIDUAL or PASS == 1) and PASS != 2:
                for run in range(0, tl.load(counts_row)):
                    run_lo = tl.load(runs_row + run)
                    run_hi = tl.minimum(tl.load(runs_row + NUM_SUPER + run), full_super)
                    accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = (
                        _attention_compressed_inner(
                            accumulator,
                            accumulator_hi,
                            accumulator_max,
                            rank_accumulator,
                            running_sum,
                            running_max,
                            q_op,
                            q_res_mult,
                            query_rank,
                            query_rank_lo,
                            query_rank_mult,
                            K_coeff_head,
                            k_coeff_desc,
                            K_basis,
                            K_mode,
                            K_scale,
                            K_bits,
                            K_offset,
                            K_codes,
                            K_raw,
                            V_coeff_head,
                            v_coeff_desc,
                            V_basis,
                            V_mode,
                            V_scale,
                            V_bits,
                            V_offset,
                            V_codes,
                            V_raw,
                            stride_kcn,
                            stride_kcr,
                            stride_vcn,
                            stride_vcr,
                            k_meta_base,
                            v_meta_base,
                            bias_rows,
                            stride_bk,
                            row_query,
                            row_valid,
                            run_lo * SUPER_BLOCK,
                            run_hi * SUPER_BLOCK,
                            N_K,
                            bias_mult,
                            softcap_log2,
                            HEAD_DIM_K,
                            HEAD_DIM_V,
                            DK_PAD,
                            DV_PAD,
                            RANK_K,
                            RANK_V * (1 + V_PACKED),
                            RK_PAD,
                            RV_PAD,
                            BLOCK_SIZE_K,
                            BLOCK_SIZE_V,
                            K_PER_BLOCK,
                            V_PER_BLOCK,
                            False,
                            False,
                            SPLIT_RANK,
                            BLOCK_M,
                            BLOCK_N,
                            HAS_BIAS,
                            SOFTCAP,
                            CAUSAL,
                            False,
                            FP32,
                            PRECISION,
                            USE_TMA,
                            False,
                            BIAS_TILE,
                            FIXED_MAX or (BOUNDED and attempt == 0),
                            q_position,
                            relative_head,
                            stride_rh_row,
                            stride_rh_d,
                            row_start,
                            N_Q,
                            n_relative,
                            logit_mult,
                            RELATIVE,
                            0,
                            0,
                            K_PLANES,
                            V_PLANES,
                            DV_HI,
                        )
                    )
            elif PASS == 0:
                # Nothing to skip: one plain loop over every full super-block.
                accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = (
                    _attention_compressed_inner(
                        accumulator,
                        accumulator_hi,
                        accumulator_max,
                        rank_accumulator,
                        running_sum,
                        running_max,
                        q_op,
                        q_res_mult,
                        query_rank,
                        query_rank_lo,
                        query_rank_mult,
                        K_coeff_head,
                        k_coeff_desc,
                        K_basis,
                        K_mode,
                        K_scale,
                        K_bits,
                        K_offset,
                        K_codes,
                        K_raw,
                        V_coeff_head,
                        v_coeff_desc,
                        V_basis,
                        V_mode,
                        V_scale,
                        V_bits,
                        V_offset,
                        V_codes,
                        V_raw,
                        stride_kcn,
                        stride_kcr,
                        stride_vcn,
                        stride_vcr,
                        k_meta_base,
                        v_meta_base,
                        bias_rows,
                        stride_bk,
                        row_query,
                        row_valid,
                        0,
                        full_super * SUPER_BLOCK,
                        N_K,
                        bias_mult,
                        softcap_log2,
                        HEAD_DIM_K,
                        HEAD_DIM_V,
                        DK_PAD,
                        DV_PAD,
                        RANK_K,
                        RANK_V * (1 + V_PACKED),
                        RK_PAD,
                        RV_PAD,
                        BLOCK_SIZE_K,
                        BLOCK_SIZE_V,
                        K_PER_BLOCK,
                        V_PER_BLOCK,
                        False,
                        False,
                        SPLIT_RANK,
                        BLOCK_M,
                        BLOCK_N,
                        HAS_BIAS,
                        SOFTCAP,
                        CAUSAL,
                        False,
                        FP32,
                        PRECISION,
                        USE_TMA,
                        False,
                        BIAS_TILE,
                        FIXED_MAX or (BOUNDED and attempt == 0),
                        q_position,
                        relative_head,
                        stride_rh_row,
                        stride_rh_d,
                        row_start,
                        N_Q,
                        n_relative,
                        logit_mult,
                        RELATIVE,
                        0,
                        0,
                        K_PLANES,
                        V_PLANES,
                        DV_HI,
                    )
                )
            if K_RESIDUAL or V_RESIDUAL:
                if K_RESIDUAL and not K_PER_BLOCK:
                    # Rebuilt here rather than kept live through loop A, which does not need it.
                    q_op, q_res_mult = _query_operand(
                        q_rows,
                        stride_qd,
                        row_valid,
                        logit_mult,
                        HEAD_DIM_K,
                        DK_PAD,
                        BLOCK_M,
                        FP32,
                        query_scale,
                        content_bias_head,
                        RELATIVE,
                        K_PLANES,
                    )
                if RUN_KINDS == 3:
                    # Uniform runs: every block low-rank or packed at the compile-time widths, decoded with no branch
                    # per tile.
                    for run in range(0, tl.load(counts_row + 1)):
                        run_lo = tl.load(runs_row + 2 * NUM_SUPER + run)
                        run_hi = tl.minimum(tl.load(runs_row + 3 * NUM_SUPER + run), full_super)
                        accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = (
                            _attention_compressed_inner(
                                accumulator,
                                accumulator_hi,
                                accumulator_max,
                                rank_accumulator,
                                running_sum,
                                running_max,
                                q_op,
                                q_res_mult,
                                query_rank,
                                query_rank_lo,
                                query_rank_mult,
                                K_coeff_head,
                                k_coeff_desc,
                                K_basis,
                                K_mode,
                                K_scale,
                                K_bits,
                                K_offset,
                                K_codes,
                                K_raw,
                                V_coeff_head,
                                v_coeff_desc,
                                V_basis,
                                V_mode,
                                V_scale,
                                V_bits,
                                V_offset,
                                V_codes,
                                V_raw,
                                stride_kcn,
                                stride_kcr,
                                stride_vcn,
                                stride_vcr,
                                k_meta_base,
                                v_meta_base,
                                bias_rows,
                                stride_bk,
                                row_query,
                                row_valid,
                                run_lo * SUPER_BLOCK,
                                run_hi * SUPER_BLOCK,
                                N_K,
                                bias_mult,
                                softcap_log2,
                                HEAD_DIM_K,
                                HEAD_DIM_V,
                                DK_PAD,
                                DV_PAD,
                                RANK_K,
                                RANK_V * (1 + V_PACKED),
                                RK_PAD,
                                RV_PAD,
                                BLOCK_SIZE_K,
                                BLOCK_SIZE_V,
                                K_PER_BLOCK,
                                V_PER_BLOCK,
                                FAST_BITS_K > 0,
                                FAST_BITS_V > 0,
                                SPLIT_RANK,
                                BLOCK_M,
                                BLOCK_N,
                                HAS_BIAS,
                                SOFTCAP,
                                CAUSAL,
                                False,
                                FP32,
                                PRECISION,
                                USE_TMA,
                                False,
                                BIAS_TILE,
                                FIXED_MAX or (BOUNDED and attempt == 0),
                                q_position,
                                relative_head,
                                stride_rh_row,
                                stride_rh_d,
                                row_start,
                                N_Q,
                                n_relative,
                                logit_mult,
                                RELATIVE,
                                FAST_BITS_K,
                                FAST_BITS_V,
                                K_PLANES,
                                V_PLANES,
                                DV_HI,
                            )
                        )
                if GENERAL_RUNS:
                    # General runs (other widths, raw blocks); compiled out when no block of the call needs them.
                    for run in range(0, tl.load(counts_row + (RUN_KINDS - 1))):
                        run_lo = tl.load(runs_row + (2 * RUN_KINDS - 2) * NUM_SUPER + run)
                        run_hi = tl.minimum(tl.load(runs_row + (2 * RUN_KINDS - 1) * NUM_SUPER + run), full_super)
                        accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = (
                            _attention_compressed_inner(
                                accumulator,
                                accumulator_hi,
                                accumulator_max,
                                rank_accumulator,
                                running_sum,
                                running_max,
                                q_op,
                                q_res_mult,
                                query_rank,
                                query_rank_lo,
                                query_rank_mult,
                                K_coeff_head,
                                k_coeff_desc,
                                K_basis,
                                K_mode,
                                K_scale,
                                K_bits,
                                K_offset,
                                K_codes,
                                K_raw,
                                V_coeff_head,
                                v_coeff_desc,
                                V_basis,
                                V_mode,
                                V_scale,
                                V_bits,
                                V_offset,
                                V_codes,
                                V_raw,
                                stride_kcn,
                                stride_kcr,
                                stride_vcn,
                                stride_vcr,
                                k_meta_base,
                                v_meta_base,
                                bias_rows,
                                stride_bk,
                                row_query,
                                row_valid,
                                run_lo * SUPER_BLOCK,
                                run_hi * SUPER_BLOCK,
                                N_K,
                                bias_mult,
                                softcap_log2,
                                HEAD_DIM_K,
                                HEAD_DIM_V,
                                DK_PAD,
                                DV_PAD,
                                RANK_K,
                                RANK_V * (1 + V_PACKED),
                                RK_PAD,
                                RV_PAD,
                                BLOCK_SIZE_K,
                                BLOCK_SIZE_V,
                                K_PER_BLOCK,
                                V_PER_BLOCK,
                                K_RESIDUAL,
                                V_RESIDUAL,
                                SPLIT_RANK,
                                BLOCK_M,
                                BLOCK_N,
                                HAS_BIAS,
                                SOFTCAP,
                                CAUSAL,
                                False,
                                FP32,
                                PRECISION,
                                USE_TMA,
                                PREDICATED_RESIDUAL,
                                BIAS_TILE,
                                FIXED_MAX or (BOUNDED and attempt == 0),
                                q_position,
                                relative_head,
                                stride_rh_row,
                                stride_rh_d,
                                row_start,
                                N_Q,
                                n_relative,
                                logit_mult,
                                RELATIVE,
                                0,
                                0,
                                K_PLANES,
                                V_PLANES,
                                DV_HI,
                            )
                        )
            if PASS != 1:
                # the masked tail (the residual-capable launch's when the work is split); with no general run in
                # the call every residual block in it is one the uniform decode reads
                TAIL_BITS_K: tl.constexpr = 0 if GENERAL_RUNS else FAST_BITS_K
                TAIL_BITS_V: tl.constexpr = 0 if GENERAL_RUNS else FAST_BITS_V
                accumulator, accumulator_hi, accumulator_max, rank_accumulator, running_sum, running_max = (
                    _attention_compressed_inner(
                        accumulator,
                        accumulator_hi,
                        accumulator_max,
                        rank_accumulator,
                        running_sum,
                        running_max,
                        q_op,
                        q_res_mult,
                        query_rank,
                        query_rank_lo,
                        query_rank_mult,
                        K_coeff_head,
                        k_coeff_desc,
                        K_basis,
                        K_mode,
                        K_scale,
                        K_bits,
                        K_offset,
                        K_codes,
                        K_raw,
                        V_coeff_head,
                        v_coeff_desc,
                        V_basis,
                        V_mode,
                        V_scale,
                        V_bits,
                        V_offset,
                        V_codes,
                        V_raw,
                        stride_kcn,
                        stride_kcr,
                        stride_vcn,
                        stride_vcr,
                        k_meta_base,
                        v_meta_base,
                        bias_rows,
                        stride_bk,
                        row_query,
                        row_valid,
                        full_super * SUPER_BLOCK,
                        end,
                        N_K,
                        bias_mult,
                        softcap_log2,
                        HEAD_DIM_K,
                        HEAD_DIM_V,
                        DK_PAD,
                        DV_PAD,
                        RANK_K,
                        RANK_V * (1 + V_PACKED),
                        RK_PAD,
                        RV_PAD,
                        BLOCK_SIZE_K,
                        BLOCK_SIZE_V,
                        K_PER_BLOCK,
                        V_PER_BLOCK,
                        K_RESIDUAL,
                        V_RESIDUAL,
                        SPLIT_RANK,
                        BLOCK_M,
                        BLOCK_N,
                        HAS_BIAS,
                        SOFTCAP,
                        CAUSAL,
                        True,
                        FP32,
                        PRECISION,
                        USE_TMA,
                        False,
                        BIAS_TILE,
                        FIXED_MAX or (BOUNDED and attempt == 0),
                        q_position,
                        relative_head,
                        stride_rh_row,
                        stride_rh_d,
                        row_start,
                        N_Q,
                        n_relative,
                        logit_mult,
                        RELATIVE,
                        TAIL_BITS_K,
                        TAIL_BITS_V,
                        K_PLANES,
                        V_PLANES,
                        DV_HI,
                    )
                )

    # ---- epilogue: O = (acc_r P_v + acc) / sum ----
    if not V_PER_BLOCK:
        if not FIXED_MAX:
            accumulator, accumulator_hi, _ = _catch_up(accumulator, accumulator_hi, accumulator_max, running_max, DV_HI)
        if RANK_V > 0:
            if V_PACKED:
                tl.static_assert(V_PLANES <= 1 and 2 * RANK_V <= RV_PAD)
            accumulator, accumulator_hi = _basis_parts(
                accumulator, accumulator_hi, rank_accumulator, V_basis + kv_head.to(tl.int64) * (RANK_V * HEAD_DIM_V),
                RANK_V, RV_PAD, HEAD_DIM_V, DV_PAD, DV_HI, V_PLANES, FP32, PRECISION, V_PACKED,
            )  # fmt: skip
    if FIXED_MAX:
        running_max = tl.where(running_sum > 0.0, running_max, float("-inf"))
    running_sum = tl.where(running_sum > 0.0, running_sum, 1.0)
    out_rows = Out + batch * stride_ob + row_head * stride_oh + row_query.to(tl.int64) * stride_on
    tl.store(
        out_rows[:, None] + (offs_dv * stride_od)[None, :],
        (accumulator / running_sum[:, None]).to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
    )
    if DV_HI > 0:
        offs_dv_hi = _columns(HEAD_DIM_V, DV_HI, V_PLANES, DV_PAD)
        tl.store(
            out_rows[:, None] + (offs_dv_hi * stride_od)[None, :],
            (accumulator_hi / running_sum[:, None]).to(Out.dtype.element_ty),
            mask=row_valid[:, None] & (offs_dv_hi < HEAD_DIM_V)[None, :],
        )
    lse = (running_max + tl.math.log2(running_sum)) * LN2
    tl.store(Lse + (batch * (H_KV * GROUP) + row_head) * N_Q + row_query, lse, mask=row_valid)


# --------------------------------------------------------------------------------------------- block runs
@triton.jit
def _block_classes(modes, bits, offsets, blocks, keep, KINDS: tl.constexpr, FAST: tl.constexpr, ALIGN: tl.constexpr):
    """Class of each block: 0 low-rank only; with two kinds 1 for any residual; with three kinds 1 for codes
    of the uniform width ``FAST`` (modes 1 and 2 alike) whose first word is a multiple of ``ALIGN`` and 2 for
    anything else (other widths, raw, unaligned codes)."""
    mode = tl.load(modes + blocks, mask=keep, other=0)
    if KINDS == 2:
        return (mode != 0).to(tl.int32)
    else:
        width = tl.load(bits + blocks, mask=keep, other=0)
        fast = ((mode == 1) | (mode == 2)) & (width == FAST)
        if ALIGN > 1:
            offset = tl.load(offsets + blocks, mask=keep, other=0)
            fast = fast & ((offset % ALIGN) == 0)
        return tl.where(mode == 0, 0, tl.where(fast, 1, 2))


@triton.jit
def _super_block_flags(
    k_modes,
    v_modes,
    k_bits,
    v_bits,
    k_offsets,
    v_offsets,
    s,
    NB_K,
    NB_V,
    NUM_SUPER,
    PER_K: tl.constexpr,
    PER_V: tl.constexpr,
    KINDS: tl.constexpr,
    FAST_K: tl.constexpr,
    FAST_V: tl.constexpr,
    ALIGN_K: tl.constexpr,
    ALIGN_V: tl.constexpr,
):
    """For super-blocks ``s`` [CHUNK]: the largest class (``_block_classes``) of the K and V blocks inside; -1
    for ``s`` outside ``[0, NUM_SUPER)``."""
    inside = (s >= 0) & (s < NUM_SUPER)
    k_blocks = s[:, None] * PER_K + tl.arange(0, PER_K)[None, :]
    v_blocks = s[:, None] * PER_V + tl.arange(0, PER_V)[None, :]
    k_class = _block_classes(
        k_modes, k_bits, k_offsets, k_blocks, inside[:, None] & (k_blocks < NB_K), KINDS, FAST_K, ALIGN_K
    )
    v_class = _block_classes(
        v_modes, v_bits, v_offsets, v_blocks, inside[:, None] & (v_blocks < NB_V), KINDS, FAST_V, ALIGN_V
    )
    flag = tl.maximum(tl.max(k_class, 1), tl.max(v_class, 1))
    return tl.where(inside, flag, -1)


@triton.jit
def _block_runs_kernel(
    K_mode,
    V_mode,
    K_bits,
    V_bits,
    K_offset,
    V_offset,
    Runs,
    Counts,
    NB_K,
    NB_V,
    NUM_SUPER,
    PER_K: tl.constexpr,
    PER_V: tl.constexpr,
    CHUNK: tl.constexpr,
    KINDS: tl.constexpr,
    FAST_K: tl.constexpr,
    FAST_V: tl.constexpr,
    ALIGN_K: tl.constexpr,
    ALIGN_V: tl.constexpr,
):
    """One program per (batch, K/V head): the runs ``block_runs`` describes, CHUNK super-blocks at a time. A run
    of kind ``f`` starts at ``s`` where flag[s] == f != flag[s - 1] and ends after ``s`` where
    flag[s] == f != flag[s + 1]; each edge is stored at its rank among the edges of its kind (a prefix sum)."""
    row = tl.program_id(0).to(tl.int64)
    k_modes = K_mode + row * NB_K
    v_modes = V_mode + row * NB_V
    k_bits = K_bits + row * NB_K
    v_bits = V_bits + row * NB_V
    k_offsets = K_offset + row * NB_K
    v_offsets = V_offset + row * NB_V
    runs_row = Runs + row * (2 * KINDS * NUM_SUPER)
    offs = tl.arange(0, CHUNK)
    starts_0 = 0
    starts_1 = 0
    starts_2 = 0
    ends_0 = 0
    ends_1 = 0
    ends_2 = 0
    for chunk_start in range(0, NUM_SUPER, CHUNK):
        s = chunk_start + offs
        before = _super_block_flags(
            k_modes,
            v_modes,
            k_bits,
            v_bits,
            k_offsets,
            v_offsets,
            s - 1,
            NB_K,
            NB_V,
            NUM_SUPER,
            PER_K,
            PER_V,
            KINDS,
            FAST_K,
            FAST_V,
            ALIGN_K,
            ALIGN_V,
        )
        flag = _super_block_flags(
            k_modes,
            v_modes,
            k_bits,
            v_bits,
            k_offsets,
            v_offsets,
            s,
            NB_K,
            NB_V,
            NUM_SUPER,
            PER_K,
            PER_V,
            KINDS,
            FAST_K,
            FAST_V,
            ALIGN_K,
            ALIGN_V,
        )
        after = _super_block_flags(
            k_modes,
            v_modes,
            k_bits,
            v_bits,
            k_offsets,
            v_offsets,
            s + 1,
            NB_K,
            NB_V,
            NUM_SUPER,
            PER_K,
            PER_V,
            KINDS,
            FAST_K,
            FAST_V,
            ALIGN_K,
            ALIGN_V,
        )
        for kind in tl.static_range(KINDS):
            starts = (flag == kind) & (before != kind)
            ends = (flag == kind) & (after != kind)
            start_rank = tl.cumsum(starts.to(tl.int32), 0) - 1
            end_rank = tl.cumsum(ends.to(tl.int32), 0) - 1
            starts_list = runs_row + (2 * kind) * NUM_SUPER
            ends_list = runs_row + (2 * kind + 1) * NUM_SUPER
            if kind == 0:
                tl.store(starts_list + starts_0 + start_rank, s, mask=starts)
                tl.store(ends_list + ends_0 + end_rank, s + 1, mask=ends)
                starts_0 += tl.sum(starts.to(tl.int32), 0)
                ends_0 += tl.sum(ends.to(tl.int32), 0)
            elif kind == 1:
                tl.store(starts_list + starts_1 + start_rank, s, mask=starts)
                tl.store(ends_list + ends_1 + end_rank, s + 1, mask=ends)
                starts_1 += tl.sum(starts.to(tl.int32), 0)
                ends_1 += tl.sum(ends.to(tl.int32), 0)
            else:
                tl.store(starts_list + starts_2 + start_rank, s, mask=starts)
                tl.store(ends_list + ends_2 + end_rank, s + 1, mask=ends)
                starts_2 += tl.sum(starts.to(tl.int32), 0)
                ends_2 += tl.sum(ends.to(tl.int32), 0)
    tl.store(Counts + row * KINDS, starts_0)
    tl.store(Counts + row * KINDS + 1, starts_1)
    if KINDS == 3:
        tl.store(Counts + row * KINDS + 2, starts_2)


# ----------------------------------------------------------------------------------------------- launcher
class CompressedOperand:
    """The tensors and scalars of one ``CompressedKV`` that the kernel reads (a plain record, so that the
    public op can pass the tensors as separate arguments)."""

    __slots__ = (
        "coeffs",
        "basis",
        "mode",
        "scale",
        "bits",
        "offset",
        "codes",
        "raw",
        "seq_len",
        "head_dim",
        "block_size",
        "shared_basis",
        "packed_bits",
    )

    def __init__(
        self,
        coeffs,
        basis,
        mode,
        scale,
        bits,
        offset,
        codes,
        raw,
        *,
        seq_len,
        head_dim,
        block_size,
        shared_basis,
        packed_bits=None,
    ):
        self.coeffs, self.basis, self.mode, self.scale, self.bits = coeffs, basis, mode, scale, bits
        self.offset, self.codes, self.raw = offset, codes, raw
        self.seq_len, self.head_dim = seq_len, head_dim
        self.block_size, self.shared_basis = block_size, shared_basis
        # The configured code width (``config.bits``), the width of most packed blocks: uniform runs decode it
        # with the width compiled in. None: assume the default configuration's width (only speed depends on it).
        self.packed_bits = packed_bits

    @classmethod
    def from_compressed(cls, ckv: CompressedKV) -> CompressedOperand:
        return cls(
            ckv.coeffs,
            ckv.basis,
            ckv.mode,
            ckv.scale,
            ckv.bits,
            ckv.offset,
            ckv.codes,
            ckv.raw,
            seq_len=ckv.seq_len,
            head_dim=ckv.head_dim,
            block_size=ckv.config.block_size,
            shared_basis=ckv.shared_basis,
            packed_bits=ckv.config.bits,
        )

    @property
    def rank(self) -> int:
        return self.coeffs.shape[-1]


_DEFAULT_BITS = CompressionConfig().bits


def _packed_bits(operand: CompressedOperand) -> int:
    bits = getattr(operand, "packed_bits", None)
    return _DEFAULT_BITS if bits is None else int(bits)


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One element kept per device and dtype (made once, never read)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _nonempty(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even to a buffer they never read; give empty buffers one element."""
    return t if t.numel() > 0 else _placeholder(like.device, t.dtype)


def block_runs(
    k: CompressedOperand,
    v: CompressedOperand,
    super_block: int,
    fast_bits: tuple[int, int] | None = None,
    align: tuple[int, int] = (1, 1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive super-blocks (``super_block`` keys) per (batch, K/V head).

    Without ``fast_bits``: two kinds, low-rank-only super-blocks and those with a residual (any K or V block
    inside not ``MODE_LOWRANK``). With ``fast_bits = (bits_k, bits_v)``: three kinds, low-rank-only, uniform
    (every K block low-rank or packed at ``bits_k`` bits, every V block likewise at ``bits_v``; 0 admits
    low-rank blocks only; a packed block whose first word is not a multiple of ``align`` (K, V) is general) and
    general (anything else). ``runs`` ``[B * Hkv, 2 * kinds, NS]`` int32 holds, per
    kind, the starts then the (exclusive) ends of its runs, each list ascending; only the first ``counts``
    entries of each list are written. ``counts`` ``[B * Hkv, kinds]`` int32 holds their numbers. One small
    kernel launch, no host synchronisation."""
    batch, heads = k.mode.shape[:2]
    num_super = -(-k.seq_len // super_block)
    device = k.mode.device
    kinds = 2 if fast_bits is None else 3
    fast_k, fast_v = fast_bits or (0, 0)
    runs = torch.empty(batch * heads, 2 * kinds, num_super, dtype=torch.int32, device=device)
    counts = torch.empty(batch * heads, kinds, dtype=torch.int32, device=device)
    k_mode, v_mode = k.mode.contiguous(), v.mode.contiguous()
    _block_runs_kernel[(batch * heads,)](
        k_mode,
        v_mode,
        k_mode if fast_bits is None else k.bits.contiguous(),
        v_mode if fast_bits is None else v.bits.contiguous(),
        k_mode if fast_bits is None else k.offset.contiguous(),
        v_mode if fast_bits is None else v.offset.contiguous(),
        runs,
        counts,
        k.mode.shape[2],
        v.mode.shape[2],
        num_super,
        PER_K=super_block // k.block_size,
        PER_V=super_block // v.block_size,
        CHUNK=min(128, next_power_of_2(num_super)),
        KINDS=kinds,
        FAST_K=fast_k,
        FAST_V=fast_v,
        ALIGN_K=align[0] if fast_bits is not None else 1,
        ALIGN_V=align[1] if fast_bits is not None else 1,
    )
    return runs, counts


def byte_planes(width: int, head_dim: int) -> int:
    """Planes of the byte decode (``_load_codes_bytes``) for a uniform width: ``8 // width`` for 2, 4 and 8 bits
    when a row of ``head_dim`` codes fills whole int32 words; 0 (the word decode, natural column order)
    otherwise."""
    if width in (2, 4, 8) and head_dim % (32 // width) == 0:
        return 8 // width
    return 0


def uniform_width(bits: int | None, head_dim: int) -> int:
    """The code width that uniform runs decode with a compile-time width: the configured ``bits`` (1 to 8; the
    float16 operand trick holds codes up to 10 bits), else 0 (no uniform path). ``head_dim`` is not limiting."""
    if bits is None or bits <= 0 or bits > 8:
        return 0
    return int(bits)


def descriptor_layout(coeffs: torch.Tensor) -> torch.Tensor:
    """``coeffs`` [..., N, r] as a view whose rows start 16 bytes apart (a zero-padded copy when they do not
    already), so that tensor descriptors can read them: same values, same shape. Unchanged when the rows are
    already 16-byte aligned, empty, or not contiguous in their last dimension."""
    if coeffs.numel() == 0 or coeffs.stride(-1) != 1:
        return coeffs
    per_16_bytes = 16 // coeffs.element_size()
    rank = coeffs.shape[-1]
    if all((stride * coeffs.element_size()) % 16 == 0 for stride in coeffs.stride()[:-1]):
        return coeffs
    padded = coeffs.new_zeros(*coeffs.shape[:-1], -(-rank // per_16_bytes) * per_16_bytes)
    padded[..., :rank] = coeffs
    return padded[..., :rank]


@functools.cache
def _warn_pointer_path(device: torch.device) -> None:
    """Once per device: residual kernels that read coefficients by pointer loads (no tensor descriptors: GPUs
    before Hopper, or unaligned coefficients) faulted on the H200 and are not verified on any GPU."""
    warnings.warn(
        f"kvbound: compressed attention with residual blocks on {torch.cuda.get_device_name(device)} reads its "
        "coefficients without tensor descriptors; that kernel path gave wrong values and illegal addresses on an "
        "H200 (Triton 3.6) and is not verified on any GPU. Check results against kvbound.reference_attention, or "
        "decompress K/V and use the dense path.",
        RuntimeWarning,
        stacklevel=3,
    )


def uniform_safe(use_tma: bool, config: dict | None, *, relative: bool = False) -> bool:
    """Whether uniform runs may be compiled: on sm_90 with Triton 3.6 every decode of them tried (compact word
    tiles, byte tiles) gave wrong values, NaN or illegal addresses when the coefficient tiles were read by
    pointer loads instead of tensor descriptors, or on 64-row tiles over 8 warps (the autotuner drops those
    for uniform kernels; an explicit ``config`` of that shape turns uniform runs off, and so do relative
    positions, whose tiles all have that shape). Measured in benchmarks/byte_decode_tiles.py and
    kernels/README.md."""
    if relative:
        return False
    if not use_tma and not _KERNELS_INTERPRETED:
        return False
    if config is not None and config.get("BLOCK_M") == 64 and config.get("num_warps") == 8:
        return False
    return True


def fast_width(packed_bits: int | None, head_dim: int) -> int:
    """The code width that the default launch (``uniform=None``) decodes in uniform runs: the configured width where
    the byte decode reads it (``byte_planes``), else 0 (every residual block goes through the general loop)."""
    width = uniform_width(packed_bits, head_dim)
    return width if byte_planes(width, head_dim) else 0


def general_loop(general_count: int, residual: bool, packed_bits: int | None, head_dim: int) -> bool:
    """Whether an operand needs the kernel's general loop, from an encoder's count of blocks with a residual not
    coded at ``packed_bits`` from a 16-byte boundary: some such block, or a residual at a width the uniform runs do
    not decode (``fast_width`` 0)."""
    return general_count > 0 or (residual and not fast_width(packed_bits, head_dim))


def general_blocks(
    mode: torch.Tensor, bits: torch.Tensor, offset: torch.Tensor, packed_bits: int | None, head_dim: int
) -> torch.Tensor:
    """Per block (int8, the shape of ``mode``): 1 where the default launch sends the block to the general loop
    (``_block_classes`` with ``fast_width``'s width and the byte decode's alignment): an exact block, codes at
    another width, or codes whose first word is not a multiple of 4; 0 for a low-rank block or one the uniform runs
    read. No host synchronisation."""
    fast = fast_width(packed_bits, head_dim)
    residual = mode != 0
    if not fast:
        return residual.to(torch.int8)
    uniform = ((mode == 1) | (mode == 2)) & (bits.to(torch.int32) == fast) & (offset % 4 == 0)
    return (residual & ~uniform).to(torch.int8)


def _uniform_bits(operand: CompressedOperand, head_dim: int, uniform: bool | None) -> int:
    """The operand's uniform-run width under the launcher's ``uniform`` policy (0: no uniform runs)."""
    if uniform is False:
        return 0
    if uniform is None:
        return fast_width(_packed_bits(operand), head_dim)
    return uniform_width(_packed_bits(operand), head_dim)


# Winning configurations by tuning key (COMPRESSED_TUNE_KEY's values and the dtypes that vary): after the first
# call of a key the jit function is launched directly, skipping the autotuner's per-call key building.
_TUNED: dict[tuple, dict] = {}


def attention_compressed_fwd(
    q: torch.Tensor,
    k: CompressedOperand,
    v: CompressedOperand,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    residual: tuple[bool, bool] | Callable[[], Sequence[bool]] | None = None,
    split_rank: bool = True,
    predicated: bool = False,
    config: dict | None = None,
    *,
    bias_tile: int = 1,
    fixed_max: bool = True,
    uniform: bool | None = None,
    relative: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    split: bool | None = None,
    lowrank_share: Sequence[float] | Callable[[], Sequence[float]] | None = None,
    bounded_max: bool | None = None,
    pack_values: bool | None = None,
    relative_runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    run_table: torch.Tensor | None = None,
    general_runs: bool | Callable[[], bool] = True,
    dv_split: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the compressed kernel (inputs validated by ``kvbound.attention``). ``bias`` and ``bias_tile`` as
    in the dense launcher. Returns ``(out, lse)`` as the dense launcher does.

    ``residual``: (K has a block with a residual, V has one), or a function returning them that is called once
    after all host-side preparation (``kvbound.attention`` reads them there, in the same synchronisation as its
    finite check, so that the preparation overlaps the device work queued before it); None reads them off the
    modes (one host sync). False compiles the kernel without any residual code.

    ``split_rank``: form the rank-space logits from a float16 hi/lo split of ``Qp`` (float32-like precision;
    False: one float16 product, 2**-12 relative error on ``Qp``). ``predicated``: load packed residual tiles of
    the residual-block loop unconditionally, masked by mode, instead of under a branch (measured slower on H200:
    see kernels/README.md). ``config`` (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``) bypasses the
    autotuner. ``fixed_max``: use the soft-cap's fixed softmax maximum when the soft-cap allows it (``_common``).
    ``uniform``: walk super-blocks whose residual blocks all use the operand's configured width (1 to 8 bits)
    in a branch-free loop with that width compiled in. None (default): only for an operand whose width the byte
    decode reads (2, 4 or 8 bits with rows of whole words, ``byte_planes``: contiguous byte tiles in plane
    order); True also for other widths, through the word decode (correct, but on the H200 with Triton 3.6 slower
    than the general loop: its gathered word loads become 4-byte asynchronous copies; kernels/README.md);
    False: the general loop for every residual block. Uniform runs are never compiled where ``uniform_safe``
    says they miscompile (coefficients without tensor descriptors, 64-row tiles on 8 warps), nor with relative
    positions (whose tiles are all 64 rows on 8 warps).
    ``relative``: ``(relative_keys [H, Nq + Nk - 1, Dk] in q's dtype, content_bias [H, Dk], position_bias [H, Dk]``
    float32 contiguous) for Transformer-XL relative positions (``Hq == Hkv``), as in the dense launcher: the logit
    of ``(i, j)`` becomes ``(scale q_i + content_bias) . k_j + (scale q_i + position_bias) . relative_keys[Nq - 1 +
    j - i]`` (+ bias), with ``k_j`` the decoded key.
    ``split``: when some super-blocks have a residual and others do not, run the low-rank-only ones in a second
    launch of the kernel compiled without residual code (its own tile shape and registers, as when no block has a
    residual), the rest in the residual-capable kernel, and merge the two partial results by their log-sum-exp
    (float32 partials, one rounding to q's dtype). True / False: always / never. None: the environment's
    ``KVBOUND_SPLIT_LOWRANK`` (``split_setting``); by default, split when at least ``SPLIT_MIN_SHARE`` of the
    super-blocks are low-rank only for K and V alike, as far as ``lowrank_share`` (the share of low-rank-only
    blocks of K and of V, or a function returning it, called with ``residual``'s; -1.0: unknown) proves it, and
    never with relative positions. None reads it off the modes in ``residual``'s host read when ``residual`` is None
    too; otherwise no split.
    ``bounded_max``: in a launch of low-rank tiles alone (no block with a residual, or the low-rank pass of a split)
    with a shared basis and no bias, soft-cap or relative positions, in bfloat16 or float32, replace the running
    row maximum by a bound on each row's logits from the rank-space query and the box of the head's key
    coefficients: no maximum is tracked and nothing is rescaled, and P enters the value product in bfloat16
    (float32 in float32), whose range holds the gap between the bound and the true maximum. A program in which a
    row's sum ends below ``BOUND_RETRY_SUM`` redoes its keys with the running maximum. None: the environment's
    ``KVBOUND_BOUNDED_MAX`` (``bounded_setting``; by default from ``BOUNDED_MIN_KEYS`` keys on); True / False:
    always (where it applies) / never. ``pack_values``: in a bounded launch, pass the V coefficients as the pair of
    ``packed_value_pair`` (None: in bfloat16 launches, where P and the coefficients meet in bfloat16; True also in
    float32, which tests the pair's path on the CPU).
    ``relative_runs``: instead of ``relative``, the same relative term when the relative keys are constant over runs
    of distances, as in the dense launcher: ``(run_keys [H, R, Dk] contiguous in q's dtype, run_starts int32 (the
    layout of ``attention_dense_fwd``'s), content_bias [H, Dk], position_bias [H, Dk])`` float32; no tile of the
    relative tile shapes may span more than ``COMPRESSED_RUN_SPAN`` runs (``attention_dense.relative_run_span`` over
    ``RUNS_WINDOW`` distances nonzero; ``kvbound.attention`` checks it). Each program writes its queries' rows of the
    table of run logits into ``run_table`` (``[B, H, R, Nq]`` float32; a new tensor when None) first, as the dense
    kernel does.
    ``general_runs``: whether some block of K or V may need the general loop (``general_blocks``: an exact block, codes
    at another width than the uniform runs', or codes off the byte decode's 16-byte alignment), or a function
    returning it, called with ``residual``'s. False (the caller's promise that none does; a block that does would be
    skipped) compiles the kernel without its general-run loop and gives the masked tail the uniform decode, where
    every operand with a residual has uniform runs: fewer registers spilled in the uniform loop (sm_90, Triton 3.6,
    AlphaGenome's shape at 8 bits: 1,568 -> 560 bytes of stack; the uniform tile 18-21 % faster on an H100,
    kernels/README.md). True (default): the kernel that is correct for any blocks.
    ``dv_split``: hold the value columns in two parts where that pads less (``attention_dense.dv_parts``: 192 as
    128 + 64, not 256): a quarter fewer columns in every value product, in the accumulator and in the decoded V
    tiles. None: ``KVBOUND_DV_SPLIT`` as for the dense kernel (``dv_split_default``: split except with the relative
    keys' window).
    """
    if relative_runs is not None and relative is not None:
        raise ValueError("relative, relative_runs: expected at most one of them")
    if relative_runs is not None and config is not None and config["BLOCK_M"] + config["BLOCK_N"] - 1 > RUNS_WINDOW:
        # kvbound.attention counts the runs of windows of RUNS_WINDOW distances; a wider tile could span more.
        raise ValueError(
            f"config: with relative_runs a tile spans at most {RUNS_WINDOW} distances (BLOCK_M + BLOCK_N - 1), got "
            f"{config['BLOCK_M']} x {config['BLOCK_N']}"
        )
    positional = relative is not None or relative_runs is not None
    q, scale = fold_scale_sign(q, scale, positional)
    setting = split_setting() if split is None else ("on" if split else "off")
    batch, q_heads, n_q, head_dim_k = q.shape
    kv_heads = k.coeffs.shape[1]
    n_k, head_dim_v = k.seq_len, v.head_dim
    group = q_heads // kv_heads
    if positional and group != 1:
        raise ValueError(
            f"relative: relative positions need one query head per K/V head, got Hq={q_heads}, Hkv={kv_heads}"
        )
    out = empty_output(q, head_dim_v)  # in q's memory order
    lse = torch.empty(batch, q_heads, n_q, dtype=torch.float32, device=q.device)
    # With relative positions the scale is applied to q in the kernel, before the two biases.
    logit_mult, bias_mult, softcap_log2 = logit_multipliers(1.0 if positional else scale, softcap)
    max_value = fixed_softmax_max(softcap) if fixed_max else None
    bias_arg = bias if bias is not None else q
    run_keys = run_starts = None
    if relative_runs is not None:
        run_keys, run_starts, content_bias, position_bias = relative_runs
        relative_keys = run_logits_table(q, run_keys.shape[1], run_table)
        # the table [B, H, R, Nq] as [B * H, R, Nq]: (head stride, run stride, number of runs R)
        relative_strides = (n_q * run_keys.shape[1], n_q, run_keys.shape[1])
    elif relative is not None:
        relative_keys, content_bias, position_bias = relative
        relative_strides = relative_keys.stride()
    else:
        # None arguments become constexpr: without relative positions the kernel's signature and code are the
        # same as a kernel that never had them.
        relative_keys = content_bias = position_bias = None
        relative_strides = (None, None, None)
    k_rank, v_rank = k.rank, v.rank
    fp32 = q.dtype == torch.float32 or k.coeffs.dtype == torch.float32 or v.coeffs.dtype == torch.float32
    k_coeffs, v_coeffs = k.coeffs, v.coeffs
    if q.is_cuda:
        # Coefficient rows narrower than 16 bytes (rank < 8 in float16) cannot be read by tensor descriptors;
        # the kernel's pointer-load path for them is the one that faulted on the H200 (kernels/README.md).
        k_coeffs, v_coeffs = descriptor_layout(k_coeffs), descriptor_layout(v_coeffs)
    super_block = max(k.block_size, v.block_size)

    def grid(meta):
        return (cdiv(n_q * group, meta["BLOCK_M"]), batch * kv_heads)

    args = (
        q,
        bias_arg,
        out,
        lse,
        _nonempty(k_coeffs, q),
        _nonempty(k.basis, q),
        k.mode,
        k.scale,
        k.bits,
        k.offset,
        _nonempty(k.codes, q),
        _nonempty(k.raw, q),
        _nonempty(v_coeffs, q),
        _nonempty(v.basis, q),
        v.mode,
        v.scale,
        v.bits,
        v.offset,
        _nonempty(v.codes, q),
        _nonempty(v.raw, q),
    )
    sizes = (
        *q.stride(),
        *broadcast_strides(bias),
        *out.stride(),
        *(k_coeffs.stride() if k_rank else (0, 0, 0, 0)),
        *(v_coeffs.stride() if v_rank else (0, 0, 0, 0)),
        *relative_strides,
        n_q,
        n_k,
        kv_heads,
        -(-n_k // k.block_size),
        -(-n_k // v.block_size),
        -(-n_k // super_block),
        logit_mult,
        bias_mult,
        softcap_log2,
        0.0 if max_value is None else max_value,
        float(scale) if positional else None,
        next_power_of_2(n_q * group),
        next_power_of_2(n_k),
    )
    if dv_split is None:
        dv_split = dv_split_default(relative is not None)
    dv_pad, dv_hi = dv_parts(head_dim_v, split=dv_split)
    constexprs = dict(
        HEAD_DIM_K=head_dim_k,
        HEAD_DIM_V=head_dim_v,
        DK_PAD=max(16, next_power_of_2(head_dim_k)),
        DV_PAD=dv_pad,
        DV_HI=dv_hi,
        RANK_K=k_rank,
        RANK_V=v_rank,
        RK_PAD=max(16, next_power_of_2(k_rank)),
        RV_PAD=max(16, next_power_of_2(v_rank)),
        BLOCK_SIZE_K=k.block_size,
        BLOCK_SIZE_V=v.block_size,
        SUPER_BLOCK=super_block,
        K_PER_BLOCK=not k.shared_basis,
        V_PER_BLOCK=not v.shared_basis,
        SPLIT_RANK=split_rank,
        PREDICATED_RESIDUAL=predicated,
        GROUP=group,
        HAS_BIAS=bias is not None,
        BIAS_TILE=bias_tile if bias is not None else 1,
        SOFTCAP=softcap_form(softcap, q.dtype),
        FIXED_MAX=max_value is not None,
        CAUSAL=causal,
        RELATIVE=2 if relative_runs is not None else int(relative is not None),
        FP32=fp32,
        PRECISION=float32_dot_precision() if fp32 else "tf32",
        USE_TMA=(k_rank == 0 or tma_ready(k_coeffs)) and (v_rank == 0 or tma_ready(v_coeffs)),
    )
    # Launches of low-rank tiles alone (no residual anywhere, or pass 1 of a split) may take the bounded maximum.
    bounded = (
        bounded_max is not False
        and (bounded_max is True or bounded_by_default(n_k, BOUNDED_MIN_KEYS))
        and k_rank > 0
        and v_rank > 0
        and k.shared_basis
        and v.shared_basis
        and bias is None
        and softcap is None
        and not positional
        and (fp32 or q.dtype == torch.bfloat16)
    )
    bound_operands = None
    if bounded:
        # Prepared before the host read of the residual flags below, so that this host work overlaps the device
        # work queued before the call (after the read the device would wait for it). Unused, and its few small
        # kernels wasted, when a residual turns out to need the residual-capable kernel without a split.
        bound_operands = (
            key_box(k.coeffs[..., :k_rank]),
            packed_value_pair(v.coeffs[..., :v_rank], torch.float32 if fp32 else torch.bfloat16)
            if (pack_values if pack_values is not None else not fp32)
            else None,
        )
    if residual is None:
        counts = torch.stack([(k.mode != 0).sum(), (v.mode != 0).sum()]).tolist()
        residual = [count > 0 for count in counts]
        if lowrank_share is None:
            sizes_kv = (k.mode.numel(), v.mode.numel())
            lowrank_share = [1 - count / max(1, size) for count, size in zip(counts, sizes_kv, strict=True)]
    elif callable(residual):
        residual = residual()
    if callable(lowrank_share):
        lowrank_share = lowrank_share()
    constexprs["K_RESIDUAL"], constexprs["V_RESIDUAL"] = bool(residual[0]), bool(residual[1])
    if q.is_cuda and not constexprs["USE_TMA"] and (residual[0] or residual[1]):
        _warn_pointer_path(q.device)
    if not uniform_safe(constexprs["USE_TMA"], config, relative=positional):
        uniform = False
    fast_k = _uniform_bits(k, head_dim_k, uniform) if residual[0] else 0
    fast_v = _uniform_bits(v, head_dim_v, uniform) if residual[1] else 0
    constexprs["FAST_BITS_K"], constexprs["FAST_BITS_V"] = fast_k, fast_v
    # Byte decode in plane order where the width allows it; its blocks must start on a 16-byte boundary.
    planes_k, planes_v = byte_planes(fast_k, head_dim_k), byte_planes(fast_v, head_dim_v)
    constexprs["K_PLANES"], constexprs["V_PLANES"] = planes_k, planes_v
    constexprs["RUN_KINDS"] = 3 if fast_k or fast_v else 2
    if callable(general_runs):
        general_runs = general_runs()
    # Without general runs (the caller's promise that no block of K or V needs the general loop) that loop is not
    # compiled; only where every operand with a residual has uniform runs.
    constexprs["GENERAL_RUNS"] = bool(general_runs) or not (
        (fast_k or not residual[0]) and (fast_v or not residual[1]) and (fast_k or fast_v)
    )
    if residual[0] or residual[1]:
        runs, run_counts = block_runs(
            k,
            v,
            super_block,
            (fast_k, fast_v) if fast_k or fast_v else None,
            (4 if planes_k else 1, 4 if planes_v else 1),
        )
    else:
        runs = run_counts = _placeholder(q.device, torch.int32)
    args = (*args, runs, run_counts, relative_keys, content_bias, position_bias, None, *sizes, run_keys, run_starts)
    constexprs["PASS"] = 0
    constexprs["BOUNDED"] = False
    constexprs["V_PACKED"] = False

    def bounded_args(args: tuple, constexprs: dict) -> tuple[tuple, dict]:
        """``args`` and ``constexprs`` for a bounded-maximum launch: the box of each head's K coefficients and the
        V coefficients as a pair ``[hi | lo]`` side by side (``packed_value_pair``; in bfloat16 unless everything
        is float32, where ``pack_values=True`` packs them too), with ``RV_PAD`` wide enough for both."""
        box, packed = bound_operands
        if packed is None:
            if not fp32:
                # float16 coefficients would pull P down to float16, whose range cannot hold the bound's gap
                raise ValueError("pack_values: a bounded launch in bfloat16 needs the packed pair, got False")
            return (*args[:25], box, *args[26:]), dict(constexprs, BOUNDED=True)
        at = 26 + 16  # V coefficient strides within sizes (after those of q, bias, out and K coefficients)
        if args[at : at + 4] != tuple(v_coeffs.stride()):
            raise RuntimeError("attention_compressed_fwd: the V coefficient strides moved within the arguments")
        new_args = (*args[:12], packed, *args[13:25], box, *args[26:at], *packed.stride(), *args[at + 4 :])
        use_tma = constexprs["USE_TMA"] and tma_ready(packed)
        return new_args, dict(constexprs, BOUNDED=True, V_PACKED=True, RV_PAD=max(16, next_power_of_2(2 * v_rank)),
                              V_PLANES=1, USE_TMA=use_tma)  # fmt: skip

    def launch(args, constexprs):
        tune_key = (
            sizes[-2],
            sizes[-1],
            *[constexprs[name] for name in COMPRESSED_TUNE_KEY[2:]],
            q.dtype,
            bias_arg.dtype,
            k.coeffs.dtype,
            v.coeffs.dtype,
            k.raw.dtype,
            v.raw.dtype,
        )
        launch_tuned(_attention_compressed_fwd, _TUNED, grid, args, constexprs, tune_key, config)

    if setting == "auto":
        # Not with relative positions: in Borzoi (batch 1 and 4, H100) the split was 0.1-1.5 % slower than one
        # launch, eager and in CUDA graphs alike (kernels/README.md).
        split = lowrank_share is not None and not positional and worth_splitting(k, v, lowrank_share)
    else:
        split = setting == "on"
    if not (split and (residual[0] or residual[1])):
        if bounded and not (residual[0] or residual[1]):
            launch(*bounded_args(args, constexprs))
        else:
            launch(args, constexprs)
        return out, lse
    # Both passes whether or not a low-rank run exists (finding out would read the device from the host; without
    # one, pass 1 only writes empty partials).
    # Low-rank runs in a kernel without residual code (pass 1), the rest in the residual-capable one (pass 2).
    # The partial outputs take out's strides: the launches below pass out's strides for them.
    partial = [(torch.empty_like(out, dtype=torch.float32), torch.empty_like(lse)) for _ in range(2)]
    lowrank = dict(constexprs, K_RESIDUAL=False, V_RESIDUAL=False, FAST_BITS_K=0, FAST_BITS_V=0, K_PLANES=1,
                   V_PLANES=1, PASS=1)  # fmt: skip
    lowrank_args = (*args[:2], *partial[0], *args[4:])
    launch(*(bounded_args(lowrank_args, lowrank) if bounded else (lowrank_args, lowrank)))
    launch((*args[:2], *partial[1], *args[4:]), dict(constexprs, PASS=2))
    return merge_partials(partial, out, lse)


# Split the work over two launches when at least this share of the super-blocks is proven low rank only (``split``
# above; ``joint_lowrank_share``). The share sweep on the H200 (BENCHMARKS.md, b979f83 and 1aa065a; N = 65536,
# r8b4), split against one launch: 1-5 % slower at 0 % residual-free blocks, -2 % to +0.3 % at 25 %, 1-4 % faster
# at 50 %, 7.5-11 % at 75 %, 15-38 % from 87.5 % on. With K and V of one block size the bound is
# share_k + share_v - 1, wherever the residual blocks sit: 0.4 splits from 70 % of the blocks of each on.
SPLIT_MIN_SHARE = 0.4


def split_setting() -> str:
    """``KVBOUND_SPLIT_LOWRANK``: ``on`` (``1``, ``true``, ``on``, ``yes``), ``off`` (``0``, ``false``, ``off``,
    ``no``) or ``auto`` (unset, empty or ``auto``): whether the compressed launcher splits its work
    (``attention_compressed_fwd``'s ``split``)."""
    return switch_setting("KVBOUND_SPLIT_LOWRANK")


# The bounded maximum is the default from this many keys on. Side by side on the H200 (residual-free rank 8, 8 heads,
# bf16; benchmarks/bounded_sweep.py; running maximum's time over the bounded maximum's at N = 4096 .. 65536, the
# bound's preparation (key box, packed pair: 6 small kernels) paid on every call):
#   a499ddc, preparation queued before the call's host read: d = 64 0.34, 0.93, 1.12, 1.13, 1.18;
#           d = 128 0.37, 1.09, 1.02, 1.11, 1.16 (benchmarks/results/h200_2026-12-01_a499ddc/bounded/);
#   e5f554b, preparation after the host read (the device waited for it): d = 64 0.50, 0.75, 0.99, 1.08, 1.16;
#           d = 128 0.97, 0.71, 0.92, 1.05, 1.06.
# Below 16384 keys the calls are bound by the host (benchmarks/host_floor.py), and the preparation's host time shows.
BOUNDED_MIN_KEYS = 16384


def key_box(coeffs: torch.Tensor) -> torch.Tensor:
    """The box of each head's key coefficients ``[B, Hkv, N, r]``: float32 ``[B, Hkv, 2, r]``, the largest then the
    smallest coefficient of each rank-space axis over the keys."""
    lowest, highest = torch.aminmax(coeffs, dim=2)
    box = torch.empty(*coeffs.shape[:2], 2, coeffs.shape[3], dtype=torch.float32, device=coeffs.device)
    return torch.stack([highest, lowest], dim=2, out=box)


def packed_value_pair(coeffs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """V coefficients ``[..., r]`` as ``[hi | lo]`` in ``dtype``, ``[..., w]`` with ``w`` = ``2 r`` rounded up to a
    multiple of 8 (16-byte rows in bfloat16, as tensor descriptors need; zeros past ``2 r``): ``hi`` the
    coefficients rounded to bfloat16, ``lo`` what is left of them, rounded to ``dtype``. ``hi + lo`` holds a float16
    coefficient to about 16 bits in bfloat16, exactly in float32. Written in place into one new tensor: ``hi``, then
    ``lo`` (a difference formed in float32, exact, then rounded once), then the zero padding."""
    rank = coeffs.shape[-1]
    width = -(-2 * rank // 8) * 8
    out = torch.empty(*coeffs.shape[:-1], width, dtype=dtype, device=coeffs.device)
    hi, lo = out[..., :rank], out[..., rank : 2 * rank]
    hi.copy_(coeffs if dtype == torch.bfloat16 else coeffs.to(torch.bfloat16))
    torch.sub(coeffs, hi, out=lo)
    if width > 2 * rank:
        out[..., 2 * rank :].zero_()
    return out


def joint_lowrank_share(k: CompressedOperand, v: CompressedOperand, shares: Sequence[float]) -> float:
    """A lower bound on the share of super-blocks whose K and V blocks are all low rank only, from the shares of
    low-rank-only blocks of K and of V (-1.0 where unknown: 0.0). Each other block of K (of V) lies in one
    super-block of ``max(block sizes)`` rows, so it rules out at most that one."""
    share_k, share_v = shares
    if share_k < 0 or share_v < 0:
        return 0.0
    super_block = max(k.block_size, v.block_size)
    ruled_out = (1 - share_k) * super_block / k.block_size + (1 - share_v) * super_block / v.block_size
    return max(0.0, 1 - ruled_out)


def worth_splitting(k: CompressedOperand, v: CompressedOperand, shares: Sequence[float]) -> bool:
    """The default's choice: whether ``joint_lowrank_share`` reaches ``SPLIT_MIN_SHARE`` (with a margin for its
    rounding: 70 % of the blocks of each operand give 0.3999999999999999)."""
    return joint_lowrank_share(k, v, shares) >= SPLIT_MIN_SHARE - 1e-9


def merge_partials(
    partial: Sequence[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of disjoint key sets from each set's normalised output and log-sum-exp (natural
    log; ``-inf`` and a zero output for a row that saw no key), written into ``out`` and ``lse``.

    Two float32 partials of ``out``'s shape (the split launch's) merge in one kernel (``_merge_two_kernel``: each
    partial and its log-sum-exp read once, ``out`` and ``lse`` written once); other counts with PyTorch operations,
    in place in the partial outputs (they are overwritten). Both compute, per row, ``top`` = the largest
    log-sum-exp (0 where it is not finite), the weights ``w_s = exp(lse_s - top)``, their sum ``total`` and
    ``out = sum_s partial_s * (w_s / total)`` (0 where ``total`` is 0), then ``lse = top + log(total)`` (``-inf``
    where ``total`` is 0), in float32; ``out`` is rounded once to its dtype."""
    if _mergeable_in_one_kernel(partial, out, lse):
        (out0, lse0), (out1, lse1) = partial
        b, h, n, dv = out.shape
        rows = b * h * n
        block_d = next_power_of_2(dv)
        block_rows = max(1, min(64, 4096 // block_d))
        options = {} if interpreting() else {"enable_fp_fusion": False}  # the products and sum as PyTorch rounds them
        _merge_two_kernel[(cdiv(rows, block_rows),)](
            out0, lse0, out1, lse1, out, lse, rows, h, n, dv,
            *out0.stride(), *out.stride(), *lse.stride(),
            BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4, **options,
        )  # fmt: skip
        return out, lse
    top = partial[0][1].clone()
    for _, part_lse in partial[1:]:
        torch.maximum(top, part_lse, out=top)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = [torch.exp(part_lse - safe) for _, part_lse in partial]
    total = sum(weights[1:], weights[0].clone())
    denominator = torch.where(total > 0, total, torch.ones_like(total))
    merged = partial[0][0].mul_((weights[0] / denominator)[..., None])
    for (part_out, _), weight in zip(partial[1:], weights[1:], strict=True):
        merged.add_(part_out.mul_((weight / denominator)[..., None]))
    out.copy_(merged)
    lse.copy_(torch.where(total > 0, safe + torch.log(total), torch.full_like(total, float("-inf"))))
    return out, lse


def _mergeable_in_one_kernel(
    partial: Sequence[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, lse: torch.Tensor
) -> bool:
    """Whether :func:`merge_partials` can run ``_merge_two_kernel``: two float32 partials on ``out``'s device (a CUDA
    device, or the CPU under Triton's interpreter), the outputs of ``out``'s shape and strides, the log-sum-exps
    float32 of ``lse``'s shape and strides, ``out`` in float32, float16 or bfloat16."""
    if len(partial) != 2 or out.dim() != 4 or lse.dim() != 3 or not (out.is_cuda or interpreting()):
        return False
    (out0, lse0), (out1, lse1) = partial
    if out.dtype not in (torch.float32, torch.float16, torch.bfloat16) or lse.dtype != torch.float32:
        return False
    for t in (out0, out1):
        if t.dtype != torch.float32 or t.shape != out.shape or t.stride() != out0.stride() or t.device != out.device:
            return False
    for t in (lse0, lse1):
        if t.dtype != torch.float32 or t.shape != lse.shape or t.stride() != lse.stride() or t.device != out.device:
            return False
    return lse.shape == out.shape[:3] and lse.device == out.device


@triton.jit
def _merge_two_kernel(
    out0, lse0, out1, lse1, out, lse, rows, heads, n, dv,
    s0_b, s0_h, s0_n, s0_d, so_b, so_h, so_n, so_d, sl_b, sl_h, sl_n,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``merge_partials`` of two partials for ``BLOCK_ROWS`` rows (``(b, h, i)`` flattened) per program."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < rows
    i = row % n
    bh = row // n
    hh = bh % heads
    bb = bh // heads
    at_lse = bb.to(tl.int64) * sl_b + hh.to(tl.int64) * sl_h + i.to(tl.int64) * sl_n
    a0 = tl.load(lse0 + at_lse, mask=row_ok, other=float("-inf"))
    a1 = tl.load(lse1 + at_lse, mask=row_ok, other=float("-inf"))
    top = tl.maximum(a0, a1, propagate_nan=tl.PropagateNan.ALL)
    safe = tl.where(tl.abs(top) < float("inf"), top, 0.0)  # NaN and +-Inf compare false
    w0 = tl.exp(a0 - safe)
    w1 = tl.exp(a1 - safe)
    total = w0 + w1
    denominator = tl.where(total > 0, total, 1.0)
    c0 = (w0 / denominator)[:, None]
    c1 = (w1 / denominator)[:, None]
    d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d < dv)[None, :]
    base0 = bb.to(tl.int64) * s0_b + hh.to(tl.int64) * s0_h + i.to(tl.int64) * s0_n
    at0 = base0[:, None] + (d * s0_d)[None, :]
    x0 = tl.load(out0 + at0, mask=ok, other=0.0)
    x1 = tl.load(out1 + at0, mask=ok, other=0.0)
    merged = x0 * c0 + x1 * c1
    base = bb.to(tl.int64) * so_b + hh.to(tl.int64) * so_h + i.to(tl.int64) * so_n
    tl.store(out + base[:, None] + (d * so_d)[None, :], merged.to(out.dtype.element_ty), mask=ok)
    tl.store(lse + at_lse, tl.where(total > 0, safe + tl.log(denominator), float("-inf")), mask=row_ok)
