"""Triton encoder of the compressed K/V format, for a calibrated (shared) basis.

Every kernel but the layout has one program per tile of ``ROWS`` rows of one head, with the grid
``(cdiv(N, ROWS), B * H)``; ``ROWS`` is chosen per kernel and head dim (``_tiling``: 4 to 64 rows, a power of two
that divides the block, so a tile never straddles two blocks). What a block needs from all of its tiles is gathered
with atomics into zeroed per-block entries: a max (of non-negative float32 values, or of 0/1 flags) or a bitwise
or, which come out the same in any order, so the stored result does not depend on the tiling or on the order in
which the tiles run.

1. ``_coefficients_kernel``: ``C = x @ P^T`` in float32, stored as float16 (float32 when a coefficient exceeds
   2**15, as the eager encoder does: the kernel flags it and the host encodes again with float32); also flags
   NaN/Inf. From the stored coefficients it rebuilds ``L = C @ P`` and raises its block's largest residual and
   whether the low-rank part alone fails an in-kernel version of the certificate.
2. ``_modes_kernel``: for the tiles of blocks whose low-rank part fails, which code widths (``bits``, then wider
   codes) fail the in-kernel check with the step that the block's largest residual gives them: one bit per width.
   ``_layout_kernel`` (one program) picks per block the first storage that passes (low-rank only, ``bits``-bit
   codes, wider codes, exact): mode, code width and step, then turns widths into offsets and totals (a running
   cumsum).
3. ``_write_kernel``: writes the packed words (loading the columns of each word directly, so no code tile is ever
   written out) into a workspace sized from the shapes, copies exact blocks, and zeroes their coefficients.

The in-kernel check uses float32 arithmetic with a generous rounding allowance, so it almost never accepts what the
exact check rejects; the float64 certificate of ``kvbound.codec.eager.uncertified_blocks`` then runs on the stored
numbers in a fourth kernel (``_certify_kernel``, one program per tile as well), and if a block fails it, the tensor
is re-encoded by the eager encoder. So the returned object carries the same guarantee as
the eager one: ``|x - decompress()| <= tau`` on every element.

Each kernel's work on a tile is a ``*_tile`` function; ``_one_pass_kernel`` calls the same functions for every tile
of one block in turn (coefficients, failing widths, the choice of ``_choose``, the write, the certificate of what it
stored), one program per block, so that the deferred encoder (``encode_triton_deferred``) can run in one launch
instead of five where the host's launches set the pace. It needs no layout pass: the deferred encoder's workspaces
hold every block at the widest code and every block exact, so each block writes at the place of its rows.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvbound._checks import DeferredChecks, _stream_capturing
from kvbound._validate import check_finite_values, check_tensor
from kvbound.codec.basis import Basis
from kvbound.codec.eager import _check_basis, encode, promotion_widths
from kvbound.codec.format import (
    MODE_LOWRANK,
    MODE_PACKED,
    MODE_PROMOTED,
    MODE_RAW,
    CompressedKV,
    decoded_magnitude,
    words_per_row,
)
from kvbound.config import CompressionConfig
from kvbound.kernels._common import cdiv, next_power_of_2, switch_setting
from kvbound.kernels.attention_compressed import fast_width, general_loop

__all__ = ["certify_triton", "encode_triton", "encode_triton_deferred"]

_STEP_MARGIN = 1.0 - 2.0**-10
_COEFF_FP16_LIMIT = 2.0**15
_COEFF_FP16_LIMIT_C = tl.constexpr(_COEFF_FP16_LIMIT)
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _ulp(y):
    """One float32 ulp of |y| (inf/NaN for non-finite y, which then fails every check)."""
    a = tl.abs(y)
    return (a.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True) - a


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _any_bits(flags):
    """Bitwise or of every element of a 2-D int32 tile (one reduction for several flags)."""
    return tl.reduce(tl.reduce(flags, 1, _or), 0, _or)


@triton.jit
def _load_rows(x_ptr, row0, rows_left, D, stride_n, stride_d, ROWS: tl.constexpr, D_PAD: tl.constexpr, col0=0):
    """x[row0 : row0 + ROWS, col0 : col0 + D_PAD] as float32, zero outside the rows left and the D columns."""
    rows = tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, D_PAD)
    mask = (rows < rows_left)[:, None] & (cols < D)[None, :]
    ptrs = x_ptr + (row0 + rows)[:, None].to(tl.int64) * stride_n + cols[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _load_basis(p_ptr, h, R, D, dtype: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr, col0=0):
    """P[h, :, col0 : col0 + D_PAD] as a [R_PAD, D_PAD] tile in ``dtype`` (the coefficients' dtype), zero-padded."""
    ranks = tl.arange(0, R_PAD)
    cols = col0 + tl.arange(0, D_PAD)
    p = tl.load(p_ptr + h * R * D + ranks[:, None] * D + cols[None, :],
                mask=(ranks < R)[:, None] & (cols < D)[None, :], other=0.0)
    return p.to(dtype)


@triton.jit
def _lowrank(c, p_tile, IEEE: tl.constexpr):
    """L = C @ P and |C| @ |P| for a [ROWS, R_PAD] tile of stored coefficients (zero outside the rows and ranks)."""
    if IEEE:
        c = c.to(tl.float32)
        low = tl.dot(c, p_tile.to(tl.float32), input_precision="ieee")
        low_abs = tl.dot(tl.abs(c), tl.abs(p_tile.to(tl.float32)), input_precision="ieee")
    else:
        # float16 x float16 products are exact in float32; only the accumulation rounds.
        low = tl.dot(c, p_tile)
        low_abs = tl.dot(tl.abs(c), tl.abs(p_tile))
    return low, low_abs


@triton.jit
def _lowrank_rows(c_ptr, p_tile, row0, rows_left, R, ROWS: tl.constexpr, R_PAD: tl.constexpr,
                  IEEE: tl.constexpr):
    """L = C[rows] @ P and |C| @ |P| for ROWS rows of one head (C row-major [N, R])."""
    rows = tl.arange(0, ROWS)
    ranks = tl.arange(0, R_PAD)
    mask = (rows < rows_left)[:, None] & (ranks < R)[None, :]
    c = tl.load(c_ptr + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], mask=mask, other=0.0)
    return _lowrank(c, p_tile, IEEE)


@triton.jit
def _tile_place(H, NB, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's place in a grid ``(cdiv(N, ROWS), B * H)``: head ``bh`` (batch ``b``, head ``h``), first row
    ``row0``, its block ``k`` and the block's flat index ``blk`` (ROWS divides BLOCK: a tile never straddles two
    blocks)."""
    bh = tl.program_id(1).to(tl.int64)
    row0 = tl.program_id(0) * ROWS
    k = row0 // BLOCK
    return bh, bh // H, bh % H, row0, k, bh * NB + k


@triton.jit
def _coefficients_tile(
    x_head, p_ptr, c_head, h, row0, N, D, R, tau_check, gamma, stride_xn, stride_xd,
    ROWS: tl.constexpr, COLS: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """ROWS rows (from ``row0``) of one head: C = x @ P^T, stored in C's dtype at ``c_head`` (the head's [N, R]
    coefficients). Returns the tile's flags and reductions: non-finite x, |C| > 2**15, the largest residual
    |x - L| of L = C @ P rebuilt from the stored coefficients, and whether the low-rank part alone fails the
    check. Both passes walk x COLS columns at a time.

    The float32 ``tl.dot`` (input_precision="ieee") accumulates each coefficient with one fused multiply-add per
    column, column after column, from the accumulator it is given: chunks of columns in order, each dot starting
    from the last one's result, give the same bits as one dot over all columns."""
    rows = tl.arange(0, ROWS)
    ranks = tl.arange(0, R_PAD)
    c = tl.zeros((ROWS, R_PAD), dtype=tl.float32)
    nonfinite = tl.zeros((ROWS, COLS), dtype=tl.int32)
    for col0 in range(0, D, COLS):
        cols = col0 + tl.arange(0, COLS)
        p_t = tl.load(p_ptr + h * R * D + ranks[None, :] * D + cols[:, None],
                      mask=(ranks < R)[None, :] & (cols < D)[:, None], other=0.0).to(tl.float32)  # P^T [COLS, R_PAD]
        x, x_mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, COLS, col0)
        c = tl.dot(x, p_t, c, input_precision="ieee")
        # NaN fails every comparison, so both flags catch it.
        nonfinite = nonfinite | (x_mask & ~(tl.abs(x) <= _FLOAT32_MAX)).to(tl.int32)
    c_mask = ((row0 + rows) < N)[:, None] & (ranks < R)[None, :]
    stored = c.to(c_head.dtype.element_ty)
    tl.store(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], stored, mask=c_mask)
    nonfinite = tl.max(tl.max(nonfinite, 1), 0)
    beyond_fp16 = tl.max(tl.max((c_mask & ~(tl.abs(c) <= _COEFF_FP16_LIMIT_C)).to(tl.int32), 1), 0)

    # The low-rank part as the later passes rebuild it: the stored coefficients (what a masked load of them
    # returns), times P in the coefficients' dtype. Elementwise max and or over the column steps, then one
    # reduction each (max and or give the same result in any order).
    stored = tl.where(c_mask, stored, tl.zeros((ROWS, R_PAD), dtype=c_head.dtype.element_ty))
    residual = tl.zeros((ROWS, COLS), dtype=tl.float32)
    lowrank_fail = tl.zeros((ROWS, COLS), dtype=tl.int32)
    for col0 in range(0, D, COLS):
        p = _load_basis(p_ptr, h, R, D, c_head.dtype.element_ty, R_PAD, COLS, col0)
        x, x_mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, COLS, col0)
        low, low_abs = _lowrank(stored, p, IEEE)
        residual = tl.maximum(residual, tl.where(x_mask, tl.abs(x - low), 0.0))
        err = tl.abs(x - low) + 2.0 * _ulp(low) + gamma * low_abs
        lowrank_fail = lowrank_fail | (x_mask & ~(err <= tau_check)).to(tl.int32)
    return nonfinite, beyond_fp16, tl.max(tl.max(residual, 1), 0), tl.max(tl.max(lowrank_fail, 1), 0)


@triton.jit
def _coefficients_kernel(
    x_ptr, p_ptr, c_ptr, summary_ptr, res_ptr, lowrank_fail_ptr, N, H, D, R, NB, tau_check, gamma,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """One tile of ROWS rows of one head (``_coefficients_tile``): flags non-finite x (summary[2]) and
    |C| > 2**15 (summary[3]); the tile's largest residual and its low-rank failure go to its block's ``res`` and
    ``lowrank_fail`` (atomic max; both start at zero, and a max is the same in any order)."""
    bh, b, h, row0, _, blk = _tile_place(H, NB, BLOCK, ROWS)
    nonfinite, beyond_fp16, res_max, lowrank_fail = _coefficients_tile(
        x_ptr + b * stride_xb + h * stride_xh, p_ptr, c_ptr + bh * N * R, h, row0, N, D, R, tau_check, gamma,
        stride_xn, stride_xd, ROWS, COLS, R_PAD, IEEE)
    tl.atomic_max(summary_ptr + 2, nonfinite.to(tl.int64), mask=nonfinite > 0)
    tl.atomic_max(summary_ptr + 3, beyond_fp16.to(tl.int64), mask=beyond_fp16 > 0)
    tl.atomic_max(res_ptr + blk, res_max, mask=res_max > 0.0)  # non-negative float32: exact
    tl.atomic_max(lowrank_fail_ptr + blk, lowrank_fail, mask=lowrank_fail > 0)


@triton.jit
def _modes_tile(
    x_head, p_ptr, c_head, h, row0, N, D, R, res_max, tau_check, max_step, gamma, stride_xn, stride_xd,
    BITS: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """ROWS rows of a block whose low-rank part fails: bit w of the result is set when code width w, with the step
    that the block's largest residual ``res_max`` gives it, fails the check on some element of the rows."""
    p = _load_basis(p_ptr, h, R, D, c_head.dtype.element_ty, R_PAD, D_PAD)
    x, mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, D_PAD)
    low, low_abs = _lowrank_rows(c_head, p, row0, N - row0, R, ROWS, R_PAD, IEEE)
    fail = tl.zeros((ROWS, D_PAD), dtype=tl.int32)
    for w in tl.static_range(2, 9):
        if (w == BITS) or (w > BITS and w >= 4 and w != 7):
            qmax = (1 << (w - 1)) - 1
            step = tl.maximum(tl.minimum(res_max / qmax, max_step), 1.1754943508222875e-38)
            q = tl.minimum(tl.maximum(tl.floor((x - low) / step + 0.5), -qmax - 1.0), qmax * 1.0)
            y = low + q * step
            err = tl.abs(x - y) + 2.0 * _ulp(y) + gamma * (low_abs + tl.abs(q) * step)
            fail = fail | ((mask & ~(err <= tau_check)).to(tl.int32) << w)
    return _any_bits(fail)


@triton.jit
def _modes_kernel(
    x_ptr, p_ptr, c_ptr, res_ptr, lowrank_fail_ptr, fail_ptr, N, H, D, R, NB, tau_check, max_step, gamma,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One tile of a block whose low-rank part fails (``_modes_tile``): its failing widths raise its block's
    ``fail`` (atomic or). Tiles of low-rank blocks do nothing."""
    bh, b, h, row0, _, blk = _tile_place(H, NB, BLOCK, ROWS)
    if tl.load(lowrank_fail_ptr + blk) != 0:
        fail = _modes_tile(x_ptr + b * stride_xb + h * stride_xh, p_ptr, c_ptr + bh * N * R, h, row0, N, D, R,
                           tl.load(res_ptr + blk), tau_check, max_step, gamma, stride_xn, stride_xd,
                           BITS, ROWS, D_PAD, R_PAD, IEEE)
        tl.atomic_or(fail_ptr + blk, fail, mask=fail != 0)


@triton.jit
def _choose(res_max, lowrank_fail, fail, max_step, BITS: tl.constexpr):
    """Mode, code width and step of blocks (any shape) from their reductions: low-rank only when the low-rank part
    passes, else the first width whose bit in ``fail`` is clear (``bits``, then wider codes), else exact."""
    chosen = tl.zeros_like(fail)
    for w in tl.static_range(2, 9):
        if (w == BITS) or (w > BITS and w >= 4 and w != 7):
            passes = ((fail >> w) & 1) == 0
            chosen = tl.where((chosen == 0) & passes, w, chosen)
    mode = tl.where(lowrank_fail == 0, 0, tl.where(chosen == BITS, 1, tl.where(chosen > 0, 2, 3)))
    width = tl.where(lowrank_fail == 0, 0, chosen)
    qmax_chosen = tl.maximum((1 << (tl.maximum(width, 1) - 1)) - 1, 1)
    step = tl.maximum(tl.minimum(res_max / qmax_chosen, max_step), 1.1754943508222875e-38)
    step = tl.where(width > 0, step, 0.0)
    return mode, width, step


@triton.jit
def _general_block(mode, width, offset, BITS: tl.constexpr):
    """Blocks with a residual that the compressed kernel's uniform runs cannot read: exact, coded at another width
    than ``BITS``, or codes starting at a word offset that is not a multiple of 4 (the byte decode's 16 bytes)."""
    return (mode != 0) & ((mode == 3) | (width != BITS) | ((offset % 4) != 0))


@triton.jit
def _layout_kernel(
    res_ptr, lowrank_fail_ptr, fail_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, summary_ptr,
    TOTAL, NB, N, D, max_step,
    BITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Per block (order b, h, k): mode, code width and step from the reductions of the two kernels above
    (``_choose``), then the offsets in ``codes``/``raw``, both totals (summary[0], summary[1]), the number of
    low-rank blocks (summary[5]) and of blocks with a residual that are not coded at ``BITS`` bits from a word offset
    that is a multiple of 4 (summary[6]: those the compressed kernel's uniform runs cannot read).

    One program scans all blocks CHUNK at a time: the running totals carry from chunk to chunk."""
    code_total = tl.full((), 0, tl.int64)
    raw_total = tl.full((), 0, tl.int64)
    lowrank_total = tl.full((), 0, tl.int64)
    general_total = tl.full((), 0, tl.int64)
    for start in range(0, TOTAL, CHUNK):
        index = start + tl.arange(0, CHUNK)
        ok = index < TOTAL
        res_max = tl.load(res_ptr + index, mask=ok, other=0.0)
        lowrank_fail = tl.load(lowrank_fail_ptr + index, mask=ok, other=0)
        fail = tl.load(fail_ptr + index, mask=ok, other=0)
        mode, width, step = _choose(res_max, lowrank_fail, fail, max_step, BITS)
        tl.store(mode_ptr + index, mode.to(tl.int8), mask=ok)
        tl.store(width_ptr + index, width.to(tl.int8), mask=ok)
        tl.store(step_ptr + index, step, mask=ok)

        rows = tl.minimum(N - (index % NB) * BLOCK, BLOCK).to(tl.int64)  # the last block may be short
        per_word = 32 // tl.maximum(width, 1)
        code_words = tl.where(ok & (width > 0), rows * ((D + per_word - 1) // per_word), 0)
        raw_elems = tl.where(ok & (mode == 3), rows * D, 0)
        code_end = tl.cumsum(code_words, 0) + code_total
        raw_end = tl.cumsum(raw_elems, 0) + raw_total
        offset = tl.where(mode == 3, raw_end - raw_elems, tl.where(width > 0, code_end - code_words, -1))
        tl.store(offset_ptr + index, offset, mask=ok)
        code_total += tl.sum(code_words, 0)
        raw_total += tl.sum(raw_elems, 0)
        lowrank_total += tl.sum((ok & (mode == 0)).to(tl.int64), 0)
        general_total += tl.sum((ok & _general_block(mode, width, offset, BITS)).to(tl.int64), 0)
    tl.store(summary_ptr, code_total)
    tl.store(summary_ptr + 1, raw_total)
    tl.store(summary_ptr + 5, lowrank_total)
    tl.store(summary_ptr + 6, general_total)


@triton.jit
def _write_tile(
    x_head, p_ptr, c_head, h, row0, t, N, D, R, mode, width, step, offset, codes_ptr, raw_ptr, codes_capacity,
    raw_capacity, stride_xn, stride_xd,
    ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, WPR_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """ROWS rows (from ``row0``, the block's row ``t``) of one block: their packed words, or (exact block) their
    rows of x copied to ``raw`` and their coefficients zeroed."""
    rows = tl.arange(0, ROWS)
    ranks = tl.arange(0, R_PAD)
    row_ok = (row0 + rows) < N
    if width > 0:
        per_word = 32 // width
        wpr = (D + per_word - 1) // per_word
        qmax = (1 << (width - 1)) - 1
        words = tl.arange(0, WPR_PAD)
        c = tl.load(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :],
                    mask=row_ok[:, None] & (ranks < R)[None, :], other=0.0)
        packed = tl.zeros((ROWS, WPR_PAD), dtype=tl.int32)
        for i in range(0, per_word):
            col = words * per_word + i
            col_ok = (col < D) & (words < wpr)
            x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + col[None, :] * stride_xd,
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            p = tl.load(p_ptr + h * R * D + ranks[:, None] * D + col[None, :],
                        mask=(ranks < R)[:, None] & col_ok[None, :], other=0.0).to(c_head.dtype.element_ty)
            if IEEE:
                low = tl.dot(c.to(tl.float32), p.to(tl.float32), input_precision="ieee")
            else:
                low = tl.dot(c, p)
            q = tl.minimum(tl.maximum(tl.floor((x - low) / step + 0.5), -qmax - 1.0), qmax * 1.0)
            u = tl.where(col_ok[None, :], q.to(tl.int32) + (1 << (width - 1)), 0)
            packed = packed | (u << (i * width))
        dest = offset + (t + rows)[:, None].to(tl.int64) * wpr + words[None, :]
        tl.store(codes_ptr + dest, packed, mask=row_ok[:, None] & (words < wpr)[None, :] & (dest < codes_capacity))
    if mode == 3:
        cols = tl.arange(0, D_PAD)
        mask = row_ok[:, None] & (cols < D)[None, :]
        x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + cols[None, :] * stride_xd,
                    mask=mask, other=0.0)
        dest = offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :]
        tl.store(raw_ptr + dest, x, mask=mask & (dest < raw_capacity))
        zero = tl.zeros((ROWS, R_PAD), dtype=c_head.dtype.element_ty)
        tl.store(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], zero,
                 mask=row_ok[:, None] & (ranks < R)[None, :])


@triton.jit
def _write_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, N, H, D, R, NB,
    codes_capacity, raw_capacity,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, WPR_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One tile of ROWS rows of one head (``_write_tile``), with its block's mode, width, step and offset."""
    bh, b, h, row0, k, blk = _tile_place(H, NB, BLOCK, ROWS)
    _write_tile(x_ptr + b * stride_xb + h * stride_xh, p_ptr, c_ptr + bh * N * R, h, row0, row0 - k * BLOCK, N, D, R,
                tl.load(mode_ptr + blk).to(tl.int32), tl.load(width_ptr + blk).to(tl.int32), tl.load(step_ptr + blk),
                tl.load(offset_ptr + blk), codes_ptr, raw_ptr, codes_capacity, raw_capacity, stride_xn, stride_xd,
                ROWS, D_PAD, R_PAD, WPR_PAD, IEEE)


@triton.jit
def _certify_tile(
    x_head, p_ptr, c_head, h, row0, t, N, D, mode, width, step, offset, codes_ptr, raw_ptr, tau, gamma,
    codes_capacity, raw_capacity, stride_xn, stride_xd,
    R: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
):
    """The float64 certificate of ``uncertified_blocks`` for ROWS rows (from ``row0``, the block's row ``t``) of one
    block with the stored ``mode``, ``width``, ``step`` (float64) and ``offset``: 1 when some element fails, else 0.
    Reads stay below the capacities (a block beyond them fails)."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    row_ok = (row0 + rows) < N
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + cols[None, :] * stride_xd,
                mask=mask, other=0.0)
    if mode == 3:
        source = offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :]
        inside = source < raw_capacity
        stored = tl.load(raw_ptr + source, mask=mask & inside, other=0.0)
        bad = mask & ((stored != x) | ~inside)
    else:
        x64 = x.to(tl.float64)
        low = tl.zeros((ROWS, D_PAD), dtype=tl.float64)
        low_abs = tl.zeros((ROWS, D_PAD), dtype=tl.float64)
        for r in tl.static_range(R):  # r = 0, 1, ..., R - 1 in order, as the float64 sums need; unrolled, so the
            # loads of the coefficients' columns (cached lines) and of the basis rows are issued together
            c = tl.load(c_head + (row0 + rows).to(tl.int64) * R + r, mask=row_ok, other=0.0).to(tl.float64)
            p = tl.load(p_ptr + h * R * D + r * D + cols, mask=cols < D, other=0.0).to(tl.float64)
            low += c[:, None] * p[None, :]
            low_abs += tl.abs(c)[:, None] * tl.abs(p)[None, :]
        y = low
        bad = tl.zeros((ROWS, D_PAD), dtype=tl.int1)
        if width > 0:
            per_word = 32 // width
            wpr = (D + per_word - 1) // per_word
            source = offset + (t + rows)[:, None].to(tl.int64) * wpr + (cols // per_word)[None, :]
            inside = source < codes_capacity
            word = tl.load(codes_ptr + source, mask=mask & inside, other=0)
            bad = mask & ~inside
            u = (word >> ((cols % per_word) * width)[None, :]) & ((1 << width) - 1)
            qs = (u - (1 << (width - 1))).to(tl.float64) * step
            y = low + qs
            low_abs = low_abs + tl.abs(qs)
        y32 = y.to(tl.float32)
        err = tl.abs(x64 - y32.to(tl.float64)) + _ulp(y32).to(tl.float64) + gamma * low_abs
        bad = bad | (mask & ~(err <= tau))
    return tl.max(tl.max(bad.to(tl.int32), 1), 0)


@triton.jit
def _certify_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, bad_ptr, any_bad_ptr,
    N, H, D, NB, tau, gamma, codes_capacity, raw_capacity,
    stride_xb, stride_xh, stride_xn, stride_xd,
    R: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, STORE_BAD: tl.constexpr,
):
    """The certificate (``_certify_tile``) of one tile of ROWS rows of one block: a failure raises ``any_bad`` to 1
    and, with STORE_BAD, the block's entry of ``bad`` (zeroed by the caller) to 1."""
    bh, b, h, row0, k, blk = _tile_place(H, NB, BLOCK, ROWS)
    bad = _certify_tile(x_ptr + b * stride_xb + h * stride_xh, p_ptr, c_ptr + bh * N * R, h, row0, row0 - k * BLOCK,
                        N, D, tl.load(mode_ptr + blk).to(tl.int32), tl.load(width_ptr + blk).to(tl.int32),
                        tl.load(step_ptr + blk).to(tl.float64), tl.load(offset_ptr + blk), codes_ptr, raw_ptr, tau,
                        gamma, codes_capacity, raw_capacity, stride_xn, stride_xd, R, ROWS, D_PAD)
    if STORE_BAD:
        tl.atomic_max(bad_ptr + blk, bad, mask=bad > 0)
    tl.atomic_max(any_bad_ptr, bad.to(tl.int64), mask=bad > 0)


@triton.jit
def _one_pass_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, summary_ptr,
    N, H, D, R, NB, tau_check, max_step, gamma, tau, gamma64, codes_capacity, raw_capacity,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BITS: tl.constexpr, BLOCK: tl.constexpr, R_CONST: tl.constexpr, C_ROWS: tl.constexpr, COLS: tl.constexpr,
    M_ROWS: tl.constexpr, W_ROWS: tl.constexpr, V_ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
    WIDEST: tl.constexpr, WPR_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    """The whole encoder for one block of one head in one program, the tiles of each step above taken in turn:
    coefficients, failing widths, the block's choice (``_choose``), the write, and the certificate of what was
    stored. A block's words and exact values go to fixed places, the ones its rows have in ``[B, H, N, WIDEST]``
    words and in ``[B, H, N, D]`` (the workspaces hold every block at the widest code and every block exact), so no
    block waits for another's size; the exact values' place of a block that is not exact is zeroed. The summary
    gets the totals of a packed layout (atomic adds), the flags (atomic max) and the verdict."""
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    start = k * BLOCK
    blk = bh * NB + k
    x_head = x_ptr + b * stride_xb + h * stride_xh
    c_head = c_ptr + bh * N * R
    nonfinite = tl.full((), 0, tl.int32)
    beyond_fp16 = tl.full((), 0, tl.int32)
    res_max = tl.full((), 0.0, tl.float32)
    lowrank_fail = tl.full((), 0, tl.int32)
    for t in range(0, BLOCK, C_ROWS):
        tile_nonfinite, tile_beyond, tile_res, tile_fail = _coefficients_tile(
            x_head, p_ptr, c_head, h, start + t, N, D, R, tau_check, gamma, stride_xn, stride_xd,
            C_ROWS, COLS, R_PAD, IEEE)
        nonfinite = tl.maximum(nonfinite, tile_nonfinite)
        beyond_fp16 = tl.maximum(beyond_fp16, tile_beyond)
        res_max = tl.maximum(res_max, tile_res)
        lowrank_fail = tl.maximum(lowrank_fail, tile_fail)
    tl.debug_barrier()  # the next steps read the coefficients stored above, by other threads of the program
    fail = tl.full((), 0, tl.int32)
    if lowrank_fail != 0:
        for t in range(0, BLOCK, M_ROWS):
            fail = fail | _modes_tile(x_head, p_ptr, c_head, h, start + t, N, D, R, res_max, tau_check, max_step,
                                      gamma, stride_xn, stride_xd, BITS, M_ROWS, D_PAD, R_PAD, IEEE)
    mode, width, step = _choose(res_max, lowrank_fail, fail, max_step, BITS)
    rows = tl.minimum(N - start, BLOCK).to(tl.int64)  # the last block may be short
    per_word = 32 // tl.maximum(width, 1)
    code_words = tl.where(width > 0, rows * ((D + per_word - 1) // per_word), 0)
    raw_elems = tl.where(mode == 3, rows * D, 0)
    raw_place = (bh * N + start) * D
    offset = tl.where(mode == 3, raw_place, tl.where(width > 0, (bh * N + start) * WIDEST, -1))
    tl.store(mode_ptr + blk, mode.to(tl.int8))
    tl.store(width_ptr + blk, width.to(tl.int8))
    tl.store(step_ptr + blk, step)
    tl.store(offset_ptr + blk, offset)
    tl.atomic_add(summary_ptr, code_words, mask=code_words > 0)
    tl.atomic_add(summary_ptr + 1, raw_elems, mask=raw_elems > 0)
    tl.atomic_max(summary_ptr + 2, nonfinite.to(tl.int64), mask=nonfinite > 0)
    tl.atomic_max(summary_ptr + 3, beyond_fp16.to(tl.int64), mask=beyond_fp16 > 0)
    tl.atomic_add(summary_ptr + 5, (mode == 0).to(tl.int64), mask=mode == 0)
    general = _general_block(mode, width, offset, BITS)
    tl.atomic_add(summary_ptr + 6, general.to(tl.int64), mask=general)
    tl.debug_barrier()  # an exact block's coefficients are zeroed over the ones stored above
    rows_w = tl.arange(0, W_ROWS)
    cols = tl.arange(0, D_PAD)
    for t in range(0, BLOCK, W_ROWS):
        _write_tile(x_head, p_ptr, c_head, h, start + t, t, N, D, R, mode, width, step, offset, codes_ptr, raw_ptr,
                    codes_capacity, raw_capacity, stride_xn, stride_xd, W_ROWS, D_PAD, R_PAD, WPR_PAD, IEEE)
        if mode != 3:
            zero = tl.zeros((W_ROWS, D_PAD), dtype=raw_ptr.dtype.element_ty)
            tl.store(raw_ptr + raw_place + (t + rows_w)[:, None].to(tl.int64) * D + cols[None, :], zero,
                     mask=((start + t + rows_w) < N)[:, None] & (cols < D)[None, :])
    tl.debug_barrier()  # the certificate reads what was stored, as the other threads of the program stored it
    mode = tl.load(mode_ptr + blk).to(tl.int32)
    width = tl.load(width_ptr + blk).to(tl.int32)
    step = tl.load(step_ptr + blk).to(tl.float64)
    offset = tl.load(offset_ptr + blk)
    bad = tl.full((), 0, tl.int32)
    for t in range(0, BLOCK, V_ROWS):
        bad = tl.maximum(bad, _certify_tile(x_head, p_ptr, c_head, h, start + t, t, N, D, mode, width, step, offset,
                                            codes_ptr, raw_ptr, tau, gamma64, codes_capacity, raw_capacity,
                                            stride_xn, stride_xd, R_CONST, V_ROWS, D_PAD))
    tl.atomic_max(summary_ptr + 4, bad.to(tl.int64), mask=bad > 0)


def certify_triton(ckv: CompressedKV, x: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, NB]: blocks of ``ckv`` (shared basis) that fail the float64 certificate against ``x``.

    The same check as ``kvbound.codec.eager.uncertified_blocks``, one program per tile of rows of a block (a block
    fails when any of its tiles does), no float64 tensor in memory.
    """
    if not ckv.shared_basis:
        raise ValueError("ckv: certify_triton reads a shared basis; use uncertified_blocks for per-block bases")
    if tuple(x.shape) != ckv.shape:
        raise ValueError(f"x: expected shape {ckv.shape}, got {tuple(x.shape)}")
    # int32: the tiles of a block raise its entry with an atomic max (no 8-bit atomics)
    bad = torch.zeros(ckv.shape[:2] + (ckv.num_blocks,), dtype=torch.int32, device=ckv.device)
    any_bad = torch.zeros(1, dtype=torch.int64, device=ckv.device)
    # an empty coefficient tensor (rank 0) still needs a valid pointer
    coeffs = ckv.coeffs if ckv.coeffs.numel() else ckv.scale
    _launch_certify(x, ckv.basis, coeffs, ckv.mode, ckv.bits, ckv.scale, ckv.offset, ckv.codes, ckv.raw, bad, any_bad,
                    ckv.config)
    return bad.bool()


def _launch_certify(x, projection, coeffs, mode, width, step, offset, codes, raw, bad, any_bad, config) -> None:
    """The certificate over every tile; ``bad`` (zeroed int32 [B, H, NB]) gets the verdict per block, or None."""
    batch, heads, n, d = x.shape
    nb, r, block = mode.shape[-1], projection.shape[1], config.block_size
    d_pad = _padded(d)
    rows, warps = _tiling(block, d_pad)["certify"]
    _certify_kernel[(cdiv(n, rows), batch * heads)](
        x, projection, coeffs, mode, width, step, offset, codes, raw, any_bad if bad is None else bad, any_bad,
        n, heads, d, nb, config.tau, (r + 2) * 2.0**-52, codes.numel(), raw.numel(), *x.stride(),
        R=r, BLOCK=block, ROWS=rows, D_PAD=d_pad, STORE_BAD=bad is not None,
        num_warps=warps,
    )


def _padded(n: int) -> int:
    """The smallest power of two >= ``n`` and >= 16: the padded width of a tile dimension (``tl.dot`` needs 16)."""
    return max(16, next_power_of_2(n))


@functools.lru_cache(maxsize=64)
def _constants(d: int, config: CompressionConfig) -> tuple[int, int, int, int, float, float, float]:
    """``(d_pad, r_pad, widest, wpr_pad, gamma, tau_check, max_step)`` of an encode: the same for every call with
    head dim ``d`` and ``config`` (frozen), so computed once. ``widest``: words per row at the widest code;
    ``gamma``: the in-kernel check's float32 allowance (a dot of r + 1 terms and two roundings, with a factor 4 to
    spare); ``tau_check`` and ``max_step``: the tau it tests against and the largest step."""
    r, tau = config.rank, config.tau
    widest = max(words_per_row(w, d) for w in promotion_widths(config.bits))
    gamma = 4.0 * (r + 3) * 2.0**-24
    return _padded(d), _padded(r), widest, _padded(widest), gamma, tau * (1.0 - 2.0**-16), 2.0 * tau * _STEP_MARGIN


def _tiling(block: int, d_pad: int) -> dict[str, tuple[int, ...]]:
    """Kernel name -> (ROWS, num_warps[, COLS]): the rows of one program (a power of two that divides the block) and,
    for the coefficients, the columns of x per step.

    Measured on an H200 (Triton 3.6, Enformer and Borzoi K/V, batch 1 to 8): these were the fastest of the tilings
    tried. The coefficients' float32 dot runs on CUDA cores, where taller tiles read less per coefficient: 64 rows,
    32 columns a step (16 or 32 rows, or 64 columns, were slower; 128 rows no faster). The certificate's float64
    tiles are small (4 to 8 elements a thread), so that many programs fit on each multiprocessor.

    Any tiling gives the same bits: every element's arithmetic is the same (tl.dot's products and sums per element do
    not depend on the tile's shape: mma.sync and wgmma tiles gave the same float32 values on the H200, and the float32
    coefficients are summed column after column either way), and what a block gathers from its tiles is a max or an
    or. The tests compare tilings bit for bit.

    ``one_pass``: (num_warps,) of ``_one_pass_kernel``, which runs each step with that step's rows. 8 warps, as the
    modes kernel: compiled for sm_90 with 4, its modes step at head dim 192 spilled (1,336 bytes of stack a thread,
    Triton 3.9; ``benchmarks/one_pass_encode.py --sm90``), with 8 nothing spills."""
    small = d_pad <= 64
    return {
        "coefficients": (min(block, 64), 4, min(32, d_pad)),
        "modes": (min(block, 64 if small else 32), 8),
        "write": (16, 4),
        "certify": (min(block, 8 if small else max(1, 1024 // d_pad)), 4),
        "one_pass": (8,),
    }


# summary[i]: what the single host read of an encode returns (int64 each).
_CODE_WORDS, _RAW_ELEMENTS, _NONFINITE, _BEYOND_FP16, _UNCERTIFIED, _LOWRANK_BLOCKS, _GENERAL_BLOCKS = range(7)
_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_SUMMARY_SIZE = 7
# Exact blocks are rare; a workspace for an eighth of the tensor covers them without a second read.
_RAW_WORKSPACE_FRACTION = 8
_LAYOUT_CHUNK = 1024


def encode_triton(x: torch.Tensor, config: CompressionConfig, basis: Basis, *, verify: bool = True) -> CompressedKV:
    """Compress ``x`` [B, H, N, D] with a calibrated ``basis``; same format and guarantee as the eager encoder.

    With ``verify=False`` the float64 certificate is skipped and the bound rests on the in-kernel check alone. That
    check is conservative by construction: with u = 2**-24, the float32 value it tests differs from the exact
    ``L + q s`` by at most ``r u sum|c p| + u |q s| + ulp/2`` (float16 products are exact; tensor-core accumulation
    is allowed twice the error of round-to-nearest), and the value ``decompress`` returns differs from the exact one
    by at most one more half ulp; the check charges ``2 ulp + 4 (r + 3) u (sum|c p| + |q s|)`` and tests against
    ``tau (1 - 2**-16)``. The default keeps the exact float64 certificate on the stored numbers.

    One host read per call: every kernel is queued first (codes and exact values go to workspaces sized from the
    shapes), then the sizes of ``codes`` and ``raw``, the NaN/Inf and float16-range flags and the certificate's
    verdict come back together. A second read happens only when coefficients exceed float16 (the tensor is encoded
    again with float32 coefficients) or when more than an eighth of the tensor is stored exactly.
    Memory: the workspaces hold every block at the widest code (8 bits: a quarter of ``x``'s bytes for 32-bit
    inputs, half for 16-bit ones) plus an eighth of ``x`` for exact blocks, until the used parts are copied out;
    that is the transient peak above ``x`` and the output (the eager encoder allocates exact sizes, after a read).
    """
    _check_inputs(x, config, basis)
    start = time.perf_counter()
    ckv = _encode(x, config, basis, torch.float16, verify)
    if ckv is None:  # coefficients beyond float16: the eager encoder's rule is float32 for the whole tensor
        ckv = _encode(x, config, basis, torch.float32, verify)
    if ckv is None:  # the float64 certificate rejected a block
        return encode(x, config, basis)
    ckv.encode_seconds = time.perf_counter() - start
    return ckv


def encode_triton_deferred(
    x: torch.Tensor,
    config: CompressionConfig,
    basis: Basis,
    scope: DeferredChecks,
    *,
    residual: bool = True,
    lowrank_share: float | None = None,
    general: bool = True,
    name: str = "x",
    sizes: Callable[[int, int, int, int], None] | None = None,
    unusable: Callable[[], None] | None = None,
    one_pass: bool | None = None,
    workspace: dict | None = None,
) -> CompressedKV:
    """``encode_triton`` with no host read, inside a speculative ``kvbound._checks`` block ``scope``.

    The same kernels run (float16 coefficients, the float64 certificate); what ``encode_triton`` reads back is
    queued on ``scope`` instead:

    - NaN/Inf in ``x``: a condition, raised as ``ValueError`` naming ``name`` when the block ends;
    - coefficients beyond float16, a block the certificate rejects, a residual where ``residual`` said there
      is none, and a block for the compressed kernel's general loop where ``general`` said there is none: retry
      flags. Each means the object returned here may not be used (it would break the bound or be
      read by the wrong kernel variant); the block's end raises ``Retry`` and its forward runs again with the
      ordinary encoder. ``unusable()`` is called first when the cause is one of the first two, which the same input
      raises again every time: the caller can stop speculating for this tensor;
    - ``sizes(code_words, raw_elements, lowrank_blocks, general_blocks)``: called after a block that ended cleanly
      (``general_blocks``: blocks with a residual not coded at ``config.bits`` from a 16-byte boundary).

    The returned object keeps the encoder's workspaces whole (every block at the widest code and room for the whole
    tensor stored exactly: about 1.5x ``x``'s bytes for 16-bit inputs, 1.25x for 32-bit ones), since their used
    lengths are on the device; the exact values' workspace is zeroed past what the encoder writes, so that a check
    of the stored tensors finds only what was written. It is meant to be read by ``kvbound.attention`` inside the
    block and dropped, not kept or saved. It records ``residual``, ``lowrank_share`` and ``general`` as the
    kernel-variant facts that ``kvbound.attention`` reads without a check (``residual=True`` and ``general=True`` are
    always safe: the residual-capable kernel reads low-rank blocks too, the kernel with general runs every block;
    ``general`` is taken as True where ``config.bits`` is not a width the uniform runs decode). The stored tensors'
    NaN/Inf check is the queued condition.

    ``one_pass``: the whole encoder in one launch, one program per block (``_one_pass_kernel``) instead of five
    launches over tiles of rows, where the host's launches rather than the device's work set the pace (a small
    batch); the same coefficients, modes, widths, steps, codes and exact values, each block's codes and exact
    values at the place of its rows in the workspaces. None: ``KVBOUND_ONE_PASS_ENCODE`` (on: ``1``, ``true``,
    ``on``, ``yes``; off: ``0``, ``false``, ``off``, ``no``; unset or ``auto``, the default: one launch for a
    tensor of at most ``ONE_PASS_AUTO_ELEMENTS`` elements, :func:`one_pass_by_default`).

    ``workspace``: a dict that the caller keeps between calls, for one-launch encodes: the stored tensors (all but
    the summary) are taken from it when an earlier call left them there for the same shapes, dtypes, device, stream
    and thread, instead of being allocated (seven allocations per call), and left there for the next call. So the
    object returned is overwritten by the next encode given the same workspace: it must be read (by kernels queued
    on the same stream) before that encode is queued, as a patched layer's attention reads its K and V. One set of
    tensors is kept per workspace (the latest shapes); not used while a CUDA graph is being captured (the graph's
    own memory is taken then).
    """
    if not scope.speculative:
        raise RuntimeError("encode_triton_deferred: scope is not a speculative deferred-check block")
    _check_inputs(x, config, basis)
    general = general or not fast_width(config.bits, x.shape[-1])
    start = time.perf_counter()
    if one_pass is None:
        one_pass = one_pass_by_default(x)
    ckv, summary = _encode(x, config, basis, torch.float16, True, deferred=True, one_pass=one_pass,
                           workspace=workspace)
    # The summary is kept once; each entry reads its own elements of it. Queueing launches nothing.
    whole = scope.keep(summary)
    scope.queue(
        _EncoderLabel(name, x.shape), {},
        [(f"{name}: expected finite values, found NaN or Inf", (whole, _NONFINITE, _NONFINITE + 1))], call=False,
    )
    scope.queue_retry(f"{name}: coefficients beyond float16 or a block the certificate rejects (synchronous path)",
                      (whole, _BEYOND_FP16, _UNCERTIFIED + 1), unusable)
    if not residual:
        scope.queue_retry(f"{name}: a residual where none was forecast", (whole, _CODE_WORDS, _RAW_ELEMENTS + 1))
    elif not general:
        scope.queue_retry(f"{name}: a block for the attention kernel's general loop where none was forecast",
                          (whole, _GENERAL_BLOCKS, _GENERAL_BLOCKS + 1))  # fmt: skip
    if sizes is not None:
        scope.queue_value((whole, 0, _SUMMARY_SIZE), lambda read: sizes(
            round(read[_CODE_WORDS]), round(read[_RAW_ELEMENTS]), round(read[_LOWRANK_BLOCKS]),
            round(read[_GENERAL_BLOCKS])))
    # also under inference mode (no version counters)
    ckv._record_checked(residual, lowrank_share, held=True, general=general)
    largest_p = basis.largest_magnitude()
    if largest_p is not None:
        # What kvbound.attention may assume of the decoded values without reading them: coefficients stored in
        # float16, codes below 2**8 steps of at most 2 tau (else the certificate's retry flag: this object is not
        # used); the exact values in raw it reads itself.
        ckv._record_magnitude_but_raw(decoded_magnitude(config.rank, _FLOAT16_MAX, largest_p,
                                                        max(2 * config.tau, 2.0**-126), 0.0))
    ckv.encode_seconds = time.perf_counter() - start
    return ckv


class _EncoderLabel:
    """What a deferred encode's queued check is called in an error: formatted only then."""

    __slots__ = ("name", "shape")

    def __init__(self, name: str, shape: torch.Size) -> None:
        self.name, self.shape = name, shape

    def __str__(self) -> str:
        return f"{self.name} [{', '.join(map(str, self.shape))}] (Triton encoder)"


# The largest tensor that a deferred encode runs in one launch by default. Measured on the H200 at 3c6805b
# (benchmarks/results/h200_2026-12-05_3c6805b/one_pass_encode.csv, time per encode in a loop): one launch costs
# about 40 us + 42 us per million elements of device time, five launches about 250-300 us of host time however
# small the tensor, and about 23 us per million elements of device time. Up to 6 Mi elements (the models' K and V
# at batch 1, Enformer's K up to batch 8) one launch took at most 7 % longer per encode and 2.7x less host time;
# at 8 Mi elements (Borzoi's K at batch 4) it took 35 % longer, at 50 Mi (Borzoi's V at batch 8) 84 % longer.
ONE_PASS_AUTO_ELEMENTS = 6 * 2**20


def one_pass_by_default(x: torch.Tensor) -> bool:
    """Whether :func:`encode_triton_deferred` runs ``x``'s encode in one launch when not told:
    ``KVBOUND_ONE_PASS_ENCODE`` on or off, else (unset or ``auto``) ``x.numel() <= ONE_PASS_AUTO_ELEMENTS``."""
    setting = switch_setting("KVBOUND_ONE_PASS_ENCODE")
    if setting == "auto":
        return x.numel() <= ONE_PASS_AUTO_ELEMENTS
    return setting == "on"


def _check_inputs(x: torch.Tensor, config: CompressionConfig, basis: Basis) -> None:
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config: expected kvbound.CompressionConfig, got {type(config).__name__}")
    # NaN/Inf are flagged by the first kernel and raised after the one host read (same error as check_tensor).
    check_tensor(x, "x", ndim=4, check_finite=False)
    batch, heads, n, d = x.shape
    config.check_head_dim(d, "x")
    if basis is None:
        raise ValueError("basis: the Triton encoder needs a calibrated basis (kvbound.calibrate); got None")
    _check_basis(basis, heads, d, config.rank)
    if config.rank == 0:
        raise ValueError("config: the Triton encoder needs rank >= 1; use impl='eager' for rank 0")


def _encode(x: torch.Tensor, config: CompressionConfig, basis: Basis, coeff_dtype: torch.dtype,
            verify: bool, deferred: bool = False, one_pass: bool = False, workspace: dict | None = None):
    """One pass of the four kernels with ``coeff_dtype`` coefficients; None when the result cannot be returned
    (float16 coefficients out of range, or a block failed the certificate). ``deferred``: no host read; returns
    ``(ckv, summary)`` with whole workspaces and the device-side summary (``encode_triton_deferred``);
    ``one_pass`` (deferred only): all of it in one launch of ``_one_pass_kernel``.
    """
    if one_pass and not deferred:
        raise ValueError("one_pass: only for a deferred encode (its codes and exact values are not packed)")
    batch, heads, n, d = x.shape
    device = x.device
    r, block = config.rank, config.block_size
    nb = -(-n // block)
    bh = batch * heads
    constants = _constants(d, config)
    d_pad, r_pad, widest, wpr_pad, gamma, tau_check, max_step = constants
    tiling = _tiling(block, d_pad)
    projection = basis.projection.to(device).contiguous()
    strides = x.stride()
    ieee = coeff_dtype != torch.float16
    if one_pass:
        return _encode_one_pass(x, config, projection, coeff_dtype, tiling, constants, workspace)

    # One zeroed workspace: the summary (int64) and three per-block reductions the tiles raise with atomics (the
    # block's largest residual, float32; whether its low-rank part fails; which code widths fail, bit w for w).
    total = bh * nb
    zeroed = torch.zeros(2 * _SUMMARY_SIZE + 3 * total, dtype=torch.int32, device=device)
    summary = zeroed[:2 * _SUMMARY_SIZE].view(torch.int64)
    res_max, lowrank_fail, fail = zeroed[2 * _SUMMARY_SIZE:].view(3, total).unbind(0)
    res_max = res_max.view(torch.float32)

    coeffs = torch.empty(batch, heads, n, r, dtype=coeff_dtype, device=device)
    rows, warps, cols = tiling["coefficients"]
    _coefficients_kernel[(cdiv(n, rows), bh)](  # one program per tile of `rows` rows of one head
        x, projection, coeffs, summary, res_max, lowrank_fail, n, heads, d, r, nb, tau_check, gamma, *strides,
        BLOCK=block, ROWS=rows, COLS=cols, R_PAD=r_pad, IEEE=ieee, num_warps=warps)
    rows, warps = tiling["modes"]
    _modes_kernel[(cdiv(n, rows), bh)](
        x, projection, coeffs, res_max, lowrank_fail, fail, n, heads, d, r, nb, tau_check, max_step, gamma, *strides,
        BITS=config.bits, BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad, IEEE=ieee, num_warps=warps)

    mode = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    width = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    step = torch.empty(batch, heads, nb, dtype=torch.float32, device=device)
    offset = torch.empty(batch, heads, nb, dtype=torch.int64, device=device)
    _layout_kernel[(1,)](res_max, lowrank_fail, fail, mode, width, step, offset, summary, total, nb, n, d, max_step,
                         BITS=config.bits, BLOCK=block, CHUNK=_LAYOUT_CHUNK)

    # Workspaces sized from the shapes: every block at the widest code, and an eighth of the tensor exact.
    codes = torch.empty(bh * n * widest, dtype=torch.int32, device=device)
    # Deferred: room for every block exact, so that no count needs reading before the object can be used; zeroed,
    # since the object keeps the whole workspace as its `raw` and a check of its stored tensors reads all of it
    # (kvbound.attention checks them whenever it runs as a dispatched op: under a profiler, torch.compile or a
    # dispatch mode). Left as allocated, the unused part would hold whatever the allocator's memory held before,
    # NaN bit patterns included.
    raw_size = bh * n * d if deferred else max(block * d, bh * n * d // _RAW_WORKSPACE_FRACTION)
    raw = (torch.zeros if deferred else torch.empty)(raw_size, dtype=x.dtype, device=device)

    def write_and_certify(codes, raw, any_bad):
        rows, warps = tiling["write"]
        _write_kernel[(cdiv(n, rows), bh)](
            x, projection, coeffs, mode, width, step, offset, codes, raw, n, heads, d, r, nb, codes.numel(),
            raw.numel(), *strides, BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad,
            WPR_PAD=wpr_pad, IEEE=ieee, num_warps=warps)
        if verify:
            _launch_certify(x, projection, coeffs, mode, width, step, offset, codes, raw, None, any_bad, config)

    write_and_certify(codes, raw, summary[_UNCERTIFIED:])
    if deferred:
        ckv = CompressedKV(
            shape=(batch, heads, n, d), dtype=x.dtype, config=config, coeffs=coeffs, basis=projection, mode=mode,
            scale=step, bits=width, offset=offset, codes=codes, raw=raw, shared_basis=True,
        )
        return ckv, summary
    # The one host read: the summary, which ends with the number of low-rank blocks, and x's extremes (a bound on
    # the decoded values' magnitudes, which kvbound.attention checks against float32's range).
    peak = torch.linalg.vector_norm(x, float("inf")).reshape(1)  # exact: one of x's magnitudes
    read = torch.cat([summary.to(torch.float64), peak.to(torch.float64)]).tolist()
    code_words, raw_elements, nonfinite, beyond_fp16, uncertified, lowrank, general = (
        int(v) for v in read[:_SUMMARY_SIZE]
    )
    largest = read[_SUMMARY_SIZE]
    if nonfinite:
        check_finite_values(x, "x")
    if beyond_fp16 and not ieee:
        return None
    if raw_elements > raw.numel():  # more exact blocks than the workspace holds: write again at the exact size
        codes = torch.empty(code_words, dtype=torch.int32, device=device)
        raw = torch.empty(raw_elements, dtype=x.dtype, device=device)
        any_bad = torch.zeros(1, dtype=torch.int64, device=device)
        write_and_certify(codes, raw, any_bad)
        uncertified = int(any_bad.item()) if verify else 0
    else:
        # Copy out what was written so that the workspaces go back to the allocator.
        codes = codes[:code_words].clone() if code_words < codes.numel() else codes
        raw = raw[:raw_elements].clone()
    if uncertified:
        return None
    ckv = CompressedKV(
        shape=(batch, heads, n, d), dtype=x.dtype, config=config, coeffs=coeffs, basis=projection, mode=mode,
        scale=step, bits=width, offset=offset, codes=codes, raw=raw, shared_basis=True,
    )
    if not beyond_fp16:
        # Every coefficient is finite (the flag is raised by NaN too), hence so is the basis (each of its elements
        # enters some coefficient, and 0 * Inf is NaN); steps come from finite residuals, raw values from x. Some
        # block holds a residual exactly when there are codes or raw values. kvbound.attention reuses this record.
        residual = code_words > 0 or raw_elements > 0
        ckv._record_checked(residual, lowrank / max(1, mode.numel()),
                            general=general_loop(general, residual, config.bits, d))  # fmt: skip
        if verify:  # every decoded element is within tau of x's
            ckv._record_magnitude(largest + config.tau)
    return ckv


def _one_pass_buffers(x, config, coeff_dtype, widest):
    """The stored tensors a one-launch encode writes: ``(coeffs, mode, width, step, offset, codes, raw)``."""
    batch, heads, n, d = x.shape
    device = x.device
    nb, bh = -(-n // config.block_size), batch * heads
    return (
        torch.empty(batch, heads, n, config.rank, dtype=coeff_dtype, device=device),
        torch.empty(batch, heads, nb, dtype=torch.int8, device=device),
        torch.empty(batch, heads, nb, dtype=torch.int8, device=device),
        torch.empty(batch, heads, nb, dtype=torch.float32, device=device),
        torch.empty(batch, heads, nb, dtype=torch.int64, device=device),
        torch.empty(bh * n * widest, dtype=torch.int32, device=device),
        torch.empty(bh * n * d, dtype=x.dtype, device=device),  # every element written (x or zero)
    )


def _encode_one_pass(x, config, projection, coeff_dtype, tiling, constants, workspace=None):
    """``_encode(..., deferred=True)`` in one launch (``_one_pass_kernel``, one program per block): the same
    stored values, each block's codes and exact values at the fixed place of its rows instead of packed one after
    the other. Returns ``(ckv, summary)``. ``workspace``: see :func:`encode_triton_deferred`."""
    batch, heads, n, d = x.shape
    device = x.device
    r, block = config.rank, config.block_size
    nb, bh = -(-n // block), batch * heads
    d_pad, r_pad, widest, wpr_pad, gamma, tau_check, max_step = constants
    summary = torch.zeros(_SUMMARY_SIZE, dtype=torch.int64, device=device)
    if workspace is None or _stream_capturing():
        buffers = _one_pass_buffers(x, config, coeff_dtype, widest)
    else:
        # Every element that is read is written by the launch below (the code words a block does not use are
        # neither), and the kernels that read them (the layer's attention and its checks) are queued on this
        # stream before the next encode that reuses them.
        stream = torch._C._cuda_getCurrentStream(device.index)[0] if device.type == "cuda" else 0
        key = (tuple(x.shape), x.dtype, coeff_dtype, r, block, widest, device, stream, threading.get_ident())
        buffers = workspace.get(key)
        if buffers is None:
            workspace.clear()  # one set per workspace: the latest shapes
            buffers = workspace[key] = _one_pass_buffers(x, config, coeff_dtype, widest)
    coeffs, mode, width, step, offset, codes, raw = buffers
    c_rows, _, cols = tiling["coefficients"]
    (warps,) = tiling["one_pass"]
    _one_pass_kernel[(nb, bh)](
        x, projection, coeffs, mode, width, step, offset, codes, raw, summary, n, heads, d, r, nb, tau_check, max_step,
        gamma, config.tau, (r + 2) * 2.0**-52, codes.numel(), raw.numel(), *x.stride(),
        BITS=config.bits, BLOCK=block, R_CONST=r, C_ROWS=c_rows, COLS=cols, M_ROWS=tiling["modes"][0],
        W_ROWS=tiling["write"][0], V_ROWS=tiling["certify"][0], D_PAD=d_pad, R_PAD=r_pad, WIDEST=widest,
        WPR_PAD=wpr_pad, IEEE=coeff_dtype != torch.float16,
        num_warps=warps,
    )  # fmt: skip
    ckv = CompressedKV(
        shape=(batch, heads, n, d), dtype=x.dtype, config=config, coeffs=coeffs, basis=projection, mode=mode,
        scale=step, bits=width, offset=offset, codes=codes, raw=raw, shared_basis=True,
    )
    return ckv, summary


# Mode numbers the kernels above write, spelled out for readers of the format.
assert (MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW) == (0, 1, 2, 3)
