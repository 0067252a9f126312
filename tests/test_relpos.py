"""Fused Transformer-XL relative-position attention (Enformer, Borzoi): ``kvbound.attention(..., relative_keys=...)``
against the float64 references, its input checks, ``torch.compile`` tracing, and the model cores' single fused call.
CPU: the kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

import kvbound
from kvbound.attention import attention
from kvbound.models import relative_position_attention
from kvbound.models.reference import relative_position_attention_reference


def _inputs(b, h, n_q, dk, dv, dtype, seed=0, n_k=None):
    n_k = n_q if n_k is None else n_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, dk, generator=g)
    k = torch.randn(b, h, n_k, dk, generator=g)
    v = torch.randn(b, h, n_k, dv, generator=g)
    relative_keys = torch.randn(h, n_q + n_k - 1, dk, generator=g) * 0.5
    u = torch.randn(1, h, 1, dk, generator=g) * 0.5
    w = torch.randn(1, h, 1, dk, generator=g) * 0.5
    return [t.to(dtype) for t in (q, k, v, relative_keys)] + [u, w]


def relative_logits(
    position_query: torch.Tensor, relative_keys: torch.Tensor, n_q: int, first: int = 0
) -> torch.Tensor:
    """``position_query[i] . R[n_q - 1 + j - i]`` in float64 for the queries ``i`` given (``first, first + 1, ...`` of
    ``n_q``) and every key ``j`` (``R`` has ``n_q + n_k - 1`` rows): ``[B, H, rows, n_k]``."""
    rows = position_query.shape[2]
    n_k = relative_keys.shape[-2] - n_q + 1
    table = position_query.double() @ relative_keys.double().transpose(-1, -2)
    device = table.device
    queries = first + torch.arange(rows, device=device)
    index = n_q - 1 + torch.arange(n_k, device=device)[None, :] - queries[:, None]
    return torch.gather(table, -1, index.expand(*table.shape[:2], rows, n_k))


def composed_reference(q, k, v, relative_keys, u, w, scale, bias, softcap):
    """Relative positions, an additive bias, a soft-cap and the causal mask in float64, relative logits
    materialised (the kernel's order: relative logits, bias, soft-cap, mask); ``u``, ``w`` ``[1, H, 1, Dk]``."""
    n_q, n_k = q.shape[2], k.shape[2]
    qs = q.double() * scale
    relative = relative_logits(qs + w.double(), relative_keys, n_q)
    logits = (qs + u.double()) @ k.double().transpose(-1, -2) + relative + bias.double()
    logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double()


def _port_style(q, k, v, relative_keys, u, w, scale):
    """The ports' own formulation in the inputs' dtype: [B, H, N, 2N - 1] table, Transformer-XL pad/reshape shift."""
    qs = q * scale
    content = (qs + u.to(q.dtype)) @ k.transpose(-1, -2)
    table = (qs + w.to(q.dtype)) @ relative_keys.transpose(-1, -2)
    b, h, n, width = table.shape
    padded = torch.cat([torch.zeros_like(table[..., :1]), table], dim=-1)
    shifted = padded.reshape(b, h, width + 1, n)[:, :, 1:].reshape(b, h, n, width)[..., :n]
    return torch.softmax((content + shifted).float(), dim=-1).to(v.dtype) @ v


@pytest.mark.parametrize(
    ("b", "h", "n", "dk", "dv", "dtype"),
    [
        (1, 1, 1, 64, 192, torch.float16),
        (2, 2, 37, 40, 48, torch.float32),
        (1, 2, 37, 64, 192, torch.float16),
        (1, 1, 130, 64, 192, torch.float16),
        (1, 2, 130, 40, 48, torch.float32),
    ],
)
def test_fused_relative_matches_float64_reference(b, h, n, dk, dv, dtype):
    q, k, v, rk, u, w = _inputs(b, h, n, dk, dv, dtype, seed=n + dk)
    scale = dk**-0.5
    out = attention(q, k, v, scale=scale, relative_keys=rk, relative_content_bias=u, relative_position_bias=w)
    expected = relative_position_attention_reference(q, k, v, rk, u, w, scale=scale)
    plain = _port_style(q, k, v, rk, u, w, scale)
    err = (out.double() - expected).abs()
    plain_err = (plain.double() - expected).abs().max().item()
    print(
        f"relpos B={b} H={h} N={n} dk={dk} dv={dv} {dtype}: max err {err.max():.2e} (mean {err.mean():.2e}), "
        f"port-style same dtype {plain_err:.2e}"
    )
    assert out.shape == (b, h, n, dv) and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert err.max().item() <= 2 * plain_err + 1e-6


def test_fused_relative_composes_with_bias_softcap_causal_and_cross_lengths():
    """Nq != Nk (relative_keys [H, Nq + Nk - 1, Dk]), plus an additive bias, a soft-cap and the causal mask,
    against the same formula in float64 with the relative logits materialised (kernel order: relative logits,
    bias, soft-cap, mask)."""
    n_q, n_k, dk, dv = 21, 45, 40, 24
    q, k, v, rk, u, w = _inputs(1, 2, n_q, dk, dv, torch.float32, seed=3, n_k=n_k)
    bias = torch.randn(n_q, n_k, generator=torch.Generator().manual_seed(4))
    scale = 0.3
    out, lse = attention(
        q,
        k,
        v,
        scale=scale,
        causal=True,
        bias=bias,
        softcap=4.0,
        relative_keys=rk,
        relative_content_bias=u[0, :, 0],
        relative_position_bias=w,
        return_lse=True,
    )
    expected = composed_reference(q, k, v, rk, u, w, scale, bias, 4.0)
    err = (out.double() - expected).abs().max().item()
    print(f"relpos + bias + softcap + causal, Nq={n_q} Nk={n_k}: max err {err:.2e}")
    assert err < 2e-5 and torch.isfinite(lse).all()


def test_fused_relative_rejects_bad_inputs():
    q, k, v, rk, u, w = _inputs(1, 2, 9, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"relative_keys: expected shape \[Hq, Nq \+ Nk - 1, Dk\] = \[2, 17, 16\]"):
        attention(q, k, v, relative_keys=rk[:, :16])
    with pytest.raises(TypeError, match="relative_keys"):
        attention(q, k, v, relative_keys=rk.half())
    with pytest.raises(ValueError, match="relative_content_bias: given without relative_keys"):
        attention(q, k, v, relative_content_bias=u)
    with pytest.raises(ValueError, match=r"relative_position_bias: expected shape \[2, 16\]"):
        attention(q, k, v, relative_keys=rk, relative_position_bias=torch.zeros(3, 16))
    with pytest.raises(ValueError, match="one query head per K/V head"):
        attention(q, k[:, :1], v[:, :1], relative_keys=rk)
    with pytest.raises(ValueError, match="relative_keys"):
        bad = rk.clone()
        bad[1, 3, 2] = float("nan")
        attention(q, k, v, relative_keys=bad)
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    ck, cv = kvbound.compress_kv(k[:, :1], config), kvbound.compress_kv(v[:, :1], config)
    with pytest.raises(ValueError, match="one query head per K/V head"):
        attention(q, ck, cv, relative_keys=rk)


def test_fused_relative_leaves_inputs_and_traces_under_torch_compile():
    q, k, v, rk, u, w = _inputs(1, 2, 19, 16, 24, torch.float16, seed=5)
    copies = [t.clone() for t in (q, k, v, rk, u, w)]
    fn = torch.compile(
        lambda q, k, v, r, u, w: attention(q, k, v, relative_keys=r, relative_content_bias=u, relative_position_bias=w),
        backend="aot_eager",
        fullgraph=True,
    )
    out = fn(q, k, v, rk, u, w)
    expected = relative_position_attention_reference(q, k, v, rk, u, w, scale=16**-0.5)
    err = (out.double() - expected).abs().max().item()
    print(f"relpos under torch.compile: max err {err:.2e}")
    assert err < 2e-3
    for before, after in zip(copies, (q, k, v, rk, u, w), strict=True):
        assert torch.equal(before, after)


def _spy(monkeypatch) -> list[dict]:
    from kvbound.models import _backend

    calls = []

    def spy(q, k, v, **kwargs):
        bias = kwargs.get("bias")
        calls.append(
            dict(
                n_q=q.shape[2],
                relative=kwargs.get("relative_keys") is not None,
                bias=None if bias is None else tuple(bias.shape),
            )
        )
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    return calls


def test_relative_core_makes_one_fused_call_for_dense_and_compressed_kv(monkeypatch):
    """Dense and compressed K/V alike: one relative-position call over all queries, whatever query_chunk says
    (compressed: against the float64 reference on the decoded K/V)."""
    q, k, v, rk, u, w = _inputs(1, 2, 40, 16, 24, torch.float32, seed=9)
    calls = _spy(monkeypatch)
    out = relative_position_attention(q, k, v, rk, u, w, scale=0.25, query_chunk=16, backend="kvbound")
    expected = relative_position_attention_reference(q, k, v, rk, u, w, scale=0.25)
    err = (out.double() - expected).abs().max().item()
    print(f"relative core, dense K/V: calls {calls}, max err {err:.2e}")
    assert calls == [dict(n_q=40, relative=True, bias=None)]
    assert err < 2e-5
    calls.clear()
    config = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)
    ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
    out = relative_position_attention(q, ck, cv, rk, u, w, scale=0.25, query_chunk=16, backend="kvbound")
    expected = relative_position_attention_reference(q, ck.decompress(), cv.decompress(), rk, u, w, scale=0.25)
    err = (out.double() - expected).abs().max().item()
    print(f"relative core, compressed K/V: calls {calls}, max err {err:.2e}")
    assert calls == [dict(n_q=40, relative=True, bias=None)]
    assert err < 2e-5


@pytest.mark.parametrize(
    ("n_q", "n_k", "causal", "dtype"),
    [
        (37, 37, False, torch.float16),
        (45, 70, False, torch.float32),
        (70, 45, False, torch.float32),
        (21, 45, True, torch.float32),
    ],
)
def test_square_tiles_carry_half_of_the_window_product(n_q, n_k, causal, dtype):
    """With BLOCK_M == BLOCK_N the dense kernel's key loop multiplies only the upper half of each tile's relative
    window and carries it as the next tile's lower half (``_common.relative_window_half``; ragged tails, windows
    reaching past either end of the relative keys, cross lengths, the causal mask). Pinned square tiles against the
    float64 formula and against a non-square tile, which computes every window whole."""
    from kvbound.kernels.attention_dense import attention_dense_fwd

    dk, dv = 40, 24
    q, k, v, rk, u, w = _inputs(1, 2, n_q, dk, dv, dtype, seed=n_q + n_k, n_k=n_k)
    scale = dk**-0.5
    qs = q.double() * scale
    logits = (qs + u.double()) @ k.double().transpose(-1, -2) + relative_logits(qs + w.double(), rk, n_q)
    if causal:
        logits = logits.masked_fill(torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None], float("-inf"))
    expected = torch.softmax(logits, dim=-1) @ v.double()
    relative = (rk, u[0, :, 0].float().contiguous(), w[0, :, 0].float().contiguous())
    outs = {}
    for block_m, block_n, halves in ((16, 16, True), (32, 32, True), (16, 16, False), (32, 16, True)):
        config = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1}
        out, _ = attention_dense_fwd(
            q, k, v, None, scale, causal, None, config=config, relative=relative, relative_halves=halves
        )
        outs[block_m, block_n, halves] = out
    tolerance = 2e-5 if dtype == torch.float32 else 4e-3
    for tile, out in outs.items():
        err = (out.double() - expected).abs().max().item()
        print(f"relative, tile and halves {tile}, Nq={n_q} Nk={n_k} causal={causal} {dtype}: max err {err:.2e}")
        assert err < tolerance, tile
    for other in ((16, 16, False), (32, 16, True)):
        assert (outs[16, 16, True].double() - outs[other].double()).abs().max().item() < tolerance


def test_relative_halves_setting(monkeypatch):
    from kvbound.kernels._common import relative_halves_default

    monkeypatch.delenv("KVBOUND_RELATIVE_HALVES", raising=False)
    assert relative_halves_default() is False
    monkeypatch.setenv("KVBOUND_RELATIVE_HALVES", " ")  # empty counts as unset
    assert relative_halves_default() is False
    monkeypatch.setenv("KVBOUND_RELATIVE_HALVES", "1")
    assert relative_halves_default() is True
    monkeypatch.setenv("KVBOUND_RELATIVE_HALVES", "yes")
    with pytest.raises(ValueError, match="KVBOUND_RELATIVE_HALVES: expected 0 or 1, got 'yes'"):
        relative_halves_default()


def test_relative_halves_gets_its_own_plan_and_kernel_path(monkeypatch):
    """Through the autotuned launch (plan cache, no pinned config): ``relative_halves`` False and True give two plans
    (``RELATIVE`` 1 and 3), and each runs only its own path: the whole-window path never calls
    ``relative_window_half``, the halves path never calls ``relative_logits_tile`` (the interpreter resolves the
    kernels' helper functions at run time, so a replaced helper would raise)."""
    import triton

    from kvbound.kernels import attention_dense

    tuner = attention_dense._attention_dense_fwd
    monkeypatch.setattr(tuner, "configs", [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)])
    monkeypatch.setattr(attention_dense, "_RELATIVE_SHAPES", frozenset({(16, 16, 4, 1)}))
    caches = (attention_dense._TUNED, attention_dense._PLANS, tuner.cache)
    for cache in caches:
        cache.clear()
    n, dk, dv = 45, 40, 24
    q, k, v, rk, u, w = _inputs(1, 2, n, dk, dv, torch.float32, seed=6)
    scale = dk**-0.5
    expected = relative_position_attention_reference(q, k, v, rk, u, w, scale=scale)
    relative = (rk, u[0, :, 0].float().contiguous(), w[0, :, 0].float().contiguous())

    def refuse(*args, **kwargs):
        raise AssertionError("this relative path must not run")

    try:
        for halves, other_path in ((False, "relative_window_half"), (True, "relative_logits_tile")):
            with monkeypatch.context() as m:
                m.setattr(attention_dense, other_path, refuse)
                out, _ = attention_dense.attention_dense_fwd(
                    q, k, v, None, scale, False, None, relative=relative, relative_halves=halves
                )
            assert (out.double() - expected).abs().max().item() < 2e-5, halves
        assert sorted(plan.constexprs["RELATIVE"] for plan in attention_dense._PLANS.values()) == [1, 3]
    finally:
        for cache in caches:
            cache.clear()


@pytest.mark.parametrize("skew", ["gather", "shared"])
def test_other_skews_match_float64_in_a_fresh_process(skew):
    """``KVBOUND_RELATIVE_SKEW=gather`` (warp shuffles) and ``=shared`` (shared memory, row-major) move the window
    product into place by other means than the default; the setting is read when the kernels are imported, so each
    runs in a fresh interpreted process: whole windows and carried halves, float16 and float32, the ports' own
    formulation in the same dtype as the baseline (the fused error at most twice its error against float64)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = f"""
import sys
sys.path.insert(0, {str(here)!r})
import torch
from kvbound.kernels import _common
from kvbound.kernels.attention_dense import attention_dense_fwd
from kvbound.models.reference import relative_position_attention_reference
from test_relpos import _inputs, _port_style
assert _common.RELATIVE_SKEW_NAME == {skew!r}, _common.RELATIVE_SKEW_NAME
for n, dtype in ((37, torch.float16), (45, torch.float32)):
    q, k, v, rk, u, w = _inputs(1, 2, n, 40, 24, dtype, seed=n)
    scale = 40**-0.5
    expected = relative_position_attention_reference(q, k, v, rk, u, w, scale=scale)
    plain = (_port_style(q, k, v, rk, u, w, scale).double() - expected).abs().max().item()
    relative = (rk, u[0, :, 0].float().contiguous(), w[0, :, 0].float().contiguous())
    for halves in (False, True):
        config = {{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}}
        out, _ = attention_dense_fwd(q, k, v, None, scale, False, None, config=config, relative=relative,
                                     relative_halves=halves)
        err = (out.double() - expected).abs().max().item()
        print(n, dtype, halves, err, plain)
        assert torch.isfinite(out).all() and err <= 2 * plain + 1e-6, (n, dtype, halves, err, plain)
"""
    env = {**os.environ, "KVBOUND_RELATIVE_SKEW": skew, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.count("\n") == 4  # every case ran
