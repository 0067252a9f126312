"""Anchored encoding (kvbound.codec.anchored): the bound on every element, the same format, and what it is for:
a variant that barely moved decodes to its reference's values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbound
from kvbound.attention import attention
from kvbound.codec.anchored import encode_anchored
from kvbound.codec.eager import uncertified_blocks
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW
from test_attention import all_modes, check_against_reference, structured  # tests/ is on sys.path (rootdir conftest)
from test_codec import assert_within_bound


def _pair(shape, dtype, seed, *, move=4e-3, jump_rows=(), jump=0.5):
    """A reference [1, H, N, D] and variants [B, H, N, D]: the reference plus ``move`` noise, plus ``jump``
    on ``jump_rows`` of the last variant."""
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(1, h, 3, d, generator=gen)
    base = torch.randn(1, h, n, 3, generator=gen) @ base + 0.3 * torch.randn(1, h, n, d, generator=gen)
    alts = base + move * torch.randn(b, h, n, d, generator=gen)
    for row in jump_rows:
        alts[-1, :, row] += jump
    return base.to(dtype), alts.to(dtype)


@pytest.mark.parametrize("use_basis", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bound_and_format_hold_and_small_moves_decode_like_the_reference(use_basis, dtype):
    ref, alts = _pair((3, 2, 300, 32), dtype, 0, jump_rows=(5, 6, 200))
    config = kvbound.CompressionConfig(block_size=64, rank=4, bits=4, tau=2.0**-5)
    basis = kvbound.calibrate([ref], config) if use_basis else None
    anchor = kvbound.compress_kv(ref, config, basis)
    fresh = kvbound.compress_kv(alts, config, basis)
    out = kvbound.compress_kv(alts, config, basis, anchor=anchor)
    assert_within_bound(alts, out)
    assert not bool(uncertified_blocks(out, alts).any())
    y_ref, y_out, y_fresh = anchor.decompress(), out.decompress(), fresh.decompress()
    same_out = (y_out == y_ref).double().mean(dim=(1, 2, 3))
    same_fresh = (y_fresh == y_ref).double().mean(dim=(1, 2, 3))
    moved = (alts != ref).double().mean(dim=(1, 2, 3))
    assert bool((moved > 0.3).all()), moved  # the variants really differ from the reference almost everywhere
    # decoded independently, nearly every element differs; anchored, nearly none does, apart from the jump
    assert bool((same_fresh < 0.5).all()), same_fresh
    assert bool((same_out[:2] > 0.97).all()), same_out
    # the last variant jumped on rows 5, 6 and 200 (blocks 0 and 3): the other blocks still follow the anchor
    calm = torch.cat([y_out[2, :, 64:192] == y_ref[0, :, 64:192], y_out[2, :, 256:] == y_ref[0, :, 256:]], dim=1)
    assert float(calm.double().mean()) > 0.97
    jumped = y_out[2, :, [5, 6, 200]] - y_ref[0, :, [5, 6, 200]]
    assert float(jumped.abs().mean()) > 0.4  # the real change is there
    # the stored tensors are laid out as any encoding is: save/load and the kernel read them
    assert out.shared_basis == use_basis
    assert out.mode.dtype == torch.int8 and out.codes.dtype == torch.int32 and out.raw.dtype == dtype


def test_items_without_anchor_are_the_fresh_encoding_and_inputs_untouched():
    ref, alts = _pair((3, 2, 130, 16), torch.bfloat16, 1)
    config = kvbound.CompressionConfig(block_size=32, rank=2, bits=4)
    basis = kvbound.calibrate([ref], config)
    batch = torch.cat([ref, alts])
    before = batch.clone()
    fresh = kvbound.compress_kv(batch, config, basis)
    index = torch.tensor([-1, 0, 0, -1])
    out = encode_anchored(batch, fresh, fresh, index)
    assert torch.equal(batch, before)
    y_out, y_fresh = out.decompress(), fresh.decompress()
    for item in (0, 3):
        assert torch.equal(y_out[item], y_fresh[item])
    assert float((y_out[1] == y_out[0]).double().mean()) > 0.97
    assert_within_bound(batch, out)


def test_every_anchor_mode_is_followed_or_replaced_within_the_bound():
    gen = torch.Generator().manual_seed(0)
    n, d, block = 4 * 32, 32, 32
    x = torch.randn(1, 1, 2, d, generator=gen).repeat_interleave(n // 2, dim=2)
    x[..., 32:64, :] += 0.08 * torch.randn(32, d, generator=gen)
    x[..., 64:96, :] += 3.0 * torch.randn(32, d, generator=gen)
    config = kvbound.CompressionConfig(block_size=block, rank=2, bits=4, tau=0.05)
    basis = kvbound.calibrate(x[..., :32, :], config)
    x[..., 100, 3] = 500.0
    anchor = kvbound.compress_kv(x, config, basis)
    assert anchor.mode.reshape(-1).tolist() == [MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW]
    alts = x + 1e-3 * torch.randn(2, 1, n, d, generator=gen)
    alts[1, :, 5] += 1.0  # the low-rank block no longer certifies row 5: that block is encoded afresh
    alts[1, :, 40] += 0.3  # a packed block: a few codes move
    alts[1, :, 100, 3] += 0.2  # the exact block: this element moves beyond tau, the others stay
    out = kvbound.compress_kv(alts, config, basis, anchor=anchor)
    assert_within_bound(alts, out)
    modes = out.mode.reshape(2, -1).tolist()
    assert modes[0] == [MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW]
    assert modes[1][0] != MODE_LOWRANK and modes[1][1:] == [MODE_PACKED, MODE_PROMOTED, MODE_RAW]
    y, y_ref = out.decompress(), anchor.decompress()
    assert torch.equal(y[0, 0, :32], y_ref[0, 0, :32])  # followed the low-rank block
    # exact block: the anchor's values where within tau of the variant, the variant's own otherwise
    assert y[1, 0, 100, 3].item() == alts[1, 0, 100, 3].item() != y_ref[0, 0, 100, 3].item()
    assert torch.equal(y[0, 0, 96:], y_ref[0, 0, 96:])
    others = torch.ones(32, d, dtype=torch.bool)
    others[100 - 96, 3] = False
    assert torch.equal(y[1, 0, 96:][others], y_ref[0, 0, 96:][others])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    n=st.integers(1, 90),
    d=st.sampled_from([8, 24, 40]),
    rank=st.integers(0, 6),
    bits=st.sampled_from([2, 4, 8]),
    block=st.sampled_from([16, 32]),
    log2_tau=st.floats(-14, 2),
    log2_move=st.floats(-20, 4),
    use_basis=st.booleans(),
    with_source=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bound_holds_for_any_move(dtype, n, d, rank, bits, block, log2_tau, log2_move, use_basis, with_source, seed):
    gen = torch.Generator().manual_seed(seed)
    ref = (torch.randn(1, 2, n, d, generator=gen) * 2).to(dtype)
    alts = (ref.float() + 2.0**log2_move * torch.randn(2, 2, n, d, generator=gen)).to(dtype)
    config = kvbound.CompressionConfig(block_size=block, rank=rank, bits=bits, tau=2.0**log2_tau)
    basis = kvbound.calibrate([ref], config) if use_basis and rank > 0 else None
    anchor = kvbound.compress_kv(ref, config, basis)
    out = kvbound.compress_kv(alts, config, basis, anchor=anchor, anchor_source=ref if with_source else None)
    assert_within_bound(alts, out)
    assert not bool(uncertified_blocks(out, alts).any())


def test_with_the_source_errors_follow_the_anchors_within_half_a_step():
    ref, alts = _pair((2, 2, 256, 32), torch.float32, 5, move=0.02, jump_rows=(40,), jump=0.3)
    config = kvbound.CompressionConfig(block_size=64, rank=4, bits=4, tau=2.0**-5)
    basis = kvbound.calibrate([ref], config)
    anchor = kvbound.compress_kv(ref, config, basis)
    kept = kvbound.compress_kv(alts, config, basis, anchor=anchor)
    followed = kvbound.compress_kv(alts, config, basis, anchor=anchor, anchor_source=ref)
    assert_within_bound(alts, followed)
    e_ref = anchor.decompress().double() - ref.double()
    same_grid = (followed.mode == anchor.mode) & (followed.scale == anchor.scale.expand_as(followed.scale))
    step = anchor.scale.double().expand_as(followed.scale)
    gap_followed = (followed.decompress().double() - alts.double()) - e_ref
    gap_kept = (kept.decompress().double() - alts.double()) - e_ref
    rows = same_grid.repeat_interleave(64, dim=-1)[..., :256, None].expand_as(gap_followed)
    half = (step / 2).repeat_interleave(64, dim=-1)[..., :256, None].expand_as(gap_followed)
    assert float(rows.double().mean()) > 0.5
    # following the rounded change: the two errors differ by at most half a step, except where no code that
    # close certifies x (blocks whose step is near 2 tau leave one or two candidates)
    assert float((gap_followed.abs()[rows] <= half[rows] * (1 + 1e-6) + 1e-7).double().mean()) > 0.9
    # and on average by less than keeping the anchor's code does, since the moves here reach past half a step
    assert float(gap_followed.abs()[rows].mean()) < 0.9 * float(gap_kept.abs()[rows].mean())
    # an item that did not move decodes exactly as its anchor
    same = kvbound.compress_kv(ref, config, basis, anchor=anchor, anchor_source=ref)
    assert torch.equal(same.decompress(), anchor.decompress())


def test_with_the_source_a_small_change_inside_the_basis_moves_the_coefficients():
    """A change far below half a step is lost by the codes, but the part of it inside the basis is carried by the
    low-rank coefficients (to float16 rounding of the moved coefficients)."""
    gen = torch.Generator().manual_seed(11)
    h, n, d, r = 2, 256, 32, 4
    structure = 0.3 * torch.randn(1, h, r, d, generator=gen)
    ref = torch.randn(1, h, n, r, generator=gen) @ structure + 0.3 * torch.randn(1, h, n, d, generator=gen)
    config = kvbound.CompressionConfig(block_size=64, rank=r, bits=4, tau=2.0**-5)
    basis = kvbound.calibrate([ref], config)
    projection = basis.projection.float()  # [H, r, D], orthonormal rows (before float16 rounding)
    change = (2e-3 * torch.randn(1, h, n, r, generator=gen)) @ projection[None]  # in the basis
    alt = ref + change
    anchor = kvbound.compress_kv(ref, config, basis)
    assert float(anchor.scale.min()) / 2 > 3 * float(change.abs().max())  # far below half a step
    kept = kvbound.compress_kv(alt, config, basis, anchor=anchor)
    followed = kvbound.compress_kv(alt, config, basis, anchor=anchor, anchor_source=ref)
    assert_within_bound(alt, followed)
    assert not bool(uncertified_blocks(followed, alt).any())
    assert torch.equal(followed.mode, anchor.mode) and torch.equal(followed.scale, anchor.scale)
    seen_kept = kept.decompress().double() - anchor.decompress().double()
    seen_followed = followed.decompress().double() - anchor.decompress().double()
    missed_kept = (seen_kept - change.double()).abs()
    missed_followed = (seen_followed - change.double()).abs()
    # keeping the codes drops the change (and moves a code by a step where the slack ran out)
    assert float(missed_kept.mean()) > 0.9 * float(change.abs().mean())
    # following it: the change, up to half a float16 ulp of each moved coefficient through the basis (and float32
    # rounding), but where the slack ran out and another code certified
    coeffs = followed.coeffs.double().abs().half()
    ulp = torch.nextafter(coeffs, torch.tensor(float("inf"), dtype=torch.half)).double() - coeffs.double()
    allowed = (ulp / 2) @ projection.double().abs()[None] + 2.0**-22 * (1 + followed.decompress().double().abs())
    assert float((missed_followed <= allowed).double().mean()) > 0.99
    assert float(missed_followed.mean()) < 0.3 * float(change.abs().mean())


def test_with_the_source_exact_anchor_blocks_store_x():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 64, 16, generator=gen)
    x[0, 0, 3, 3] = 400.0  # beyond the codes: the block is stored exactly
    config = kvbound.CompressionConfig(block_size=32, rank=2, bits=4, tau=0.05)
    basis = kvbound.calibrate(torch.randn(1, 1, 64, 16, generator=gen), config)
    anchor = kvbound.compress_kv(x, config, basis)
    assert anchor.mode.reshape(-1).tolist()[0] == MODE_RAW
    alt = x + 1e-3 * torch.randn(x.shape, generator=gen)
    out = kvbound.compress_kv(alt, config, basis, anchor=anchor, anchor_source=x)
    assert torch.equal(out.decompress()[0, 0, :32], alt[0, 0, :32])
    with pytest.raises(ValueError, match=r"^anchor_source: expected the anchor's shape \[1, 1, 64, 16\]"):
        kvbound.compress_kv(alt, config, basis, anchor=anchor, anchor_source=x[..., :32, :])


def test_fused_kernel_reads_an_anchored_encoding():
    cfg = kvbound.CompressionConfig(block_size=16, rank=8)
    k_ref = structured(1, 2, 200, 64, torch.float16, 1)
    v_ref = structured(1, 2, 200, 40, torch.float16, 2)
    k_basis = kvbound.calibrate(structured(1, 2, 200, 64, torch.float16, 1, spikes=False), cfg)
    v_basis = kvbound.calibrate(structured(1, 2, 200, 40, torch.float16, 2, spikes=False), cfg)
    gen = torch.Generator().manual_seed(3)
    k = (k_ref.float() + 2e-3 * torch.randn(k_ref.shape, generator=gen)).half()
    v = (v_ref.float() + 2e-3 * torch.randn(v_ref.shape, generator=gen)).half()
    ck = kvbound.compress_kv(k, cfg, k_basis, anchor=kvbound.compress_kv(k_ref, cfg, k_basis))
    cv = kvbound.compress_kv(v, cfg, v_basis, anchor=kvbound.compress_kv(v_ref, cfg, v_basis))
    assert all_modes(ck) and all_modes(cv), (ck.mode_fractions(), cv.mode_fractions())
    q = torch.randn(1, 4, 37, 64, generator=gen).to(torch.float16)
    out = attention(q, ck, cv, causal=True)
    check_against_reference(out, q, ck.decompress(), cv.decompress(), causal=True)


class TestBadInput:
    def setup_method(self):
        self.config = kvbound.CompressionConfig(block_size=16, rank=2)
        self.x = torch.randn(2, 2, 40, 16)
        self.fresh = kvbound.compress_kv(self.x, self.config)

    def test_shape(self):
        other = kvbound.compress_kv(torch.randn(1, 2, 41, 16), self.config)
        with pytest.raises(ValueError, match=r"anchor: expected \[\*, 2, 40, 16\]"):
            encode_anchored(self.x, self.fresh, other)

    def test_config(self):
        other = kvbound.compress_kv(self.x[:1], kvbound.CompressionConfig(block_size=16, rank=2, tau=0.1))
        with pytest.raises(ValueError, match="anchor: expected the config"):
            encode_anchored(self.x, self.fresh, other)

    def test_dtype(self):
        other = kvbound.compress_kv(self.x[:1].half(), self.config)
        with pytest.raises(ValueError, match="anchor: expected dtype torch.float32"):
            encode_anchored(self.x, self.fresh, other)

    def test_basis(self):
        basis = kvbound.calibrate([self.x], self.config)
        other = kvbound.compress_kv(self.x[:1], self.config, basis)
        with pytest.raises(ValueError, match="same calibrated basis"):
            encode_anchored(self.x, self.fresh, other)

    def test_index(self):
        anchor = kvbound.compress_kv(torch.randn(3, 2, 40, 16), self.config)
        with pytest.raises(ValueError, match="anchor_index: needed"):
            encode_anchored(self.x, self.fresh, anchor)
        with pytest.raises(ValueError, match=r"anchor_index: expected values in \[-1, 2\]"):
            encode_anchored(self.x, self.fresh, anchor, torch.tensor([0, 3]))
        with pytest.raises(ValueError, match=r"anchor_index: expected shape \[2\]"):
            encode_anchored(self.x, self.fresh, anchor, torch.tensor([0]))
        with pytest.raises(ValueError, match=r"^anchor_index: given without an anchor \(pass anchor="):
            kvbound.compress_kv(self.x, self.config, anchor_index=torch.tensor([0, 0]))

    def test_nan(self):
        x = self.x.clone()
        x[1, 0, 3, 2] = float("nan")
        with pytest.raises(ValueError, match=r"^x: expected finite values"):
            encode_anchored(x, self.fresh, self.fresh)
        source = self.x.clone()
        source[0, 1, 0, 0] = float("inf")
        with pytest.raises(ValueError, match=r"^source: expected finite values"):
            encode_anchored(self.x, self.fresh, self.fresh, source=source)

    def test_fresh_must_encode_x(self):
        other = kvbound.compress_kv(torch.randn(2, 2, 40, 16), self.config)
        with pytest.raises(ValueError, match=r"fresh: expected x's own encoding \(within tau"):
            encode_anchored(self.x, other, other, torch.tensor([-1, -1]))

    def test_index_must_be_integers(self):
        with pytest.raises(ValueError, match="anchor_index: expected integers, got dtype torch.float32"):
            encode_anchored(self.x, self.fresh, self.fresh, torch.tensor([0.9, 1.0]))

    def test_source_without_anchor(self):
        with pytest.raises(ValueError, match=r"^anchor_source: given without an anchor"):
            kvbound.compress_kv(self.x, self.config, anchor_source=self.x)
        with pytest.raises(ValueError, match=r"^anchor_index, anchor_source: given without an anchor"):
            kvbound.compress_kv(self.x, self.config, anchor_index=torch.tensor([0, 0]), anchor_source=self.x)


def test_coefficients_stay_float16_unless_a_stored_one_needs_more():
    gen = torch.Generator().manual_seed(4)
    config = kvbound.CompressionConfig(block_size=16, rank=2, bits=4, tau=2.0**-5)
    x = torch.randn(2, 1, 32, 16, generator=gen)
    loud = x[:1].clone()
    loud[0, 0, 20] = 6e4  # its coefficients exceed float16's range: the anchor stores float32
    anchor = kvbound.compress_kv(loud, config)
    fresh = kvbound.compress_kv(x, config)
    assert anchor.coeffs.dtype == torch.float32 and fresh.coeffs.dtype == torch.float16
    out = encode_anchored(x, fresh, anchor, torch.tensor([-1, -1]))
    assert out.coeffs.dtype == torch.float16 and out.nbytes == fresh.nbytes
    assert torch.equal(out.decompress(), fresh.decompress())


def test_with_the_source_exact_blocks_keep_zero_coefficients_and_float16():
    """Exact blocks store no low-rank part: following a change must not leave moved coefficients there (they
    would keep the whole tensor's coefficients in float32)."""
    gen = torch.Generator().manual_seed(4)
    config = kvbound.CompressionConfig(block_size=16, rank=2, bits=4, tau=2.0**-5)
    ref = torch.randn(1, 1, 32, 16, generator=gen)
    ref[0, 0, 20] = 6e4  # block 1 of the reference: stored exactly, with float32 coefficients
    alt = ref.clone()
    alt[0, 0, 20] = torch.randn(16, generator=gen)  # the variant lost the spike
    alt[0, 0, :16] += 5.0 * torch.randn(16, 16, generator=gen)  # and block 0 moved too far to follow
    anchor = kvbound.compress_kv(ref, config)
    assert anchor.coeffs.dtype == torch.float32
    out = kvbound.compress_kv(alt, config, anchor=anchor, anchor_source=ref)
    assert_within_bound(alt, out)
    assert out.mode.tolist() == [[[MODE_RAW, MODE_RAW]]]
    assert float(out.coeffs.abs().max()) == 0.0 and out.coeffs.dtype == torch.float16
