"""kvbound.deferred_checks: NaN/Inf checks of dense attention calls read once at the end of a block."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kvbound
from kvbound import _checks
from kvbound.config import CompressionConfig


def _qkv(seed: int = 0, n: int = 24, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, d, generator=g) for _ in range(3)]


def test_finite_inputs_give_the_same_output_and_no_error():
    q, k, v = _qkv()
    immediate = kvbound.attention(q, k, v)
    with kvbound.deferred_checks() as scope:
        deferred = kvbound.attention(q, k, v)
        assert len(scope) == 1  # queued, not read
    torch.testing.assert_close(deferred, immediate, rtol=0, atol=0)
    assert _checks.active() is None


def test_entries_that_are_not_calls_keep_the_calls_numbered():
    """An encoder's entry (or a call's output check) is named by its label; attention calls are numbered among
    themselves only."""
    q, k, v = _qkv()
    v_bad = v.clone()
    v_bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match=r"^v: expected finite values, found NaN \(kvbound.attention call 2 of 2 in "
                                         r"this deferred-check block: q \[1, 2, 24, 16\]\)$"):
        with kvbound.deferred_checks() as scope:
            kvbound.attention(q, k, v)
            scope.queue("K [1, 2, 24, 16] (an encoder)", {"K": k}, call=False)
            assert scope.calls == 1
            kvbound.attention(q, k, v_bad)
    with pytest.raises(ValueError, match=r"^K: expected finite values, found NaN \(K \[1, 2, 24, 16\] \(an "
                                         r"encoder\), in this deferred-check block\)$"):
        with kvbound.deferred_checks() as scope:
            kvbound.attention(q, k, v)
            scope.queue("K [1, 2, 24, 16] (an encoder)", {"K": v_bad}, call=False)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_at_the_end_naming_call_and_tensor(bad):
    q, k, v = _qkv()
    v_bad = v.clone()
    v_bad[0, 1, 5, 3] = bad
    with pytest.raises(ValueError, match=r"^v: expected finite values, found (NaN|Inf) .*call 2 of 3"):
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
            kvbound.attention(q, k, v_bad)  # does not raise here
            kvbound.attention(q, k, v)
    # and without the block the same call raises at once
    with pytest.raises(ValueError, match=r"^v: expected finite values"):
        kvbound.attention(q, k, v_bad)


def test_values_whose_float32_sums_overflow_raise_deferred_and_at_once():
    """Finite values so large that the kernel's float32 sum of weighted values overflows (24 keys of 3e38) would
    give an Inf output where the float64 reference is finite: the call raises instead, in a deferred block at its
    end and outside one at once, naming v and the limit. Values below the limit give the reference's output."""
    q, k, v = _qkv()
    v = v.clone()
    v[0, 0, :, :] = 3e38
    limit = torch.finfo(torch.float32).max / 24
    expected_error = r"^v: expected a largest magnitude of at most 1\.42e\+37 \(dense\).*got 3e\+38"
    with pytest.raises(ValueError, match=expected_error):
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
    with pytest.raises(ValueError, match=r"^v: expected a largest magnitude of at most .* over 24 keys"):
        kvbound.attention(q, k, v)
    v[0, 0, :, :] = limit / 4  # every weight at most 1: the sums stay below the limit
    with kvbound.deferred_checks():
        out = kvbound.attention(q, k, v)
    expected = kvbound.reference_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() <= 1e-5 * expected.abs().amax(dim=(-2, -1), keepdim=True)).all()


class _RecordOps(TorchDispatchMode):
    """The aten ops dispatched while open, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_queued_check_runs_one_norm_per_dtype_and_joins_at_the_end():
    """Per call a block runs only the multi-tensor norms, one per dtype: no stack, no cast to float64 (on a GPU at
    batch 1 each of those is a launch the layer waits for). Each tensor's own peak is read at the end: a dtype's
    largest finite value passes, and Inf in the float32 group or NaN in the bfloat16 group is named."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "q": torch.randn(1, 2, 8, 4, generator=g).to(torch.bfloat16),
        "k": torch.randn(1, 2, 8, 4, generator=g).to(torch.bfloat16).transpose(2, 3),
        "relative_content_bias": torch.randn(2, 4, generator=g),
        "relative_position_bias": torch.randn(2, 4, generator=g),
    }
    tensors["k"][0, 1, 2, 3] = torch.finfo(torch.bfloat16).max
    tensors["relative_position_bias"][1, 1] = -torch.finfo(torch.float32).max
    for bad_name, bad in ((None, None), ("relative_content_bias", float("inf")), ("q", float("nan"))):
        scope = _checks.DeferredChecks()
        calls = {name: t.clone() for name, t in tensors.items()}
        if bad_name is not None:
            calls[bad_name][0, 1] = bad
        with _RecordOps() as ops:
            scope.queue("first", tensors)
            scope.queue("second", calls)
        assert ops.names == ["_foreach_norm", "_foreach_norm"] * 2
        if bad_name is None:
            scope.read()
        else:
            with pytest.raises(ValueError, match=rf"^{bad_name}: expected finite values.*call 2 of 2.*second"):
                scope.read()


def test_an_exception_inside_the_block_propagates_unchanged():
    q, k, v = _qkv()
    v[0, 0, 0, 0] = float("nan")
    with pytest.raises(KeyError, match="inner"):
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v)
            raise KeyError("inner")
    assert _checks.active() is None


def test_compressed_kv_is_checked_at_the_call_and_q_at_the_end():
    """Compressed K/V are checked at the call (the kernel variant depends on their modes), deferred block or not;
    once checked, the result is kept on the object and q's check is deferred like a dense call's."""
    q, k, v = _qkv(n=32)
    config = CompressionConfig(block_size=16, rank=2, bits=4, tau=2**-4)
    ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
    ck.coeffs[0, 1, 5, 0] = float("inf")
    with kvbound.deferred_checks() as scope:
        with pytest.raises(ValueError, match=r"^k\.coeffs: expected finite values"):
            kvbound.attention(q, ck, cv)
        assert len(scope) == 0
    ck = kvbound.compress_kv(k, config)
    q_bad = q.clone()
    q_bad[0, 0, 2, 2] = float("nan")
    with pytest.raises(ValueError, match=r"^q: expected finite values.*call 1 of 1"):
        with kvbound.deferred_checks() as scope:
            kvbound.attention(q_bad, ck, cv)
            assert len(scope) == 1
    with pytest.raises(ValueError, match=r"^q: expected finite values"):
        kvbound.attention(q_bad, ck, cv)  # outside a block: at the call


def test_the_check_record_follows_in_place_changes():
    """A recorded check is reused only while no stored tensor changes: an in-place write (a NaN here) moves the
    tensor's version counter and the next call checks again; a replaced tensor does the same."""
    q, k, v = _qkv(n=48)
    config = CompressionConfig(block_size=16, rank=2, bits=4, tau=2**-6)
    ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
    first = kvbound.attention(q, ck, cv)
    assert ck._checked_residual() is not None and cv._checked_residual() is not None
    assert ck._checked_residual() == bool((ck.mode != 0).any())
    torch.testing.assert_close(kvbound.attention(q, ck, cv), first, rtol=0, atol=0)
    cv.scale[0, 0, 1] = float("nan")
    assert cv._checked_residual() is None
    with pytest.raises(ValueError, match=r"^v\.scale: expected finite values"):
        kvbound.attention(q, ck, cv)
    ck.raw = torch.full_like(ck.raw, float("nan")) if ck.raw.numel() else ck.raw
    ck.basis = ck.basis.clone()
    assert ck._checked_residual() is None


class _TwoLayers(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail

    def forward(self, q, k, v):
        out = kvbound.attention(q, k, v)
        out = kvbound.attention(out, k, v)
        if self.fail:
            raise RuntimeError("forward failed")
        return out


def test_deferred_forward_reads_once_per_forward():
    q, k, v = _qkv()
    model = _TwoLayers()
    model.forward = _checks.DeferredForward(model.forward)
    reads = []
    original = _checks.DeferredChecks.read

    def counting_read(self):
        reads.append(len(self))
        return original(self)

    _checks.DeferredChecks.read = counting_read
    try:
        model(q, k, v)
        assert reads == [2]  # two calls, one read
        k_bad = k.clone()
        k_bad[0, 0, 1, 1] = float("nan")
        with pytest.raises(ValueError, match=r"^k: expected finite values.*call 1 of 2"):
            model(q, k_bad, v)
        # a forward called while the caller handles another exception still reads its checks
        try:
            raise RuntimeError("outer")
        except RuntimeError:
            with pytest.raises(ValueError, match=r"^k: expected finite values"):
                model(q, k_bad, v)
        model.fail = True
        with pytest.raises(RuntimeError, match="forward failed"):
            model(q, k_bad, v)  # the forward's own error, not the deferred one
    finally:
        _checks.DeferredChecks.read = original
    assert _checks.active() is None


def test_interrupted_forward_leaves_no_open_block():
    q, k, v = _qkv()

    class Interrupted(nn.Module):
        def forward(self, q, k, v):
            kvbound.attention(q, k, v)
            raise KeyboardInterrupt

    model = Interrupted()
    model.forward = _checks.DeferredForward(model.forward)
    with pytest.raises(KeyboardInterrupt):
        model(q, k, v)
    assert _checks.active() is None
    v_bad = v.clone()
    v_bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^v: expected finite values"):
        kvbound.attention(q, k, v_bad)  # checked at the call again


def test_patch_wraps_the_forward_and_undo_restores_it():
    port = pytest.importorskip("enformer_pytorch", reason="enformer-pytorch (kvbound[models]) is not installed")
    model = port.Enformer.from_hparams(
        dim=96, depth=1, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=8),
    ).eval()
    assert "forward" not in vars(model)
    handle = kvbound.patch(model, compress=False, backend="eager")
    assert isinstance(vars(model)["forward"], _checks.DeferredForward)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(model)
    handle.undo()
    assert "forward" not in vars(model) and not model._forward_hooks and not model._forward_pre_hooks


def test_patch_of_an_attention_module_itself_undoes_cleanly():
    pytest.importorskip("enformer_pytorch", reason="enformer-pytorch (kvbound[models]) is not installed")
    from enformer_pytorch.modeling_enformer import Attention

    module = Attention(dim=32, heads=2, dim_key=8, dim_value=16, num_rel_pos_features=12).eval()
    module.to_out.reset_parameters()  # zero-initialised by the port: the output would not depend on attention
    x = torch.randn(1, 10, 32)
    with torch.no_grad():
        expected = module(x)
        handle = kvbound.patch(module, compress=False, backend="eager")
        assert isinstance(vars(module)["forward"], _checks.DeferredForward)
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)
    handle.undo()
    assert "forward" not in vars(module)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_largest_magnitude_flags_nan_and_inf_in_every_dtype_without_copying(dtype):
    """NaN and Inf anywhere (non-contiguous views too) come out non-finite, the largest finite magnitude (even
    the dtype's largest) comes out exact, and the reduction allocates nothing of the input's size."""
    from torch.profiler import ProfilerActivity, profile

    largest_magnitude = _checks.largest_magnitude
    x = torch.randn(64, 300, dtype=torch.float64).to(dtype)
    x[17, 3] = -torch.finfo(dtype).max
    assert largest_magnitude(x).item() == float(torch.finfo(dtype).max)
    assert largest_magnitude(x).dtype == torch.float64
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = x.clone()
        bad[40, 200] = value
        assert not math.isfinite(largest_magnitude(bad).item())
        assert not math.isfinite(largest_magnitude(bad.t()).item())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        largest_magnitude(x)
    peak = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert peak < x.numel() * x.element_size() // 8, peak


def _largest_magnitudes_case(device: str) -> None:
    dtypes = (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float64)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(33, 70, generator=g, dtype=torch.float64).to(dtype).to(device) for dtype in dtypes]
    base[0] = base[0].t()  # non-contiguous
    base[3] = base[3][:, ::3]  # strided
    base[1][5, 5] = -torch.finfo(torch.float32).max
    base[3][7, 4] = torch.finfo(torch.bfloat16).max
    peaks = _checks.largest_magnitudes(base)
    assert peaks.dtype == torch.float64 and peaks.shape == (len(base),)
    assert peaks.tolist() == [_checks.largest_magnitude(t).item() for t in base]
    assert peaks[1].item() == float(torch.finfo(torch.float32).max)
    assert peaks[3].item() == float(torch.finfo(torch.bfloat16).max)
    for index in range(len(base)):
        for value in (float("nan"), float("inf"), float("-inf")):
            bad = [t.clone() for t in base]
            bad[index][index + 1, 2 * index] = value
            got = _checks.largest_magnitudes(bad).tolist()
            assert not math.isfinite(got[index]), (index, value, got)
            assert all(math.isfinite(x) for i, x in enumerate(got) if i != index), (index, value, got)


def test_largest_magnitudes_of_mixed_dtypes_in_one_call():
    """One call's tensors in one reduction: each tensor's own largest magnitude exactly (also a dtype's largest
    finite value), NaN and Inf flagged in the tensor that holds them and nowhere else, in any layout."""
    _largest_magnitudes_case("cpu")
    with pytest.raises(ValueError, match="at least one tensor"):
        _checks.largest_magnitudes([])


@pytest.mark.gpu
def test_largest_magnitudes_of_mixed_dtypes_in_one_call_on_the_gpu():
    """The same on CUDA, whose multi-tensor norm is its own code path."""
    _largest_magnitudes_case("cuda")


def test_inference_tensors_are_checked_at_every_call():
    """Inference tensors keep no version counter: nothing is recorded and every call checks K/V again."""
    q, k, v = _qkv(n=32)
    config = CompressionConfig(block_size=16, rank=2, bits=4, tau=2**-5)
    with torch.inference_mode():
        ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
        out = kvbound.attention(q, ck, cv)
        assert ck._checked is None and ck._checked_residual() is None
        ck.scale[0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match=r"^k\.scale: expected finite values"):
            kvbound.attention(q, ck, cv)
    assert torch.isfinite(out).all()
