"""The bounded maximum of compressed attention: launches of low-rank tiles alone (no residual anywhere, or the
low-rank pass of a split) replace the running row maximum by a bound from the rank-space query and the box of the
head's key coefficients, and put P in a wide-range type (bfloat16; float32 here, in Triton's interpreter). It must
compute the same attention, fall back to the running maximum where the bound overshoots so far that P would
underflow, and stay off where it does not apply."""

from __future__ import annotations

import math

import pytest
import torch

from kvbound import CompressionConfig, calibrate, compress_kv
from kvbound.attention import attention
from kvbound.kernels import attention_compressed as kernels
from kvbound.kernels._common import bounded_setting
from test_attention import check_against_reference, structured  # tests/ is on sys.path (rootdir conftest)


def _constexprs(monkeypatch) -> list[dict]:
    """(PASS, BOUNDED) of every kernel launch from now on, with the bounded maximum on wherever it applies
    (``KVBOUND_BOUNDED_MAX=on``: by default it starts at ``BOUNDED_MIN_KEYS`` keys, more than these tests use)."""
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    seen: list[dict] = []
    original = kernels.launch_tuned

    def spy(kernel, tuned, grid, args, constexprs, tune_key, config):
        seen.append((constexprs["PASS"], constexprs["BOUNDED"]))
        return original(kernel, tuned, grid, args, constexprs, tune_key, config)

    monkeypatch.setattr(kernels, "launch_tuned", spy)
    return seen


def _lowrank_case(dtype=torch.float32, n=150, seed=3):
    """K/V within tau of a shared rank-8 basis (every block low rank only), GQA: 4 query heads on 2 K/V heads."""
    cfg = CompressionConfig(block_size=16, rank=8, tau=0.25)
    k = structured(1, 2, n, 64, torch.float32, seed, spikes=False)
    v = structured(1, 2, n, 40, torch.float32, seed + 1, spikes=False)
    ck = compress_kv(k, cfg, calibrate(k, cfg))
    cv = compress_kv(v, cfg, calibrate(v, cfg))
    assert int((ck.mode != 0).sum()) == 0 and int((cv.mode != 0).sum()) == 0
    q = torch.randn(1, 4, 37, 64, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    return q, ck, cv


@pytest.mark.parametrize("causal", [False, True])
def test_bounded_matches_running_max_and_float64(monkeypatch, causal):
    q, ck, cv = _lowrank_case()
    seen = _constexprs(monkeypatch)
    out, lse = attention(q, ck, cv, causal=causal, return_lse=True)
    assert seen == [(0, True)]
    check_against_reference(out, q, ck.decompress(), cv.decompress(), causal=causal)
    # No program of this case retries: without the second attempt the output is the same to the bit.
    retry_sum = kernels.BOUND_RETRY_SUM
    monkeypatch.setattr(kernels, "BOUND_RETRY_SUM", 0.0)
    assert torch.equal(attention(q, ck, cv, causal=causal), out)
    monkeypatch.setattr(kernels, "BOUND_RETRY_SUM", retry_sum)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "0")
    tracked, tracked_lse = attention(q, ck, cv, causal=causal, return_lse=True)
    assert seen[-1] == (0, False)
    assert torch.allclose(out, tracked, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, tracked_lse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, tracked)  # a different path (no maximum tracked), equal to float32 rounding


def test_bounded_low_rank_pass_of_a_split(monkeypatch):
    """With residual blocks the residual-capable pass keeps the running maximum; the low-rank pass is bounded."""
    cfg = CompressionConfig(block_size=16, rank=8)
    k = structured(1, 2, 200, 64, torch.float32, 1)
    v = structured(1, 2, 200, 40, torch.float32, 2)
    ck = compress_kv(k, cfg, calibrate(structured(1, 2, 200, 64, torch.float32, 1, spikes=False), cfg))
    cv = compress_kv(v, cfg, calibrate(structured(1, 2, 200, 40, torch.float32, 2, spikes=False), cfg))
    q = torch.randn(1, 4, 37, 64, generator=torch.Generator().manual_seed(4))
    seen = _constexprs(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    out = attention(q, ck, cv)
    assert seen == [(1, True), (2, False)]
    check_against_reference(out, q, ck.decompress(), cv.decompress())


def _far_bound_case(factor: float = 1.0):
    """Keys of rank 2 with coefficients near (+-600, 0) and (0, +-500), queries along (1, 1): the largest logit
    comes from one axis, but the box bound adds both, about 190 log2 units above the true maximum, so that
    exp2(x - bound) underflows to 0 in float32. ``factor`` scales the keys, and with them every gap."""
    g = torch.Generator().manual_seed(0)
    n, d = 64, 16
    axis = torch.arange(n) % 4
    coeffs = torch.zeros(n, 2)
    coeffs[axis == 0, 0], coeffs[axis == 1, 0], coeffs[axis == 2, 1], coeffs[axis == 3, 1] = (
        600.0,
        -600.0,
        500.0,
        -500.0,
    )
    coeffs += torch.randn(n, 2, generator=g) * 0.5
    k = (coeffs * factor @ torch.eye(d)[:2]).reshape(1, 1, n, d)
    v = (torch.randn(n, 2, generator=g) @ torch.eye(d)[2:4]).reshape(1, 1, n, d)
    cfg = CompressionConfig(block_size=16, rank=2, tau=1.0)
    ck = compress_kv(k, cfg, calibrate(k, cfg))
    cv = compress_kv(v, cfg, calibrate(v, cfg))
    assert int((ck.mode != 0).sum()) == 0 and int((cv.mode != 0).sum()) == 0
    q = torch.zeros(1, 1, 16, d)
    q[..., :2] = 1.0 + torch.rand(1, 1, 16, 2, generator=g) * 0.1
    return q, ck, cv


def test_bounded_falls_back_to_the_running_max_where_the_bound_overshoots(monkeypatch):
    q, ck, cv = _far_bound_case()
    seen = _constexprs(monkeypatch)
    out = attention(q, ck, cv)
    assert seen == [(0, True)]
    check_against_reference(out, q, ck.decompress(), cv.decompress())
    # Without the second attempt the same launch loses every row (P underflows): the fallback is what saves it.
    monkeypatch.setattr(kernels, "BOUND_RETRY_SUM", 0.0)
    broken = attention(q, ck, cv)
    assert not torch.allclose(broken, out, atol=1e-2)


@pytest.mark.parametrize(("kernel", "factor", "retries"), [
    ("compressed", 0.41, False),  # the box bound leaves row sums of 2**-77 .. 2**-71
    ("compressed", 0.71, True),  # 2**-136 .. 2**-125
    ("dense", 0.83, False),  # the Cauchy-Schwarz bound: 2**-82 .. 2**-68
    ("dense", 1.2, True),  # about 2**-121 .. 2**-101
])  # fmt: skip
def test_bounded_retry_threshold(monkeypatch, kernel, factor, retries):
    """Where ``BOUND_RETRY_SUM`` (2**-90) sits: a program whose smallest row sum is about 2**-70 .. 2**-82 keeps its
    bounded pass (2**-60 would have retried it), one whose row sums are all below 2**-100 retries (2**-140 would not
    have); either way the output is float32-exact. A retry shows as a different rounding than the same launch with
    the retry compiled out."""
    from kvbound.kernels import attention_dense

    q, ck, cv = _far_bound_case(factor)
    module = kernels if kernel == "compressed" else attention_dense
    operands = (ck, cv) if kernel == "compressed" else (ck.decompress(), cv.decompress())
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    if kernel == "dense":
        monkeypatch.setattr(attention_dense, "_PLANS", {})
    out = attention(q, *operands)
    check_against_reference(out, q, ck.decompress(), cv.decompress())
    monkeypatch.setattr(module, "BOUND_RETRY_SUM", 0.0)
    if kernel == "dense":
        monkeypatch.setattr(attention_dense, "_PLANS", {})
    without_retry = attention(q, *operands)
    assert torch.equal(out, without_retry) != retries


def test_bounded_off_where_it_does_not_apply(monkeypatch):
    q, ck, cv = _lowrank_case()
    seen = _constexprs(monkeypatch)
    attention(q.half(), ck, cv)  # float16: P must stay in float16's range, so the running maximum
    attention(q, ck, cv, bias=torch.zeros(1, 4, 37, 150))
    attention(q, ck, cv, softcap=20.0)
    assert [bounded for _, bounded in seen] == [False, False, False]


def _relative_case():
    """Compressed K/V whose every block is low rank only (and the same values dense), queries, and Transformer-XL
    relative inputs: keys constant over runs of distances starting at ``starts``, content and position biases."""
    from test_kernels_residual import L, build
    from test_relative_runs import _run_keys

    n, h, dk, dv = 37, 2, 40, 48
    ck = build([[L, L, L]] * h, n=n, d=dk, bits=4, block=16, dtype=torch.float32, seed=1)
    cv = build([[L, L, L]] * h, n=n, d=dv, bits=4, block=16, dtype=torch.float32, seed=2)
    g = torch.Generator().manual_seed(40)
    q = torch.randn(1, h, n, dk, generator=g)
    u, w = (torch.randn(1, h, 1, dk, generator=g) * 0.5 for _ in range(2))
    starts = [0, 10, 30, 36, 37, 38, 44, 60]
    return q, ck, cv, _run_keys(h, 2 * n - 1, dk, starts, g), u, w, starts


@pytest.mark.parametrize("case", ["dense-relative-keys", "dense-relative-runs", "compressed-relative-keys",
                                  "compressed-relative-runs", "per-block-basis", "rank-0-v",
                                  "dense-q-float32-v-float16"])  # fmt: skip
def test_bounded_off_where_its_bound_does_not_hold(monkeypatch, case):
    """With ``KVBOUND_BOUNDED_MAX=on``, launches whose logits or P the bound does not describe keep the running
    maximum: relative positions (relative keys or runs, dense or compressed K/V: the logits gain a term the bound
    leaves out), per-block bases of K or of V (no shared rank space for the box of the key coefficients), rank-0 V
    (no coefficients for the value pair), a float32 query with float16 V in the dense kernel (P would enter the value
    product in float16, whose range cannot hold the bound's gap). The same operands without what rules the bound out
    take it, so that each case reaches its guard; the output passes the float64 check."""
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.models.reference import relative_position_attention_reference
    from kvbound.reference import reference_attention
    from test_attention import FLOOR
    from test_relpos import _port_style

    compressed = _constexprs(monkeypatch)  # (PASS, BOUNDED) of each compressed launch; the setting on
    dense = _dense_plans(monkeypatch)  # BOUNDED of each dense launch
    if "relative" in case:
        q, ck, cv, keys, u, w, starts = _relative_case()
        k_ref, v_ref = ck.decompress(), cv.decompress()
        operands = (ck, cv) if case.startswith("compressed") else (k_ref, v_ref)
        scale = q.shape[-1] ** -0.5
        out = attention(q, *operands, scale=scale, relative_keys=keys, relative_content_bias=u,
                        relative_position_bias=w, relative_runs=starts if case.endswith("runs") else None)
        attention(q, *operands, scale=scale)  # plain logits: bounded
        expected = relative_position_attention_reference(q, k_ref, v_ref, keys, u, w, scale=scale)
        plain = _port_style(q, k_ref, v_ref, keys, u, w, scale)
        err, plain_err = ((x.double() - expected).abs().max().item() for x in (out, plain))
        assert torch.isfinite(out).all() and err <= 2 * plain_err + FLOOR[torch.float32], (err, plain_err)
        if case.startswith("compressed"):
            assert compressed == [(0, False), (0, True)] and dense == []
        else:
            assert dense == [False, True] and compressed == []
    elif case == "per-block-basis":
        cfg = CompressionConfig(block_size=16, rank=8, tau=0.25)
        k = structured(1, 2, 64, 32, torch.float32, 3, spikes=False)
        v = structured(1, 2, 64, 24, torch.float32, 4, spikes=False)
        q = torch.randn(1, 4, 20, 32, generator=torch.Generator().manual_seed(41))
        per_block = compress_kv(k, cfg), compress_kv(v, cfg)  # no basis: an exact truncated SVD per block
        shared = compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))
        assert not any(c.shared_basis for c in per_block) and all(c.shared_basis for c in shared)
        assert all(int((c.mode != 0).sum()) == 0 for c in (*per_block, *shared))  # no residual: one launch
        for ck, cv in ((per_block[0], shared[1]), (shared[0], per_block[1])):
            check_against_reference(attention(q, ck, cv), q, ck.decompress(), cv.decompress())
        attention(q, *shared)
        assert compressed == [(0, False), (0, False), (0, True)]
    elif case == "rank-0-v":
        # V of rank 0: its first two blocks within tau of zero (low rank only, nothing stored), the last two coded;
        # the split's low-rank pass (pass 1) takes the super-blocks where K and V are both low rank only.
        cfg = CompressionConfig(block_size=16, rank=8, tau=0.25)
        g = torch.Generator().manual_seed(42)
        k = structured(1, 2, 64, 32, torch.float32, 3, spikes=False)
        v = torch.randn(1, 2, 64, 24, generator=g) * 0.05
        v[:, :, 32:] *= 20.0
        ck = compress_kv(k, cfg, calibrate(k, cfg))
        cfg0 = CompressionConfig(block_size=16, rank=0, tau=0.25)
        cv = compress_kv(v, cfg0, calibrate(v, cfg0))  # a shared basis of rank 0: only the rank rules it out
        cv_rank8 = compress_kv(v, cfg, calibrate(v, cfg))
        assert cv.rank == 0 and cv.shared_basis and int((ck.mode != 0).sum()) == 0
        for c in (cv, cv_rank8):
            assert bool((c.mode[..., :2] == 0).all()) and bool((c.mode[..., 2:] != 0).all()), c.mode
        q = torch.randn(1, 4, 20, 32, generator=g)
        monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
        out = attention(q, ck, cv)
        attention(q, ck, cv_rank8)
        assert compressed == [(1, False), (2, False), (1, True), (2, False)]
        check_against_reference(out, q, ck.decompress(), cv.decompress())
    else:
        # Not reachable through kvbound.attention (which wants V in q's dtype): the dense launcher itself.
        g = torch.Generator().manual_seed(43)
        q, k = torch.randn(1, 2, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
        v = torch.randn(1, 2, 40, 24, generator=g)
        scale = 32**-0.5
        out, _ = attention_dense_fwd(q, k, v.half(), None, scale, False, None)
        attention_dense_fwd(q, k, v, None, scale, False, None)
        assert dense == [False, True]
        # the 2x criterion against plain attention with the value product in V's dtype, as the kernel forms it
        expected = reference_attention(q, k, v.half().float(), scale=scale)
        plain = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1).half() @ v.half()
        err, plain_err = ((x.double() - expected).abs().max().item() for x in (out, plain))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert err <= 2 * plain_err + FLOOR[torch.float16], (err, plain_err)


def test_bounded_setting_reads_the_environment(monkeypatch):
    for value, expected in (("", "auto"), ("auto", "auto"), ("on", "on"), ("1", "on"), ("off", "off"), ("no", "off")):
        monkeypatch.setenv("KVBOUND_BOUNDED_MAX", value)
        assert bounded_setting() == expected
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "maybe")
    with pytest.raises(ValueError, match="KVBOUND_BOUNDED_MAX: expected one of"):
        bounded_setting()


def test_bounded_by_default_only_from_the_threshold(monkeypatch):
    """By default (``auto``) the bounded maximum starts at ``BOUNDED_MIN_KEYS`` keys: below, the running maximum."""
    q, ck, cv = _lowrank_case()
    seen = _constexprs(monkeypatch)
    monkeypatch.delenv("KVBOUND_BOUNDED_MAX")
    attention(q, ck, cv)
    monkeypatch.setattr(kernels, "BOUNDED_MIN_KEYS", 150)  # this case's key count
    out = attention(q, ck, cv)
    assert seen == [(0, False), (0, True)]
    check_against_reference(out, q, ck.decompress(), cv.decompress())


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "causal", "rank"), [(64, False, 8), (128, False, 8), (64, True, 8), (64, False, 6)])
def test_gpu_bounded_bf16(monkeypatch, d, causal, rank):
    """bfloat16 on the GPU (P in bfloat16, the V coefficients as a bfloat16 pair; rank 6: the pair's rows padded to
    16 bytes for the tensor descriptors): against float64 within the 2x criterion, and against the running
    maximum."""
    n = 4096
    cfg = CompressionConfig(block_size=128, rank=rank, tau=0.25)
    k = structured(1, 4, n, d, torch.float32, 7, spikes=False).cuda().bfloat16()
    v = structured(1, 4, n, d, torch.float32, 8, spikes=False).cuda().bfloat16()
    ck, cv = compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))
    assert int((ck.mode != 0).sum()) == 0 and int((cv.mode != 0).sum()) == 0
    q = torch.randn(1, 8, n, d, generator=torch.Generator().manual_seed(9)).cuda().bfloat16()
    seen = _constexprs(monkeypatch)
    out = attention(q, ck, cv, causal=causal)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "0")
    tracked = attention(q, ck, cv, causal=causal)
    assert seen == [(0, True), (0, False)]
    rows = slice(0, 512)  # the first queries: a causal reference of these rows lines up with the keys
    check_against_reference(out[:, :, rows], q[:, :, rows], ck.decompress(), cv.decompress(), causal=causal)
    assert math.isfinite(float(out.float().abs().max()))
    assert float((out.float() - tracked.float()).abs().max()) <= 4 * 2.0**-8 * float(tracked.float().abs().max())


@pytest.mark.gpu
def test_gpu_bounded_split_bf16(monkeypatch):
    """The split launch's low-rank pass bounded in bfloat16 (residual blocks in pass 2), causal."""
    n, d = 4096, 64
    cfg = CompressionConfig(block_size=128, rank=8)
    k = structured(1, 4, n, d, torch.float32, 1).cuda().bfloat16()
    v = structured(1, 4, n, d, torch.float32, 2).cuda().bfloat16()
    clean = (structured(1, 4, n, d, torch.float32, s, spikes=False).cuda().bfloat16() for s in (1, 2))
    ck, cv = (compress_kv(x, cfg, calibrate(c, cfg)) for x, c in zip((k, v), clean, strict=True))
    q = torch.randn(1, 8, n, d, generator=torch.Generator().manual_seed(10)).cuda().bfloat16()
    seen = _constexprs(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    out = attention(q, ck, cv, causal=True)
    assert seen == [(1, True), (2, False)]
    rows = slice(0, 512)  # the first queries: a causal reference of these rows lines up with the keys
    check_against_reference(out[:, :, rows], q[:, :, rows], ck.decompress(), cv.decompress(), causal=True)


# ----------------------------------------------------------------------------------------------- dense kernel
def _dense_plans(monkeypatch) -> list[bool]:
    """BOUNDED of every dense launch plan built from now on (each call signature and setting builds its own)."""
    from kvbound.kernels import attention_dense

    seen: list[bool] = []
    original = attention_dense._plan

    def spy(*args, **kwargs):
        plan = original(*args, **kwargs)
        seen.append(plan.constexprs["BOUNDED"])
        return plan

    monkeypatch.setattr(attention_dense, "_plan", spy)
    monkeypatch.setattr(attention_dense, "_PLANS", {})  # plans of earlier tests would hide their calls
    return seen


@pytest.mark.parametrize("causal", [False, True])
def test_dense_bounded_matches_running_max_and_float64(monkeypatch, causal):
    g = torch.Generator().manual_seed(21)
    q = torch.randn(1, 4, 45, 40, generator=g)
    k, v = torch.randn(1, 2, 45, 40, generator=g) * 2.0, torch.randn(1, 2, 45, 24, generator=g)
    seen = _dense_plans(monkeypatch)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    check_against_reference(out, q, k, v, causal=causal)
    from kvbound.kernels import attention_dense

    retry_sum = attention_dense.BOUND_RETRY_SUM
    monkeypatch.setattr(attention_dense, "BOUND_RETRY_SUM", 0.0)
    assert torch.equal(attention(q, k, v, causal=causal), out)  # no program retried
    monkeypatch.setattr(attention_dense, "BOUND_RETRY_SUM", retry_sum)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "off")
    tracked, tracked_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert seen == [True, False]
    assert torch.allclose(out, tracked, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, tracked_lse, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, tracked)  # a different path (no maximum tracked), equal to float32 rounding


def test_dense_bounded_reads_each_heads_key_norm(monkeypatch):
    """Batch 2, two query heads per K/V head, keys whose norms differ by 30x between (batch, head) pairs and logits
    up to about 1,500 log2 units: a bound taken from another pair's keys would overflow or underflow P."""
    g = torch.Generator().manual_seed(26)
    q = torch.randn(2, 4, 45, 32, generator=g) * 4
    k = torch.randn(2, 2, 45, 32, generator=g) * torch.tensor([[1.0, 30.0], [30.0, 1.0]]).view(2, 2, 1, 1) * 4
    v = torch.randn(2, 2, 45, 24, generator=g)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    out = attention(q, k, v)
    assert torch.isfinite(out).all()
    check_against_reference(out, q, k, v)


@pytest.mark.parametrize("bounded", ["on", "off"])
def test_dense_negative_scale(monkeypatch, bounded):
    """A negative scale (a legal if unusual softmax temperature) flips which logit is largest; the plain softmax
    step and the bound must follow it, with and without a bias."""
    g = torch.Generator().manual_seed(27)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", bounded)
    for scale in (-8.0, -0.1):  # -8: logits span more than float32 exp2 holds from the wrong end
        check_against_reference(attention(q, k, v, scale=scale), q, k, v, scale=scale)
        bias = torch.randn(1, 2, 40, 40, generator=g)
        check_against_reference(attention(q, k, v, scale=scale, bias=bias), q, k, v, scale=scale, bias=bias)


def test_dense_bounded_off_by_default_and_where_it_does_not_apply(monkeypatch):
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    seen = _dense_plans(monkeypatch)
    monkeypatch.delenv("KVBOUND_BOUNDED_MAX", raising=False)
    attention(q, k, v)  # auto: 40 keys, below the default's threshold
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    attention(q.half(), k.half(), v.half())  # float16 P could not hold the gap
    attention(q, k, v, bias=torch.zeros(1, 2, 40, 40))
    attention(q, k, v, softcap=20.0)
    assert seen == [False, False, False, False]


def test_dense_bounded_by_default_from_the_threshold(monkeypatch):
    """``auto``: bounded from ``BOUNDED_MIN_KEYS`` keys on (the H200's side-by-side sweep), the running maximum below;
    ``off`` never."""
    from kvbound.kernels import attention_dense

    g = torch.Generator().manual_seed(28)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    seen = _dense_plans(monkeypatch)
    monkeypatch.delenv("KVBOUND_BOUNDED_MAX", raising=False)
    monkeypatch.setattr(attention_dense, "BOUNDED_MIN_KEYS", 40)  # this case's key count
    out = attention(q, k, v)
    monkeypatch.setattr(attention_dense, "BOUNDED_MIN_KEYS", 41)
    monkeypatch.setattr(attention_dense, "_PLANS", {})
    attention(q, k, v)
    monkeypatch.setattr(attention_dense, "BOUNDED_MIN_KEYS", 40)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "off")
    monkeypatch.setattr(attention_dense, "_PLANS", {})
    attention(q, k, v)
    assert seen == [True, False, False]
    check_against_reference(out, q, k, v)


def test_dense_bounded_falls_back_where_the_bound_overshoots(monkeypatch):
    """Keys of norm 2000 orthogonal to the queries make the Cauchy-Schwarz bound exceed every logit by about 1400
    log2 units, so exp2(x - bound) underflows; the second attempt (running maximum) must give the right output,
    and without it the output is wrong."""
    from kvbound.kernels import attention_dense

    g = torch.Generator().manual_seed(23)
    n, d = 48, 32
    q = torch.zeros(1, 1, n, d)
    q[..., :2] = torch.randn(1, 1, n, 2, generator=g)
    k = torch.zeros(1, 1, n, d)
    k[..., :2] = torch.randn(1, 1, n, 2, generator=g)
    k[0, 0, 7, 5] = 2000.0  # a key orthogonal to every query, of huge norm
    v = torch.randn(1, 1, n, d, generator=g)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    out = attention(q, k, v)
    check_against_reference(out, q, k, v)
    monkeypatch.setattr(attention_dense, "BOUND_RETRY_SUM", 0.0)
    broken = attention(q, k, v)
    assert not torch.allclose(broken, out, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dense_bounded_bf16(monkeypatch, d):
    """The dense kernel's bounded maximum in bfloat16 on the GPU: against float64 within the 2x criterion, and
    against the running maximum."""
    g = torch.Generator().manual_seed(24)
    q, k, v = (torch.randn(1, 8, 4096, d, generator=g).cuda().bfloat16() for _ in range(3))
    seen = _dense_plans(monkeypatch)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    out = attention(q, k, v)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "off")
    tracked = attention(q, k, v)
    assert seen == [True, False]
    rows = slice(0, 512)
    check_against_reference(out[:, :, rows], q[:, :, rows], k, v)
    assert float((out.float() - tracked.float()).abs().max()) <= 4 * 2.0**-8 * float(tracked.float().abs().max())


def test_packed_value_pair_holds_the_coefficients():
    """``[hi | lo]``: hi the bfloat16 rounding, hi + lo the float16 value to about 16 bits in bfloat16 and exactly
    in float32; rows padded with zeros to a multiple of 8 (16 bytes in bfloat16) for any rank."""
    from kvbound.kernels.attention_compressed import packed_value_pair

    g = torch.Generator().manual_seed(25)
    for rank, width in ((2, 8), (4, 8), (5, 16), (6, 16), (8, 16), (9, 24), (16, 32)):
        for source in (torch.float16, torch.float32, torch.bfloat16):
            coeffs = (torch.randn(1, 2, 40, rank, generator=g) * 3).to(source)
            # a bfloat16 coefficient is its own hi; float32 keeps 24 bits, of which hi + lo hold about 16
            exact_in_bf16 = source == torch.bfloat16
            for dtype, tolerance in ((torch.bfloat16, 0.0 if exact_in_bf16 else 2.0**-15), (torch.float32, 0.0)):
                packed = packed_value_pair(coeffs, dtype)
                assert packed.shape == (1, 2, 40, width) and packed.dtype == dtype and packed.is_contiguous()
                hi, lo = packed[..., :rank].float(), packed[..., rank : 2 * rank].float()
                assert torch.equal(hi, coeffs.float().bfloat16().float())
                assert torch.equal(lo, (coeffs.float() - hi).to(dtype).float())
                assert float((hi + lo - coeffs.float()).abs().max()) <= tolerance * float(coeffs.float().abs().max())
                assert not packed[..., 2 * rank :].any()


def test_key_box_is_the_largest_then_smallest_coefficient_per_axis():
    from kvbound.kernels.attention_compressed import key_box

    g = torch.Generator().manual_seed(26)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        coeffs = (torch.randn(2, 3, 70, 6, generator=g) * 5).to(dtype)
        box = key_box(coeffs)
        assert box.shape == (2, 3, 2, 6) and box.dtype == torch.float32 and box.is_contiguous()
        for b in range(2):
            for h in range(3):
                for axis in range(6):
                    column = coeffs[b, h, :, axis].float()
                    assert box[b, h, 0, axis] == column.max() and box[b, h, 1, axis] == column.min()


@pytest.mark.parametrize(("rank", "causal"), [(8, False), (6, False), (6, True), (7, True)])
def test_bounded_packed_pair_path_against_float64(rank, causal):
    """The packed pair's path (the bfloat16 launch's layout: 2r coefficient columns, the basis stacked twice) run
    in float32 in the interpreter: exact to float32 rounding, so losing either half (about 2**-9 of each
    coefficient) would show. Ranks 6 and 7 pad the pair's rows (16 bytes) and take the pointer loads."""
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd
    from kvbound.reference import reference_attention

    cfg = CompressionConfig(block_size=16, rank=rank, tau=0.25)
    k = structured(1, 2, 150, 64, torch.float32, 3, spikes=False)
    v = structured(1, 2, 150, 40, torch.float32, 4, spikes=False)
    ck, cv = compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))
    assert int((ck.mode != 0).sum()) == 0 and int((cv.mode != 0).sum()) == 0
    q = torch.randn(1, 4, 37, 64, generator=torch.Generator().manual_seed(5))
    kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    out = attention_compressed_fwd(q, kop, vop, None, 64**-0.5, causal, None, (False, False), bounded_max=True,
                                   pack_values=True)[0]  # fmt: skip
    expected = reference_attention(q, ck.decompress(), cv.decompress(), causal=causal)
    assert float((out.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


def test_bounded_refuses_unpacked_bfloat16():
    """In bfloat16 the bounded launch needs the packed pair: float16 coefficients would pull P into float16."""
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd

    q, ck, cv = _lowrank_case(dtype=torch.bfloat16)
    kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    with pytest.raises(ValueError, match="pack_values: a bounded launch in bfloat16 needs the packed pair"):
        attention_compressed_fwd(q, kop, vop, None, 0.125, False, None, (False, False), bounded_max=True,
                                 pack_values=False)  # fmt: skip


@pytest.mark.parametrize("rank", [0, 8])
def test_compressed_negative_scale(rank):
    """The compressed kernel with a negative scale, with (rank 8) and without (rank 0: the row multiplier is then
    the scale's own) a low-rank part; -8 spans more than float32's exp2 holds from the wrong end."""
    g = torch.Generator().manual_seed(28)
    cfg = CompressionConfig(block_size=16, rank=rank, bits=4)
    k, v = torch.randn(1, 2, 64, 32, generator=g), torch.randn(1, 2, 64, 32, generator=g)
    q = torch.randn(1, 2, 40, 32, generator=g)
    ck = compress_kv(k, cfg, calibrate(k, cfg) if rank else None)
    cv = compress_kv(v, cfg, calibrate(v, cfg) if rank else None)
    for scale in (-8.0, -0.1):
        check_against_reference(attention(q, ck, cv, scale=scale), q, ck.decompress(), cv.decompress(), scale=scale)


def test_dense_tile_list_fits_shared_memory():
    """128 x 128 keys on 3 stages joins the autotuner's dense tiles only where its pipelined K/V tiles and Q tile fit
    227 KiB: bf16 at d = 128, not float32 nor a padded V width of 256; the other tiles are pruned as before."""
    from kvbound.kernels.attention_dense import _prune_dense_configs, _shape_of, dense_configs

    configs = dense_configs(interpret=False)
    wide = (128, 128, 8, 3)

    def kept(dtype, dk_pad, dv_pad):
        named = {"Q": torch.empty(0, dtype=dtype), "DK_PAD": dk_pad, "DV_PAD": dv_pad, "RELATIVE": 0}
        return {_shape_of(c) for c in _prune_dense_configs(configs, named)}

    assert wide in kept(torch.bfloat16, 128, 128) and wide in kept(torch.bfloat16, 64, 64)
    assert wide not in kept(torch.float32, 128, 128)
    assert wide not in kept(torch.bfloat16, 128, 256)
    assert kept(torch.float32, 128, 128) == kept(torch.bfloat16, 128, 128) - {wide}


def _inductor_compiles() -> bool:
    try:
        torch._dynamo.reset()
        return bool(torch.compile(lambda x: x.sin() + 1.0)(torch.ones(4)).sum() > 0)
    except Exception:  # no C++ compiler or Python headers for Inductor's CPU code
        return False


def test_bounded_under_torch_compile_with_reused_buffers(monkeypatch):
    """Two layers compiled by Inductor, whose generated code writes the second layer's keys into the first layer's
    buffer (one tensor object, its version counter unmoved): anything derived from the keys (the dense kernel's key
    norms) must come from the second layer's values. A bound derived from the first layer's keys, 30x too small,
    would overflow P."""
    if not _inductor_compiles():
        pytest.skip("Inductor cannot build CPU code here (C++ compiler, Python.h)")
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")

    def two_layers(q, x, y, v):
        o1 = attention(q, torch.sin(x) * 2.0, v)
        o2 = attention(q, torch.cos(y) * 60.0, v)
        return o1, o2

    g = torch.Generator().manual_seed(30)
    q = torch.randn(1, 2, 40, 32, generator=g) * 3
    x, y, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    torch._dynamo.reset()
    o1, o2 = torch.compile(two_layers)(q, x, y, v)
    check_against_reference(o1, q, torch.sin(x) * 2.0, v)
    check_against_reference(o2, q, torch.cos(y) * 60.0, v)


@pytest.mark.parametrize(("rank", "key_scale", "tau"), [(0, 10.0, 2.0), (0, 1.0, 0.25), (4, 30.0, 6.0)])
def test_compressed_zero_query_row(rank, key_scale, tau):
    """A query row of zeros (a padding token) through the compressed kernel's float16 path, with residual tiles:
    its per-row scale (``row_normaliser``) must keep the quotients by it finite, so the row is the mean of V."""
    g = torch.Generator().manual_seed(31)
    k = torch.randn(1, 2, 64, 32, generator=g) * key_scale
    v = torch.randn(1, 2, 64, 32, generator=g)
    cfg = CompressionConfig(block_size=16, rank=rank, bits=4, tau=tau)
    ck = compress_kv(k, cfg, calibrate(k, cfg) if rank else None)
    cv = compress_kv(v, cfg, calibrate(v, cfg) if rank else None)
    q = torch.randn(1, 2, 40, 32, generator=g)
    q[0, 0, 5] = 0.0
    q = q.half()
    out = attention(q, ck, cv)
    assert torch.isfinite(out).all()
    check_against_reference(out, q, ck.decompress(), cv.decompress())


def test_bound_preparation_is_queued_before_the_residual_read(monkeypatch):
    """The box and the packed pair are built before the launcher reads the residual flags (the call's one host
    synchronisation), so that their host work overlaps the device work queued before the call; built also when a
    residual then rules the bound out (without a split), and the launch then runs the running maximum."""
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd
    from kvbound.reference import reference_attention

    events = []
    box, pair = kernels.key_box, kernels.packed_value_pair
    monkeypatch.setattr(kernels, "key_box", lambda c: events.append("box") or box(c))
    monkeypatch.setattr(kernels, "packed_value_pair", lambda c, d: events.append("pair") or pair(c, d))
    k = structured(1, 1, 64, 32, torch.float32, 3, spikes=False)
    q = torch.randn(1, 1, 16, 32, generator=torch.Generator().manual_seed(2))
    scale = 32**-0.5

    def operand(tau):
        cfg = CompressionConfig(block_size=16, rank=4, tau=tau)
        ck = compress_kv(k, cfg, calibrate(k, cfg))
        return ck, CompressedOperand.from_compressed(ck)

    def reads(flags):
        def read():
            events.append("read")
            return flags

        return read

    def check(out, ck):
        expected = reference_attention(q, ck.decompress(), ck.decompress(), scale=scale)
        assert float((out.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())

    # every block low rank: the bound runs, with the preparation queued before the read
    low, low_op = operand(8.0)
    assert int((low.mode != 0).sum()) == 0
    out = attention_compressed_fwd(q, low_op, low_op, None, scale, False, None, reads((False, False)), bounded_max=True,
                                   pack_values=True)[0]  # fmt: skip
    assert events == ["box", "pair", "read"]
    check(out, low)
    events.clear()
    attention_compressed_fwd(q, low_op, low_op, None, scale, False, None, reads((False, False)), bounded_max=False)
    assert events == ["read"]

    # blocks with a residual, no split: the preparation was queued for nothing, the running maximum's
    # residual-capable launch runs, and the output is right
    coded, coded_op = operand(0.05)
    assert int((coded.mode != 0).sum()) > 0
    events.clear()
    out = attention_compressed_fwd(q, coded_op, coded_op, None, scale, False, None, reads((True, True)),
                                   bounded_max=True, pack_values=True, split=False)[0]  # fmt: skip
    assert events == ["box", "pair", "read"]
    check(out, coded)
    # float32 without the packed pair (optional there): the same, and the box alone is built
    events.clear()
    out = attention_compressed_fwd(q, coded_op, coded_op, None, scale, False, None, reads((True, True)),
                                   bounded_max=True, pack_values=False, split=False)[0]  # fmt: skip
    assert events == ["box", "read"]
    check(out, coded)
