"""kvbound.attention against the float64 oracle, on awkward shapes, dense and compressed K/V.

Criterion (as flash-attention's tests): the kernel's max error against ``reference_attention`` (float64, on the
decompressed K/V for compressed inputs) is at most twice that of plain PyTorch attention computed in the same
dtype, plus a tiny absolute floor. CPU runs use Triton's interpreter (tests/conftest.py sets it) with fp16/fp32.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbound import CompressionConfig, calibrate, compress_kv, reference_attention
from kvbound.attention import attention

# Absolute floor added to the 2x criterion: a few units in the last place of the output dtype at unit scale.
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def plain_attention(q, k, v, *, scale=None, causal=False, bias=None, softcap=None):
    """torch softmax(q k^T) v in q's dtype (the baseline whose error the kernel must match)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k = k.to(q.dtype).repeat_interleave(group, 1)
    v = v.to(q.dtype).repeat_interleave(group, 1)
    logits = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias.to(q.dtype)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~keep, -math.inf)
    return torch.softmax(logits, dim=-1) @ v


def check_against_reference(out, q, k_ref, v_ref, **kw):
    """Assert the 2x criterion; ``k_ref``/``v_ref`` are what the kernel must reproduce (decompressed if compressed)."""
    ref_kw = dict(kw)
    if ref_kw.get("bias") is not None and ref_kw["bias"].dtype == torch.float64:
        # reference_attention takes 16/32-bit floats; the kernel reads a float64 bias as float32 too.
        ref_kw["bias"] = ref_kw["bias"].float()
    ref = reference_attention(q, k_ref, v_ref, **ref_kw)
    plain = plain_attention(q, k_ref, v_ref, **kw)
    err = (out.double() - ref).abs()
    plain_err = (plain.double() - ref).abs()
    print(
        f"kernel max {err.max().item():.3e} mean {err.mean().item():.3e} | "
        f"plain {q.dtype} max {plain_err.max().item():.3e} mean {plain_err.mean().item():.3e}"
    )
    assert out.dtype == q.dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert err.max().item() <= 2 * plain_err.max().item() + FLOOR[q.dtype]


def structured(b, h, n, d, dtype, seed, *, spikes=True):
    """Rank-6 rows plus noise, with blocks that need every storage mode at block size 16 and the default tau:
    rows 16-31 get noise that 4-bit codes hold, rows 32-47 noise that needs wider codes, and one outlier
    (row 50) and rows 64-79 of wide noise that only exact storage certifies; the rest is low-rank within tau."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(h, d, 6, generator=g, dtype=torch.float64))[0].transpose(1, 2)
    x = torch.randn(b, h, n, 6, generator=g, dtype=torch.float64) * math.sqrt(d / 6) @ basis
    x += (torch.rand(b, h, n, d, generator=g, dtype=torch.float64) * 2 - 1) * 0.004
    if spikes:
        x[:, :, 16:32] += torch.randn(b, h, min(n, 32) - min(n, 16), d, generator=g, dtype=torch.float64) * 0.05
        x[:, :, 32:48] += torch.randn(b, h, min(n, 48) - min(n, 32), d, generator=g, dtype=torch.float64) * 0.4
        if n > 50:
            x[:, :, 50, 3] += 40.0
        if n > 64:
            x[:, :, 64:80] += torch.randn(b, h, min(n, 80) - 64, d, generator=g, dtype=torch.float64) * 8.0
    return x.to(dtype)


def all_modes(ckv) -> bool:
    return all(share > 0 for share in ckv.mode_fractions().values())


# ------------------------------------------------------------------------------------------------- dense
DENSE_CASES = [
    # B, Hq, Hkv, Nq, Nk, Dk, Dv, dtype, causal, bias shape (None = no bias), softcap
    (1, 2, 2, 1, 1, 64, 64, torch.float16, False, None, None),
    (1, 2, 2, 37, 37, 40, 192, torch.float16, True, None, None),
    (2, 4, 1, 37, 200, 64, 40, torch.float32, False, (200,), 5.0),
    (1, 6, 2, 200, 37, 40, 64, torch.float16, True, (1, 1, 200, 37), None),
    (1, 8, 1, 5, 1000, 64, 64, torch.float16, False, (1, 8, 1, 1000), 3.0),
    # A soft-cap above kernels._common.FIXED_MAX_LIMIT: the running maximum is tracked.
    (1, 4, 2, 37, 70, 64, 48, torch.float16, True, (1, 4, 37, 70), 30.0),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}/{c[2]}N{c[3]}x{c[4]}D{c[5]}/{c[6]}")
def test_dense_matches_reference(case):
    b, hq, hkv, nq, nk, dk, dv, dtype, causal, bias_shape, softcap = case
    g = torch.Generator().manual_seed(nq * 7 + nk)
    q = torch.randn(b, hq, nq, dk, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, dk, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, dv, generator=g).to(dtype)
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=g)
    out = attention(q, k, v, causal=causal, bias=bias, softcap=softcap)
    check_against_reference(out, q, k, v, causal=causal, bias=bias, softcap=softcap)


def test_dense_noncontiguous_inputs_and_custom_scale():
    """[B, N, H, D] storage viewed as [B, H, N, D] (strides go to the kernel, no copies), GQA, causal."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 37, 4, 64, generator=g).to(torch.float16).transpose(1, 2)
    k = torch.randn(1, 37, 2, 64, generator=g).to(torch.float16).transpose(1, 2)
    v = torch.randn(1, 48, 2, 37, generator=g).to(torch.float16).permute(0, 2, 3, 1)[..., :40]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = attention(q, k, v, causal=True, scale=0.3)
    check_against_reference(out, q, k, v, causal=True, scale=0.3)


def test_bias_of_every_float_dtype_broadcast():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 19, 64, generator=g).to(torch.float16)
    k = torch.randn(2, 2, 33, 64, generator=g).to(torch.float16)
    v = torch.randn(2, 2, 33, 64, generator=g).to(torch.float16)
    for dtype, shape in ((torch.float64, (2, 1, 19, 1)), (torch.bfloat16, (33,)), (torch.float16, (1, 2, 1, 33))):
        bias = (torch.randn(shape, generator=g) * 3).to(dtype)
        out = attention(q, k, v, bias=bias)
        check_against_reference(out, q, k, v, bias=bias)


@pytest.mark.parametrize("softcap", [4.0, 30.0], ids=["fixed-max", "running-max"])
def test_lse_is_natural_log_sum_exp(softcap):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 37, 40, generator=g)
    k = torch.randn(1, 2, 53, 40, generator=g)
    v = torch.randn(1, 2, 53, 24, generator=g)
    bias = torch.randn(37, 53, generator=g)
    out, lse = attention(q, k, v, causal=True, bias=bias, softcap=softcap, return_lse=True)
    logits = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(40) + bias.double()
    logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~torch.ones(37, 53, dtype=torch.bool).tril(), -math.inf)
    want = torch.logsumexp(logits, dim=-1)
    err = (lse.double() - want).abs().max().item()
    print(f"lse max err {err:.3e}")
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 37)
    assert err < 1e-5


# -------------------------------------------------------------------------------------------- compressed
def every_mode_case():
    """float16 q [1, 4, 37, 64] (GQA over 2 K/V heads), K and V of 200 keys compressed with a shared basis into
    every storage mode (dk 64, dv 40)."""
    cfg = CompressionConfig(block_size=16, rank=8)
    k = structured(1, 2, 200, 64, torch.float16, 1)
    v = structured(1, 2, 200, 40, torch.float16, 2)
    # Calibrated on clean samples of the same heads (same seed: same low-rank basis, no spikes).
    ck = compress_kv(k, cfg, calibrate(structured(1, 2, 200, 64, torch.float16, 1, spikes=False), cfg))
    cv = compress_kv(v, cfg, calibrate(structured(1, 2, 200, 40, torch.float16, 2, spikes=False), cfg))
    assert all_modes(ck) and all_modes(cv), (ck.mode_fractions(), cv.mode_fractions())
    q = torch.randn(1, 4, 37, 64, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    return q, ck, cv


def test_compressed_shared_basis_every_mode_gqa_causal_bias_softcap():
    q, ck, cv = every_mode_case()
    bias = torch.randn(1, 4, 1, 200, generator=torch.Generator().manual_seed(5))
    out = attention(q, ck, cv, causal=True, bias=bias, softcap=5.0)
    check_against_reference(out, q, ck.decompress(), cv.decompress(), causal=True, bias=bias, softcap=5.0)


def test_compressed_per_block_basis_every_mode_mqa_fp32():
    cfg = CompressionConfig(block_size=16, rank=8, bits=4)
    k = structured(2, 1, 77, 40, torch.float32, 3)
    v = structured(2, 1, 77, 192, torch.float32, 4)
    ck, cv = compress_kv(k, cfg), compress_kv(v, cfg)
    assert not ck.shared_basis and all_modes(ck) and all_modes(cv), (ck.mode_fractions(), cv.mode_fractions())
    q = torch.randn(2, 8, 37, 40, generator=torch.Generator().manual_seed(6))
    out = attention(q, ck, cv)
    check_against_reference(out, q, ck.decompress(), cv.decompress())


@pytest.mark.parametrize("n", [1, 37])
def test_compressed_mixed_configs_and_rank_zero(n):
    """K and V with different block sizes, widths and ranks (V: rank 0, residual codes only)."""
    k = structured(1, 2, n, 64, torch.float16, 5)
    v = structured(1, 2, n, 64, torch.float16, 6)
    ck = compress_kv(k, CompressionConfig(block_size=32, rank=8, bits=3))
    cv = compress_kv(v, CompressionConfig(block_size=16, rank=0, bits=2))
    q = torch.randn(1, 2, n, 64, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    out = attention(q, ck, cv, causal=True)
    check_against_reference(out, q, ck.decompress(), cv.decompress(), causal=True)


@pytest.mark.parametrize("compressed", [False, True])
def test_extreme_logits_never_nan(compressed):
    """q scaled by 1e3: logits in the tens of thousands. fp16 plain attention overflows here, so the baseline is
    plain attention in float32 on the same fp16 inputs."""
    k = structured(1, 1, 100, 64, torch.float16, 8)
    v = structured(1, 1, 100, 64, torch.float16, 9)
    q = (torch.randn(1, 2, 37, 64, generator=torch.Generator().manual_seed(10)) * 1e3).to(torch.float16)
    cfg = CompressionConfig(block_size=16)
    kk, vv = (compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))) if compressed else (k, v)
    out = attention(q, kk, vv, causal=True)
    k_ref, v_ref = (kk.decompress(), vv.decompress()) if compressed else (k, v)
    ref = reference_attention(q, k_ref, v_ref, causal=True)
    plain32 = plain_attention(q.float(), k_ref.float(), v_ref.float(), causal=True)
    err = (out.double() - ref).abs().max().item()
    plain_err = (plain32.double() - ref).abs().max().item()
    print(f"kernel max {err:.3e} | plain float32 max {plain_err:.3e}")
    assert torch.isfinite(out).all()
    # fp16 output rounding of values up to |v|max is the unavoidable part.
    assert err <= 2 * plain_err + 2.0**-10 * v_ref.abs().max().item()


def test_inputs_are_not_modified():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 2, 17, 64, generator=g).to(torch.float16)
    k = torch.randn(1, 1, 17, 64, generator=g).to(torch.float16)
    v = torch.randn(1, 1, 17, 64, generator=g).to(torch.float16)
    bias = torch.randn(17, generator=g)
    copies = [t.clone() for t in (q, k, v, bias)]
    attention(q, k, v, bias=bias, softcap=2.0)
    for before, after in zip(copies, (q, k, v, bias), strict=True):
        assert torch.equal(before, after)


def test_output_follows_the_query_layout_dense_compressed_and_compiled():
    """A q that is a head-split view of [B, N, H * D] (the ports' layout) gives an output in the same order, so that
    ``out.transpose(1, 2).reshape(B, N, H * Dv)`` is a view; the fake implementations (torch.compile) agree with the
    kernels on the strides; a contiguous q gives a contiguous output."""
    g = torch.Generator().manual_seed(21)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v), backend="aot_eager", fullgraph=True)
    for b in (2, 1):  # batch 1: the size-1 dimension must not turn the layout back to row-major
        q = torch.randn(b, 29, 3 * 32, generator=g).to(torch.float16).view(b, 29, 3, 32).transpose(1, 2)
        k = structured(b, 3, 29, 32, torch.float16, 31)
        v = structured(b, 3, 29, 48, torch.float16, 32)
        ck = compress_kv(k, CompressionConfig(block_size=16, rank=4))
        cv = compress_kv(v, CompressionConfig(block_size=16, rank=4))
        _check_output_layout(q, k, v, ck, cv, compiled)


def _check_output_layout(q, k, v, ck, cv, compiled):
    b = q.shape[0]
    for kk, vv, kd, vd in ((k, v, k, v), (ck, cv, ck.decompress(), cv.decompress())):
        out = attention(q, kk, vv)
        assert out.transpose(1, 2).is_contiguous()
        if b > 1:
            assert out.stride() == (29 * 3 * 48, 48, 3 * 48, 1)
        check_against_reference(out, q, kd, vd)
        contiguous = attention(q.contiguous(), kk, vv)
        assert contiguous.is_contiguous()
        torch.testing.assert_close(contiguous, out, rtol=0, atol=0)
        traced = compiled(q, kk, vv)
        assert traced.stride() == out.stride()
        torch.testing.assert_close(traced, out, rtol=0, atol=0)


def test_torch_compile_traces_both_ops():
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 21, 64, generator=g).to(torch.float16)
    k = structured(1, 1, 21, 64, torch.float16, 14)
    v = structured(1, 1, 21, 64, torch.float16, 15)
    ck = compress_kv(k, CompressionConfig(block_size=16))
    cv = compress_kv(v, CompressionConfig(block_size=16))
    fn = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    check_against_reference(fn(q, k, v), q, k, v, causal=True)
    check_against_reference(fn(q, ck, cv), q, ck.decompress(), cv.decompress(), causal=True)
    tiles = torch.randn(1, 2, 2, 2, generator=g)
    tiled = torch.compile(
        lambda q, k, v, b: attention(q, k, v, bias=b, bias_tile=16, softcap=5.0), backend="aot_eager", fullgraph=True
    )
    full = expand_tile_bias(tiles, 16, 21, 21)
    check_against_reference(tiled(q, ck, cv, tiles), q, ck.decompress(), cv.decompress(), bias=full, softcap=5.0)


# -------------------------------------------------------------------------------------------- tile bias
def expand_tile_bias(bias: torch.Tensor, tile: int, n_q: int, n_k: int) -> torch.Tensor:
    """The full bias of a compact one (``bias_tile``): ``repeat_interleave`` on the last two dimensions, cropped;
    size-1 dimensions are left to broadcast."""
    if bias.dim() >= 2 and bias.shape[-2] > 1:
        bias = bias.repeat_interleave(tile, -2)[..., :n_q, :]
    if bias.shape[-1] > 1:
        bias = bias.repeat_interleave(tile, -1)[..., :n_k]
    return bias


TILE_CASES = [
    # B, Hq, Hkv, Nq, Nk, Dk, Dv, dtype, causal, tile, compact bias shape, softcap, K/V compressed
    (1, 8, 1, 40, 77, 64, 48, torch.float16, False, 16, (1, 8, 3, 5), 5.0, False),
    (2, 4, 2, 37, 53, 40, 40, torch.float32, True, 4, (10, 14), None, False),
    (1, 2, 2, 45, 100, 64, 64, torch.float16, False, 32, (1, 2, 1, 4), 30.0, False),
    (1, 8, 1, 21, 97, 64, 48, torch.float16, False, 16, (1, 8, 2, 7), 5.0, True),
    (2, 2, 1, 33, 70, 40, 192, torch.float32, True, 32, (2, 1, 2, 3), 5.0, True),
]


@pytest.mark.parametrize(
    "case", TILE_CASES, ids=lambda c: f"T{c[9]}-N{c[3]}x{c[4]}-H{c[1]}/{c[2]}-{'compressed' if c[12] else 'dense'}"
)
def test_tile_bias_matches_expanded_reference(case):
    """``bias_tile=T``: the compact bias against the reference given the same bias expanded by repeat_interleave."""
    b, hq, hkv, nq, nk, dk, dv, dtype, causal, tile, bias_shape, softcap, compressed = case
    g = torch.Generator().manual_seed(nq + nk + tile)
    q = torch.randn(b, hq, nq, dk, generator=g).to(dtype)
    bias = torch.randn(bias_shape, generator=g) * 3
    if compressed:
        cfg = CompressionConfig(block_size=16, rank=8)
        kk = compress_kv(structured(b, hkv, nk, dk, dtype, nk), cfg)
        vv = compress_kv(structured(b, hkv, nk, dv, dtype, nk + 1), cfg)
        assert kk.mode_fractions()["lowrank"] < 1.0
        k_ref, v_ref = kk.decompress(), vv.decompress()
    else:
        kk = k_ref = torch.randn(b, hkv, nk, dk, generator=g).to(dtype)
        vv = v_ref = torch.randn(b, hkv, nk, dv, generator=g).to(dtype)
    out = attention(q, kk, vv, causal=causal, bias=bias, bias_tile=tile, softcap=softcap)
    full = expand_tile_bias(bias, tile, nq, nk)
    check_against_reference(out, q, k_ref, v_ref, causal=causal, bias=full, softcap=softcap)


def test_tile_bias_of_one_equals_full_bias():
    """``bias_tile=1`` is the plain bias; a compact bias and its expansion give the same result to rounding."""
    g = torch.Generator().manual_seed(17)
    q = torch.randn(1, 4, 29, 32, generator=g)
    k = torch.randn(1, 2, 50, 32, generator=g)
    v = torch.randn(1, 2, 50, 16, generator=g)
    tiles = torch.randn(1, 4, 4, 7, generator=g)
    full = expand_tile_bias(tiles, 8, 29, 50)
    compact = attention(q, k, v, bias=tiles, bias_tile=8, softcap=5.0)
    expanded = attention(q, k, v, bias=full, bias_tile=1, softcap=5.0)
    err = (compact - expanded).abs().max().item()
    print(f"compact vs expanded bias: max diff {err:.3e}")
    assert err < 1e-6


# ---------------------------------------------------------------------------------- fixed softmax maximum
@pytest.mark.parametrize("compressed", [False, True])
def test_soft_capped_rows_far_below_the_cap(compressed):
    """With a soft-cap the kernels use a fixed softmax maximum (no running maximum). Rows whose every logit sits
    near -cap (a bias of -1e4) exercise its smallest probabilities, e**(-2 cap), in float16 operands."""
    g = torch.Generator().manual_seed(19)
    q = torch.randn(1, 4, 37, 64, generator=g).to(torch.float16)
    k = structured(1, 2, 80, 64, torch.float16, 20)
    v = structured(1, 2, 80, 48, torch.float16, 21)
    bias = torch.zeros(1, 4, 37, 1)
    bias[:, :, ::2] = -1.0e4
    cfg = CompressionConfig(block_size=16)
    kk, vv = (compress_kv(k, cfg), compress_kv(v, cfg)) if compressed else (k, v)
    k_ref, v_ref = (kk.decompress(), vv.decompress()) if compressed else (k, v)
    for softcap in (5.0, 9.5):
        out = attention(q, kk, vv, bias=bias, softcap=softcap)
        check_against_reference(out, q, k_ref, v_ref, bias=bias, softcap=softcap)


# ------------------------------------------------------------------------------------------ host syncs
SYNC_METHODS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__", "numpy", "cpu")


def count_host_syncs(monkeypatch) -> list[str]:
    """Record every call of a torch.Tensor method that reads device values on the host (the ways a call can
    synchronise with the device)."""
    calls: list[str] = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def recording(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recording)
    return calls


def _sync_cases():
    g = torch.Generator().manual_seed(23)
    q = torch.randn(1, 4, 40, 32, generator=g).to(torch.float16)
    k = torch.randn(1, 2, 40, 32, generator=g).to(torch.float16)
    v = torch.randn(1, 2, 40, 32, generator=g).to(torch.float16)
    cfg = CompressionConfig(block_size=16)
    low_k = structured(1, 2, 40, 32, torch.float16, 24, spikes=False)
    low_v = structured(1, 2, 40, 32, torch.float16, 25, spikes=False)
    ck0 = compress_kv(low_k, cfg, calibrate(low_k, cfg))
    ck1, cv1 = compress_kv(structured(1, 2, 40, 32, torch.float16, 26), cfg), compress_kv(low_v, cfg)
    assert ck0.mode_fractions()["lowrank"] == 1.0 and ck1.mode_fractions()["lowrank"] < 1.0
    cv0 = compress_kv(low_v, cfg, calibrate(low_v, cfg))
    return {
        "dense": ((q, k, v), {}),
        "dense-bias-softcap": ((q, k, v), dict(bias=torch.randn(40, generator=g), softcap=5.0)),
        "dense-tile-bias": ((q, k, v), dict(bias=torch.randn(1, 4, 3, 3, generator=g), bias_tile=16)),
        "compressed-lowrank": ((q, ck0, cv0), dict(causal=True)),
        "compressed-residual": ((q, ck1, cv1), dict(bias=torch.randn(1, 4, 3, 3, generator=g), bias_tile=16)),
    }


@pytest.mark.parametrize("name", list(_sync_cases()))
def test_one_host_sync_per_call(name, monkeypatch):
    """The finite check and (compressed) the residual flags are read back together, once; nothing else in a call
    reads device values on the host (block runs are built on the device)."""
    args, kwargs = _sync_cases()[name]
    attention(*args, **kwargs)  # first call: autotuning and compilation
    calls = count_host_syncs(monkeypatch)
    attention(*args, **kwargs)
    print(f"{name}: host reads {calls}")
    assert calls == ["tolist"]


# ------------------------------------------------------------------------------------------- validation
def _tensors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 32, generator=g).to(torch.float16)
    k = torch.randn(1, 2, 8, 32, generator=g).to(torch.float16)
    v = torch.randn(1, 2, 8, 16, generator=g).to(torch.float16)
    return q, k, v


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda q, k, v: (q.double(), k, v), TypeError,
         r"^q: expected dtype in \(float16, bfloat16, float32\), got float64$"),
        (lambda q, k, v: (q, k.float(), v), TypeError, r"^k: expected dtype in \(float16\), got float32$"),
        (lambda q, k, v: (q[0], k, v), ValueError, r"^q: expected 4 dimensions, got 3 \(shape \(4, 8, 32\)\)$"),
        (lambda q, k, v: (q, k[..., :16], v), ValueError,
         r"^k: expected shape \[1, Hkv, Nk, 32\] \(B and Dk from q\), got \[1, 2, 8, 16\]$"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError,
         r"^v: expected shape \[1, 2, 8, Dv\] \(from k\), got \[1, 1, 8, 16\]$"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError,
         r"^q: expected a head count that is a multiple of k's 2, got 3$"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), ValueError,
         r"^k: expected a non-empty tensor, got shape \(1, 2, 0, 32\)$"),
        (lambda q, k, v: (q, compress_kv(k, CompressionConfig(block_size=16)), v), TypeError,
         r"^k, v: expected both torch.Tensor or both kvbound.CompressedKV, got CompressedKV and Tensor$"),
        (lambda q, k, v: (q, [k], v), TypeError, r"^k: expected a torch.Tensor, got list$"),
    ],
)
def test_invalid_inputs_raise_clear_errors(change, error, words):
    q, k, v = change(*_tensors())
    with pytest.raises(error, match=words):
        attention(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v", "bias"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_inputs_raise(name, value):
    q, k, v = _tensors()
    tensors = {"q": q, "k": k, "v": v, "bias": torch.zeros(8)}
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[5] = value
    with pytest.raises(ValueError, match=f"{name}: expected finite values"):
        attention(tensors["q"], tensors["k"], tensors["v"], bias=tensors["bias"])


def test_non_finite_broadcast_bias_is_reported_as_expanded():
    """The finite check reads a broadcast bias once (not its expansion), yet reports the index and count of the
    expanded ``[B, Hq, Nq, Nk]`` bias; a compact tile bias is reported as itself."""
    q, k, v = _tensors()
    bias = torch.zeros(8)
    bias[5] = math.nan
    with pytest.raises(ValueError, match=r"^bias: expected finite values, found nan at index \(0, 0, 0, 5\) \(32 non"):
        attention(q, k, v, bias=bias)
    tiles = torch.zeros(1, 4, 2, 2)
    tiles[0, 3, 1, 0] = math.inf
    with pytest.raises(ValueError, match=r"^bias: expected finite values, found inf at index \(0, 3, 1, 0\) \(1 non"):
        attention(q, k, v, bias=tiles, bias_tile=4)


def test_large_finite_inputs_pass_the_finite_check():
    """Finite values whose float32 sum overflows pass the finite check (it reads each tensor's largest
    magnitude)."""
    g = torch.Generator().manual_seed(29)
    q = torch.randn(1, 2, 9, 16, generator=g)
    k = torch.randn(1, 2, 12, 16, generator=g)
    v = torch.randn(1, 2, 12, 16, generator=g)
    bias = torch.full((12,), 2.0e38)
    assert not math.isfinite(bias.sum().item())
    out = attention(q, k, v, bias=bias)
    check_against_reference(out, q, k, v, bias=bias)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("field", ["coeffs", "basis", "scale", "raw"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_compressed_tensors_raise(name, field, value):
    """NaN or Inf written into any floating tensor that compressed K or V store (coefficients, basis, steps, exact
    values) raises at the call, naming the operand and the field, whether or not an earlier call's check was
    recorded on the object (the write moves the tensor's version counter)."""
    q, ck, cv = every_mode_case()
    attention(q, ck, cv)  # records the check of both operands
    target = getattr({"k": ck, "v": cv}[name], field)
    assert target.numel() > 0
    target.view(-1)[target.numel() // 2] = value
    with pytest.raises(ValueError, match=rf"^{name}\.{field}: expected finite values"):
        attention(q, ck, cv)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(scale=math.nan), ValueError, "scale"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-2.0), ValueError, "softcap"),
        (dict(softcap=1e20), ValueError, r"^softcap: expected at most 2\*\*64 or None, got 1e\+20"),
        (dict(softcap=1e-39), ValueError,
         r"^softcap: expected at least 2\*\*-64 and \|scale\| / softcap within float32's range, got softcap 1e-39"),
        (dict(softcap=1e-10, scale=1e30), ValueError,
         r"^softcap: expected at least .*, got softcap 1e-10 at scale 1e\+30"),
        (dict(causal=1), TypeError, "causal"),
        (dict(bias=torch.zeros(3, 8)), ValueError, "bias: expected a shape broadcastable to"),
        (dict(bias=torch.zeros(8, dtype=torch.int32)), TypeError, "bias: expected dtype"),
        (dict(bias=torch.zeros(1), bias_tile=3), ValueError, r"bias_tile: expected a power of two from 1 to .*, got 3"),
        (dict(bias=torch.zeros(1), bias_tile=0), ValueError, r"bias_tile: expected a power of two from 1 to .*, got 0"),
        (dict(bias=torch.zeros(1), bias_tile=True), TypeError, "bias_tile: expected int, got bool"),
        (dict(bias=torch.zeros(1), bias_tile=4.0), TypeError, "bias_tile: expected int, got float"),
        (
            dict(bias=torch.zeros(1, 4, 8, 8), bias_tile=4),
            ValueError,
            r"bias: expected a shape broadcastable to \[B, Hq, ceil\(Nq / 4\), ceil\(Nk / 4\)\] = \[1, 4, 2, 2\] "
            r"for bias_tile=4, got \[1, 4, 8, 8\]",
        ),
        (dict(bias=torch.zeros(3), bias_tile=4), ValueError, r"= \[1, 4, 2, 2\] for bias_tile=4, got \[3\]"),
    ],
)
def test_invalid_options_raise(kwargs, error, words):
    with pytest.raises(error, match=words):
        attention(*_tensors(), **kwargs)


@pytest.mark.parametrize("inference", [False, True])
def test_compressed_values_beyond_float32_sums_raise(inference):
    """Compressed V whose exact blocks hold values too large for the kernel's float32 sums over the keys: the call
    raises naming v, whether the stored tensors are checked with the call (inference tensors, which keep no record)
    or at the operand's first call (the bound is recorded with the check and used by later calls). Values below the
    limit give the reference's output on the decompressed K/V."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    config = CompressionConfig(block_size=16, rank=2, bits=4, tau=0.05)
    limit = torch.finfo(torch.float32).max / 32
    for big, raises in ((limit * 2, True), (limit / 8, False)):
        v_big = v.clone()
        v_big[0, 0, :16] = big  # one block: stored exactly
        with torch.inference_mode(inference):
            ck, cv = compress_kv(k, config), compress_kv(v_big, config)
            for _ in range(2):  # the second call reads the bound recorded by the first (outside inference mode)
                if raises:
                    with pytest.raises(ValueError, match=r"^v: expected a largest magnitude of at most .*compressed"):
                        attention(q, ck, cv)
                else:
                    out = attention(q, ck, cv)
                    expected = reference_attention(q, ck.decompress(), cv.decompress())
                    assert torch.isfinite(out).all()
                    assert ((out.double() - expected).abs() <= 1e-5 * expected.abs().amax()).all()


def test_logits_beyond_float32_raise_naming_q_and_k():
    """q and k large enough that a float32 logit can overflow (1e20 each at head dim 16) raise before the kernel
    runs, naming both; relative keys with a large query and a bias near float32's largest value raise naming
    them."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
    q_big, k_big = q.clone(), k.clone()
    q_big[0, 1, 3, 2], k_big[0, 0, 7, 5] = 1e20, 1e20
    with pytest.raises(ValueError, match=r"^q, k: expected magnitudes whose logits stay below 2\.36e\+38"):
        attention(q_big, k_big, v)
    keys = torch.full((2, 47, 16), 1e20)
    u, w = torch.zeros(2, 16), torch.zeros(2, 16)
    with pytest.raises(ValueError, match=r"^relative_keys: expected magnitudes"):
        attention(q_big, k, v, relative_keys=keys, relative_content_bias=u, relative_position_bias=w)
    # the kernels scale logits by log2(e): a bias between 3.4e38 / log2(e) and 3.4e38 would overflow there
    for value in (2.4e38, -2.4e38):
        with pytest.raises(ValueError, match=r"^bias: expected magnitudes whose logits stay below"):
            attention(q, k, v, bias=torch.full((24, 24), value))
    check_against_reference(attention(q, k, v), q, k, v)  # ordinary magnitudes pass


def test_logits_beyond_float32_raise_for_triton_encoded_keys():
    """The synchronous Triton encoder records a bound on its output's magnitudes (x's largest plus tau), so that
    compressed K fresh from it (recorded as checked: attention reads none of its tensors) is held to float32's range
    too: a key of 1e20 outside the basis's span, stored exactly, with a query of 1e20 along it, raises naming q and k
    before the kernel runs."""
    g = torch.Generator().manual_seed(6)
    config = CompressionConfig(rank=4, bits=4, block_size=16, tau=0.05)
    sample = torch.zeros(1, 2, 32, 16)
    sample[..., :4] = torch.randn(1, 2, 32, 4, generator=g)  # the basis spans the first four coordinates
    basis = calibrate(sample, config)
    k = sample.clone()
    k[..., :4] = torch.randn(1, 2, 32, 4, generator=g)
    v = torch.randn(1, 2, 32, 16, generator=g)
    k_big = k.clone()
    k_big[0, 1, 20, 9] = 1e20
    q = torch.randn(1, 2, 8, 16, generator=g)
    ck = compress_kv(k_big, config, basis, impl="triton")
    cv = compress_kv(v, config, basis=None)
    assert ck._checked_residual() is not None  # attention trusts the encoder's record and reads nothing of ck
    assert ck._checked_magnitude() == pytest.approx(1e20 + 0.05)
    assert float(ck.decompress().abs().amax()) == float(torch.tensor(1e20))  # stored exactly
    q_big = q.clone()
    q_big[0, 1, 2, 9] = 1e20
    with pytest.raises(ValueError, match=r"^q, k: expected magnitudes whose logits stay below"):
        attention(q_big, ck, cv)
    ordinary = compress_kv(k, config, basis, impl="triton")
    assert ordinary._checked_magnitude() == pytest.approx(float(k.abs().amax()) + 0.05)
    check_against_reference(attention(q, ordinary, cv), q, ordinary.decompress(), cv.decompress())


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention(*_tensors())


# --------------------------------------------------------------------------------------------------- GPU
def _gpu_case(n, dk, dv, hq, hkv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, hq, n, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, dk, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, dv, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v


def _check_rows(out, q, k_ref, v_ref, rows, **kw):
    """The 2x criterion on the first query rows (the float64 reference of all rows would not fit)."""
    check_against_reference(out[:, :, :rows].contiguous(), q[:, :, :rows].contiguous(), k_ref, v_ref, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("n, dk, dv, hq, hkv", [(4096, 64, 64, 8, 8), (65536, 128, 128, 8, 8), (8192, 128, 192, 8, 1)])
def test_gpu_dense_bf16(n, dk, dv, hq, hkv):
    q, k, v = _gpu_case(n, dk, dv, hq, hkv, n + dk)
    out = attention(q, k, v)
    _check_rows(out, q, k, v, 128)


@pytest.mark.gpu
def test_gpu_dense_bf16_causal_bias_softcap_mqa():
    q, k, v = _gpu_case(8192, 128, 192, 8, 1, 1)
    tile = torch.randn(1, 8, 512, 512, device="cuda")
    bias = tile.repeat_interleave(16, 2).repeat_interleave(16, 3)
    out = attention(q, k, v, bias=bias, softcap=5.0)
    check_against_reference(
        out[:, :, :64].contiguous(), q[:, :, :64].contiguous(), k, v, bias=bias[:, :, :64], softcap=5.0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("compressed", [False, True])
def test_gpu_alphagenome_compact_tile_bias_bf16(compressed):
    q, k, v = _gpu_case(8192, 128, 192, 8, 1, 2)
    tiles = torch.randn(1, 8, 512, 512, device="cuda")
    if compressed:
        cfg = CompressionConfig()
        k, v = compress_kv(k, cfg), compress_kv(v, cfg)
    out = attention(q, k, v, bias=tiles, bias_tile=16, softcap=5.0)
    k_ref, v_ref = (k.decompress(), v.decompress()) if compressed else (k, v)
    full = expand_tile_bias(tiles[:, :, :4], 16, 64, 8192)
    check_against_reference(
        out[:, :, :64].contiguous(), q[:, :, :64].contiguous(), k_ref, v_ref, bias=full, softcap=5.0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False])
def test_gpu_compressed_bf16(shared):
    n, d = 65536 if shared else 16384, 64
    cfg = CompressionConfig()
    k = structured(1, 8, n, d, torch.float32, 21, spikes=False).to("cuda", torch.bfloat16)
    v = structured(1, 8, n, d, torch.float32, 22, spikes=False).to("cuda", torch.bfloat16)
    k[:, :, 1000:1200] += 0.2 * torch.randn_like(k[:, :, 1000:1200])
    ck = compress_kv(k, cfg, calibrate(k, cfg) if shared else None)
    cv = compress_kv(v, cfg, calibrate(v, cfg) if shared else None)
    q = torch.randn(1, 8, n, d, device="cuda", dtype=torch.bfloat16)
    out = attention(q, ck, cv)
    check_against_reference(out[:, :, :128].contiguous(), q[:, :, :128].contiguous(), ck.decompress(), cv.decompress())


def test_flags_and_scalars_of_the_wrong_type_are_refused():
    """Flags take bools and scalars take Python numbers: a truthy int or string for ``return_lse``, a NumPy or
    tensor scale, booleans as run starts and a bias tile beyond the kernels' 32-bit indices raise, naming the
    argument; bfloat16 is refused on the CPU, where Triton's interpreter multiplies bfloat16 tiles wrongly."""
    import numpy as np

    q, k, v = _tensors()
    for value in (1, "no"):
        with pytest.raises(TypeError, match=r"^return_lse: expected bool, got"):
            attention(q, k, v, return_lse=value)
    for value, name in ((np.float32(0.5), "numpy.float32"), (torch.tensor(0.5), "torch.Tensor")):
        with pytest.raises(TypeError, match=rf"^scale: expected a float or None, got {name} \(pass float\(scale\)\)$"):
            attention(q, k, v, scale=value)
    with pytest.raises(TypeError, match=r"^softcap: expected a float or None, got numpy.float32 \(pass float"):
        attention(q, k, v, softcap=np.float32(5.0))
    with pytest.raises(ValueError, match=r"^bias_tile: expected a power of two from 1 to 2\*\*30, got"):
        attention(q, k, v, bias=torch.zeros(1, 1, 1, 1), bias_tile=2**40)
    with pytest.raises(ValueError, match=r"^bias_tile: expected 1 without a bias \(it gives the tile size of bias\), "
                                         r"got 16"):
        attention(q, k, v, bias_tile=16)
    n = q.shape[2] + k.shape[2] - 1
    keys = torch.zeros(q.shape[1], n, q.shape[3])
    with pytest.raises(TypeError, match=r"^relative_runs: expected a sequence of ints"):
        attention(q, k, v, relative_keys=keys, relative_runs=[False, True])
    with pytest.raises(TypeError, match=r"^q: expected float16 or float32 on the CPU, got torch.bfloat16"):
        attention(q.bfloat16(), k.bfloat16(), v.bfloat16())


@pytest.mark.parametrize("compressed", [False, True])
def test_backward_raises_a_clear_error(compressed):
    """kvbound.attention computes the forward only: with an input that requires grad the forward runs, and a
    backward through it raises saying so and where gradients come from, instead of returning none."""
    q, k, v = _tensors()
    q = q.clone().requires_grad_()
    if compressed:
        config = CompressionConfig(block_size=16)
        k, v = compress_kv(k, config), compress_kv(v, config)
    out = attention(q, k, v)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"^kvbound.attention: expected no backward pass"):
        out.sum().backward()
    assert q.grad is None


def test_compressed_layout_is_checked_before_the_kernels_read_it():
    """The kernels read codes and exact values at the stored offsets: an object whose offsets, code buffer or
    widths were edited after encoding is refused at its first call, naming the operand and the field, before any
    kernel reads past its buffers."""
    import dataclasses

    q, ck, cv = every_mode_case()
    for bad, field in (
        (dataclasses.replace(ck, offset=ck.offset + 10**6), "offset"),
        (dataclasses.replace(ck, codes=ck.codes[:5]), "offset"),
        (dataclasses.replace(ck, mode=torch.full_like(ck.mode, 7)), "mode"),
    ):
        with pytest.raises(ValueError, match=rf"^k: {field}: expected"):
            attention(q, bad, cv)
    check_against_reference(attention(q, ck, cv), q, ck.decompress(), cv.decompress())


def test_first_call_on_unrecorded_compressed_kv_reads_each_once(monkeypatch):
    """K/V without a checked record (copies of checked objects keep none) are checked on their first call, the layout
    and the finite values in one read per object, then the call's own read; a second call reads once."""
    import dataclasses

    q, ck, cv = _sync_cases()["compressed-residual"][0]
    attention(q, ck, cv)  # compile
    fresh_k, fresh_v = dataclasses.replace(ck), dataclasses.replace(cv)
    assert fresh_k._checked_residual() is None and fresh_v._checked_residual() is None
    calls = count_host_syncs(monkeypatch)
    attention(q, fresh_k, fresh_v)
    assert calls == ["tolist"] * 3
    calls.clear()
    attention(q, fresh_k, fresh_v)
    assert calls == ["tolist"]


def test_checked_compressed_kv_under_a_profiler_reads_once_and_is_recorded_by_name(monkeypatch):
    """Under torch.profiler the op runs through the dispatcher (so that the trace names it) and still uses the
    objects' checked records: inside kvbound.deferred_checks() no read until the block ends, as without the
    profiler (an unrecorded object's layout and which kernel variant runs would be read before the kernel)."""
    from torch.profiler import ProfilerActivity, profile

    import kvbound

    q, ck, cv = _sync_cases()["compressed-residual"][0]
    expected = attention(q, ck, cv)  # compiles; checks and records both objects
    calls = count_host_syncs(monkeypatch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with kvbound.deferred_checks():
            out = attention(q, ck, cv)
            assert calls == []
    assert calls == ["tolist"]
    assert any(e.name == "kvbound::attention_compressed" for e in prof.events())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's store
def test_output_beyond_q_dtype_from_wider_compressed_v_raises():
    """The output takes q's dtype; compressed V of a wider dtype may decode beyond its range. Checked after the
    kernel with the call's reads (at the block's end inside kvbound.deferred_checks()); V in range passes."""
    import kvbound

    g = torch.Generator().manual_seed(41)
    q = torch.randn(1, 2, 8, 16, generator=g).half()
    k, v = torch.randn(1, 2, 32, 16, generator=g), torch.randn(1, 2, 32, 16, generator=g)
    cfg = CompressionConfig(block_size=16, rank=4)
    ck, cv = compress_kv(k, cfg), compress_kv(v, cfg)
    out = attention(q, ck, cv)
    check_against_reference(out, q, ck.decompress().half(), cv.decompress().half())
    big = compress_kv(v * 1e5, cfg)  # float32 values up to some 3e5: beyond float16's 65504
    message = (r"^output \(float16 as q; v is a float32 CompressedKV whose values may exceed float16's range: pass q "
               r"in float32 or compress V in q's dtype\): expected finite values")
    with pytest.raises(ValueError, match=message + r", found -?inf at index"):
        attention(q, ck, big)
    deferred = (r", found Inf \(the output of kvbound.attention call 1: q \[1, 2, 8, 16\], in this deferred-check "
                r"block\)$")
    with pytest.raises(ValueError, match=message + deferred):
        with kvbound.deferred_checks():
            attention(q, ck, big)
    assert torch.isfinite(attention(q.float(), ck, big)).all()  # in q's float32 the same call holds


def test_wider_compressed_v_bounded_within_q_dtype_costs_no_second_read(monkeypatch):
    """float32 compressed V whose checked bound lies within float16: the output is not read again."""
    g = torch.Generator().manual_seed(43)
    q = torch.randn(1, 2, 8, 16, generator=g).half()
    cfg = CompressionConfig(block_size=16, rank=4)
    ck, cv = (compress_kv(torch.randn(1, 2, 32, 16, generator=g), cfg) for _ in range(2))
    attention(q, ck, cv)  # compiles, and records both operands' checks
    calls = count_host_syncs(monkeypatch)
    out = attention(q, ck, cv)
    assert calls == ["tolist"]
    check_against_reference(out, q, ck.decompress().half(), cv.decompress().half())


def test_unscaled_products_beyond_float32_raise_even_under_a_tiny_scale():
    """The dense kernel forms q . k in float32 before scaling: logits of 1.6e11 from products of 1.6e41 under a
    scale of 1e-30 gave a non-finite output; they raise, naming q and k."""
    q, k = torch.full((1, 1, 4, 16), 1.0e20), torch.full((1, 1, 8, 16), 1.0e20)
    k[0, 0, ::2] *= -1
    v = torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(reference_attention(q, k, v, scale=1e-30)).all()
    with pytest.raises(ValueError, match=r"^q, k: expected dk max\|q\| max\|k\| below 1\.33e\+36 \(float32's range "
                                         r"over 2\*\*8: the kernels form q \. k before scaling it\), got 1\.6e\+41"):
        attention(q, k, v, scale=1e-30)
