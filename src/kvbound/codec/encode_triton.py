"""Triton encoder of the compressed K/V format, for a calibrated (shared) basis.

Passes over ``x``, one program per block of ``block_size`` rows of one head:

1. ``_coefficients_kernel``: ``C = x @ P^T`` in float32, stored as float16 (float32 when a coefficient exceeds 2**15,
   as the eager encoder does: the kernel flags it and the host encodes again with float32); also flags NaN/Inf.
2. ``_modes_kernel``: rebuilds ``L = C @ P`` from the stored coefficients, takes the block's largest residual, and
   picks the first storage that passes an in-kernel version of the certificate (low-rank only, ``bits``-bit codes,
   wider codes, exact): mode, code width and step per block. ``_layout_kernel`` (one program) turns widths into
   offsets and totals (a running cumsum).
3. ``_write_kernel``: writes the packed words (loading the columns of each word directly, so no code tile is ever
   written out) into a workspace sized from the shapes, copies exact blocks, and zeroes their coefficients.

The in-kernel check uses float32 arithmetic with a generous rounding allowance, so it almost never accepts what the
exact check rejects; the float64 certificate of ``kvbound.codec.eager.uncertified_blocks`` then runs on the stored
numbers in a fourth kernel (``_certify_kernel``), and if a block fails it, the tensor is re-encoded by the eager
encoder. So the returned object carries the same guarantee as
the eager one: ``|x - decompress()| <= tau`` on every element.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kvbound._checks import DeferredChecks
from kvbound._validate import check_finite_values, check_tensor
from kvbound.codec.basis import Basis
from kvbound.codec.eager import _check_basis, encode, promotion_widths
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, CompressedKV, words_per_row
from kvbound.config import CompressionConfig

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
def _load_rows(x_ptr, row0, rows_left, D, stride_n, stride_d, ROWS: tl.constexpr, D_PAD: tl.constexpr):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    mask = (rows < rows_left)[:, None] & (cols < D)[None, :]
    ptrs = x_ptr + (row0 + rows)[:, None].to(tl.int64) * stride_n + cols[None, :] * stride_d
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), mask


@triton.jit
def _lowrank_rows(c_ptr, p_tile, row0, rows_left, R, ROWS: tl.constexpr, R_PAD: tl.constexpr,
                  IEEE: tl.constexpr):
    """L = C[rows] @ P and |C| @ |P| for ROWS rows of one head (C row-major [N, R])."""
    rows = tl.arange(0, ROWS)
    ranks = tl.arange(0, R_PAD)
    mask = (rows < rows_left)[:, None] & (ranks < R)[None, :]
    c = tl.load(c_ptr + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], mask=mask, other=0.0)
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
def _coefficients_kernel(
    x_ptr, p_ptr, c_ptr, summary_ptr, N, H, D, R,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
):
    """C = x @ P^T, stored in C's dtype; flags non-finite x (summary[2]) and |C| > 2**15 (summary[3])."""
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_head = x_ptr + b * stride_xb + h * stride_xh
    ranks = tl.arange(0, R_PAD)
    cols = tl.arange(0, D_PAD)
    p = tl.load(p_ptr + h * R * D + ranks[None, :] * D + cols[:, None],
                mask=(ranks < R)[None, :] & (cols < D)[:, None], other=0.0).to(tl.float32)  # P^T [D_PAD, R_PAD]
    nonfinite = 0
    beyond_fp16 = 0
    for t in range(0, BLOCK, ROWS):
        row0 = k * BLOCK + t
        x, x_mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, D_PAD)
        c = tl.dot(x, p, input_precision="ieee")
        rows = tl.arange(0, ROWS)
        mask = ((row0 + rows) < N)[:, None] & (ranks < R)[None, :]
        tl.store(c_ptr + bh * N * R + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :],
                 c.to(c_ptr.dtype.element_ty), mask=mask)
        # NaN fails every comparison, so both flags catch it.
        nonfinite = nonfinite | tl.max(tl.max((x_mask & ~(tl.abs(x) <= _FLOAT32_MAX)).to(tl.int32), 1), 0)
        beyond_fp16 = beyond_fp16 | tl.max(tl.max((mask & ~(tl.abs(c) <= _COEFF_FP16_LIMIT_C)).to(tl.int32), 1), 0)
    tl.atomic_max(summary_ptr + 2, nonfinite.to(tl.int64), mask=nonfinite > 0)
    tl.atomic_max(summary_ptr + 3, beyond_fp16.to(tl.int64), mask=beyond_fp16 > 0)


@triton.jit
def _modes_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, N, H, D, R, NB, tau_check, max_step, gamma,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_head = x_ptr + b * stride_xb + h * stride_xh
    c_head = c_ptr + bh * N * R
    ranks = tl.arange(0, R_PAD)
    cols = tl.arange(0, D_PAD)
    p = tl.load(p_ptr + h * R * D + ranks[:, None] * D + cols[None, :],
                mask=(ranks < R)[:, None] & (cols < D)[None, :], other=0.0)  # [R_PAD, D_PAD], stored dtype
    p = p.to(c_ptr.dtype.element_ty)

    # Largest residual of the block and whether the low-rank part alone certifies it.
    res_max = 0.0
    lowrank_fail = 0
    for t in range(0, BLOCK, ROWS):
        row0 = k * BLOCK + t
        x, mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, D_PAD)
        low, low_abs = _lowrank_rows(c_head, p, row0, N - row0, R, ROWS, R_PAD, IEEE)
        res_max = tl.maximum(res_max, tl.max(tl.max(tl.where(mask, tl.abs(x - low), 0.0), 1), 0))
        err = tl.abs(x - low) + 2.0 * _ulp(low) + gamma * low_abs
        lowrank_fail = lowrank_fail | tl.max(tl.max((mask & ~(err <= tau_check)).to(tl.int32), 1), 0)

    # Which code widths certify the block: bit w of `fail` is set when width w does not.
    fail = 0
    for t in range(0, BLOCK, ROWS):
        row0 = k * BLOCK + t
        x, mask = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, D_PAD)
        low, low_abs = _lowrank_rows(c_head, p, row0, N - row0, R, ROWS, R_PAD, IEEE)
        for w in tl.static_range(2, 9):
            if (w == BITS) or (w > BITS and w >= 4 and w != 7):
                qmax = (1 << (w - 1)) - 1
                step = tl.maximum(tl.minimum(res_max / qmax, max_step), 1.1754943508222875e-38)
                q = tl.minimum(tl.maximum(tl.floor((x - low) / step + 0.5), -qmax - 1.0), qmax * 1.0)
                y = low + q * step
                err = tl.abs(x - y) + 2.0 * _ulp(y) + gamma * (low_abs + tl.abs(q) * step)
                bad = tl.max(tl.max((mask & ~(err <= tau_check)).to(tl.int32), 1), 0)
                fail = fail | (bad << w)

    chosen = 0
    for w in tl.static_range(2, 9):
        if (w == BITS) or (w > BITS and w >= 4 and w != 7):
            ok = ((fail >> w) & 1) == 0
            chosen = tl.where((chosen == 0) & ok, w, chosen)
    mode = tl.where(lowrank_fail == 0, 0, tl.where(chosen == BITS, 1, tl.where(chosen > 0, 2, 3)))
    width = tl.where(lowrank_fail == 0, 0, chosen)
    qmax_chosen = tl.maximum((1 << (tl.maximum(width, 1) - 1)) - 1, 1)
    step = tl.maximum(tl.minimum(res_max / qmax_chosen, max_step), 1.1754943508222875e-38)
    step = tl.where(width > 0, step, 0.0)
    tl.store(mode_ptr + bh * NB + k, mode.to(tl.int8))
    tl.store(width_ptr + bh * NB + k, width.to(tl.int8))
    tl.store(step_ptr + bh * NB + k, step)


@triton.jit
def _layout_kernel(
    mode_ptr, width_ptr, offset_ptr, summary_ptr, TOTAL, NB, N, D,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Offsets of every block in ``codes``/``raw`` (block order b, h, k) and both totals (summary[0], summary[1]).

    One program scans all blocks CHUNK at a time: the running totals carry from chunk to chunk."""
    code_total = tl.full((), 0, tl.int64)
    raw_total = tl.full((), 0, tl.int64)
    for start in range(0, TOTAL, CHUNK):
        index = start + tl.arange(0, CHUNK)
        ok = index < TOTAL
        mode = tl.load(mode_ptr + index, mask=ok, other=0).to(tl.int32)
        width = tl.load(width_ptr + index, mask=ok, other=0).to(tl.int32)
        rows = tl.minimum(N - (index % NB) * BLOCK, BLOCK).to(tl.int64)  # the last block may be short
        per_word = 32 // tl.maximum(width, 1)
        code_words = tl.where(width > 0, rows * ((D + per_word - 1) // per_word), 0)
        raw_elems = tl.where(mode == 3, rows * D, 0)
        code_end = tl.cumsum(code_words, 0) + code_total
        raw_end = tl.cumsum(raw_elems, 0) + raw_total
        offset = tl.where(mode == 3, raw_end - raw_elems, tl.where(width > 0, code_end - code_words, -1))
        tl.store(offset_ptr + index, offset, mask=ok)
        code_total += tl.sum(code_words, 0)
        raw_total += tl.sum(raw_elems, 0)
    tl.store(summary_ptr, code_total)
    tl.store(summary_ptr + 1, raw_total)


@triton.jit
def _write_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, N, H, D, R, NB,
    codes_capacity, raw_capacity,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, WPR_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_head = x_ptr + b * stride_xb + h * stride_xh
    c_head = c_ptr + bh * N * R
    mode = tl.load(mode_ptr + bh * NB + k).to(tl.int32)
    width = tl.load(width_ptr + bh * NB + k).to(tl.int32)
    step = tl.load(step_ptr + bh * NB + k)
    offset = tl.load(offset_ptr + bh * NB + k)
    rows = tl.arange(0, ROWS)
    ranks = tl.arange(0, R_PAD)
    if width > 0:
        per_word = 32 // width
        wpr = (D + per_word - 1) // per_word
        qmax = (1 << (width - 1)) - 1
        words = tl.arange(0, WPR_PAD)
        for t in range(0, BLOCK, ROWS):
            row0 = k * BLOCK + t
            row_ok = (row0 + rows) < N
            c = tl.load(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :],
                        mask=row_ok[:, None] & (ranks < R)[None, :], other=0.0)
            packed = tl.zeros((ROWS, WPR_PAD), dtype=tl.int32)
            for i in range(0, per_word):
                col = words * per_word + i
                col_ok = (col < D) & (words < wpr)
                x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + col[None, :] * stride_xd,
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                p = tl.load(p_ptr + h * R * D + ranks[:, None] * D + col[None, :],
                            mask=(ranks < R)[:, None] & col_ok[None, :], other=0.0).to(c_ptr.dtype.element_ty)
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
        for t in range(0, BLOCK, ROWS):
            row0 = k * BLOCK + t
            row_ok = (row0 + rows) < N
            mask = row_ok[:, None] & (cols < D)[None, :]
            x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + cols[None, :] * stride_xd,
                        mask=mask, other=0.0)
            dest = offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :]
            tl.store(raw_ptr + dest, x, mask=mask & (dest < raw_capacity))
            zero = tl.zeros((ROWS, R_PAD), dtype=c_ptr.dtype.element_ty)
            tl.store(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], zero,
                     mask=row_ok[:, None] & (ranks < R)[None, :])


@triton.jit
def _certify_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, bad_ptr, any_bad_ptr,
    N, H, D, R, NB, tau, gamma, codes_capacity, raw_capacity,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
):
    """The float64 certificate of ``uncertified_blocks`` for one block, evaluated in-kernel: per block in ``bad``,
    and any failure raises ``any_bad`` to 1. Reads stay below the capacities (a block beyond them fails)."""
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_head = x_ptr + b * stride_xb + h * stride_xh
    c_head = c_ptr + bh * N * R
    mode = tl.load(mode_ptr + bh * NB + k).to(tl.int32)
    width = tl.load(width_ptr + bh * NB + k).to(tl.int32)
    step = tl.load(step_ptr + bh * NB + k).to(tl.float64)
    offset = tl.load(offset_ptr + bh * NB + k)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, D_PAD)
    bad = 0
    for t in range(0, BLOCK, ROWS):
        row0 = k * BLOCK + t
        row_ok = (row0 + rows) < N
        mask = row_ok[:, None] & (cols < D)[None, :]
        x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + cols[None, :] * stride_xd,
                    mask=mask, other=0.0)
        if mode == 3:
            source = offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :]
            inside = source < raw_capacity
            stored = tl.load(raw_ptr + source, mask=mask & inside, other=0.0)
            bad = bad | tl.max(tl.max((mask & ((stored != x) | ~inside)).to(tl.int32), 1), 0)
        else:
            x64 = x.to(tl.float64)
            low = tl.zeros((ROWS, D_PAD), dtype=tl.float64)
            low_abs = tl.zeros((ROWS, D_PAD), dtype=tl.float64)
            for r in range(0, R):
                c = tl.load(c_head + (row0 + rows).to(tl.int64) * R + r, mask=row_ok, other=0.0).to(tl.float64)
                p = tl.load(p_ptr + h * R * D + r * D + cols, mask=cols < D, other=0.0).to(tl.float64)
                low += c[:, None] * p[None, :]
                low_abs += tl.abs(c)[:, None] * tl.abs(p)[None, :]
            y = low
            if width > 0:
                per_word = 32 // width
                wpr = (D + per_word - 1) // per_word
                source = offset + (t + rows)[:, None].to(tl.int64) * wpr + (cols // per_word)[None, :]
                inside = source < codes_capacity
                word = tl.load(codes_ptr + source, mask=mask & inside, other=0)
                bad = bad | tl.max(tl.max((mask & ~inside).to(tl.int32), 1), 0)
                u = (word >> ((cols % per_word) * width)[None, :]) & ((1 << width) - 1)
                qs = (u - (1 << (width - 1))).to(tl.float64) * step
                y = low + qs
                low_abs = low_abs + tl.abs(qs)
            y32 = y.to(tl.float32)
            err = tl.abs(x64 - y32.to(tl.float64)) + _ulp(y32).to(tl.float64) + gamma * low_abs
            bad = bad | tl.max(tl.max((mask & ~(err <= tau)).to(tl.int32), 1), 0)
    tl.store(bad_ptr + bh * NB + k, bad.to(tl.int8))
    tl.atomic_max(any_bad_ptr, bad.to(tl.int64), mask=bad > 0)


def certify_triton(ckv: CompressedKV, x: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, NB]: blocks of ``ckv`` (shared basis) that fail the float64 certificate against ``x``.

    The same check as ``kvbound.codec.eager.uncertified_blocks``, one program per block, no float64 tensor in memory.
    """
    if not ckv.shared_basis:
        raise ValueError("ckv: certify_triton reads a shared basis; use uncertified_blocks for per-block bases")
    if tuple(x.shape) != ckv.shape:
        raise ValueError(f"x: expected shape {ckv.shape}, got {tuple(x.shape)}")
    bad = torch.empty(ckv.shape[:2] + (ckv.num_blocks,), dtype=torch.int8, device=ckv.device)
    any_bad = torch.zeros(1, dtype=torch.int64, device=ckv.device)
    # an empty coefficient tensor (rank 0) still needs a valid pointer
    coeffs = ckv.coeffs if ckv.coeffs.numel() else ckv.scale
    _launch_certify(x, ckv.basis, coeffs, ckv.mode, ckv.bits, ckv.scale, ckv.offset, ckv.codes, ckv.raw, bad, any_bad,
                    ckv.config)
    return bad.bool()


def _launch_certify(x, projection, coeffs, mode, width, step, offset, codes, raw, bad, any_bad, config) -> None:
    batch, heads, n, d = x.shape
    nb, r, block = mode.shape[-1], projection.shape[1], config.block_size
    d_pad = max(16, triton.next_power_of_2(d))
    _certify_kernel[(nb, batch * heads)](
        x, projection, coeffs, mode, width, step, offset, codes, raw, bad, any_bad, n, heads, d, r, nb,
        config.tau, (r + 2) * 2.0**-52, codes.numel(), raw.numel(), *x.stride(),
        BLOCK=block, ROWS=_certify_rows_per_tile(block, d_pad), D_PAD=d_pad,
    )


def _rows_per_tile(block: int, d_pad: int) -> int:
    # Keep a [ROWS, D_PAD] float32 tile around 8K elements.
    return max(16, min(block, 8192 // d_pad))


def _certify_rows_per_tile(block: int, d_pad: int) -> int:
    # The certificate holds three float64 [ROWS, D_PAD] tiles; 2K elements each compile for sm_90 with no spills
    # (Triton 3.6: 8K elements spilled 1.5 KB per thread). The verdict per element does not depend on the tiling.
    return max(16, min(block, 2048 // d_pad))


# summary[i]: what the single host read of an encode returns (int64 each).
_CODE_WORDS, _RAW_ELEMENTS, _NONFINITE, _BEYOND_FP16, _UNCERTIFIED = range(5)
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
    name: str = "x",
    sizes: Callable[[int, int, int], None] | None = None,
) -> CompressedKV:
    """``encode_triton`` with no host read, inside a speculative ``kvbound._checks`` block ``scope``.

    The same kernels run (float16 coefficients, the float64 certificate); what ``encode_triton`` reads back is
    queued on ``scope`` instead:

    - NaN/Inf in ``x``: a condition, raised as ``ValueError`` naming ``name`` when the block ends;
    - coefficients beyond float16, a block the certificate rejects, and a residual where ``residual`` said there
      is none: retry flags. Each means the object returned here may not be used (it would break the bound or be
      read by the wrong kernel variant); the block's end raises ``Retry`` and its forward runs again with the
      ordinary encoder;
    - ``sizes(code_words, raw_elements, lowrank_blocks)``: called after a block that ended cleanly.

    The returned object keeps the encoder's workspaces whole (every block at the widest code and room for the whole
    tensor stored exactly: about 1.5x ``x``'s bytes for 16-bit inputs, 1.25x for 32-bit ones), since their used
    lengths are on the device; it is meant to be read by ``kvbound.attention`` inside the block and dropped, not
    kept or saved. It records ``residual`` and ``lowrank_share`` as the kernel-variant facts that
    ``kvbound.attention`` reads without a check (``residual=True`` is always safe: the residual-capable kernel reads
    low-rank blocks too). The stored tensors' NaN/Inf check is the queued condition.
    """
    if not scope.speculative:
        raise RuntimeError("encode_triton_deferred: scope is not a speculative deferred-check block")
    _check_inputs(x, config, basis)
    start = time.perf_counter()
    ckv, summary, lowrank = _encode(x, config, basis, torch.float16, True, deferred=True)
    scope.queue(
        f"{name} [{', '.join(map(str, x.shape))}] (Triton encoder)", {},
        [(f"{name}: expected finite values, found NaN or Inf", summary[_NONFINITE])],
    )
    flag = summary[_BEYOND_FP16] + summary[_UNCERTIFIED]
    if not residual:
        flag = flag + summary[_CODE_WORDS] + summary[_RAW_ELEMENTS]
    scope.queue_retry(f"{name}: the Triton encoder's result needs the synchronous path", flag)
    if sizes is not None:
        scope.queue_value(torch.cat([summary[:_NONFINITE], lowrank.view(1)]),
                          lambda read: sizes(*(round(value) for value in read)))
    ckv._record_checked(residual, lowrank_share)
    ckv.encode_seconds = time.perf_counter() - start
    return ckv


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
            verify: bool, deferred: bool = False):
    """One pass of the four kernels with ``coeff_dtype`` coefficients; None when the result cannot be returned
    (float16 coefficients out of range, or a block failed the certificate). ``deferred``: no host read; returns
    ``(ckv, summary, lowrank_blocks)`` with whole workspaces and the device-side summary (``encode_triton_deferred``).
    """
    batch, heads, n, d = x.shape
    device = x.device
    r, block, tau = config.rank, config.block_size, config.tau
    nb = -(-n // block)
    bh = batch * heads
    d_pad = max(16, triton.next_power_of_2(d))
    r_pad = max(16, triton.next_power_of_2(r))
    rows = _rows_per_tile(block, d_pad)
    projection = basis.projection.to(device).contiguous()
    grid = (nb, bh)
    strides = x.stride()
    ieee = coeff_dtype != torch.float16

    summary = torch.zeros(5, dtype=torch.int64, device=device)
    coeffs = torch.empty(batch, heads, n, r, dtype=coeff_dtype, device=device)
    _coefficients_kernel[grid](x, projection, coeffs, summary, n, heads, d, r, *strides,
                               BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad)

    mode = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    width = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    step = torch.empty(batch, heads, nb, dtype=torch.float32, device=device)
    # float32 evaluation: a dot of r + 1 terms and two roundings, with a factor 4 to spare.
    gamma = 4.0 * (r + 3) * 2.0**-24
    _modes_kernel[grid](x, projection, coeffs, mode, width, step, n, heads, d, r, nb,
                        tau * (1.0 - 2.0**-16), 2.0 * tau * _STEP_MARGIN, gamma, *strides,
                        BITS=config.bits, BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad, IEEE=ieee)

    offset = torch.empty(batch, heads, nb, dtype=torch.int64, device=device)
    _layout_kernel[(1,)](mode, width, offset, summary, bh * nb, nb, n, d, BLOCK=block, CHUNK=_LAYOUT_CHUNK)

    # Workspaces sized from the shapes: every block at the widest code, and an eighth of the tensor exact.
    widest = max(words_per_row(w, d) for w in promotion_widths(config.bits))
    codes = torch.empty(bh * n * widest, dtype=torch.int32, device=device)
    # Deferred: room for every block exact, so that no count needs reading before the object can be used.
    raw_size = bh * n * d if deferred else max(block * d, bh * n * d // _RAW_WORKSPACE_FRACTION)
    raw = torch.empty(raw_size, dtype=x.dtype, device=device)
    bad = torch.empty(batch, heads, nb, dtype=torch.int8, device=device) if verify else None

    def write_and_certify(codes, raw, any_bad):
        _write_kernel[grid](x, projection, coeffs, mode, width, step, offset, codes, raw, n, heads, d, r, nb,
                            codes.numel(), raw.numel(), *strides,
                            BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad,
                            WPR_PAD=max(16, triton.next_power_of_2(widest)), IEEE=ieee)
        if verify:
            _launch_certify(x, projection, coeffs, mode, width, step, offset, codes, raw, bad, any_bad, config)

    write_and_certify(codes, raw, summary[_UNCERTIFIED:])
    if deferred:
        ckv = CompressedKV(
            shape=(batch, heads, n, d), dtype=x.dtype, config=config, coeffs=coeffs, basis=projection, mode=mode,
            scale=step, bits=width, offset=offset, codes=codes, raw=raw, shared_basis=True,
        )
        return ckv, summary, (mode == MODE_LOWRANK).sum()
    # The one host read: the summary and the number of low-rank blocks.
    read = torch.cat([summary, (mode == MODE_LOWRANK).sum().view(1)]).tolist()
    code_words, raw_elements, nonfinite, beyond_fp16, uncertified, lowrank = read
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
        ckv._record_checked(code_words > 0 or raw_elements > 0, lowrank / max(1, mode.numel()))
    return ckv


# Mode numbers the kernels above write, spelled out for readers of the format.
assert (MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW) == (0, 1, 2, 3)
