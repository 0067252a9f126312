"""Pools over pairs of positions: Enformer's AttentionPool (softmax pool) and Borzoi's MaxPool1d(2), each in one
kernel, installed by kvbound.patch as helpers of a model whose attention it patches.

On CPU tensors the kernels run in Triton's interpreter only where a test allows it (``_fused_norm_device``); these
tests use float16 autocast (the interpreter's float32 -> bfloat16 conversion truncates)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from kvbound.kernels.pair_pool import max_pair_pool, softmax_pair_pool  # noqa: E402
from kvbound.models import patch  # noqa: E402
from small_models import small_borzoi, small_enformer  # noqa: E402  (tests/ is on sys.path: rootdir conftest)


def _pool_reference(x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The port's pool in float64 on the given logits."""
    pairs = logits.double().unflatten(-1, (-1, 2)).softmax(-1)
    return (x.double().unflatten(-1, (-1, 2)) * pairs).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_softmax_pair_pool_against_float64_within_twice_the_port_arithmetic(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 2 * 1100, generator=g).to(dtype)
    logits = (4 * torch.randn(2, 6, 2 * 1100, generator=g)).to(dtype)
    logits[0, 0, :8] = torch.tensor([80.0, -80.0, 0.0, 0.0, -30.0, -30.5, 11.0, 11.0]).to(dtype)  # far apart, ties
    exact = _pool_reference(x, logits)
    port = (x.unflatten(-1, (-1, 2)) * logits.unflatten(-1, (-1, 2)).float().softmax(-1)).sum(-1)
    out = softmax_pair_pool(x, logits)
    assert out.dtype == torch.float32 and out.shape == (2, 6, 1100)
    port_error = (port.double() - exact).abs().max().item()
    error = (out.double() - exact).abs().max().item()
    assert error <= 2 * port_error + 1e-7, (error, port_error)


def test_softmax_pair_pool_propagates_nan_and_inf_as_the_port():
    x = torch.ones(1, 1, 8)
    logits = torch.zeros(1, 1, 8)
    logits[0, 0, 1] = float("nan")
    logits[0, 0, 2] = float("inf")
    x[0, 0, 6] = float("inf")
    out = softmax_pair_pool(x, logits)
    port = (x.unflatten(-1, (-1, 2)) * logits.unflatten(-1, (-1, 2)).softmax(-1)).sum(-1)
    assert torch.equal(out.isnan(), port.isnan()) and out.isnan()[0, 0, :2].all()
    assert torch.equal(out.isinf(), port.isinf()) and out[0, 0, 3] == math.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_max_pair_pool_equals_max_pool1d_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 2 * 700, generator=g).to(dtype)
    x[0, 0, :12] = torch.tensor([float("nan"), 1.0, 1.0, float("nan"), 0.0, -0.0, -0.0, 0.0, 2.0, 2.0,
                                 -float("inf"), -float("inf")]).to(dtype)  # fmt: skip
    out = max_pair_pool(x)
    want = F.max_pool1d(x.float(), 2).to(dtype) if dtype != torch.float32 else F.max_pool1d(x, 2)
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int8), want.nan_to_num().view(torch.int8))  # signed zeros too


def test_pair_pools_reject_bad_input():
    with pytest.raises(ValueError, match=r"x: expected a non-empty tensor whose last dimension is even, got shape "
                                         r"\[2, 3, 5\]"):
        max_pair_pool(torch.zeros(2, 3, 5))
    with pytest.raises(TypeError, match="x: expected float32, float16 or bfloat16, got int64"):
        max_pair_pool(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits: expected x's shape \[1, 2, 4\] on cpu, got \[1, 2, 6\]"):
        softmax_pair_pool(torch.zeros(1, 2, 4), torch.zeros(1, 2, 6))


# ---------------------------------------------------------------------------------------------- in the models
@pytest.fixture(scope="module")
def enformer():
    model, port = small_enformer()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():  # the port starts its logits at the identity (dirac x 2): make them mix
            if type(module).__name__ == "AttentionPool":
                w = module.to_attn_logits.weight
                w.add_(0.3 * torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))
    return model, port


def _pools(model, port):
    return [m for m in model.modules() if type(m) is port.modeling_enformer.AttentionPool]


@pytest.fixture
def pool_calls(monkeypatch):
    """Allow the fused pools on CPU tensors (interpreter) and count the kernels' calls."""
    import kvbound.kernels.pair_pool as kernel
    import kvbound.models._ports as ports

    monkeypatch.setattr(ports, "_fused_norm_device", lambda x: True)
    # CUDA's autocast runs softmax in float32 (the CPU's in the autocast dtype): the pool is fused only there
    monkeypatch.setattr(ports, "_softmax_in_float32", lambda device_type, dtype: True)
    calls = {"softmax": 0, "max": 0}
    real_softmax, real_max = kernel.softmax_pair_pool, kernel.max_pair_pool

    def softmax_spy(*args):
        calls["softmax"] += 1
        return real_softmax(*args)

    def max_spy(*args):
        calls["max"] += 1
        return real_max(*args)

    monkeypatch.setattr(kernel, "softmax_pair_pool", softmax_spy)
    monkeypatch.setattr(kernel, "max_pair_pool", max_spy)
    return calls


def test_patch_installs_the_pools_as_helpers_and_undo_restores_them(enformer):
    model, port = enformer
    pools = _pools(model, port)
    assert len(pools) == 3  # the stem's and two in the tower (num_downsamples=3)
    with patch(model, compress=False, backend="eager") as handle:
        helpers = [r for r in handle.helpers if r.role == "pool"]
        assert [r.module for r in helpers] == pools
        assert all(r.kind == "enformer" and r.target is handle.modules[0].module for r in helpers)
        assert "pool in one kernel" in handle.summary()
    assert not any("forward" in vars(p) for p in pools)
    # A model whose attention is not patched gets no pools.
    with patch(model, compress=False, backend="eager", filter_fn=lambda name, m: False) as handle:
        assert handle.helpers == [] and not any("forward" in vars(p) for p in pools)


def test_fused_attention_pool_under_autocast_within_twice_the_port_error(enformer, pool_calls, monkeypatch):
    """Under float16 autocast each pool is one matmul and one kernel; against the float64 pool of the same input
    (logits from float64 weights) its error is at most twice that of the port's arithmetic under CUDA's autocast
    (float16 logits, then float32 from the softmax on); the output is float32 as there."""
    model, port = enformer
    pool = _pools(model, port)[1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, pool.to_attn_logits.in_channels, 96, generator=g).to(torch.float16)
    with torch.no_grad():
        w = pool.to_attn_logits.weight.double().flatten(1)
        exact = _pool_reference(x, torch.matmul(w, x.double()))
        with patch(model, compress=False, backend="eager"):
            with torch.autocast("cpu", dtype=torch.float16):
                fused = pool(x)
                assert pool_calls["softmax"] == 1
                monkeypatch.setenv("KVBOUND_FUSED_POOL", "0")
                logits = pool.to_attn_logits(x.unflatten(-1, (-1, 2)))  # the port's, in float16
                assert logits.dtype == torch.float16 and pool_calls["softmax"] == 1
        own = (x.unflatten(-1, (-1, 2)).float() * logits.float().softmax(-1)).sum(-1)
    assert fused.dtype == torch.float32 and fused.shape == own.shape == (2, x.shape[1], 48)
    own_error = (own.double() - exact).abs().max().item()
    error = (fused.double() - exact).abs().max().item()
    assert 0 < own_error and error <= 2 * own_error, (error, own_error)


def test_fused_pools_in_the_whole_model_and_where_the_module_runs_itself(enformer, pool_calls, monkeypatch):
    model, port = enformer
    seq = torch.randint(0, 4, (1, 8 * 48), generator=torch.Generator().manual_seed(3))
    x = F.one_hot(seq, 4).float()
    with torch.no_grad(), patch(model, compress=False, backend="eager", query_chunk=16):
        with torch.autocast("cpu", dtype=torch.float16):
            fused = model(x)["human"]
            assert pool_calls["softmax"] == len(_pools(model, port))
            monkeypatch.setenv("KVBOUND_FUSED_POOL", "0")
            plain = model(x)["human"]
            monkeypatch.delenv("KVBOUND_FUSED_POOL")
        calls = pool_calls["softmax"]
        model(x)  # no autocast: the module's own forward
        assert pool_calls["softmax"] == calls
        pool = _pools(model, port)[0]
        hook = pool.to_attn_logits.register_forward_hook(lambda *a: None)
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                model(x)
        finally:
            hook.remove()
        assert pool_calls["softmax"] == calls + len(_pools(model, port)) - 1  # the hooked pool ran itself
        odd = torch.randn(1, pool.to_attn_logits.in_channels, 7)
        with torch.autocast("cpu", dtype=torch.float16):
            pool(odd)  # odd length: the port pads; its own forward
        assert pool_calls["softmax"] == calls + len(_pools(model, port)) - 1
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_borzoi_max_pools_fused_bit_for_bit(pool_calls):
    model, x = small_borzoi()
    pools = [m for m in model.modules() if type(m) is nn.MaxPool1d]
    with torch.no_grad():
        want = model(x)
        with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
            assert [r.module for r in handle.helpers if r.role == "pool"] == pools and pools
            got = model(x)
            assert pool_calls["max"] > 0
        assert not any("forward" in vars(p) for p in pools)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # attention eager-chunked; the pools exact
    with torch.no_grad():
        y = torch.randn(1, 8, 64)
        assert torch.equal(max_pair_pool(y), F.max_pool1d(y, 2))


@pytest.mark.gpu
def test_gpu_attention_pool_at_enformer_width_bf16():
    """At the first pool of the full Enformer (768 channels, 2 x 8192 positions here) under bfloat16 autocast: the
    fused pool's error against the float64 pool is at most twice the port's own."""
    from types import SimpleNamespace

    from kvbound.models._ports import _fusable_attention_pool, attention_pool_forward

    port = pytest.importorskip("enformer_pytorch", reason="enformer_pytorch is not installed (kvbound[models])")
    pool = port.modeling_enformer.AttentionPool(768).cuda().eval()
    with torch.no_grad():
        pool.to_attn_logits.weight.add_(0.02 * torch.randn_like(pool.to_attn_logits.weight))
    x = torch.randn(2, 768, 8192, device="cuda").to(torch.bfloat16)
    handle = SimpleNamespace(_patches_attention=lambda target: True)  # as a handle whose attention is patched
    with torch.no_grad():
        exact = _pool_reference(x, torch.matmul(pool.to_attn_logits.weight.double().flatten(1), x.double()))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert _fusable_attention_pool(pool, x)
            fused = attention_pool_forward(pool, SimpleNamespace(target=None), handle, x)
            own = pool(x)
    assert fused.dtype == own.dtype == torch.float32
    own_error = (own.double() - exact).abs().max().item()
    error = (fused.double() - exact).abs().max().item()
    assert 0 < own_error and error <= 2 * own_error, (error, own_error)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_max_pair_pool_equals_max_pool1d(dtype):
    x = torch.randn(2, 512, 2 * 40_000, device="cuda").to(dtype)
    x[0, 0, :4] = torch.tensor([float("nan"), 1.0, 0.0, -0.0], device="cuda").to(dtype)
    out, want = max_pair_pool(x), F.max_pool1d(x, 2)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num().view(torch.int8), want.nan_to_num().view(torch.int8))
