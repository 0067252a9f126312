"""Anchored encoding: compress a tensor against the compressed form of a reference, for paired forwards.

A variant's effect is the difference of two forwards, reference and alternative, whose K/V differ a little almost
everywhere once attention has mixed the variant in. Encoded independently, each element of the two sides lands on
its own quantisation grid point, and an input change far below the step flips a code by a whole step now and
then: the difference of the two decoded tensors carries noise of the order of the step even where the inputs
barely moved.

``encode_anchored`` removes that noise without giving up the bound. Each block of ``x`` first tries the anchor's
block (the reference's) as it is stored: its mode, code width, step, coefficients and, per element, its code. An
element keeps the anchor's code wherever that still certifies ``x`` within ``tau`` (the same float64 certificate
as the eager encoder, ``kvbound.codec.eager``), and only the elements that moved out of it are re-quantised on
the anchor's grid. A block whose re-quantised codes still fail the certificate, or whose anchor stores no codes and
no longer certifies, takes the independent encoding of ``x`` instead; exact (raw) anchor blocks keep the anchor's
value per element wherever it is within the bound, and ``x``'s own value elsewhere. So:

* every returned element is within ``tau`` of ``x``, certified as for any other encoding;
* the format is unchanged (any decoder and the fused kernels read it);
* where ``x`` moved by less than the anchor's slack (``tau`` minus the anchor's own error), both sides decode to
  the same value, and the difference of the two forwards comes from the elements that really moved.

The price is a bias toward the reference: a change smaller than the slack is not represented at all. It is
bounded by ``tau`` per element like every other error of the codec.

With the reference's own values (``source``), the block follows the change instead. Its low-rank coefficients move
by the change projected on the basis, ``c + (x - source) P^T`` (rounded to the stored coefficient dtype, whose
step is far below the code step), and each code moves by the rounded remainder outside the basis, choosing among
the certifying codes the one whose error is closest to the reference's. The part of a small change that lies in
the basis (most of it, for K/V whose basis was calibrated on them) is then represented, to coefficient rounding,
instead of being dropped; what stays unrepresented is the part outside the basis below half a step.
"""

from __future__ import annotations

import time

import torch

from kvbound._validate import check_tensor
from kvbound.codec.eager import (
    _COEFF_FP16_LIMIT,
    _blocks,
    _certified,
    _chunks,
    _ulp32,
    _unpack,
    _valid_rows,
    assemble,
    promotion_widths,
    uncertified_blocks,
)
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, CompressedKV, words_per_row

__all__ = ["encode_anchored"]


def _parts(ckv: CompressedKV, rows: torch.Tensor, low_rank: bool = True) -> dict:
    """Per-block pieces of heads ``rows`` (indices into B*H) of ``ckv``, in float64 where they are numbers;
    ``low_rank``: also the low-rank part ``C @ P`` and ``|C| @ |P|`` (the certificate's rounding term)."""
    batch, heads, n, d = ckv.shape
    block, r = ckv.config.block_size, ckv.rank
    nb = ckv.num_blocks
    device = ckv.device
    valid = _valid_rows(n, block, device)
    bh = batch * heads
    coeff_rows = _blocks(ckv.coeffs.reshape(bh, n, r)[rows], n, block)  # [c, NB, Bn, r]
    if ckv.shared_basis:
        projection = ckv.basis[rows % heads][:, None]  # [c, 1, r, D]
    else:
        projection = ckv.basis.reshape(bh, nb, r, d)[rows]  # [c, NB, r, D]
    mode = ckv.mode.reshape(bh, nb)[rows]
    width = ckv.bits.reshape(bh, nb)[rows]
    offset = ckv.offset.reshape(bh, nb)[rows]
    local_row = torch.arange(block, device=device, dtype=torch.int64)
    q = torch.zeros(len(rows), nb, block, d, dtype=torch.int64, device=device)
    for bits in promotion_widths(ckv.config.bits):
        take = (width == bits)[..., None] & valid[None]
        if not bool(take.any()):
            continue
        wpr = words_per_row(bits, d)
        src = (offset[..., None] + local_row * wpr)[take]
        q[take] = _unpack(ckv.codes[src[:, None] + torch.arange(wpr, device=device)], bits, d)
    raw = torch.zeros(len(rows), nb, block, d, dtype=ckv.raw.dtype, device=device)
    take = (mode == MODE_RAW)[..., None] & valid[None]
    if bool(take.any()):
        src = (offset[..., None] + local_row * d)[take]
        raw[take] = ckv.raw[src[:, None] + torch.arange(d, device=device)]
    return {
        "coeff_rows": coeff_rows,
        "projection": projection,
        **_low_rank(coeff_rows, projection, low_rank),
        "mode": mode,
        "width": width,
        "scale": ckv.scale.reshape(bh, nb)[rows],
        "q": q,
        "raw": raw,
    }


def _certifies(codes, xb, low, low_abs, step, gamma, tau) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: do ``codes`` on the grid ``low + codes * step`` pass the eager certificate for ``xb``? And the
    float32 values they decode to."""
    y = (low + codes * step).to(torch.float32)
    error = (xb - y.to(torch.float64)).abs() + _ulp32(y)
    return error + gamma * (low_abs + codes.abs() * step) <= tau, y


def _low_rank(coeff_rows: torch.Tensor, projection: torch.Tensor, wanted: bool) -> dict:
    if not wanted:
        return {}
    cd, pd = coeff_rows.to(torch.float64), projection.to(torch.float64)
    return {"low": cd @ pd, "low_abs": cd.abs() @ pd.abs()}


def _check_pair(x: torch.Tensor, fresh: CompressedKV, anchor: CompressedKV) -> None:
    batch, heads, n, d = x.shape
    for name, ckv in (("fresh", fresh), ("anchor", anchor)):
        if not isinstance(ckv, CompressedKV):
            raise TypeError(f"{name}: expected kvbound.CompressedKV, got {type(ckv).__name__}")
        if ckv.shape[1:] != (heads, n, d):
            raise ValueError(f"{name}: expected [*, {heads}, {n}, {d}] (from x), got {list(ckv.shape)}")
        if ckv.config != fresh.config:
            raise ValueError(f"{name}: expected the config {fresh.config}, got {ckv.config}")
        if ckv.dtype != x.dtype:
            raise ValueError(f"{name}: expected dtype {x.dtype} (from x), got {ckv.dtype}")
        if ckv.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (from x), got {ckv.device}")
    if fresh.shape[0] != batch:
        raise ValueError(f"fresh: expected batch {batch} (from x), got {fresh.shape[0]}")
    if fresh.shared_basis != anchor.shared_basis or (fresh.shared_basis and not torch.equal(fresh.basis, anchor.basis)):
        raise ValueError("anchor: expected the same calibrated basis as the fresh encoding (or both per-block)")


def encode_anchored(
    x: torch.Tensor,
    fresh: CompressedKV,
    anchor: CompressedKV,
    anchor_index: torch.Tensor | None = None,
    source: torch.Tensor | None = None,
    *,
    check_fresh: bool = True,
    source_name: str = "source",
) -> CompressedKV:
    """Encode ``x`` [B, H, N, D] on the blocks of ``anchor`` wherever they still certify it (module docstring).
    ``source_name``: what errors call ``source`` (``compress_kv`` passes ``anchor_source``).

    Args:
        x: the tensor to encode (finite; the dtype ``fresh`` and ``anchor`` were encoded from).
        fresh: ``x``'s own encoding (any encoder); blocks that cannot follow the anchor are taken from it, after
            checking that they certify ``x`` (a ``ValueError`` otherwise).
        anchor: the reference's encoding, same heads, N, D, config, dtype and basis.
        anchor_index: int64 [B]: the anchor's batch item for each item of ``x``, or -1 for "no anchor: keep
            ``fresh``". Default: item ``b`` for every ``b`` when the anchor has ``B`` items, item 0 when it has one.
        source: optional, the tensor the anchor was encoded from (the anchor's shape). With it, each element
            follows the anchor's code moved by the rounded change ``round((x - source) / step)``, the choice that
            makes ``x``'s error closest to the anchor's own (their difference is at most half a step, and zero
            where nothing moved), after the coefficients have moved by ``(x - source) P^T`` (module docstring);
            exact anchor blocks then store ``x`` exactly (the anchor's error there is zero).
            Without it, an element keeps the anchor's code while that still certifies ``x``.
        check_fresh: check that the blocks kept from ``fresh`` certify ``x`` (default). ``False`` is for a caller
            that has just made ``fresh`` from ``x`` with a certifying encoder, and saves recomputing it.

    Returns:
        a :class:`CompressedKV` of ``x`` in the usual format, within ``tau`` of ``x`` element by element.
    """
    start = time.perf_counter()
    check_tensor(x, "x", ndim=4)
    _check_pair(x, fresh, anchor)
    batch, heads, n, d = x.shape
    if anchor_index is None:
        if anchor.shape[0] == batch:
            anchor_index = torch.arange(batch)
        elif anchor.shape[0] == 1:
            anchor_index = torch.zeros(batch, dtype=torch.int64)
        else:
            raise ValueError(
                f"anchor_index: needed when the anchor's batch ({anchor.shape[0]}) is neither 1 nor x's ({batch})"
            )
    anchor_index = torch.as_tensor(anchor_index, device=x.device)
    if anchor_index.dtype.is_floating_point or anchor_index.dtype.is_complex or anchor_index.dtype == torch.bool:
        raise ValueError(f"anchor_index: expected integers, got dtype {anchor_index.dtype}")
    anchor_index = anchor_index.to(torch.int64)
    if anchor_index.shape != (batch,):
        raise ValueError(f"anchor_index: expected shape [{batch}], got {list(anchor_index.shape)}")
    if bool(((anchor_index < -1) | (anchor_index >= anchor.shape[0])).any()):
        raise ValueError(f"anchor_index: expected values in [-1, {anchor.shape[0] - 1}], got {anchor_index.tolist()}")

    config = fresh.config
    block, r, tau = config.block_size, config.rank, config.tau
    nb, bh = fresh.num_blocks, batch * heads
    device = x.device
    gamma = (r + 2) * 2.0**-52
    valid = _valid_rows(n, block, device)
    row_ok = valid[None, :, :, None]
    xs = x.detach().reshape(bh, n, d)
    head = torch.arange(bh, device=device) % heads
    anchor_row = anchor_index.repeat_interleave(heads) * heads + head  # [BH] (negative: no anchor)
    has_anchor = anchor_index.repeat_interleave(heads) >= 0
    if source is not None:
        check_tensor(source, source_name, ndim=4)
        if tuple(source.shape) != tuple(anchor.shape):
            raise ValueError(f"{source_name}: expected the anchor's shape {list(anchor.shape)}, got "
                             f"{list(source.shape)}")  # fmt: skip
        if source.device != x.device:
            raise ValueError(f"{source_name}: expected device {x.device} (from x), got {source.device}")
        source_rows = source.detach().reshape(-1, n, d)

    mode = fresh.mode.reshape(bh, nb).clone()
    width = fresh.bits.reshape(bh, nb).clone()
    scale = fresh.scale.reshape(bh, nb).clone()
    coeff_dtype = torch.float32 if torch.float32 in (fresh.coeffs.dtype, anchor.coeffs.dtype) else torch.float16
    coeffs = _blocks(fresh.coeffs.reshape(bh, n, r).to(coeff_dtype), n, block)  # [BH, NB, Bn, r]
    basis = fresh.basis if fresh.shared_basis else fresh.basis.reshape(bh, nb, r, d).clone()
    # every block that may be kept from fresh must certify x (the codec's own check of stored numbers)
    fresh_uncertified = uncertified_blocks(fresh, x).reshape(bh, nb) if check_fresh else None
    q_store, raw_store = [], []
    for sl in _chunks(bh, nb * block * d, device):
        rows = torch.arange(bh, device=device)[sl]
        own = _parts(fresh, rows, low_rank=False)
        q, raw = own["q"], own["raw"]
        use = has_anchor[sl]
        xb = _blocks(xs[sl].to(torch.float64), n, block)
        if fresh_uncertified is not None:
            fresh_bad = fresh_uncertified[sl]
        else:
            fresh_bad = torch.zeros_like(own["mode"], dtype=torch.bool)
        if bool(use.any()):
            ref = _parts(anchor, anchor_row[sl].clamp_min(0))
            low, low_abs = ref["low"], ref["low_abs"]
            coeff_new = ref["coeff_rows"].to(coeff_dtype)
            step = ref["scale"].to(torch.float64)[..., None, None]
            if source is not None:
                src = _blocks(source_rows[anchor_row[sl].clamp_min(0)].to(torch.float64), n, block)
                anchor_error = (low + ref["q"] * step).to(torch.float32).to(torch.float64) - src
                if r > 0:
                    # the low-rank part follows the change inside the basis: coefficients c + (x - source) P^T
                    # (rounded to the stored dtype), so only the change outside it is left to the codes
                    projection = ref["projection"].to(torch.float64)
                    moved = ref["coeff_rows"].to(torch.float64) + (xb - src) @ projection.transpose(-1, -2)
                    fits = torch.isfinite(moved).all(dim=-1, keepdim=True)
                    if coeff_dtype == torch.float16:
                        fits &= (moved.abs() <= _COEFF_FP16_LIMIT).all(dim=-1, keepdim=True)
                    coeff_new = torch.where(fits, moved, ref["coeff_rows"].to(torch.float64)).to(coeff_dtype)
                    moved_parts = _low_rank(coeff_new, ref["projection"], True)
                    low_ref = low
                    low, low_abs = moved_parts["low"], moved_parts["low_abs"]
                    src = src + (low - low_ref)  # the source as seen against the moved low-rank part
            kind = ref["mode"]
            # codes: follow the anchor's (moved by the rounded change when the source says what changed) where
            # that certifies x; re-quantise the rest on the anchor's grid
            qmax = ((1 << ref["width"].clamp_min(1).to(torch.int64)) >> 1) - 1
            qmax = qmax[..., None, None]
            safe_step = torch.where(step > 0, step, torch.ones_like(step))
            nearest = torch.round((xb - low) / safe_step).clamp(-qmax - 1, qmax).to(torch.int64)

            if source is None:
                keep, _ = _certifies(ref["q"], xb, low, low_abs, step, gamma, tau)
                q_new = torch.where(keep, ref["q"], nearest)
            else:
                # among the codes that certify x, the one whose error is closest to the anchor's own error
                follow = ref["q"] + torch.round((xb - src) / safe_step).to(torch.int64)
                q_new, best = nearest, torch.full_like(xb, float("inf"))
                for codes in (nearest, follow + 1, follow - 1, follow):
                    codes = codes.clamp(-qmax - 1, qmax)
                    ok, y = _certifies(codes, xb, low, low_abs, step, gamma, tau)
                    gap = torch.where(ok, (y.to(torch.float64) - xb - anchor_error).abs(), float("inf"))
                    better = gap <= best
                    q_new, best = torch.where(better, codes, q_new), torch.where(better, gap, best)
            y_new = (low + q_new * step).to(torch.float32)
            coded = (kind == MODE_PACKED) | (kind == MODE_PROMOTED)
            ok_coded = _certified(xb, y_new, gamma * (low_abs + q_new.abs() * step), tau, row_ok) & coded
            ok_low = _certified(xb, low.to(torch.float32), gamma * low_abs, tau, row_ok) & (kind == MODE_LOWRANK)
            # exact blocks: the anchor's value per element where it is within the bound, x's own elsewhere
            ref_raw = ref["raw"]
            own_raw = _blocks(xs[sl], n, block)
            raw_keep = (xb - ref_raw.to(torch.float64)).abs() + _ulp32(ref_raw.to(torch.float32)) <= tau
            if source is not None:
                raw_keep = torch.zeros_like(raw_keep)
            is_raw = kind == MODE_RAW
            take = (ok_coded | ok_low | is_raw) & use[:, None]  # [c, NB]
            fresh_bad = fresh_bad & ~take
            t4 = take[..., None, None]
            q = torch.where(t4 & coded[..., None, None], q_new, torch.where(t4, 0, q))
            raw = torch.where(t4 & is_raw[..., None, None], torch.where(raw_keep, ref_raw, own_raw), raw)
            mode[sl] = torch.where(take, kind, mode[sl])
            width[sl] = torch.where(take, ref["width"], width[sl])
            scale[sl] = torch.where(take, ref["scale"], scale[sl])
            # exact blocks store no low-rank part (zero coefficients, as assemble() writes them)
            coeff_new = torch.where(is_raw[..., None, None], torch.zeros_like(coeff_new), coeff_new)
            coeffs[sl] = torch.where(t4, coeff_new, coeffs[sl])
            if not fresh.shared_basis:
                basis[sl] = torch.where(t4, ref["projection"], basis[sl])
        if bool(fresh_bad.any()):
            raise ValueError(
                f"fresh: expected x's own encoding (within tau = {tau} of x), but {int(fresh_bad.sum())} of its "
                "blocks that would be kept are not"
            )
        q_store.append((sl, q))
        raw_store.append(raw)

    raw_all = torch.cat(raw_store) if raw_store else torch.zeros(0, nb, block, d, dtype=x.dtype, device=device)
    if coeffs.dtype == torch.float32 and bool((coeffs.to(torch.float16).to(torch.float32) == coeffs).all()):
        coeffs = coeffs.to(torch.float16)  # the format's rule: float16 unless a coefficient needs more
    return assemble(
        x.shape,
        x.dtype,
        config,
        mode,
        width,
        scale,
        coeffs,
        basis,
        fresh.shared_basis,
        q_store,
        lambda sl: raw_all[sl],
        fresh.encode_seconds + time.perf_counter() - start,
    )
