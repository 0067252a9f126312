"""Speculative encoding: the Triton encoder with no host read inside a patched forward, and the retry that runs the
forward again when an encoding cannot be kept (CPU: Triton interpreter)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import kvbound  # noqa: E402
from kvbound import _checks  # noqa: E402
from kvbound.codec.encode_triton import encode_triton_deferred  # noqa: E402
from kvbound.codec.format import MODE_LOWRANK  # noqa: E402
from kvbound.kernels.attention_compressed import general_blocks  # noqa: E402


# --------------------------------------------------------------------------------------------- the block
def test_retry_flag_raises_retry_after_the_finite_checks_and_values_wait_for_a_clean_end():
    got = []
    with pytest.raises(_checks.Retry) as caught:
        with _checks._block(speculative=True) as scope:
            scope.queue_retry("first", torch.zeros(1))
            scope.queue_retry("second", torch.tensor([3]))
            scope.queue_value(torch.tensor([1.0, 2.0]), got.append)
    assert caught.value.reasons == ["second"]
    assert got == [] and _checks.active() is None

    # NaN/Inf win over a retry: the error is the user's, running again would not help.
    with pytest.raises(ValueError, match="x: expected finite values"):
        with _checks._block(speculative=True) as scope:
            scope.queue("call", {"x": torch.tensor([1.0, math.nan])})
            scope.queue_retry("flagged", torch.ones(1))

    with _checks._block(speculative=True) as scope:
        scope.queue_retry("clear", torch.zeros((), dtype=torch.int64))
        scope.queue_value(torch.tensor([[5, 7]]), got.append)
        scope.queue_value(torch.tensor(2**40, dtype=torch.int64), got.append)
    assert got == [[5.0, 7.0], [float(2**40)]]


def test_on_flag_runs_before_the_retry_and_only_for_flags_set():
    called = []
    with pytest.raises(_checks.Retry) as caught:
        with _checks._block(speculative=True) as scope:
            scope.queue_retry("clear", torch.zeros(1), lambda: called.append("clear"))
            scope.queue_retry("set", torch.ones(1), lambda: called.append("set"))
    assert called == ["set"] and caught.value.reasons == ["set"]


def test_retry_flags_need_a_speculative_block():
    with kvbound.deferred_checks() as scope:
        assert not scope.speculative
        with pytest.raises(RuntimeError, match="not speculative"):
            scope.queue_retry("x", torch.ones(1))


def test_flags_of_any_shape_and_queueing_dispatches_no_op():
    """A flag is set when any element is nonzero; conditions sum their counts. Queueing keeps the tensors as they
    are: no op runs (no conversion, no concatenation) until the block's end reads everything at once."""
    from test_host_path import _RecordOps  # tests/ is on sys.path (rootdir conftest)

    summary = torch.tensor([0, 0, 0, 0, 2, 7], dtype=torch.int64)
    got = []
    with pytest.raises(_checks.Retry) as caught:
        with _checks._block(speculative=True) as scope:
            views = summary[0:2], summary[2:3], summary[3:5]
            with _RecordOps() as ops:
                scope.queue_retry("clear", views[0])
                scope.queue("call", {}, [("x: {count} bad", views[1])])
                scope.queue_retry("set", views[2])
                scope.queue_value(summary, got.append)
            assert ops.ops == []
    assert caught.value.reasons == ["set"]
    assert got == []
    with pytest.raises(ValueError, match=r"x: 5 bad"):
        with _checks._block(speculative=True) as scope:
            scope.queue("call", {}, [("x: {count} bad", torch.tensor([2, 3], dtype=torch.int32))])
    with _checks._block(speculative=True) as scope:
        scope.queue_retry("clear", torch.zeros(3, dtype=torch.int8))
        scope.queue_value(summary, got.append)
        scope.queue_value(torch.tensor([0.5], dtype=torch.float32), got.append)
    assert got == [[0.0, 0.0, 0.0, 0.0, 2.0, 7.0], [0.5]]


def test_entries_read_their_own_elements_of_a_kept_tensor():
    """``keep`` a tensor once; ``(index, start, stop)`` triples then stand for its elements in conditions, flags and
    values, read with everything else at the block's end."""
    summary = torch.tensor([0, 0, 0, 0, 2, 7], dtype=torch.int64)
    got, called = [], []
    with pytest.raises(_checks.Retry) as caught:
        with _checks._block(speculative=True) as scope:
            whole = scope.keep(summary)
            scope.queue_retry("clear", (whole, 0, 2), lambda: called.append("clear"))
            scope.queue("call", {}, [("x: {count} bad", (whole, 2, 3))])
            scope.queue_retry("set", (whole, 3, 5), lambda: called.append("set"))
            scope.queue_value((whole, 4, 6), got.append)
    assert caught.value.reasons == ["set"] and called == ["set"] and got == []
    with pytest.raises(ValueError, match=r"x: 9 bad"):
        with _checks._block(speculative=True) as scope:
            whole = scope.keep(summary)
            scope.queue("call", {}, [("x: {count} bad", (whole, 4, 6))])
    with _checks._block(speculative=True) as scope:
        whole = scope.keep(summary)
        scope.queue_retry("clear", (whole, 0, 4))
        scope.queue_value((whole, 4, 6), got.append)
        scope.queue_value((whole, 0, 6), got.append)
    assert got == [[2.0, 7.0], [0.0, 0.0, 0.0, 0.0, 2.0, 7.0]]


def test_deferred_forward_runs_again_after_a_retry():
    calls, retries = [], []

    class Model(nn.Module):
        def forward(self, x):
            scope = _checks.active()
            calls.append(scope.speculative)
            if scope.speculative:
                scope.queue_retry("forced", torch.ones(1))
                return x * 0  # a result the retry must drop
            return x + 1

    model = Model()
    wrapped = _checks.DeferredForward(model.forward, lambda: True, retries.append)
    out = wrapped(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert calls == [True, False] and len(retries) == 1 and retries[0].reasons == ["forced"]
    # Without speculation (the predicate says no): one ordinary run.
    calls.clear()
    out = _checks.DeferredForward(model.forward, lambda: False)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and calls == [False]


# -------------------------------------------------------------------------------------------- the encoder
def _data(n, d, gen, outlier=True):
    x = torch.randn(2, 2, n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
    x = x + 0.05 * torch.randn(2, 2, n, d, generator=gen)
    if outlier:
        x[1, 1, n // 2, d // 3] = 50.0  # an exact block
    return x.to(torch.float16)


@pytest.mark.parametrize("one_pass", [False, True])
def test_speculative_keys_are_held_to_float32s_range(one_pass):
    """K from the speculative encoder is not read back, but its decoded values outside the exact ones are bounded
    by what a kept encoding guarantees (coefficients within float16 times the basis's largest element, codes below
    2**8 steps of at most 2 tau), and the exact values' largest magnitude is read with the attention call's other
    checks: a key of 1e20 outside the basis's span, stored exactly, with a query of 1e20 along it, raises at the
    block's end naming q and k; ordinary keys pass and give the synchronous encoder's output."""
    g = torch.Generator().manual_seed(7)
    config = kvbound.CompressionConfig(rank=4, bits=4, block_size=16, tau=0.05)
    sample = torch.zeros(1, 2, 32, 16, dtype=torch.float16)
    sample[..., :4] = torch.randn(1, 2, 32, 4, generator=g).half()  # the basis spans the first four coordinates
    basis = kvbound.calibrate(sample, config)
    assert 0.5 < basis.largest_magnitude() <= 1.0  # orthonormal rows: no element above 1
    k = sample.clone()
    k[..., :4] = torch.randn(1, 2, 32, 4, generator=g).half()
    v = torch.randn(1, 2, 32, 16, generator=g).half()
    q = torch.randn(1, 2, 8, 16, generator=g).half()
    k_big, q_big = k.clone(), q.clone()
    k_big[0, 1, 20, 9] = 6e4  # as large as float16 holds; with a query of 6e4 along it, scaled, in float16
    q_big[0, 1, 2, 9] = 6e4
    with _checks._block(speculative=True) as scope:
        ck = encode_triton_deferred(k, config, basis, scope, name="K", one_pass=one_pass)
        bound = ck._magnitude_but_raw()
        assert bound == pytest.approx(4 * 65504 * basis.largest_magnitude() + 2**8 * 0.1)
        assert ck._checked_magnitude() is None  # nothing of it was read
        out = kvbound.attention(q, ck, kvbound.compress_kv(v, config, basis=None))
    expected = kvbound.attention(q, kvbound.compress_kv(k, config, basis, impl="triton"),
                                 kvbound.compress_kv(v, config, basis=None))  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # at head dim 16 and scale 1/4: logits up to 16 * 1.5e4 * (4 * 65504 + 25.6 + 6e4), far below float32's limit
    with _checks._block(speculative=True) as scope:
        ck = encode_triton_deferred(k_big, config, basis, scope, name="K", one_pass=one_pass)
        out_big = kvbound.attention(q_big, ck, kvbound.compress_kv(v, config, basis=None))
    expected_big = kvbound.attention(q_big, kvbound.compress_kv(k_big, config, basis, impl="triton"),
                                     kvbound.compress_kv(v, config, basis=None))  # fmt: skip
    assert torch.isfinite(out_big).all()
    torch.testing.assert_close(out_big, expected_big, rtol=0, atol=0)
    # float32 keys of 1e20 (stored exactly: outside the span, coefficients zero) with queries of 1e20 along them
    basis32 = kvbound.calibrate(sample.float(), config)
    k32, q32 = k.float(), q.float()
    k32[0, 1, 20, 9], q32[0, 1, 2, 9] = 1e20, 1e20
    with pytest.raises(ValueError, match=r"^q, k: expected magnitudes whose logits stay below .*\(k, compressed"):
        with _checks._block(speculative=True) as scope:
            ck = encode_triton_deferred(k32, config, basis32, scope, name="K", one_pass=one_pass)
            kvbound.attention(q32, ck, kvbound.compress_kv(v.float(), config, basis=None))


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("outlier", [True, False])
def test_deferred_encoder_matches_the_synchronous_one(outlier, one_pass):
    """The deferred encoder stores what the synchronous one stores: the five launches at the same places (packed
    offsets), the one launch (the default for small tensors) each block's codes and exact values at its rows'
    place, so that its offsets differ and the decoded tensor does not."""
    gen = torch.Generator().manual_seed(3)
    x = _data(100, 32, gen, outlier)
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    basis = kvbound.calibrate(x, config)
    sync = kvbound.compress_kv(x, config, basis, impl="triton")
    sizes = []
    with _checks._block(speculative=True) as scope:
        spec = encode_triton_deferred(x, config, basis, scope, sizes=lambda *a: sizes.append(a), one_pass=one_pass)
        assert spec._checked_residual() is True and spec._checked_lowrank_share() is None
        assert sizes == []  # nothing read before the block ends
        decoded = spec.decompress()
    general = int(general_blocks(spec.mode, spec.bits, spec.offset, config.bits, x.shape[-1]).sum())
    assert sizes == [(sync.codes.numel(), sync.raw.numel(), int((sync.mode == MODE_LOWRANK).sum()), general)]
    assert (sizes[0][0] + sizes[0][1] > 0) is bool((sync.mode != MODE_LOWRANK).any())
    for field in ("coeffs", "mode", "scale", "bits"):
        assert torch.equal(getattr(spec, field), getattr(sync, field)), field
    if not one_pass:
        assert torch.equal(spec.offset, sync.offset)
        assert torch.equal(spec.codes[: sync.codes.numel()], sync.codes)
        assert torch.equal(spec.raw[: sync.raw.numel()], sync.raw)
    else:
        assert not torch.equal(spec.offset, sync.offset)
    assert torch.equal(decoded, sync.decompress())
    assert bool(((decoded.double() - x.double()).abs() <= config.tau).all())


def test_one_pass_encodes_reuse_a_workspace_and_store_what_fresh_tensors_store():
    """With a ``workspace`` a one-launch encode writes into the tensors an earlier encode of the same shapes left
    there (no allocation), and stores exactly what an encode into fresh tensors stores (the code words of blocks
    that use fewer than the widest code's are not written, and not read: the decoded values cover them); other
    shapes replace them."""
    gen = torch.Generator().manual_seed(5)
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    first, second = _data(100, 32, gen, True), _data(100, 32, gen, False)
    basis = kvbound.calibrate(torch.cat([first, second], 2), config)
    fields = ("coeffs", "mode", "scale", "bits", "offset", "codes", "raw")
    workspace = {}
    for x in (first, second):
        with _checks._block(speculative=True) as scope:
            fresh = encode_triton_deferred(x, config, basis, scope, one_pass=True)
            kept = encode_triton_deferred(x, config, basis, scope, one_pass=True, workspace=workspace)
            again = encode_triton_deferred(x, config, basis, scope, one_pass=True, workspace=workspace)
            for field in fields:
                assert getattr(again, field).data_ptr() == getattr(kept, field).data_ptr(), field
                assert getattr(again, field).data_ptr() != getattr(fresh, field).data_ptr(), field
                if field != "codes":
                    assert torch.equal(getattr(again, field), getattr(fresh, field)), field
            decoded = again.decompress()
        assert torch.equal(decoded, fresh.decompress())
        assert bool(((decoded.double() - x.double()).abs() <= config.tau).all())
    assert len(workspace) == 1
    shorter = first[:, :, :64]
    with _checks._block(speculative=True) as scope:
        small = encode_triton_deferred(shorter, config, basis, scope, one_pass=True, workspace=workspace)
        assert small.coeffs.shape[2] == 64 and len(workspace) == 1
        assert torch.equal(small.decompress(), encode_triton_deferred(shorter, config, basis, scope).decompress())


def test_deferred_encoder_flags_a_residual_it_was_told_is_absent_and_raises_nan_at_the_end():
    gen = torch.Generator().manual_seed(4)
    x = _data(64, 32, gen, outlier=True)
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    basis = kvbound.calibrate(x, config)
    with pytest.raises(_checks.Retry, match="K: a residual where none was forecast"):
        with _checks._block(speculative=True) as scope:
            ckv = encode_triton_deferred(x, config, basis, scope, residual=False, lowrank_share=1.0, name="K")
            assert ckv._checked_residual() is False and ckv._checked_lowrank_share() == 1.0
    # Told there is a residual: nothing to retry, whatever the blocks hold.
    with _checks._block(speculative=True) as scope:
        encode_triton_deferred(x, config, basis, scope, residual=True)

    # Coefficients beyond float16: a retry, and `unusable` says that this input would raise it again.
    huge = x.float() * 1e4
    called = []
    with pytest.raises(_checks.Retry, match="coefficients beyond float16"):
        with _checks._block(speculative=True) as scope:
            encode_triton_deferred(huge, config, basis, scope, unusable=lambda: called.append(True))
    assert called == [True]
    ckv = kvbound.compress_kv(huge, config, basis, impl="triton")  # the synchronous path handles it
    assert ckv.coeffs.dtype == torch.float32
    assert bool(((ckv.decompress().double() - huge.double()).abs() <= config.tau).all())

    bad = x.clone()
    bad[0, 0, 5, 1] = math.nan
    with pytest.raises(ValueError, match=r"V: expected finite values, found NaN or Inf .*V \[2, 2, 64, 32\]"):
        with _checks._block(speculative=True) as scope:
            encode_triton_deferred(bad, config, basis, scope, name="V")
    with kvbound.deferred_checks() as scope:
        with pytest.raises(RuntimeError, match="not a speculative"):
            encode_triton_deferred(x, config, basis, scope)


# --------------------------------------------------------------------------------- a patched model forward
@pytest.fixture(scope="module")
def enformer():
    port = pytest.importorskip(
        "enformer_pytorch", reason="enformer_pytorch is not installed (src/kvbound/models/README.md)"
    )
    from enformer_pytorch.modeling_enformer import Attention

    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=96, depth=2, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=8),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m) is Attention:
                for p in m.parameters():  # to_out starts at zero: attention would add nothing
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1] if p.dim() > 1 else 4))
    return model.eval()


def _sequence(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8 * tokens, 4, generator=g).softmax(-1)


def test_patched_forward_encodes_speculatively_and_retries_a_wrong_forecast(enformer, monkeypatch):
    """On the CPU the patch picks the eager encoder; here it is told to use the Triton one (interpreted), so the
    speculative path runs as on a GPU: one host read per forward, the same output as the synchronous encoder, and
    a forward run again when a layer's residual was forecast absent."""
    import importlib

    patch_module = importlib.import_module("kvbound.models.patch")  # the module (kvbound.models.patch is the function)
    monkeypatch.setattr(patch_module, "_encoder", lambda x, config, basis: "triton" if basis is not None else "eager")
    model = enformer
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)
    x = _sequence(40, 2)
    reads = []
    original_read = _checks.DeferredChecks.read

    def counting_read(self):
        reads.append(self.speculative)
        return original_read(self)

    with torch.no_grad(), patch_module.patch(model, config, backend="kvbound", calibrate_on=_sequence(40, 1)) as h:
        h.speculative = False
        sync = model(x)["human"]
        sync_ratios = [ratio for r in h.modules for ratio in (r.last_k_ratio, r.last_v_ratio)]
        learnt = [dict(r._forecast) for r in h.modules]
        # at this tau the first layer's blocks hold residuals and the second's are low rank only
        assert [(f["k"][0], f["v"][0]) for f in learnt] == [(True, True), (False, False)]
        for r in h.modules:
            r._forecast.clear()
            r.last_k_ratio = r.last_v_ratio = None
        h.speculative = True
        monkeypatch.setattr(_checks.DeferredChecks, "read", counting_read)
        spec = model(x)["human"]
        assert reads == [True] and h.speculative_retries == 0
        assert torch.equal(spec, sync)
        spec_ratios = [ratio for r in h.modules for ratio in (r.last_k_ratio, r.last_v_ratio)]
        assert spec_ratios == pytest.approx(sync_ratios, rel=1e-12)
        assert [r._forecast for r in h.modules] == learnt  # the same facts, read at the forward's end

        # Forecasts from that forward: the second layer now runs the low-rank-only kernel, with no retry.
        reads.clear()
        assert torch.equal(model(x)["human"], sync)
        assert reads == [True] and h.speculative_retries == 0

        # A forecast "no residual" that is wrong: the forward runs again, synchronously, and gives the same output.
        for r in h.modules:
            r._forecast["k"] = (False, 1.0, False)
        reads.clear()
        again = model(x)["human"]
        assert reads == [True, False] and h.speculative_retries == 1
        assert h.retry_reasons == [[f"{r.name} K: a residual where none was forecast" for r in h.modules[:1]]]
        assert h.synchronous_tensors == []  # a wrong forecast is learnt, not a reason to stop speculating
        assert torch.equal(again, sync)
        assert [r._forecast for r in h.modules] == learnt  # learnt again by the second run

        # A tensor whose speculative encoding could not be kept is encoded synchronously from then on; the rest
        # of the forward stays speculative.
        h.modules[0]._synchronous.add("v")
        h.modules[0].last_v_ratio = None
        assert h.synchronous_tensors == [(h.modules[0].name, "v")]
        reads.clear()
        assert torch.equal(model(x)["human"], sync)
        assert reads == [True] and h.speculative_retries == 1
        assert h.modules[0].last_v_ratio == pytest.approx(sync_ratios[1], rel=1e-12)

        # Under inference mode (tensors without version counters) the speculative objects still carry their
        # record: attention checks no K/V itself, and the forward reads the device once.
        attention_module = importlib.import_module("kvbound.attention")
        checked_kv = []
        original_checks = attention_module._queue_checks

        def spy(tensors, *args, flags=(), **kwargs):
            checked_kv.append(bool(flags))
            return original_checks(tensors, *args, flags=flags, **kwargs)

        monkeypatch.setattr(attention_module, "_queue_checks", spy)
        h.forget_forecasts()  # (a synchronous tensor would be checked by attention under inference mode)
        assert all(not r._forecast and not r._synchronous for r in h.modules)
        reads.clear()
        with torch.inference_mode():
            assert torch.equal(model(x)["human"], sync)
        assert reads == [True] and checked_kv and not any(checked_kv)
        monkeypatch.setattr(attention_module, "_queue_checks", original_checks)

        # Training mode anywhere in the model: no speculation (a second run would draw dropout again).
        reads.clear()
        model.transformer[0].train()
        try:
            assert not h._speculate()
        finally:
            model.transformer[0].eval()
        assert h._speculate()
        model.stem[2].pool_fn.train()  # einops' Rearrange: no state, no dropout (copies come back training)
        assert h._speculate()
        model.stem[2].pool_fn.eval()
        h.speculative = False
        assert not h._speculate()


def _record_modes_run(model, x, sample, monkeypatch, speculative):
    """Patch ``model``, run a forward with ``record_modes`` off, one with it on and one off again; returns each
    layer's ``mode_counts()`` after the forward with it on, having checked them against the modes of the encoded
    K/V that attention read and checked that forwards with it off neither count nor clear them."""
    import importlib

    patch_module = importlib.import_module("kvbound.models.patch")
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)
    read = []
    original = patch_module.PatchHandle._prepare_kv

    def spy(self, record, k, v):
        ck, cv = original(self, record, k, v)
        if isinstance(ck, kvbound.CompressedKV):  # (calibration reads dense K/V)
            counts = [torch.bincount(c.mode.reshape(-1).long(), minlength=4).tolist() for c in (ck, cv)]
            read.append((record.name, counts))
        return ck, cv

    monkeypatch.setattr(patch_module.PatchHandle, "_prepare_kv", spy)
    with torch.no_grad(), patch_module.patch(model, config, backend="kvbound", calibrate_on=sample) as h:
        h.speculative = speculative
        assert not h.record_modes
        model(x)
        assert [r.mode_counts() for r in h.modules] == [None] * len(h.modules)  # off: nothing counted
        h.record_modes = True
        read.clear()
        model(x)
        h.record_modes = False
        assert h.speculative_retries == 0 and len(read) == len(h.modules)
        expected = dict(read)
        counted = {r.name: r.mode_counts() for r in h.modules}
        assert counted == {name: {"k": kv[0], "v": kv[1]} for name, kv in expected.items()}
        model(x)  # off again: the counts stay those of the last forward run with it on
        assert {r.name: r.mode_counts() for r in h.modules} == counted
    return [counted[r.name] for r in h.modules]


@pytest.mark.parametrize("speculative", [False, True])
def test_record_modes_counts_each_layers_blocks_per_storage_mode(enformer, monkeypatch, speculative):
    """``handle.record_modes``: each patched layer's K and V blocks per storage mode in the last forward run with it
    on, as the encoded K/V that attention read hold them (synchronous and speculative encodes); off by default."""
    import importlib

    if speculative:  # the Triton encoder (interpreted), as on a GPU
        patch_module = importlib.import_module("kvbound.models.patch")
        monkeypatch.setattr(patch_module, "_encoder", lambda x, cfg, basis: "triton" if basis is not None else "eager")
    first, second = _record_modes_run(enformer, _sequence(40, 2), _sequence(40, 1), monkeypatch, speculative)
    # at this tau the first layer keeps residuals and the second is low rank only: the counts tell them apart
    assert first["k"][0] < sum(first["k"]) and second["k"] == [sum(second["k"]), 0, 0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("speculative", [False, True])
def test_gpu_record_modes_counts_each_layers_blocks_per_storage_mode(enformer, monkeypatch, speculative):
    """The same on the GPU in bfloat16, with the encoder the patch picks there (Triton): the counts are the encoded
    K/V's own, every block counted once."""
    import copy

    model = copy.deepcopy(enformer).cuda().to(torch.bfloat16)
    x, sample = (_sequence(64, s).cuda().to(torch.bfloat16) for s in (2, 1))
    counts = _record_modes_run(model, x, sample, monkeypatch, speculative)
    assert len(counts) == 2 and all(sum(layer[role]) > 0 for layer in counts for role in ("k", "v"))


@pytest.mark.gpu
def test_gpu_patched_forward_speculative_matches_synchronous(enformer):
    """On the GPU the patch picks the Triton encoder itself: a compressed forward reads the device once, and its
    output is the synchronous encoder's (the first forward, with nothing forecast yet, through the
    residual-capable kernel everywhere: within bfloat16 rounding; later forwards bit for bit)."""
    import copy

    model = copy.deepcopy(enformer).cuda().to(torch.bfloat16)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)
    x = _sequence(64, 2).cuda().to(torch.bfloat16)
    reads = []
    original_read = _checks.DeferredChecks.read

    def counting_read(self):
        reads.append(self.speculative)
        return original_read(self)

    sample = _sequence(64, 1).cuda().to(torch.bfloat16)
    with torch.no_grad(), kvbound.patch(model, config, calibrate_on=sample) as handle:
        handle.speculative = False
        sync = model(x)["human"].float()
        for r in handle.modules:
            r._forecast.clear()
        handle.speculative = True
        _checks.DeferredChecks.read = counting_read
        try:
            first = model(x)["human"].float()
            second = model(x)["human"].float()
        finally:
            _checks.DeferredChecks.read = original_read
        # One-launch encodes (small tensors): every layer wrote K and V into the handle's two kept sets of tensors.
        assert [len(w) for w in handle._encode_workspaces.values()] == [1, 1]
        kept = [t.data_ptr() for w in handle._encode_workspaces.values() for ts in w.values() for t in ts]
        untimed = sum(r.encode_seconds for r in handle.modules)  # time_encoding off: no events recorded
        handle.time_encoding = True
        third = model(x)["human"].float()
        handle.time_encoding = False
        timed = sum(r.encode_seconds for r in handle.modules) - untimed
        assert kept == [t.data_ptr() for w in handle._encode_workspaces.values() for ts in w.values() for t in ts]
        held = handle.operand_bytes
        handle.clear_operands()
        assert handle.operand_bytes == 0 and [len(w) for w in handle._encode_workspaces.values()] == [0, 0]
        fourth = model(x)["human"].float()
        assert handle.operand_bytes == held
    assert reads == [True, True] and handle.speculative_retries == 0
    assert untimed == 0 and timed > 0
    scale = sync.abs().max().item()
    print(f"first speculative forward vs synchronous: {(first - sync).abs().max().item() / scale:.2e} (relative)")
    assert (first - sync).abs().max().item() <= 2e-2 * scale
    for out in (second, third, fourth):
        assert torch.equal(out, sync)


_MISSING = "{} is not installed (src/kvbound/models/README.md: installing the ports)"


def _small_borzoi():
    port = pytest.importorskip("borzoi_pytorch", reason=_MISSING.format("borzoi_pytorch"))
    from borzoi_pytorch.config_borzoi import BorzoiConfig

    torch.manual_seed(0)
    model = port.Borzoi(BorzoiConfig(dim=64, depth=2, heads=2, attn_dim_key=8, attn_dim_value=16, bins_to_return=64))
    g = torch.Generator().manual_seed(7)
    return model.eval(), torch.randn(1, 4, 128 * 32, generator=g), torch.randn(1, 4, 128 * 32, generator=g)


def _small_alphagenome_tower():
    pytest.importorskip("alphagenome_pytorch", reason=_MISSING.format("alphagenome_pytorch"))
    from alphagenome_pytorch.model import TransformerTower

    torch.manual_seed(0)
    tower = TransformerTower(64)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for m in tower.modules():
            if hasattr(m, "running_var"):
                m.running_var.uniform_(0.5, 2.0)
    return tower.eval(), torch.randn(1, 32, 64, generator=g), torch.randn(1, 32, 64, generator=g)


@pytest.mark.parametrize("port, one_pass", [("borzoi", "0"), ("alphagenome", "0"), ("borzoi", "1"),
                                            ("borzoi", "handle")])
def test_other_ports_encode_speculatively_with_the_synchronous_output(port, one_pass, monkeypatch):
    """Borzoi (relative positions) and AlphaGenome's tower (one shared K/V head, tile bias, soft-cap): a compressed
    forward with the Triton encoder (interpreted here) reads the device once and gives the synchronous output, also
    with the one-launch encoder (``KVBOUND_ONE_PASS_ENCODE=1``, or ``handle.one_pass_encode = True`` with the
    variable off)."""
    import importlib

    from test_encode_triton import counted_one_pass_launches  # tests/ is on sys.path (rootdir conftest)

    launches = counted_one_pass_launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_ONE_PASS_ENCODE", "0" if one_pass == "handle" else one_pass)

    patch_module = importlib.import_module("kvbound.models.patch")
    monkeypatch.setattr(patch_module, "_encoder", lambda x, config, basis: "triton" if basis is not None else "eager")
    model, sample, x = _small_borzoi() if port == "borzoi" else _small_alphagenome_tower()
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    reads = []
    original_read = _checks.DeferredChecks.read

    def counting_read(self):
        reads.append(self.speculative)
        return original_read(self)

    with torch.no_grad(), patch_module.patch(model, config, backend="kvbound", calibrate_on=sample) as h:
        h.speculative = False
        sync = first(model(x))
        learnt = [dict(r._forecast) for r in h.modules]
        h.speculative = True
        h.one_pass_encode = True if one_pass == "handle" else None
        monkeypatch.setattr(_checks.DeferredChecks, "read", counting_read)
        outs = [first(model(x)) for _ in range(2 if port == "borzoi" else 1)]
    assert reads == [True] * len(outs) and h.speculative_retries == 0
    assert [r._forecast for r in h.modules] == learnt
    for out in outs:
        torch.testing.assert_close(out, sync, rtol=0, atol=0)
    # one launch for each speculative K and V of each layer and forward, and none without the switch
    assert len(launches) == (2 * len(h.modules) * len(outs) if one_pass in ("1", "handle") else 0)


@pytest.mark.parametrize("one_pass", [False, True])
def test_deferred_workspace_is_finite_where_unwritten_and_checks_pass_under_a_profiler(one_pass, monkeypatch):
    """The deferred encoder's object keeps the whole exact-values workspace as ``raw``. ``kvbound.attention`` checks
    every stored tensor when it runs as a dispatched op (here: under ``torch.profiler``), so the workspace's unwritten
    part must hold finite values whatever the allocator's memory held: every fresh allocation of the encoder is
    poisoned with NaN bit patterns here, and the call under the profiler equals the plain one. The one-launch
    encoder allocates the workspace without zeroing it and writes all of it: the exact blocks' values at the places
    of their rows, zeros elsewhere."""
    from kvbound.codec import encode_triton as et

    real = torch

    def poisoned_empty(*args, **kwargs):
        t = real.empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t.fill_(-1)

    class PoisonedTorch:
        def __getattr__(self, name):
            return poisoned_empty if name == "empty" else getattr(real, name)

    monkeypatch.setattr(et, "torch", PoisonedTorch())
    gen = torch.Generator().manual_seed(3)
    x = _data(100, 32, gen, True)
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    basis = kvbound.calibrate(x, config)
    q = torch.randn(x.shape, generator=gen).to(torch.float16)
    with _checks._block(speculative=True) as scope:
        ck = encode_triton_deferred(x, config, basis, scope, name="K", one_pass=one_pass)
        cv = encode_triton_deferred(x, config, basis, scope, name="V", one_pass=one_pass)
        assert bool(torch.isfinite(ck.raw).all()) and bool(torch.isfinite(cv.raw).all())
        plain = kvbound.attention(q, ck, cv)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            profiled = kvbound.attention(q, ck, cv)  # the op dispatched: every stored tensor checked
    sync = kvbound.compress_kv(x, config, basis, impl="triton")
    assert sync.raw.numel() > 0  # an exact block: the workspace's used part is not empty either
    if one_pass:  # x's layout: the exact block's rows hold x, every other row zeros
        exact = (ck.mode == 3).repeat_interleave(config.block_size, dim=-1)[..., : x.shape[2], None]
        assert torch.equal(ck.raw.view(x.shape), torch.where(exact, x, torch.zeros_like(x)))
    else:
        assert bool((ck.raw[sync.raw.numel():] == 0).all())
    torch.testing.assert_close(profiled, plain, rtol=0, atol=0)
