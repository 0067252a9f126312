"""Triton encoder of the compressed K/V format, for a calibrated (shared) basis.

Three passes over ``x``, one program per block of ``block_size`` rows of one head:

1. ``_coefficients_kernel``: ``C = x @ P^T`` in float32; the host rounds C to the stored dtype (float16 unless a
   coefficient exceeds 2**15, as the eager encoder does).
2. ``_modes_kernel``: rebuilds ``L = C @ P`` from the stored coefficients, takes the block's largest residual, and
   picks the first storage that passes an in-kernel version of the certificate (low-rank only, ``bits``-bit codes,
   wider codes, exact): mode, code width and step per block. The host turns widths into offsets (a cumsum).
3. ``_write_kernel``: writes the packed words (loading the columns of each word directly, so no code tile is ever
   written out), copies exact blocks, and zeroes the coefficients of exact blocks.

The in-kernel check uses float32 arithmetic with a generous rounding allowance, so it almost never accepts what the
exact check rejects; the float64 certificate of ``kvbound.codec.eager.uncertified_blocks`` then runs on the stored
numbers in a fourth kernel (``_certify_kernel``), and if a block fails it, the tensor is re-encoded by the eager
encoder. So the returned object carries the same guarantee as
the eager one: ``|x - decompress()| <= tau`` on every element.
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from kvbound._validate import check_tensor
from kvbound.codec.basis import Basis
from kvbound.codec.eager import _check_basis, encode, promotion_widths
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, CompressedKV, words_per_row
from kvbound.config import CompressionConfig

__all__ = ["certify_triton", "encode_triton"]

_STEP_MARGIN = 1.0 - 2.0**-10
_COEFF_FP16_LIMIT = 2.0**15


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
    x_ptr, p_ptr, c_ptr, N, H, D, R,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr,
):
    k = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    x_head = x_ptr + b * stride_xb + h * stride_xh
    ranks = tl.arange(0, R_PAD)
    cols = tl.arange(0, D_PAD)
    p = tl.load(p_ptr + h * R * D + ranks[None, :] * D + cols[:, None],
                mask=(ranks < R)[None, :] & (cols < D)[:, None], other=0.0).to(tl.float32)  # P^T [D_PAD, R_PAD]
    for t in range(0, BLOCK, ROWS):
        row0 = k * BLOCK + t
        x, _ = _load_rows(x_head, row0, N - row0, D, stride_xn, stride_xd, ROWS, D_PAD)
        c = tl.dot(x, p, input_precision="ieee")
        rows = tl.arange(0, ROWS)
        mask = ((row0 + rows) < N)[:, None] & (ranks < R)[None, :]
        tl.store(c_ptr + bh * N * R + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], c, mask=mask)


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
def _write_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, N, H, D, R, NB,
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
            tl.store(codes_ptr + dest, packed, mask=row_ok[:, None] & (words < wpr)[None, :])
    if mode == 3:
        cols = tl.arange(0, D_PAD)
        for t in range(0, BLOCK, ROWS):
            row0 = k * BLOCK + t
            row_ok = (row0 + rows) < N
            mask = row_ok[:, None] & (cols < D)[None, :]
            x = tl.load(x_head + (row0 + rows)[:, None].to(tl.int64) * stride_xn + cols[None, :] * stride_xd,
                        mask=mask, other=0.0)
            tl.store(raw_ptr + offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :], x, mask=mask)
            zero = tl.zeros((ROWS, R_PAD), dtype=c_ptr.dtype.element_ty)
            tl.store(c_head + (row0 + rows)[:, None].to(tl.int64) * R + ranks[None, :], zero,
                     mask=row_ok[:, None] & (ranks < R)[None, :])


@triton.jit
def _certify_kernel(
    x_ptr, p_ptr, c_ptr, mode_ptr, width_ptr, step_ptr, offset_ptr, codes_ptr, raw_ptr, bad_ptr,
    N, H, D, R, NB, tau, gamma,
    stride_xb, stride_xh, stride_xn, stride_xd,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, D_PAD: tl.constexpr,
):
    """The float64 certificate of ``uncertified_blocks`` for one block, evaluated in-kernel."""
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
            stored = tl.load(raw_ptr + offset + (t + rows)[:, None].to(tl.int64) * D + cols[None, :], mask=mask,
                             other=0.0)
            bad = bad | tl.max(tl.max((mask & (stored != x)).to(tl.int32), 1), 0)
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
                word_index = (t + rows)[:, None].to(tl.int64) * wpr + (cols // per_word)[None, :]
                word = tl.load(codes_ptr + offset + word_index, mask=mask, other=0)
                u = (word >> ((cols % per_word) * width)[None, :]) & ((1 << width) - 1)
                qs = (u - (1 << (width - 1))).to(tl.float64) * step
                y = low + qs
                low_abs = low_abs + tl.abs(qs)
            y32 = y.to(tl.float32)
            err = tl.abs(x64 - y32.to(tl.float64)) + _ulp(y32).to(tl.float64) + gamma * low_abs
            bad = bad | tl.max(tl.max((mask & ~(err <= tau)).to(tl.int32), 1), 0)
    tl.store(bad_ptr + bh * NB + k, bad.to(tl.int8))


def certify_triton(ckv: CompressedKV, x: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, NB]: blocks of ``ckv`` (shared basis) that fail the float64 certificate against ``x``.

    The same check as ``kvbound.codec.eager.uncertified_blocks``, one program per block, no float64 tensor in memory.
    """
    if not ckv.shared_basis:
        raise ValueError("ckv: certify_triton reads a shared basis; use uncertified_blocks for per-block bases")
    if tuple(x.shape) != ckv.shape:
        raise ValueError(f"x: expected shape {ckv.shape}, got {tuple(x.shape)}")
    batch, heads, n, d = ckv.shape
    nb, r, block = ckv.num_blocks, ckv.rank, ckv.config.block_size
    d_pad = max(16, triton.next_power_of_2(d))
    bad = torch.empty(batch, heads, nb, dtype=torch.int8, device=ckv.device)
    # an empty coefficient tensor (rank 0) still needs a valid pointer
    coeffs = ckv.coeffs if ckv.coeffs.numel() else ckv.scale
    _certify_kernel[(nb, batch * heads)](
        x, ckv.basis, coeffs, ckv.mode, ckv.bits, ckv.scale, ckv.offset, ckv.codes, ckv.raw, bad, n, heads, d, r, nb,
        ckv.config.tau, (r + 2) * 2.0**-52, *x.stride(), BLOCK=block, ROWS=_rows_per_tile(block, d_pad), D_PAD=d_pad,
    )
    return bad.bool()


def _rows_per_tile(block: int, d_pad: int) -> int:
    # Keep a [ROWS, D_PAD] float32 tile around 8K elements.
    return max(16, min(block, 8192 // d_pad))


def encode_triton(x: torch.Tensor, config: CompressionConfig, basis: Basis, *, verify: bool = True) -> CompressedKV:
    """Compress ``x`` [B, H, N, D] with a calibrated ``basis``; same format and guarantee as the eager encoder.

    With ``verify=False`` the float64 certificate is skipped and the bound rests on the in-kernel check alone. That
    check is conservative by construction: with u = 2**-24, the float32 value it tests differs from the exact
    ``L + q s`` by at most ``r u sum|c p| + u |q s| + ulp/2`` (float16 products are exact; tensor-core accumulation
    is allowed twice the error of round-to-nearest), and the value ``decompress`` returns differs from the exact one
    by at most one more half ulp; the check charges ``2 ulp + 4 (r + 3) u (sum|c p| + |q s|)`` and tests against
    ``tau (1 - 2**-16)``. The default keeps the exact float64 certificate on the stored numbers.
    """
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config: expected kvbound.CompressionConfig, got {type(config).__name__}")
    check_tensor(x, "x", ndim=4)
    batch, heads, n, d = x.shape
    config.check_head_dim(d, "x")
    if basis is None:
        raise ValueError("basis: the Triton encoder needs a calibrated basis (kvbound.calibrate); got None")
    _check_basis(basis, heads, d, config.rank)
    if config.rank == 0:
        raise ValueError("config: the Triton encoder needs rank >= 1; use impl='eager' for rank 0")
    start = time.perf_counter()
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

    coeff32 = torch.empty(batch, heads, n, r, dtype=torch.float32, device=device)
    _coefficients_kernel[grid](x, projection, coeff32, n, heads, d, r, *strides,
                               BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad)
    small = bool(coeff32.abs().max() <= _COEFF_FP16_LIMIT) if coeff32.numel() else True
    coeffs = coeff32.to(torch.float16 if small else torch.float32)
    del coeff32
    ieee = not small

    mode = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    width = torch.empty(batch, heads, nb, dtype=torch.int8, device=device)
    step = torch.empty(batch, heads, nb, dtype=torch.float32, device=device)
    # float32 evaluation: a dot of r + 1 terms and two roundings, with a factor 4 to spare.
    gamma = 4.0 * (r + 3) * 2.0**-24
    _modes_kernel[grid](x, projection, coeffs, mode, width, step, n, heads, d, r, nb,
                        tau * (1.0 - 2.0**-16), 2.0 * tau * _STEP_MARGIN, gamma, *strides,
                        BITS=config.bits, BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad, IEEE=ieee)

    rows_in_block = torch.full((nb,), block, dtype=torch.int64, device=device)
    rows_in_block[-1] = n - (nb - 1) * block
    wpr_of = torch.zeros(9, dtype=torch.int64, device=device)
    for w in promotion_widths(config.bits):
        wpr_of[w] = words_per_row(w, d)
    code_words = (rows_in_block * wpr_of[width.long()]).reshape(-1)
    raw_elems = torch.where(mode == MODE_RAW, rows_in_block * d, 0).reshape(-1)
    code_offset = torch.cumsum(code_words, 0) - code_words
    raw_offset = torch.cumsum(raw_elems, 0) - raw_elems
    offset = torch.where(width.reshape(-1) > 0, code_offset, -1)
    offset = torch.where(mode.reshape(-1) == MODE_RAW, raw_offset, offset).reshape(batch, heads, nb)
    codes = torch.empty(int(code_words.sum()), dtype=torch.int32, device=device)
    raw = torch.empty(int(raw_elems.sum()), dtype=x.dtype, device=device)
    # the widest promotion (8 bits) has the most words per row
    wpr_pad = max(16, triton.next_power_of_2(max(words_per_row(w, d) for w in promotion_widths(config.bits))))
    _write_kernel[grid](x, projection, coeffs, mode, width, step, offset, codes, raw, n, heads, d, r, nb, *strides,
                        BLOCK=block, ROWS=rows, D_PAD=d_pad, R_PAD=r_pad, WPR_PAD=wpr_pad, IEEE=ieee)
    ckv = CompressedKV(
        shape=(batch, heads, n, d), dtype=x.dtype, config=config, coeffs=coeffs, basis=projection, mode=mode,
        scale=step, bits=width, offset=offset, codes=codes, raw=raw, shared_basis=True,
    )
    if verify and bool(certify_triton(ckv, x).any()):
        return encode(x, config, basis)
    ckv.encode_seconds = time.perf_counter() - start
    return ckv


# Mode numbers the kernels above write, spelled out for readers of the format.
assert (MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW) == (0, 1, 2, 3)
