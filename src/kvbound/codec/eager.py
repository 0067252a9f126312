"""Eager float64 encoder and decoder of the compressed K/V format (see ``kvbound.codec.format``).

How the bound is certified. For every block the encoder tries, in order, low-rank only, ``bits``-bit codes,
8-bit codes, and exact storage, and keeps the first candidate that passes this check on every element::

    |x - y| + ulp32(y) + gamma * (|C| @ |P| + |q| * s) <= tau,     gamma = (r + 2) * 2**-52

where ``y`` is the float32 value that ``decode`` returns (computed in float64 from the stored float16/float32
factors and codes, then rounded once to float32). The two extra terms bound how far any other correct
float64 evaluation of the same stored numbers can land from ``y``: one float32 ulp for the final rounding, and
the classic dot-product error bound for the float64 sum of ``r + 1`` products. So the bound holds for the
values we return and survives a different summation order on another device. The quantisation step is
``s = min(2 * tau * (1 - 2**-10), max|residual| / qmax)`` per block, so in exact arithmetic the error is at most
``s / 2 < tau``; the check catches whatever rounding, clipping or overflow breaks that, and such blocks move to
the next candidate. Exact storage always passes, so the bound holds for every finite input; a ``tau`` below what
the input dtype resolves simply makes more blocks exact (visible in ``nbytes`` and ``mode_fractions()``).
"""

from __future__ import annotations

import math
import time

import torch

from kvbound._validate import check_tensor
from kvbound.codec.basis import Basis
from kvbound.codec.format import (
    MODE_LOWRANK,
    MODE_PACKED,
    MODE_PROMOTED,
    MODE_RAW,
    CompressedKV,
    check_layout,
    codes_per_word,
    packed_layout,
    promotion_widths,
    words_per_row,
)
from kvbound.config import CompressionConfig

__all__ = ["encode", "decode", "promotion_widths", "uncertified_blocks"]

# Elements of x processed at once (float64 temporaries of this size dominate memory).
_CHUNK_ELEMENTS = 1 << 22
_CHUNK_ELEMENTS_CUDA = 1 << 25
_STEP_MARGIN = 1.0 - 2.0**-10
_COEFF_FP16_LIMIT = 2.0**15


def _chunks(total: int, per_item: int, device: torch.device | None = None):
    budget = _CHUNK_ELEMENTS_CUDA if device is not None and device.type == "cuda" else _CHUNK_ELEMENTS
    step = max(1, budget // max(1, per_item))
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def _ulp32(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return (torch.nextafter(a, torch.full_like(a, math.inf)) - a).to(torch.float64)


def _certified(x64, y32, rounding, tau, row_ok) -> torch.Tensor:
    """Per block: does ``|x - y| + ulp32(y) + rounding <= tau`` hold on every existing row? NaN -> False."""
    err = (x64 - y32.to(torch.float64)).abs() + _ulp32(y32) + rounding
    return ((err <= tau) | ~row_ok).all(dim=-1).all(dim=-1)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``q`` [..., D] (in [-2**(b-1), 2**(b-1)-1]) into int32 words [..., wpr]."""
    d = q.shape[-1]
    per_word, wpr = codes_per_word(bits), words_per_row(bits, q.shape[-1])
    u = (q.to(torch.int64) + (1 << (bits - 1))).clamp_(0, (1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, wpr * per_word - d)).reshape(*q.shape[:-1], wpr, per_word)
    shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1)
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def _unpack(words: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of ``_pack``: int32 words [..., wpr] -> int64 codes [..., D]."""
    per_word = codes_per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    u = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return u.reshape(*words.shape[:-1], -1)[..., :d] - (1 << (bits - 1))


def _blocks(t: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """[c, N, X] -> [c, NB, block, X], zero-padded along N."""
    nb = -(-n // block)
    t = torch.nn.functional.pad(t, (0, 0, 0, nb * block - n))
    return t.reshape(t.shape[0], nb, block, t.shape[-1])


def _valid_rows(n: int, block: int, device: torch.device) -> torch.Tensor:
    nb = -(-n // block)
    return (torch.arange(nb * block, device=device) < n).reshape(nb, block)


def _block_projection(xb: torch.Tensor, rank: int) -> torch.Tensor:
    """Exact per-block truncated SVD: the top ``rank`` right singular vectors [c, NB, r, D], float16."""
    amax = xb.abs().amax(dim=(-2, -1), keepdim=True)
    normalised = xb / torch.where(amax > 0, amax, torch.ones_like(amax))
    _, _, vh = torch.linalg.svd(normalised, full_matrices=False)
    return vh[..., :rank, :].to(torch.float16)


def _check_basis(basis: Basis, heads: int, head_dim: int, rank: int) -> None:
    """``basis`` against x's heads and head dim and the config's rank, after ``Basis.check`` (a float16 ``[H, r, D]``
    projection with finite values; the values are read only when the projection changed since its last check)."""
    if not isinstance(basis, Basis):
        raise TypeError(f"basis: expected kvbound.Basis or None, got {type(basis).__name__}")
    basis.check()
    if basis.head_dim != head_dim:
        raise ValueError(f"basis: expected head dim {head_dim} (from x), got a basis of head dim {basis.head_dim}")
    if basis.num_heads != heads:
        raise ValueError(f"basis: expected {heads} heads (from x), got a basis of {basis.num_heads} heads")
    if basis.rank != rank:
        raise ValueError(f"basis: expected rank {rank} (from config), got a basis of rank {basis.rank}")


def encode(x: torch.Tensor, config: CompressionConfig, basis: Basis | None = None) -> CompressedKV:
    """Compress ``x`` [B, H, N, D] (fp16/bf16/fp32, finite) within ``config.tau`` element-wise."""
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config: expected kvbound.CompressionConfig, got {type(config).__name__}")
    check_tensor(x, "x", ndim=4)
    start = time.perf_counter()
    batch, heads, n, d = x.shape
    config.check_head_dim(d, "x")
    r, block, tau = config.rank, config.block_size, config.tau
    if basis is not None:
        _check_basis(basis, heads, d, r)
    elif r > config.block_size:
        raise ValueError(
            f"config: without a basis each block's basis is the top singular vectors of its own {config.block_size} "
            f"rows, at most CompressionConfig.block_size = {config.block_size} of them; got rank {config.rank} "
            "(lower the rank, raise the block size, or pass a basis from kvbound.calibrate)"
        )
    device = x.device
    nb = -(-n // block)
    bh = batch * heads
    xs = x.detach().reshape(bh, n, d)
    head_of = torch.arange(bh, device=device) % heads
    valid = _valid_rows(n, block, device)  # [NB, Bn]

    # Pass 1: projections and float64 coefficients (small), to fix one coefficient dtype for the tensor.
    if basis is not None:
        shared = basis.projection.to(device)
        projection_store = shared
    else:
        projection_store = torch.empty(bh, nb, r, d, dtype=torch.float16, device=device)
    coeff64 = torch.empty(bh, nb, block, r, dtype=torch.float64, device=device)
    for sl in _chunks(bh, nb * block * d, device):
        xb = _blocks(xs[sl].to(torch.float64), n, block)
        if basis is not None:
            p = shared[head_of[sl]][:, None]  # [c, 1, r, D]
        else:
            p = _block_projection(xb, r) if r > 0 else xb.new_zeros(xb.shape[0], nb, 0, d, dtype=torch.float16)
            projection_store[sl] = p
        coeff64[sl] = xb @ p.to(torch.float64).transpose(-1, -2)
    finite_coeffs = torch.isfinite(coeff64).all() and bool((coeff64.abs() <= _COEFF_FP16_LIMIT).all())
    coeff_dtype = torch.float16 if finite_coeffs else torch.float32
    coeffs = coeff64.to(coeff_dtype)
    del coeff64

    widths = promotion_widths(config.bits)
    mode = torch.empty(bh, nb, dtype=torch.int8, device=device)
    width = torch.zeros(bh, nb, dtype=torch.int8, device=device)
    scale = torch.zeros(bh, nb, dtype=torch.float32, device=device)
    q_store: list[tuple[slice, torch.Tensor]] = []
    gamma = (r + 2) * 2.0**-52
    for sl in _chunks(bh, nb * block * d, device):
        xb = _blocks(xs[sl].to(torch.float64), n, block)  # [c, NB, Bn, D]
        cd = coeffs[sl].to(torch.float64)
        pd = (shared[head_of[sl]][:, None] if basis is not None else projection_store[sl]).to(torch.float64)
        low = cd @ pd
        low_abs = cd.abs() @ pd.abs()
        residual = xb - low
        row_ok = valid[None, :, :, None]
        res_max = torch.where(row_ok, residual.abs(), 0).amax(dim=(-2, -1))  # [c, NB]

        done = _certified(xb, low.to(torch.float32), gamma * low_abs, tau, row_ok)
        chosen = torch.where(done, MODE_LOWRANK, MODE_RAW).to(torch.int8)
        chosen_width = torch.zeros_like(chosen)
        chosen_step = torch.zeros_like(res_max, dtype=torch.float32)
        chosen_q = torch.zeros(residual.shape, dtype=torch.int16, device=device)
        for w in widths:
            if bool(done.all()):
                break
            qmax = (1 << (w - 1)) - 1
            step = torch.minimum(res_max / qmax, torch.full_like(res_max, 2.0 * tau * _STEP_MARGIN))
            step = step.to(torch.float32).clamp_min(torch.finfo(torch.float32).tiny)
            s64 = step.to(torch.float64)[..., None, None]
            q = torch.round(residual / s64).clamp_(-qmax - 1, qmax)
            y32 = (low + q * s64).to(torch.float32)
            take = _certified(xb, y32, gamma * (low_abs + q.abs() * s64), tau, row_ok) & ~done
            m = MODE_PACKED if w == config.bits else MODE_PROMOTED
            chosen = torch.where(take, m, chosen).to(torch.int8)
            chosen_width = torch.where(take, w, chosen_width).to(torch.int8)
            chosen_step = torch.where(take, step, chosen_step)
            chosen_q = torch.where(take[..., None, None], q.to(torch.int16), chosen_q)
            done = done | take
        mode[sl], width[sl], scale[sl] = chosen, chosen_width, chosen_step
        q_store.append((sl, chosen_q))

    def raw_rows(sl: slice) -> torch.Tensor:
        return _blocks(xs[sl], n, block)

    return assemble(
        x.shape,
        x.dtype,
        config,
        mode,
        width,
        scale,
        coeffs,
        projection_store,
        basis is not None,
        q_store,
        raw_rows,
        time.perf_counter() - start,
    )


def assemble(shape, dtype, config, mode, width, scale, coeffs, basis, shared_basis, q_store, raw_rows, seconds):
    """The :class:`CompressedKV` of per-block choices: ``mode``/``width``/``scale`` [BH, NB], ``coeffs``
    [BH, NB, Bn, r] in their stored dtype, ``basis`` [H, r, D] (shared) or [BH, NB, r, D], codes and exact values
    as :func:`lay_out` takes them. Exact blocks get zero coefficients, so a kernel can treat the stored block as
    the whole tile."""
    batch, heads, n, d = shape
    bh, nb = mode.shape
    block, r = config.block_size, coeffs.shape[-1]
    offset, codes_buf, raw_buf = lay_out(
        n, d, block, promotion_widths(config.bits), mode, width, q_store, raw_rows, dtype
    )
    coeffs = torch.where((mode == MODE_RAW)[..., None, None], 0, coeffs).to(coeffs.dtype)
    coeffs = coeffs.reshape(bh, nb * block, r)[:, :n].reshape(batch, heads, n, r).contiguous()
    basis_out = basis.contiguous() if shared_basis else basis.reshape(batch, heads, nb, r, d).contiguous()
    return CompressedKV(
        shape=(batch, heads, n, d),
        dtype=dtype,
        config=config,
        coeffs=coeffs,
        basis=basis_out,
        mode=mode.reshape(batch, heads, nb).contiguous(),
        scale=scale.reshape(batch, heads, nb).contiguous(),
        bits=width.reshape(batch, heads, nb).contiguous(),
        offset=offset.reshape(batch, heads, nb).contiguous(),
        codes=codes_buf,
        raw=raw_buf,
        shared_basis=shared_basis,
        encode_seconds=seconds,
    )


def lay_out(n, d, block, widths, mode, width, q_store, raw_rows, dtype):
    """Lay the codes and the exact blocks out in block order (b, h, k), only the rows that exist.

    ``mode``/``width``: [BH, NB]; ``q_store``: ``[(slice over BH, int codes [c, NB, Bn, D])]`` covering every
    block that has codes; ``raw_rows(slice)``: the exact values [c, NB, Bn, D] (``dtype``) of those heads.
    Returns ``(offset [BH, NB] int64, codes int32 words, raw values)``.
    """
    device = mode.device
    bh, nb = mode.shape
    valid = _valid_rows(n, block, device)
    offset, code_words, raw_elems = packed_layout(n, d, block, mode, width)
    codes_buf = torch.zeros(int(code_words.item()), dtype=torch.int32, device=device)
    raw_buf = torch.zeros(int(raw_elems.item()), dtype=dtype, device=device)
    local_row = torch.arange(block, device=device, dtype=torch.int64)
    for sl, q in q_store:
        for w in widths:
            rows = (width[sl] == w)[..., None] & valid[None]  # [c, NB, Bn]
            if not bool(rows.any()):
                continue
            wpr = words_per_row(w, d)
            dest = (offset[sl][..., None] + local_row * wpr)[rows]
            codes_buf[dest[:, None] + torch.arange(wpr, device=device)] = _pack(q[rows], w)
    raw_rows_all = (mode == MODE_RAW)[..., None] & valid[None]
    if bool(raw_rows_all.any()):
        for sl in _chunks(bh, nb * block * d, device):
            rows = raw_rows_all[sl]
            if not bool(rows.any()):
                continue
            dest = (offset[sl][..., None] + local_row * d)[rows]
            raw_buf[dest[:, None] + torch.arange(d, device=device)] = raw_rows(sl)[rows]
    return offset, codes_buf, raw_buf


def _decode_chunks(ckv: CompressedKV, with_rounding: bool = False):
    """Yield ``(slice over B*H, y32 [c, NB, Bn, D], rounding)`` chunk by chunk; ``rounding`` is the float64 term
    ``gamma * (|C| @ |P| + |q| * s)`` of the certificate (None unless asked)."""
    batch, heads, n, d = ckv.shape
    block = ckv.config.block_size
    nb, bh, r = ckv.num_blocks, batch * heads, ckv.rank
    device = ckv.device
    valid = _valid_rows(n, block, device)
    head_of = torch.arange(bh, device=device) % heads
    coeffs = ckv.coeffs.reshape(bh, n, r)
    mode = ckv.mode.reshape(bh, nb)
    scale = ckv.scale.reshape(bh, nb)
    width = ckv.bits.reshape(bh, nb)
    offset = ckv.offset.reshape(bh, nb)
    basis = ckv.basis if ckv.shared_basis else ckv.basis.reshape(bh, nb, r, d)
    local_row = torch.arange(block, device=device, dtype=torch.int64)
    gamma = (r + 2) * 2.0**-52
    for sl in _chunks(bh, nb * block * d, device):
        cd = _blocks(coeffs[sl].to(torch.float64), n, block)
        pd = (basis[head_of[sl]][:, None] if ckv.shared_basis else basis[sl]).to(torch.float64)
        y = cd @ pd  # [c, NB, Bn, D]
        rounding = gamma * (cd.abs() @ pd.abs()) if with_rounding else None
        for bits in promotion_widths(ckv.config.bits):
            rows = (width[sl] == bits)[..., None] & valid[None]
            if not bool(rows.any()):
                continue
            wpr = words_per_row(bits, d)
            src = (offset[sl][..., None] + local_row * wpr)[rows]
            q = _unpack(ckv.codes[src[:, None] + torch.arange(wpr, device=device)], bits, d)
            step = scale[sl][..., None].expand(rows.shape)[rows].to(torch.float64)
            qs = q.to(torch.float64) * step[:, None]
            y[rows] = y[rows] + qs
            if rounding is not None:
                rounding[rows] = rounding[rows] + gamma * qs.abs()
        y32 = y.to(torch.float32)
        rows = (mode[sl] == MODE_RAW)[..., None] & valid[None]
        if bool(rows.any()):
            src = (offset[sl][..., None] + local_row * d)[rows]
            y32[rows] = ckv.raw[src[:, None] + torch.arange(d, device=device)].to(torch.float32)
            if rounding is not None:
                rounding[rows] = 0.0
        yield sl, y32, rounding


def decode(ckv: CompressedKV) -> torch.Tensor:
    """Reconstruct float32 [B, H, N, D] from ``ckv`` (the values the bound is certified on).

    First checks what the decoding relies on (``check_layout`` without ``packed``: dtypes, shapes, modes and code
    widths, every block's reads inside ``codes``/``raw``), so that a damaged object raises a ``ValueError``/
    ``TypeError`` naming the field instead of reading out of range or decoding wrong widths. Values are not checked
    (``CompressedKV.validate`` does): NaN/Inf stored in the object come out as NaN/Inf."""
    check_layout(ckv, packed=False)
    batch, heads, n, d = ckv.shape
    out = torch.empty(batch * heads, n, d, dtype=torch.float32, device=ckv.device)
    for sl, y32, _ in _decode_chunks(ckv):
        out[sl] = y32.reshape(y32.shape[0], -1, d)[:, :n]
    return out.reshape(batch, heads, n, d)


def uncertified_blocks(ckv: CompressedKV, x: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, NB]: blocks of ``ckv`` whose decoded values fail the certificate against ``x``.

    Exactly the check the eager encoder applies when it chooses a mode, run on the stored numbers; an encoder
    that computes in lower precision (the Triton one) calls this to certify what it wrote. An exact block also
    passes when it holds ``x`` itself (as the Triton encoder checks them), whatever float32's spacing at ``|x|``.
    """
    batch, heads, n, d = ckv.shape
    block = ckv.config.block_size
    valid = _valid_rows(n, block, ckv.device)
    row_ok = valid[None, :, :, None]
    xs = x.detach().reshape(batch * heads, n, d)
    modes = ckv.mode.reshape(batch * heads, -1)
    bad = torch.zeros(batch * heads, ckv.num_blocks, dtype=torch.bool, device=ckv.device)
    for sl, y32, rounding in _decode_chunks(ckv, with_rounding=True):
        xb = _blocks(xs[sl].to(torch.float64), n, block)
        certified = _certified(xb, y32, rounding, ckv.config.tau, row_ok)
        exact = ((y32.to(torch.float64) == xb) | ~row_ok).all(dim=-1).all(dim=-1)
        bad[sl] = ~(certified | ((modes[sl] == MODE_RAW) & exact))
    return bad.reshape(batch, heads, -1)
