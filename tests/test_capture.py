"""kvbound.capture: a forward captured in a CUDA graph, its NaN/Inf checks read after every replay.

The staging of the checks (what the graph captures and what is read after a replay) is tested on the CPU; the
capture itself needs a GPU (``gpu`` tests)."""

from __future__ import annotations

import pytest
import torch

import kvbound
from kvbound import _checks


def _qkv(seed: int = 0, n: int = 24, d: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, d, generator=g).to(device) for _ in range(3)]


def test_a_staged_read_can_be_called_after_every_replay():
    """A repeatable stage reads the same device buffers at every call (once per replay of the graph that captured
    it): finite checks pass each time, a non-finite one raises each time, naming the call and tensor."""
    q, k, v = _qkv()
    v_bad = v.clone()
    v_bad[0, 1, 3, 2] = float("nan")
    with _checks.graph_staging() as staged:
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
            kvbound.attention(q, k, v)
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
            kvbound.attention(q, k, v_bad)  # not read here
        with kvbound.deferred_checks():
            pass
    assert len(staged) == 3
    for _ in range(2):
        staged[0]()
        staged[2]()
        with pytest.raises(ValueError, match=r"^v: expected finite values, found NaN .*call 2 of 2"):
            staged[1]()


def test_staging_is_off_outside_capture_and_blocks_read_at_their_end():
    q, k, v = _qkv()
    v[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^v: expected finite values, found Inf"):
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
    with _checks.graph_staging() as staged:
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)  # not read here
        assert len(staged) == 1
        with pytest.raises(RuntimeError, match="already capturing"):
            with _checks.graph_staging():
                pass
    with pytest.raises(ValueError, match=r"^v: expected finite values, found Inf"):
        staged[0]()
    assert getattr(_checks._LOCAL, "graph", None) is None


def test_retry_flags_and_values_are_read_after_every_replay():
    """A speculative block staged for replay (a compressed patch's forward in kvbound.capture): each call of its
    read raises Retry while a retry flag is set (calling the flag's callback), and hands the queued values to their
    callbacks when none is; a non-finite input raises ValueError first."""
    flagged, values = [], []
    scope = _checks.DeferredChecks(speculative=True)
    scope.queue("call", {}, [("x: expected finite values, found NaN or Inf", torch.zeros(1))])
    scope.queue_retry("residual where none was forecast", torch.zeros(3), lambda: flagged.append(1))
    scope.queue_value(torch.tensor([7.0, 2.0]), values.append)
    finish = scope.stage(repeatable=True)
    for _ in range(2):
        finish()
    assert values == [[7.0, 2.0], [7.0, 2.0]] and not flagged
    scope = _checks.DeferredChecks(speculative=True)
    scope.queue_retry("residual where none was forecast", torch.tensor([0.0, 1.0]), lambda: flagged.append(1))
    scope.queue_value(torch.tensor([7.0]), values.append)
    finish = scope.stage(repeatable=True)
    for _ in range(2):
        with pytest.raises(_checks.Retry, match="residual where none was forecast"):
            finish()
    assert flagged == [1, 1] and len(values) == 2  # no value from a replay that cannot be used
    scope = _checks.DeferredChecks(speculative=True)
    scope.queue("call", {}, [("x: expected finite values, found NaN or Inf", torch.ones(1))])
    scope.queue_retry("residual where none was forecast", torch.ones(1))
    with pytest.raises(ValueError, match="x: expected finite values"):
        scope.stage(repeatable=True)()


def test_a_patched_forward_refuses_a_foreign_graph_capture(monkeypatch):
    """Captured by torch.cuda.graph directly, a patched forward would skip its checks: it raises instead."""
    model = torch.nn.Linear(4, 4)
    model.forward = _checks.DeferredForward(model.forward)
    monkeypatch.setattr(_checks, "_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"outside kvbound.capture.*use\s+kvbound.capture"):
        model(torch.randn(2, 4))
    with _checks.graph_staging() as staged:  # inside kvbound.capture: runs, its read staged
        model(torch.randn(2, 4))
    assert len(staged) == 1  # the block's staged read (nothing queued in it)
    staged[0]()


def test_capture_validates_its_arguments():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"warmup: expected an int >= 1, got 0"):
        kvbound.capture(model, x, warmup=0)
    with pytest.raises(TypeError, match=r"^clone_outputs: expected a bool, got str$"):
        kvbound.capture(model, x, clone_outputs="yes")
    with pytest.raises(TypeError, match=r"^fn: expected a module or callable, got int$"):
        kvbound.capture(3, x)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            kvbound.capture(model, x)
    else:
        with pytest.raises(ValueError, match=r"args\[0\]: expected a tensor on a CUDA device, got one on cpu"):
            kvbound.capture(model.cuda(), x)


def test_a_compressed_patch_that_would_encode_synchronously_is_named_with_the_reason():
    """What kvbound.capture checks before capturing a compressed patch (no GPU needed): each way a forward would read
    block modes on the host gives its reason; a patch that speculates with calibrated bases gives none."""
    from kvbound.graphs import _synchronous_reason
    from small_models import small_enformer  # tests/ is on sys.path (rootdir conftest)

    model, _ = small_enformer()
    handle = kvbound.patch(model, kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=2**-4), compress=True)
    assert "no calibrated basis" in _synchronous_reason(handle)
    for record in handle.modules:  # stand-ins: only their presence is read here
        record.basis_k = record.basis_v = object()
    assert _synchronous_reason(handle) is None
    handle.speculative = False
    assert "handle.speculative = False" in _synchronous_reason(handle)
    handle.speculative = True
    model.train()
    assert "training mode" in _synchronous_reason(handle)
    model.eval()
    with handle.variants([-1]):
        assert "handle.variants()" in _synchronous_reason(handle)
    handle.modules[0]._synchronous.add("v")
    assert f"{handle.modules[0].name} V encode synchronously" in _synchronous_reason(handle)
    handle.forget_forecasts()
    assert _synchronous_reason(handle) is None
    handle.undo()


# ------------------------------------------------------------------------------------------------------ GPU
def _tiny_enformer(seed: int = 0):
    port = pytest.importorskip("enformer_pytorch", reason="enformer-pytorch (kvbound[models]) is not installed")
    torch.manual_seed(seed)
    model = port.Enformer.from_hparams(
        dim=192, depth=2, heads=4, attn_dim_key=32, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=16),
    ).eval()
    for module in model.modules():  # Enformer zero-initialises to_out: attention would add nothing
        if type(module).__name__ == "Attention":
            torch.nn.init.normal_(module.to_out.weight, std=0.05)
    return model.cuda()


def _dna(batch: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.one_hot(torch.randint(0, 4, (batch, tokens * 8), generator=g), 4).float().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("patched", [False, True])
def test_gpu_captured_forward_equals_the_eager_forward_on_new_inputs(patched):
    """Replays with inputs other than the capture's give the eager forward's output (bf16 autocast); the caller's
    tensors are not written; each call returns its own output."""
    model = _tiny_enformer()
    handle = kvbound.patch(model, compress=False) if patched else None
    example, later = _dna(2, 256, 1), [_dna(2, 256, s) for s in (2, 3)]
    kept = example.clone()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, example)
        outs = [captured(x)["human"] for x in later]
        eager = [model(x)["human"] for x in later]
    torch.cuda.synchronize()
    assert torch.equal(example, kept)
    for got, want in zip(outs, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(outs[0], outs[1])  # the clones are the call's own
    assert captured.replays == 2
    assert len(captured._finishers) == (1 if patched else 0)  # the patched forward's block; nothing to read else
    if patched:
        handle.undo()
        with pytest.raises(RuntimeError, match="patched, unpatched or undone since the capture"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                captured(later[0])


@pytest.mark.gpu
def test_gpu_captured_patched_forward_raises_for_nan_after_the_replay():
    model = _tiny_enformer()
    kvbound.patch(model, compress=False)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, _dna(1, 256, 1))
        bad = _dna(1, 256, 2)
        bad[0, 100, 2] = float("nan")
        with pytest.raises(ValueError, match=r"expected finite values, found NaN \(kvbound.attention call 1 of"):
            captured(bad)
        captured(_dna(1, 256, 3))  # the graph runs on after an error


@pytest.mark.gpu
def test_gpu_captured_forward_names_what_differs_from_the_capture():
    model = _tiny_enformer()
    kvbound.patch(model, compress=False)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, _dna(1, 256, 1))
        with pytest.raises(ValueError, match=r"args\[0\]: expected shape \[1, 2048, 4\], float32 on cuda:0 as "
                                             r"captured, got \[2, 2048, 4\]"):
            captured(_dna(2, 256, 1))
        with pytest.raises(TypeError, match="expected 1 positional arguments as captured, got 2"):
            captured(_dna(1, 256, 1), 3)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"autocast state of the capture \(autocast bfloat16\), "
                                                            r"got \(no autocast\)"):
        captured(_dna(1, 256, 1))
    first = next(model.parameters())
    model.load_state_dict(model.state_dict())  # in place: the graph sees it
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured(_dna(1, 256, 1))
    with torch.no_grad():
        first.data = first.data.clone()  # another tensor: the graph would read the old one
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="was "
                                                                                          "moved or replaced"):
        captured(_dna(1, 256, 1))


@pytest.mark.gpu
def test_gpu_captured_patched_forward_reads_weights_loaded_in_place_after_the_capture():
    """The patched layers keep their weights' casts and relative keys between forwards; a graph that reads them gets
    them made again, in place, before a replay after load_state_dict: the replay gives the eager forward of the new
    weights, bit for bit, and the port's forward of them within bf16 rounding."""
    model, other = _tiny_enformer(0), _tiny_enformer(1)
    handle = kvbound.patch(model, compress=False)
    x = _dna(1, 256, 2)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, _dna(1, 256, 1))
        before = captured(x)["human"]
        kept = len(captured._operands)
        model.load_state_dict(other.state_dict())
        after = captured(x)["human"]
        eager = model(x)["human"]
        port = other(x)["human"]
    assert kept > 0 and handle.operand_bytes > 0
    assert torch.equal(after, eager) and not torch.equal(after, before)
    assert float((after.float() - port.float()).abs().max()) <= 2e-2 * float(port.float().abs().max())


def _compressed(model, tau: float):
    """``model`` patched with compressed K/V, calibrated on one forward."""
    config = kvbound.CompressionConfig(block_size=64, rank=8, bits=4, tau=tau)
    calibration = _dna(1, 256, 9)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return kvbound.patch(model, config, compress=True, calibrate_on=lambda m: m(calibration))


def _close_to(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1 % of the output's scale: the eager forward may split a layer's launch where the capture's forecast
    did not (the split and the single launch round differently)."""
    assert float((got.float() - want.float()).abs().max()) <= 1e-2 * float(want.float().abs().max())


@pytest.mark.gpu
def test_gpu_captured_compressed_forward_equals_the_eager_forward():
    """A compressed patch (speculative encoding) captures: replays on new inputs give the eager compressed
    forward's output, with no eager fallback when every layer's forecast holds (a tau small enough that every
    layer has residual blocks, which the warm-up forwards learn)."""
    model = _tiny_enformer()
    handle = _compressed(model, 2**-8)
    later = [_dna(1, 256, s) for s in (2, 3)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, _dna(1, 256, 1))
        outs = [captured(x)["human"] for x in later]
        eager = [model(x)["human"] for x in later]
    assert all(r._forecast.get(role, (False,))[0] for r in handle.modules for role in ("k", "v"))
    assert captured.replays == 2 and captured.fallbacks == 0
    for got, want in zip(outs, eager, strict=True):
        _close_to(got, want)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_gpu_captured_compressed_forward_runs_eagerly_after_a_retry(monkeypatch):
    """A capture whose forecast says no layer has a residual (forced here), replayed on an input with residual
    blocks: the replay's retry flag is read, its output is not returned, and the eager forward's is."""
    from kvbound.models.patch import PatchedModule

    model = _tiny_enformer()
    handle = _compressed(model, 2**-8)
    for record in handle.modules:  # what the calibration forward taught
        record._forecast.clear()
    learn = PatchedModule._learn
    monkeypatch.setattr(PatchedModule, "_learn", lambda self, role, *found: learn(self, role, False, 1.0, False))
    x = _dna(1, 256, 2)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        captured = kvbound.capture(model, _dna(1, 256, 1))
        monkeypatch.setattr(PatchedModule, "_learn", learn)
        got = captured(x)["human"]
        assert captured.fallbacks == 1
        want = model(x)["human"]
    _close_to(got, want)
    # What the replay computed (residuals dropped) is farther from the eager output than what was returned.
    replayed = captured._output["human"]
    assert (replayed.float() - want.float()).abs().max() > (got.float() - want.float()).abs().max()


@pytest.mark.gpu
def test_gpu_compressed_patch_that_encodes_synchronously_cannot_be_captured_and_says_why():
    model = _tiny_enformer()
    handle = _compressed(model, 2**-4)
    handle.speculative = False
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"encodes synchronously.*speculative = False.*compress=False"):
            kvbound.capture(model, _dna(1, 256, 1))
    torch.randn(4, device="cuda")  # nothing was captured: the generator is as it was


def test_capture_names_kwargs_that_are_not_a_dict_of_keyword_arguments():
    """Checked before the device is looked at, so the same on the CPU and on a GPU."""
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match=r"^kwargs: expected a dict of keyword arguments, got list$"):
        kvbound.capture(model, x, kwargs=[1])
    with pytest.raises(TypeError, match=r"^kwargs: expected a dict of keyword arguments, got tuple$"):
        kvbound.capture(model, kwargs=(("input", x),))
    with pytest.raises(TypeError, match=r"^kwargs: expected str keys \(argument names\), got 0 \(int\)$"):
        kvbound.capture(model, kwargs={0: x})
