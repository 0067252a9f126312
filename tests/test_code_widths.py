"""Calibrated code widths (``kvbound.patch(widen_codes=True)``, ``calibrated_width``): a layer whose K or V blocks
would all be promoted past ``config.bits`` is coded at a width the fused kernel decodes as bytes, when that costs at
most 1.25x the stored bytes; the bound is the same."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

import kvbound
from kvbound.bench import ports
from kvbound.models.patch import WIDEN_BYTES_LIMIT, calibrated_width

patch_module = importlib.import_module("kvbound.models.patch")

_MISSING = "{} is not installed (src/kvbound/models/README.md: installing the ports)"


def _blocks(rows_per_scale, d=32, rank=4, seed=0):
    """``[1, 1, N, d]``: a rank-``rank`` part shared by every block plus per-block noise of the given scales
    (one block of 16 rows per scale)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, d, generator=g, dtype=torch.float64)
    parts = []
    for scale in rows_per_scale:
        coeffs = torch.randn(16, rank, generator=g, dtype=torch.float64)
        parts.append(coeffs @ basis + scale * torch.randn(16, d, generator=g, dtype=torch.float64))
    return torch.cat(parts)[None, None].float()


def _trials(x, config):
    basis = kvbound.calibrate([x], config)
    width, found = calibrated_width([x], config, basis)
    # every entry is what compress_kv stores at that width
    for w, (stored, fast) in found.items():
        ckv = kvbound.compress_kv(x, kvbound.CompressionConfig(16, config.rank, w, config.tau), basis)
        assert stored == ckv.nbytes
        mode = ckv.mode.reshape(-1)
        on_path = (mode == 0) | ((mode == 1) & (w in (2, 4, 8)))  # byte-decoded widths only
        assert fast == pytest.approx(float(on_path.double().mean()))
    return width, found


def test_residuals_that_fit_config_bits_keep_them():
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)
    x = _blocks([0.02, 0.1, 0.15, 0.02])  # within 8 steps of 0.1: packed at 4 bits, or low rank
    width, found = _trials(x, config)
    assert width == 4 and list(found) == [4, 8]
    assert found[4][1] == 1.0 == found[8][1] and found[8][0] > found[4][0]  # a tie on speed: the narrower


def test_residuals_promoted_everywhere_go_to_eight_bits():
    """Unit-scale residuals at tau = 1/32: no block fits 4 bits (all promoted, the kernel's general loop), and at
    8 bits every block is packed for about the same bytes."""
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)
    x = _blocks([1.0] * 6)
    width, found = _trials(x, config)
    assert found[4][1] == 0.0 and found[8][1] == 1.0
    assert found[8][0] <= WIDEN_BYTES_LIMIT * found[4][0]
    assert width == 8


def test_eight_bits_are_refused_when_they_cost_too_many_bytes():
    """Most blocks fit 4 bits and a few need 5: 8 bits everywhere would put every block on the fast path but store
    far more than 1.25x the bytes."""
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)
    x = _blocks([0.03] * 5 + [0.25])
    width, found = _trials(x, config)
    assert 0 < found[4][1] < 1 and found[8][1] == 1.0
    assert found[8][0] > WIDEN_BYTES_LIMIT * found[4][0]
    assert width == 4


@pytest.mark.parametrize(("bits", "candidates"), [(2, [2, 4, 8]), (3, [3, 4, 8]), (4, [4, 8]), (8, [8])])
def test_candidates_are_config_bits_then_the_wider_byte_widths(bits, candidates):
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=bits, tau=2.0**-5)
    x = _blocks([1.0] * 2)
    width, found = _trials(x, config)
    assert list(found) == candidates and width in candidates


def test_three_bit_codes_move_to_four_bits_for_the_same_bytes():
    """3-bit codes are decoded by the kernel's general loop (no byte planes), as are blocks promoted past them. At
    d = 32 a row of 3-bit codes fills as many 32-bit words as a row of 4-bit codes (10 and 8 per word), so
    ``bits=4`` puts every block on the fast path for the same bytes."""
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=3, tau=0.05)
    x = _blocks([0.12] * 4)
    width, found = _trials(x, config)
    assert found[3] == (found[4][0], 0.0) and found[4][1] == 1.0
    assert width == 4


# ------------------------------------------------------------------------------------------------ in a patch
def _encoded_kv(monkeypatch, each) -> list:
    """A list that collects ``each(dense, encoded)`` for the K and then the V of every compressed attention call
    of patched modules (the encoded K/V that attention reads)."""
    seen = []
    original = patch_module.PatchHandle._prepare_kv

    def spy(self, record, k, v):
        ck, cv = original(self, record, k, v)
        if isinstance(ck, kvbound.CompressedKV):  # (calibration reads dense K/V)
            seen.extend(each(dense, ckv) for dense, ckv in ((k, ck), (v, cv)))
        return ck, cv

    monkeypatch.setattr(patch_module.PatchHandle, "_prepare_kv", spy)
    return seen


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_patch_widens_alphagenomes_promoted_codes_and_keeps_the_bound(monkeypatch):
    """AlphaGenome's tower at tau = 1/32 (LayerNorm'd K/V, unit scale): calibration codes K and V at 8 bits, the
    encoded K/V that attention reads are packed at 8 bits with every element within tau, and the output agrees
    with the fixed-width patch's to within 5 % (relative L2), as each does with the unpatched tower.
    ``widen_codes=False`` keeps 4 bits, the eager backend chooses nothing."""
    from test_speculative_encode import _small_alphagenome_tower  # tests/ is on sys.path (rootdir conftest)

    tower, sample, x = _small_alphagenome_tower()
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)

    def each(dense, ckv):
        error = (ckv.decompress().double() - dense.double()).abs().max().item()
        return ckv.config.bits, torch.bincount(ckv.mode.reshape(-1).long(), minlength=4).tolist(), error

    seen = _encoded_kv(monkeypatch, each)
    with torch.no_grad():
        reference = _first(tower(x))
        outs = {}
        for widen in (True, False):
            seen.clear()
            with kvbound.patch(tower, config, backend="kvbound", calibrate_on=sample, widen_codes=widen) as h:
                assert h.widen_codes is widen
                outs[widen] = _first(tower(x))
                widths = {(r.config_k.bits, r.config_v.bits) if r.config_k is not None else None for r in h.modules}
                trials = [r.width_trials for r in h.modules]
                summary = h.summary()
            assert len(seen) == 2 * 9 and all(err <= config.tau for _, _, err in seen)
            if widen:
                assert widths == {(8, 8)} and all(set(t) == {"k", "v"} for t in trials)
                assert all(bits == 8 and counts[1] == sum(counts) for bits, counts, _ in seen)
                assert "codes K 8 / V 8 bits (calibrated)" in summary
                assert all(t["k"][4][1] == 0.0 and t["k"][8][1] == 1.0 for t in trials)
            else:
                assert widths == {None} and trials == [{}] * 9
                assert all(bits == 4 and counts[2] == sum(counts) for bits, counts, _ in seen)  # all promoted
                assert "calibrated)" not in summary
    scale = reference.norm().item()
    for out in outs.values():
        assert (out - reference).norm().item() < 5e-2 * scale
    assert (outs[True] - outs[False]).norm().item() < 5e-2 * scale
    with torch.no_grad(), kvbound.patch(tower, config, backend="eager", calibrate_on=sample) as h:
        assert all(r.config_k is None and not r.width_trials for r in h.modules)


def test_widened_widths_reach_the_speculative_encoder_and_the_variants_encoding(monkeypatch):
    """With the Triton encoder (interpreted here, as on a GPU) the speculative encodes and the anchored encodes of
    ``handle.variants`` use each layer's calibrated width: K/V packed at 8 bits, outputs equal to the synchronous
    encoder's."""
    from test_speculative_encode import _small_alphagenome_tower  # tests/ is on sys.path (rootdir conftest)

    monkeypatch.setattr(patch_module, "_encoder", lambda x, cfg, basis: "triton" if basis is not None else "eager")
    tower, sample, x = _small_alphagenome_tower()
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)
    seen = _encoded_kv(monkeypatch, lambda dense, ckv: ckv.config.bits)
    with torch.no_grad(), kvbound.patch(tower, config, backend="kvbound", calibrate_on=sample) as h:
        assert {(r.config_k.bits, r.config_v.bits) for r in h.modules} == {(8, 8)}
        h.speculative = False
        sync = _first(tower(x))
        h.speculative = True
        seen.clear()
        spec = _first(tower(x))
        assert seen == [8] * 18 and h.speculative_retries == 0
        torch.testing.assert_close(spec, sync, rtol=0, atol=0)
        seen.clear()
        with h.variants([-1, 0]):  # a reference and one variant of it, the variant encoded against it
            _first(tower(torch.cat([x, x + 0.01 * sample])))
        assert seen == [8] * 18


def test_relative_position_layers_keep_config_bits():
    """Enformer's and Borzoi's kernels decode every coded block in their general loop: no width is calibrated."""
    port = pytest.importorskip("enformer_pytorch", reason=_MISSING.format("enformer_pytorch"))
    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=48, depth=1, heads=2, attn_dim_key=8, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=4),
    ).eval()  # fmt: skip
    sample = torch.randn(1, 256, 4).softmax(-1)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)
    with torch.no_grad(), kvbound.patch(model, config, backend="kvbound", calibrate_on=sample) as h:
        assert h.widen_codes and len(h.modules) == 1
        assert all(r.config_k is None and r.config_v is None and not r.width_trials for r in h.modules)
        assert ports.width_label(h) == "code widths 4 (not calibrated: relative positions)"


def test_widen_codes_must_be_a_bool():
    with pytest.raises(TypeError, match="widen_codes: expected bool, got int"):
        kvbound.patch(torch.nn.Linear(2, 2), widen_codes=1)


def test_width_label_counts_layers_per_width():
    config = kvbound.CompressionConfig()

    def record(k, v, kind="alphagenome"):
        return SimpleNamespace(kind=kind, width_trials={"k": {}, "v": {}} if k else {},
                               config_k=kvbound.CompressionConfig(bits=k) if k else None,
                               config_v=kvbound.CompressionConfig(bits=v) if v else None)  # fmt: skip

    handle = SimpleNamespace(config=config, widen_codes=True, modules=[record(8, 8), record(8, 4), record(8, 8)])
    assert ports.width_label(handle) == ("code widths K 8 (3 layers), V 4 (1 layer), 8 (2 layers): calibrated "
                                         "from 4")
    handle.modules.append(record(None, None))  # a layer the calibration sample never reached
    assert ports.width_label(handle).endswith("calibrated from 4; 1 other layer at 4")
    handle.modules = [record(None, None)]
    assert ports.width_label(handle) == ("code widths 4 (not calibrated: no calibrate_on, or a backend or GPU "
                                         "without the kernel's uniform loop)")
    handle.modules = [record(None, None, kind="borzoi"), record(None, None, kind="enformer")]
    assert ports.width_label(handle) == "code widths 4 (not calibrated: relative positions)"
    handle.modules = []
    assert ports.width_label(handle) == "code widths 4 (not calibrated: no attention module patched)"
    handle.widen_codes = False
    assert ports.width_label(handle) == "code widths 4 (not calibrated: widen_codes off)"
    assert math.isclose(WIDEN_BYTES_LIMIT, 1.25)


def test_general_loop_label_counts_layers_whose_forecasts_need_no_general_loop():
    def record(k, v, kind="alphagenome"):
        return SimpleNamespace(kind=kind, _forecast={"k": k, "v": v} if k else {})

    none, needs, low_rank = (True, 0.0, False), (True, 0.0, True), (False, 1.0, True)
    handle = SimpleNamespace(modules=[record(none, none), record(none, needs), record(low_rank, none),
                                      record(low_rank, low_rank), record(needs, needs, kind="borzoi")])  # fmt: skip
    # a layer with no residual at all runs no residual code: not counted as without the general loop
    assert ports.general_loop_label(handle) == "no block for the kernel's general loop in 2 of 4 layers"
    handle.modules = [record(None, None), record(needs, needs, kind="enformer")]  # nothing run, or relative only
    assert ports.general_loop_label(handle) == ""
    handle.modules = [record(none, low_rank)]
    assert ports.general_loop_label(handle) == "no block for the kernel's general loop in 1 of 1 layer"
