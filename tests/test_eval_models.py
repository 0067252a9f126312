"""The compact models: attention math against direct float64 formulas, hooks, ablation, files."""

import math

import pytest
import torch

from kvbound.eval import kv_hooks
from kvbound.eval.models import (
    ModelConfig,
    alphagenome_attention,
    build_model,
    enformer_attention,
    load_model,
    relative_positional_features,
    relative_shift,
    save_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_hot(batch, length, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (batch, length), generator=generator)
    return torch.nn.functional.one_hot(codes, 4).float().transpose(1, 2)


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_relative_shift_matches_gather(n):
    x = torch.randn(2, 3, n, 2 * n - 1)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None]
    expected = x.gather(-1, (j - i + n - 1).expand(2, 3, n, n))
    assert torch.equal(relative_shift(x), expected)


def test_positional_features_shape_and_symmetry():
    features = relative_positional_features(9, 12)
    assert features.shape == (17, 12)
    assert torch.isfinite(features).all()
    # first half symmetric in the distance, second half antisymmetric; zero distance has no sign
    torch.testing.assert_close(features[:, :6], features.flip(0)[:, :6])
    torch.testing.assert_close(features[:, 6:], -features.flip(0)[:, 6:])


def test_enformer_attention_matches_direct_formula():
    torch.manual_seed(0)
    b, h, n, dk, dv = 2, 3, 11, 8, 5
    q, k = torch.randn(b, h, n, dk, dtype=torch.float64), torch.randn(b, h, n, dk, dtype=torch.float64)
    v = torch.randn(b, h, n, dv, dtype=torch.float64)
    relative_k = torch.randn(h, 2 * n - 1, dk, dtype=torch.float64)
    u, w = torch.randn(h, dk, dtype=torch.float64), torch.randn(h, dk, dtype=torch.float64)
    out = enformer_attention(q, k, v, relative_k, u, w)
    expected = torch.empty(b, h, n, dv, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            logits = torch.empty(n, n, dtype=torch.float64)
            for i in range(n):
                for j in range(n):
                    logits[i, j] = (q[bi, hi, i] + u[hi]) @ k[bi, hi, j] + (q[bi, hi, i] + w[hi]) @ relative_k[
                        hi, j - i + n - 1
                    ]
            expected[bi, hi] = torch.softmax(logits, -1) @ v[bi, hi]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_alphagenome_attention_matches_direct_formula():
    torch.manual_seed(1)
    b, h, n, dk, dv, tile = 2, 4, 32, 16, 12, 16
    q = torch.randn(b, h, n, dk, dtype=torch.float64) * 3
    k = torch.randn(b, 1, n, dk, dtype=torch.float64) * 3
    v = torch.randn(b, 1, n, dv, dtype=torch.float64)
    pair_bias = torch.randn(b, h, n // tile, n // tile, dtype=torch.float64) * 4
    out = alphagenome_attention(q, k, v, pair_bias, tile, 5.0)
    i = torch.arange(n)
    bias = pair_bias[:, :, i[:, None] // tile, i[None, :] // tile]  # constant over 16 x 16 tiles
    logits = q @ k.transpose(-1, -2) / math.sqrt(dk) + bias
    capped = 5.0 * torch.tanh(logits / 5.0)
    assert capped.abs().max() < 5.0
    expected = torch.softmax(capped, -1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["enformer", "alphagenome"])
def test_forward_shapes_and_hook_shapes(kind):
    config = ModelConfig.toy(kind, 5)
    model = build_model(config, seed=0).eval()
    x = _one_hot(2, config.window_bp, seed=0)
    seen = []

    def hook(layer, k, v):
        seen.append((layer, tuple(k.shape), tuple(v.shape)))
        return k, v

    with torch.no_grad():
        exact = model(x)
        with kv_hooks.install(model, hook):
            hooked = model(x)
    assert exact.shape == (2, config.target_bins, 5)
    assert torch.equal(exact, hooked)  # an identity hook changes nothing
    kv_heads = config.heads if kind == "enformer" else 1
    n = config.window_bins
    assert seen == [(i, (2, kv_heads, n, config.key_dim), (2, kv_heads, n, config.value_dim)) for i in range(2)]
    assert all(layer.kv_hook is None for layer in model.attention)  # the handle restored the layers


@pytest.mark.parametrize("kind", ["enformer", "alphagenome"])
def test_kv_hook_and_attention_fn_reach_the_output(kind):
    config = ModelConfig.toy(kind, 5)
    model = build_model(config, seed=0).eval()
    x = _one_hot(1, config.window_bp, seed=1)
    with torch.no_grad():
        exact = model(x)
        with kv_hooks.install(model, lambda layer, k, v: (k, torch.zeros_like(v))):
            zeroed = model(x)
        original = model.attention[0].attention_fn
        calls = []

        def wrapped(*args):
            calls.append(1)
            return original(*args)

        with kv_hooks.install(model, None, attention_fn=wrapped):
            swapped = model(x)
    assert (exact - zeroed).abs().max() > 1e-3
    assert torch.equal(exact, swapped) and len(calls) == config.depth
    assert model.attention[0].attention_fn is original


@pytest.mark.parametrize("kind", ["enformer", "alphagenome"])
def test_attention_carries_distant_sequence_and_the_ablation_does_not(kind):
    # a change 40 bins (5 kb) left of the output crop reaches the outputs only through attention
    config = ModelConfig.toy(kind, 3, window_bins=128, target_bins=32)
    x = _one_hot(1, config.window_bp, seed=2)
    changed = x.clone()
    changed[:, :, 500:600] = changed[:, :, 500:600].roll(1, dims=1)
    for attention, moves in ((True, True), (False, False)):
        model = build_model(ModelConfig(**{**config.as_dict(), "attention": attention}), seed=0).eval()
        with torch.no_grad():
            delta = (model(x) - model(changed)).abs().max().item()
        assert (delta > 1e-4) == moves, (attention, delta)


def test_compressed_hook_respects_the_bound_and_counts_bytes():
    kvbound = pytest.importorskip("kvbound")
    config = ModelConfig.toy("alphagenome", 4)
    model = build_model(config, seed=0).eval()
    x = _one_hot(1, config.window_bp, seed=3)
    hook = kv_hooks.CompressedKVHook(kvbound.CompressionConfig(block_size=16, rank=4, bits=4))
    with torch.no_grad():
        exact = model(x)
        with kv_hooks.install(model, hook):
            compressed = model(x)
    assert hook.stats.calls == config.depth and hook.stats.bound_violations == 0
    assert 0 < max(hook.stats.max_abs_error.values()) <= 2.0**-5
    assert hook.stats.ratio() > 1.0
    assert 0 < (exact - compressed).abs().max() < 1.0


def test_compressed_hook_counts_and_raises_on_a_bound_violation(monkeypatch):
    """A codec output that misses tau (here each block's step stored 1.5x too wide, so that its codes decode up to
    half a code's magnitude away) is counted once per tensor in ``stats.bound_violations`` with strict=False, the
    forward going on; with strict=True (the default) the first such tensor raises, by layer and tensor."""
    import kvbound

    config = ModelConfig.toy("alphagenome", 4)
    model = build_model(config, seed=0).eval()
    x = _one_hot(1, config.window_bp, seed=3)
    codec = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    original = kvbound.compress_kv
    missed = []  # per encoded tensor: whether its decode misses tau, measured here in float64

    def widened(stored, *args, **kwargs):
        ckv = original(stored, *args, **kwargs)
        ckv.scale.mul_(1.5)
        missed.append(bool(((ckv.decompress().double() - stored.double()).abs() > codec.tau).any()))
        return ckv

    monkeypatch.setattr(kvbound, "compress_kv", widened)
    hook = kv_hooks.CompressedKVHook(codec, strict=False)
    with torch.no_grad(), kv_hooks.install(model, hook):
        model(x)
    assert hook.stats.calls == config.depth and len(missed) == 2 * config.depth
    assert any(missed) and hook.stats.bound_violations == sum(missed)
    assert max(hook.stats.max_abs_error.values()) > codec.tau
    strict = kv_hooks.CompressedKVHook(codec)
    with torch.no_grad(), kv_hooks.install(model, strict):
        with pytest.raises(ValueError, match=r"^layer \d [kv]: max \|x - x_hat\| = \S+ exceeds tau = 0.03125$"):
            model(x)
    assert strict.stats.bound_violations == 1


def test_low_rank_only_hook_is_exact_at_full_rank_and_lossy_below():
    k = torch.randn(1, 2, 40, 8)
    v = torch.randn(1, 2, 40, 8)
    full = kv_hooks.LowRankOnlyHook(rank=8, block_size=16)
    k_hat, _ = full(0, k, v)
    torch.testing.assert_close(k_hat, k.to(torch.bfloat16).float(), atol=1e-5, rtol=1e-5)
    low = kv_hooks.LowRankOnlyHook(rank=2, block_size=16)
    k_low, _ = low(0, k, v)
    assert (k_low - k).abs().max() > 0.1
    # 2 bytes x (40 x 2 coefficients + 3 blocks x 2 x 8 basis) per head, against 40 x 8 x 2 bytes dense
    assert low.stats.ratio("k") == pytest.approx((40 * 8) / (40 * 2 + 3 * 2 * 8))


def test_save_and_load_roundtrip(tmp_path):
    config = ModelConfig.toy("enformer", 3)
    model = build_model(config, seed=5).eval()
    path = tmp_path / "m.safetensors"
    save_model(model, str(path), {"track_names": ["a", "b", "c"]})
    loaded, metadata = load_model(str(path))
    assert loaded.config == config and metadata == {"track_names": ["a", "b", "c"]}
    x = _one_hot(1, config.window_bp, seed=4)
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="kind"):
        ModelConfig(kind="borzoi")
    with pytest.raises(ValueError, match="target_bins"):
        ModelConfig(window_bins=64, target_bins=33)
    with pytest.raises(ValueError, match="window_bins"):
        ModelConfig(kind="alphagenome", window_bins=72, target_bins=32)
