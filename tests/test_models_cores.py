"""The memory-lean attention cores of kvbound.models against their float64 references (no port needed)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvbound
from kvbound.models import TileBias, _backend, attention_output_bound, relative_position_attention, tile_bias_attention
from kvbound.models.reference import (
    relative_position_attention_reference,
    tile_bias_attention_reference,
)
from kvbound.models.tile_bias import expand_tile_rows


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _relative_inputs(b, h, n, dk, dv, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, dk, generator=g)
    k = torch.randn(b, h, n, dk, generator=g)
    v = torch.randn(b, h, n, dv, generator=g)
    relative_keys = torch.randn(h, 2 * n - 1, dk, generator=g) * 0.5
    u = torch.randn(1, h, 1, dk, generator=g) * 0.5
    pos = torch.randn(1, h, 1, dk, generator=g) * 0.5
    return [t.to(dtype) for t in (q, k, v, relative_keys, u, pos)]


def _relative_port_style_fp32(q, k, v, relative_keys, u, pos, scale):
    """The ports' own formulation in float32: full [B, H, N, 2N-1] table and Transformer-XL pad/reshape shift."""
    qs = q * scale
    content = (qs + u) @ k.transpose(-1, -2)
    table = (qs + pos) @ relative_keys.transpose(-1, -2)
    b, h, n, width = table.shape
    padded = torch.cat([torch.zeros_like(table[..., :1]), table], dim=-1)
    shifted = padded.reshape(b, h, width + 1, n)[:, :, 1:].reshape(b, h, n, width)[..., :n]
    return torch.softmax(content + shifted, dim=-1) @ v


@pytest.mark.parametrize(
    ("b", "h", "n", "dk", "dv", "chunk"),
    [
        (2, 3, 37, 16, 24, 5),
        (1, 2, 1, 8, 8, None),
        (1, 4, 113, 64, 192, 16),
        (2, 2, 40, 8, 16, 40),
        (1, 1, 23, 40, 59, 1),
    ],
)
def test_relative_position_attention_matches_reference(b, h, n, dk, dv, chunk):
    q, k, v, rk, u, pos = _relative_inputs(b, h, n, dk, dv)
    scale = dk**-0.5
    expected = relative_position_attention_reference(q, k, v, rk, u, pos, scale=scale)
    out = relative_position_attention(q, k, v, rk, u, pos, scale=scale, query_chunk=chunk, backend="eager")
    plain = _relative_port_style_fp32(q, k, v, rk, u, pos, scale)
    err = (out.double() - expected).abs().max().item()
    plain_err = (plain.double() - expected).abs().max().item()
    print(f"relative N={n} chunk={chunk}: lean max err {err:.2e}, port-style fp32 {plain_err:.2e}")
    assert out.shape == (b, h, n, dv) and out.dtype == torch.float32
    assert err <= 2 * plain_err + 1e-6


def test_lean_cores_through_fused_kvbound_attention():
    """The same chunks handed to kvbound.attention (Triton; interpreted on CPU) instead of the eager form."""
    q, k, v, rk, u, pos = _relative_inputs(1, 2, 37, 16, 24, seed=7)
    expected = relative_position_attention_reference(q, k, v, rk, u, pos, scale=0.25)
    out = relative_position_attention(q, k, v, rk, u, pos, scale=0.25, query_chunk=16, backend="kvbound")
    plain = _relative_port_style_fp32(q, k, v, rk, u, pos, 0.25)
    err, plain_err = (out.double() - expected).abs().max().item(), (plain.double() - expected).abs().max().item()
    print(f"relative via kvbound.attention: max err {err:.2e}, port-style fp32 {plain_err:.2e}")
    assert err <= 2 * plain_err + 1e-6
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 8, 40, 32, generator=g), torch.randn(1, 1, 40, 32, generator=g), torch.randn(1, 1, 40, 48)
    values = torch.randn(1, 8, 3, 3, generator=g)
    expected = tile_bias_attention_reference(q, k, v, values, scale=0.2, softcap=5.0)
    out = tile_bias_attention(
        q, k, v, TileBias(values, 16, 40, 40), scale=0.2, softcap=5.0, query_chunk=16, backend="kvbound"
    )
    err = (out.double() - expected).abs().max().item()
    print(f"tile bias via kvbound.attention: max err {err:.2e}")
    assert err < 2e-6


def _spy_on_fused_attention(monkeypatch) -> list[dict]:
    """Record the bias shape, ``bias_tile`` and query count of every ``kvbound.attention`` call the lean paths make."""
    from kvbound.attention import attention
    from kvbound.models import _backend

    calls = []

    def spy(q, k, v, **kwargs):
        bias = kwargs.get("bias")
        calls.append(
            dict(n_q=q.shape[2], bias=None if bias is None else tuple(bias.shape), bias_tile=kwargs.get("bias_tile", 1))
        )
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    return calls


@pytest.mark.parametrize(("tile", "n"), [(16, 50), (8, 40), (12, 40)])
def test_tile_bias_fused_backend_reads_the_compact_bias_in_one_call(tile, n, monkeypatch):
    """On the fused backend a power-of-two TileBias goes to kvbound.attention once, compact (bias_tile), over all
    queries, whatever query_chunk says; another tile size is expanded chunk by chunk (the kernels index tiles
    by powers of two)."""
    g = torch.Generator().manual_seed(tile)
    q, k, v = torch.randn(1, 8, n, 32, generator=g), torch.randn(1, 1, n, 32, generator=g), torch.randn(1, 1, n, 24)
    tiles = -(-n // tile)
    values = torch.randn(1, 8, tiles, tiles, generator=g) * 2
    calls = _spy_on_fused_attention(monkeypatch)
    out = tile_bias_attention(
        q, k, v, TileBias(values, tile, n, n), scale=0.2, softcap=5.0, query_chunk=16, backend="kvbound"
    )
    expected = tile_bias_attention_reference(q, k, v, values, tile_size=tile, scale=0.2, softcap=5.0)
    err = (out.double() - expected).abs().max().item()
    print(f"tile {tile}, N={n}: {len(calls)} call(s) {calls}, max err {err:.2e}")
    assert err < 2e-6
    if tile & (tile - 1) == 0:
        assert calls == [dict(n_q=n, bias=tuple(values.shape), bias_tile=tile)]
    else:
        assert [c["n_q"] for c in calls] == [16, 16, n - 32] and all(c["bias_tile"] == 1 for c in calls)


def test_relative_position_attention_never_builds_n_by_n():
    b, h, n, chunk = 1, 2, 96, 16
    q, k, v, rk, u, pos = _relative_inputs(b, h, n, 16, 16)
    with LargestTensor() as lean:
        relative_position_attention(q, k, v, rk, u, pos, scale=0.25, query_chunk=chunk, backend="eager")
    with LargestTensor() as full:
        relative_position_attention_reference(q, k, v, rk, u, pos, scale=0.25)
    print(f"largest tensor: lean {lean.largest}, reference {full.largest}, H*N*N {h * n * n}")
    assert full.largest >= b * h * n * n  # the instrument sees an N x N tensor when there is one
    assert lean.largest <= b * h * chunk * (chunk + n - 1)


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "n", "chunk", "softcap"),
    [(2, 8, 1, 64, 16, 5.0), (1, 8, 1, 50, 7, 5.0), (1, 4, 2, 33, None, None), (1, 2, 1, 16, 16, 1.0)],
)
def test_tile_bias_attention_matches_reference(b, hq, hkv, n, chunk, softcap):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, hq, n, 128, generator=g)
    k = torch.randn(b, hkv, n, 128, generator=g)
    v = torch.randn(b, hkv, n, 192, generator=g)
    tiles = -(-n // 16)
    values = torch.randn(b, hq, tiles, tiles, generator=g) * 3
    scale = 128**-0.5
    expected = tile_bias_attention_reference(q, k, v, values, scale=scale, softcap=softcap)
    bias = TileBias(values, 16, n, n)
    lean = tile_bias_attention(q, k, v, bias, scale=scale, softcap=softcap, query_chunk=chunk, backend="eager")
    full = tile_bias_attention(q, k, v, bias.expand(), scale=scale, softcap=softcap, query_chunk=chunk, backend="eager")
    plain = torch.softmax(
        _softcap((q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * scale + bias.expand(), softcap), -1
    ) @ v.repeat_interleave(hq // hkv, 1)
    plain_err = (plain.double() - expected).abs().max().item()
    for name, out in (("tile", lean), ("full", full)):
        err = (out.double() - expected).abs().max().item()
        print(f"tile-bias N={n} chunk={chunk} {name}: max err {err:.2e}, plain fp32 {plain_err:.2e}")
        assert err <= 2 * plain_err + 1e-6


def _softcap(x, c):
    return x if c is None else c * torch.tanh(x / c)


def test_tile_bias_expand_rows_match_repeat():
    values = torch.randn(2, 3, 4, 4)
    full = values.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, :55, :55]
    bias = TileBias(values, 16, 55, 55)
    assert torch.equal(bias.expand(), full)
    for start, stop in ((0, 1), (5, 37), (16, 32), (47, 55)):
        assert torch.equal(expand_tile_rows(bias, start, stop), full[:, :, start:stop])


def test_tile_bias_rejects_wrong_shapes():
    with pytest.raises(ValueError, match=r"TileBias.values: expected \[B, H, 4, 4\]"):
        TileBias(torch.zeros(1, 8, 3, 4), 16, 64, 64)
    q, k, v = torch.zeros(1, 8, 32, 16), torch.zeros(1, 1, 32, 16), torch.zeros(1, 1, 32, 8)
    with pytest.raises(ValueError, match="bias: expected a TileBias over 32 x 32"):
        tile_bias_attention(q, k, v, TileBias(torch.zeros(1, 8, 1, 1), 16, 16, 16), scale=1.0, softcap=None)
    with pytest.raises(ValueError, match="broadcastable"):
        tile_bias_attention(q, k, v, torch.zeros(1, 8, 31, 32), scale=1.0, softcap=None)
    with pytest.raises(ValueError, match="relative_keys: expected shape"):
        relative_position_attention(q, q, q, torch.zeros(8, 62, 16), torch.zeros(8, 16), torch.zeros(8, 16), scale=1.0)


def test_tile_bias_attention_never_builds_full_bias():
    b, hq, n, chunk = 1, 8, 128, 32
    q, k, v = torch.randn(b, hq, n, 32), torch.randn(b, 1, n, 32), torch.randn(b, 1, n, 16)
    bias = TileBias(torch.randn(b, hq, n // 16, n // 16), 16, n, n)
    with LargestTensor() as lean:
        tile_bias_attention(q, k, v, bias, scale=0.2, softcap=5.0, query_chunk=chunk, backend="eager")
    with LargestTensor() as full:
        tile_bias_attention_reference(q, k, v, bias.values, scale=0.2, softcap=5.0)
    print(f"largest tensor: lean {lean.largest}, reference {full.largest}, Hq*N*N {hq * n * n}")
    assert full.largest >= b * hq * n * n
    assert lean.largest <= b * hq * chunk * n


# ------------------------------------------------------------------------------------------ compressed K/V
def test_output_bounds_refuse_what_would_make_them_wrong():
    """Negative or NaN taus, non-finite or unpaired tensors gave negative, NaN, empty or broadcast 'bounds'."""
    from kvbound.models import linear_output_bound

    g = torch.Generator().manual_seed(7)
    a, v = torch.randn(1, 2, 5, 4, generator=g), torch.randn(1, 2, 7, 3, generator=g)
    cases = [
        (dict(tau_k=-0.5, tau_v=0.1), ValueError, r"^tau_k: expected a finite float >= 0, got -0\.5$"),
        (dict(tau_k=0.1, tau_v=math.nan), ValueError, r"^tau_v: expected a finite float >= 0, got nan$"),
        (dict(tau_k=0.1, tau_v=0.1, logit_scale=math.inf), ValueError, r"^logit_scale: expected a finite float, got"),
        (dict(tau_k="0.1", tau_v=0.1), TypeError, r"^tau_k: expected a float, got str$"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            attention_output_bound(a, v, **kwargs)
    bad = a.clone()
    bad[0, 1, 2, 3] = math.nan
    with pytest.raises(ValueError, match=r"^effective_query: expected finite values, found nan at index \(0, 1, 2, 3"):
        attention_output_bound(bad, v, tau_k=0.1, tau_v=0.1)
    with pytest.raises(ValueError, match=r"^effective_query: expected a head count that is a multiple of v's 2, got 1"):
        attention_output_bound(a[:, :1], v, tau_k=0.1, tau_v=0.1)
    with pytest.raises(ValueError, match=r"^v: expected batch 1 \(from effective_query\), got 3$"):
        attention_output_bound(a, v.expand(3, -1, -1, -1), tau_k=0.1, tau_v=0.1)
    with pytest.raises(ValueError, match=r"^v: expected a non-empty tensor, got shape \(1, 2, 0, 3\)$"):
        attention_output_bound(a, v[:, :, :0], tau_k=0.1, tau_v=0.1)
    with pytest.raises(TypeError, match=r"^v: expected dtype in \(float16, bfloat16, float32, float64\), got int64$"):
        attention_output_bound(a, v.long(), tau_k=0.1, tau_v=0.1)
    bound = attention_output_bound(a, v, tau_k=0.1, tau_v=0.1)
    assert bound.shape == (1, 2, 5, 3) and bool((bound >= 0.1).all())
    with pytest.raises(ValueError, match=r"^bound: expected values >= 0"):
        linear_output_bound(-bound, torch.randn(6, 3, generator=g))
    with pytest.raises(ValueError, match=r"^weight: expected \[out, 3\] \(in from bound\), got \[6, 4\]$"):
        linear_output_bound(bound, torch.randn(6, 4, generator=g))


def test_output_bound_holds_under_worst_case_perturbations():
    """attention_output_bound against float64 outputs with K/V moved by up to tau, adversarially and randomly."""
    g = torch.Generator().manual_seed(3)
    b, h, n, dk, dv, tau = 1, 2, 24, 16, 8, 0.05
    q, k, v, rk, u, pos = (t.double() for t in _relative_inputs(b, h, n, dk, dv, seed=3))
    scale = dk**-0.5
    effective = q * scale + u
    bound = attention_output_bound(effective, v, tau_k=tau, tau_v=tau)
    exact = relative_position_attention_reference(q, k, v, rk, u, pos, scale=scale)
    worst = 0.0
    for trial in range(20):
        if trial < 2:  # push every logit of every query up (or down) for the first half of the keys only
            sign = torch.sign(effective)[:, :, :1].expand(b, h, n, dk) * (1 if trial == 0 else -1)
            dk_ = torch.where(torch.arange(n)[:, None] < n // 2, sign, -sign) * tau
        else:
            dk_ = (torch.rand(b, h, n, dk, generator=g, dtype=torch.float64) * 2 - 1) * tau
        dv_ = torch.sign(torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)) * tau
        moved = relative_position_attention_reference(q, k + dk_, v + dv_, rk, u, pos, scale=scale)
        ratio = ((moved - exact).abs() / bound).max().item()
        worst = max(worst, ratio)
        assert ratio <= 1.0
    print(f"largest error / bound over 20 perturbations: {worst:.3f}")


def _compressed(x, config):
    ckv = kvbound.compress_kv(x, config)
    assert ckv.max_abs_error(x) <= config.tau
    return ckv


@pytest.mark.parametrize(("n", "backend"), [(40, "eager"), (77, "eager"), (40, "kvbound")])
def test_relative_attention_on_compressed_kv_within_bound(n, backend):
    b, h, dk, dv = 1, 2, 16, 24
    q, k, v, rk, u, pos = _relative_inputs(b, h, n, dk, dv, seed=5)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    scale = dk**-0.5
    ck, cv = _compressed(k, config), _compressed(v, config)
    out = relative_position_attention(q, ck, cv, rk, u, pos, scale=scale, query_chunk=16, backend=backend)
    exact = relative_position_attention_reference(q, k, v, rk, u, pos, scale=scale)
    bound = attention_output_bound(q.double() * scale + u.double(), v, tau_k=config.tau, tau_v=config.tau)
    err = (out.double() - exact).abs()
    print(
        f"relative N={n} {backend}, K {ck.compression_ratio:.2f}x V {cv.compression_ratio:.2f}x: output max err "
        f"{err.max().item():.2e} (mean {err.mean().item():.2e}), bound max {bound.max().item():.2e} "
        f"min {bound.min().item():.2e}"
    )
    assert (err <= bound + 1e-5).all()


@pytest.mark.parametrize("backend", ["eager", "kvbound"])
def test_tile_bias_attention_on_compressed_kv_within_bound(backend):
    b, hq, n = 1, 8, 64
    g = torch.Generator().manual_seed(6)
    q = torch.nn.functional.layer_norm(torch.randn(b, hq, n, 128, generator=g), (128,))
    k = torch.nn.functional.layer_norm(torch.randn(b, 1, n, 128, generator=g), (128,))
    v = torch.nn.functional.layer_norm(torch.randn(b, 1, n, 192, generator=g), (192,))
    values = torch.randn(b, hq, n // 16, n // 16, generator=g)
    config = kvbound.CompressionConfig(block_size=16, rank=8, bits=4)
    ck, cv = _compressed(k, config), _compressed(v, config)
    scale = 1 / math.sqrt(128)
    bias = TileBias(values, 16, n, n)
    out = tile_bias_attention(q, ck, cv, bias, scale=scale, softcap=5.0, query_chunk=32, backend=backend)
    exact = tile_bias_attention_reference(q, k, v, values, scale=scale, softcap=5.0)
    bound = attention_output_bound(q, v, tau_k=config.tau, tau_v=config.tau, logit_scale=scale)
    err = (out.double() - exact).abs()
    print(
        f"tile-bias N={n} {backend}: output max err {err.max().item():.2e} (mean {err.mean().item():.2e}), "
        f"bound max {bound.max().item():.2e}"
    )
    assert (err <= bound + 1e-5).all()


def test_explicit_kvbound_backend_never_falls_back(monkeypatch):
    q, k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    bias = TileBias(torch.randn(1, 2, 2, 2), 16, 32, 32)
    with pytest.raises(ValueError, match=r"^backend: expected one of \('auto', 'eager', 'kvbound'\), got 'flash'$"):
        tile_bias_attention(q, k, v, bias, scale=0.25, softcap=5.0, backend="flash")
    out = tile_bias_attention(q, k, v, bias, scale=0.25, softcap=5.0, backend="kvbound")
    expected = tile_bias_attention_reference(q, k, v, bias.values, scale=0.25, softcap=5.0)
    assert (out.double() - expected).abs().max().item() < 1e-4
    # an installation without the fused op: the explicit backend raises instead of running another implementation
    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: None)
    with pytest.raises(RuntimeError, match="kvbound.attention is not available"):
        tile_bias_attention(q, k, v, bias, scale=0.25, softcap=5.0, backend="kvbound")


def test_patched_module_folds_finished_encode_events():
    # On CUDA each compressed forward records a pair of events around its encoder calls; finished pairs are folded
    # into the total as new ones arrive, so an inference loop that never reads encode_seconds keeps few alive.
    import torch

    from kvbound.models.patch import PatchedModule

    class Event:  # stands in for torch.cuda.Event (no GPU here)
        def __init__(self, t, done):
            self.t, self.done = t, done

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    record = PatchedModule(name="m", kind="k", role="attention", module=torch.nn.Identity())
    for i in range(100):
        record._add_encode_events(Event(i, True), Event(i + 0.002, True))
    assert len(record._encode_events) == 1
    record._add_encode_events(Event(0, False), Event(0.5, False))  # still running: kept, then waited for
    assert len(record._encode_events) == 1
    assert abs(record.encode_seconds - (100 * 0.002 + 0.5)) < 1e-9 and record._encode_events == []
