"""Launcher-level tests of the attention kernels: block runs, tile shapes, optional paths. Every result is
compared with the float64 oracle (``reference_attention``) on the decompressed K/V."""

from __future__ import annotations

import math

import pytest
import torch

from kvbound import CompressionConfig, calibrate, compress_kv, reference_attention
from kvbound.kernels._common import tma_ready
from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd, block_runs
from kvbound.kernels.attention_dense import attention_dense_fwd, dv_parts, dv_split_default
from test_attention import check_against_reference, structured  # tests/ is on sys.path (rootdir conftest)


def _python_runs(flags: list[int], want: int) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, f in enumerate(flags + [1 - want]):
        if f == want and start is None:
            start = i
        elif f != want and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _fake_operand(mode: torch.Tensor, block_size: int, seq_len: int) -> CompressedOperand:
    return CompressedOperand(
        None,
        None,
        mode,
        None,
        None,
        None,
        None,
        None,
        seq_len=seq_len,
        head_dim=8,
        block_size=block_size,
        shared_basis=True,
    )


@pytest.mark.parametrize(
    "k_block, v_block, n, share",
    [(16, 16, 300, 0.3), (32, 16, 300, 0.3), (16, 64, 300, 0.3), (16, 16, 16 * 300, 0.05), (64, 16, 64 * 260, 0.5)],
)
def test_block_runs_match_a_python_scan(k_block, v_block, n, share):
    """Runs as a plain scan finds them; the last two cases have more super-blocks than one chunk (128) of the
    kernel that builds them, so runs cross chunk borders."""
    g = torch.Generator().manual_seed(k_block + v_block + n)
    mode_k = (torch.rand(2, 3, -(-n // k_block), generator=g) < share).to(torch.int8) * 3
    mode_v = (torch.rand(2, 3, -(-n // v_block), generator=g) < share * 2 / 3).to(torch.int8)
    super_block = max(k_block, v_block)
    runs, counts = block_runs(_fake_operand(mode_k, k_block, n), _fake_operand(mode_v, v_block, n), super_block)
    num_super = -(-n // super_block)
    for row in range(6):
        b, h = divmod(row, 3)
        k_modes, v_modes = mode_k[b, h].tolist(), mode_v[b, h].tolist()
        flags = []
        for s in range(num_super):
            keys = range(s * super_block, min(n, (s + 1) * super_block))
            flags.append(int(any(k_modes[j // k_block] != 0 or v_modes[j // v_block] != 0 for j in keys)))
        for kind in (0, 1):
            want = _python_runs(flags, kind)
            count = int(counts[row, kind])
            got = list(zip(runs[row, 2 * kind, :count].tolist(), runs[row, 2 * kind + 1, :count].tolist(), strict=True))
            assert got == want, (row, kind, flags)


def _compressed_case(n=150, d=64, dv=48, block=32, shared=True, seed=0):
    cfg = CompressionConfig(block_size=block, rank=8)
    k = structured(1, 2, n, d, torch.float16, seed)
    v = structured(1, 2, n, dv, torch.float16, seed + 1)
    if shared:
        ck = compress_kv(k, cfg, calibrate(structured(1, 2, n, d, torch.float16, seed, spikes=False), cfg))
        cv = compress_kv(v, cfg, calibrate(structured(1, 2, n, dv, torch.float16, seed + 1, spikes=False), cfg))
    else:
        ck, cv = compress_kv(k, cfg), compress_kv(v, cfg)
    q = torch.randn(1, 4, 45, d, generator=torch.Generator().manual_seed(seed + 2)).to(torch.float16)
    return q, ck, cv


@pytest.mark.parametrize(
    "options",
    [
        dict(predicated=True),
        dict(split_rank=False),
        dict(config=dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)),
    ],
    ids=["predicated", "single-fp16-rank-product", "tile-16x32"],
)
def test_compressed_launcher_options(options):
    q, ck, cv = _compressed_case()
    assert ck.mode_fractions()["lowrank"] < 1.0
    out, lse = attention_compressed_fwd(
        q,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        None,
        0.125,
        True,
        None,
        **options,
    )
    check_against_reference(out, q, ck.decompress(), cv.decompress(), scale=0.125, causal=True)


def test_residual_loops_on_low_rank_only_data_change_nothing():
    """Residual code compiled in (forced flags) on data without residual blocks: same result, and the
    all-low-rank kernel (flags off) agrees with it to the last bit of float16 when the head dimension keeps its
    order (``uniform=False``); with uniform runs (the byte decode's plane order, the default) the products sum in
    another order, within the oracle's tolerance."""
    cfg = CompressionConfig(block_size=32, rank=8)
    k = structured(1, 1, 130, 64, torch.float16, 4, spikes=False)
    v = structured(1, 1, 130, 64, torch.float16, 5, spikes=False)
    ck, cv = compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))
    assert ck.mode_fractions()["lowrank"] == 1.0 and cv.mode_fractions()["lowrank"] == 1.0
    q = torch.randn(1, 2, 33, 64, generator=torch.Generator().manual_seed(6)).to(torch.float16)
    kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
    plain, _ = attention_compressed_fwd(q, kop, vop, None, 0.125, False, None, residual=(False, False))
    forced, _ = attention_compressed_fwd(q, kop, vop, None, 0.125, False, None, residual=(True, True), uniform=False)
    check_against_reference(forced, q, ck.decompress(), cv.decompress(), scale=0.125)
    assert torch.equal(plain, forced)
    planes, _ = attention_compressed_fwd(q, kop, vop, None, 0.125, False, None, residual=(True, True))
    check_against_reference(planes, q, ck.decompress(), cv.decompress(), scale=0.125)


def test_per_block_basis_launcher_gqa_bias():
    q, ck, cv = _compressed_case(n=97, shared=False, seed=7)
    bias = torch.randn(97, generator=torch.Generator().manual_seed(8))
    out, _ = attention_compressed_fwd(
        q,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        bias.expand(1, 4, 45, 97),
        0.125,
        False,
        2.0,
    )
    check_against_reference(out, q, ck.decompress(), cv.decompress(), scale=0.125, bias=bias, softcap=2.0)


def test_dense_pointer_path_when_rows_are_not_16_byte_aligned():
    """Head dim 36 in float16 (72-byte rows) cannot go through tensor descriptors; the pointer path runs."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 2, 29, 36, generator=g).to(torch.float16)
    k = torch.randn(1, 2, 41, 36, generator=g).to(torch.float16)
    v = torch.randn(1, 2, 41, 36, generator=g).to(torch.float16)
    assert not tma_ready(k, v)
    out, lse = attention_dense_fwd(q, k, v, None, 1 / math.sqrt(36), True, None)
    check_against_reference(out, q, k, v, causal=True)
    assert torch.isfinite(lse).all()


def test_dense_explicit_tile_shape():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 3, 50, 64, generator=g)
    k = torch.randn(2, 3, 70, 64, generator=g)
    v = torch.randn(2, 3, 70, 32, generator=g)
    out, _ = attention_dense_fwd(
        q, k, v, None, 0.1, False, None, config=dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
    )
    ref = reference_attention(q, k, v, scale=0.1)
    check_against_reference(out, q, k, v, scale=0.1)
    assert (out.double() - ref).abs().max() < 1e-5


def test_dv_parts():
    """The value columns in power-of-two parts: split where two parts pad less than one."""
    assert dv_parts(192) == (128, 64)
    assert dv_parts(160) == (128, 32)
    assert dv_parts(40) == (32, 16)
    assert dv_parts(72) == (64, 16)
    for whole in (16, 64, 128, 256):  # powers of two stay whole
        assert dv_parts(whole) == (whole, 0)
    assert dv_parts(24) == (32, 0)  # 16 + 16 is not narrower than 32
    assert dv_parts(200) == (256, 0)  # 128 + 128 neither
    assert dv_parts(8) == (16, 0)
    assert dv_parts(192, split=False) == (256, 0)


def test_dv_split_setting(monkeypatch):
    """``KVBOUND_DV_SPLIT``: auto (unset) splits except with the relative keys' window; 0 / 1 force it; else raises."""
    monkeypatch.delenv("KVBOUND_DV_SPLIT", raising=False)
    assert dv_split_default(False) and not dv_split_default(True)
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "1")
    assert dv_split_default(False) and dv_split_default(True)
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "0")
    assert not dv_split_default(False) and not dv_split_default(True)
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "yes")
    with pytest.raises(ValueError, match="KVBOUND_DV_SPLIT: expected 0, 1 or auto, got 'yes'"):
        dv_split_default(False)


def _spy_plans(monkeypatch) -> list[tuple[int, int, tuple]]:
    """``(DV_PAD, DV_HI, tune key)`` of every launch plan the dense launcher builds, from an empty plan cache."""
    from kvbound.kernels import attention_dense

    seen = []
    build = attention_dense._plan

    def spy(*args, **kwargs):
        plan = build(*args, **kwargs)
        seen.append((plan.constexprs["DV_PAD"], plan.constexprs["DV_HI"], plan.tune_key))
        return plan

    monkeypatch.setattr(attention_dense, "_plan", spy)
    monkeypatch.setattr(attention_dense, "_PLANS", {})
    return seen


def test_split_and_whole_are_tuned_apart(monkeypatch):
    """A tile tuned for the value columns in two parts may not fit them whole (shared memory): the autotuner's key and
    the launcher's cache of winners tell the two apart."""
    seen = _spy_plans(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 2, 40, 16, generator=g).half() for _ in range(2))
    v = torch.randn(1, 2, 40, 48, generator=g).half()
    for split in (True, False):
        attention_dense_fwd(q, k, v, None, 0.25, False, None, dv_split=split)
    assert seen[0][:2] == (32, 16) and seen[1][:2] == (64, 0)
    assert seen[0][2] != seen[1][2]


@pytest.mark.parametrize("dv", [40, 80])
def test_split_value_columns_with_the_bounded_maximum_and_its_retry(monkeypatch, dv):
    """The bounded maximum (float32 here) with the value columns in two parts: a program whose bound overshoots by far
    redoes its keys with the running maximum, resetting both accumulators; the outputs match float64 and the whole
    width. With the retry disabled the same call is wrong, so the case does retry."""
    from kvbound import attention
    from kvbound.kernels import attention_dense

    g = torch.Generator().manual_seed(23)
    n, d = 48, 32
    q = torch.zeros(1, 1, n, d)
    q[..., :2] = torch.randn(1, 1, n, 2, generator=g)
    q[0, 0, 0, 5] = 1.0  # row 0 sees the huge key: its bound is tight, the others' far too high
    k = torch.zeros(1, 1, n, d)
    k[..., :2] = torch.randn(1, 1, n, 2, generator=g)
    k[0, 0, 7, 5] = 2000.0
    v = torch.randn(1, 1, n, dv, generator=g)
    seen = _spy_plans(monkeypatch)
    monkeypatch.setenv("KVBOUND_BOUNDED_MAX", "on")
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "1")
    out = attention(q, k, v)
    check_against_reference(out, q, k, v)
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "0")
    whole = attention(q, k, v)
    assert seen[0][1] > 0 and seen[1][1] == 0
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=0)
    monkeypatch.setattr(attention_dense, "BOUND_RETRY_SUM", 0.0)
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "1")
    assert not torch.allclose(attention(q, k, v), out, atol=1e-2)


@pytest.mark.parametrize("dv", [40, 72])
@pytest.mark.parametrize("causal", [False, True])
def test_split_value_columns_padded_second_part_with_softcap(monkeypatch, dv, causal):
    """A second part wider than the columns left (40 -> 32 + 16, 72 -> 64 + 16) through tensor descriptors, causal or
    not, with and without a soft-cap (its fixed maximum: no rescaling), split and whole, against float64."""
    from kvbound import attention

    g = torch.Generator().manual_seed(dv)
    q, k = (torch.randn(1, 2, 45, 16, generator=g).half() for _ in range(2))
    v = torch.randn(1, 2, 45, dv, generator=g).half()
    assert tma_ready(k, v)
    seen = _spy_plans(monkeypatch)
    for split in ("1", "0"):
        monkeypatch.setenv("KVBOUND_DV_SPLIT", split)
        for softcap in (None, 5.0):
            out = attention(q, k, v, causal=causal, softcap=softcap)
            check_against_reference(out, q, k, v, causal=causal, softcap=softcap)
    assert [hi > 0 for _, hi, _ in seen] == [True, True, False, False]


@pytest.mark.parametrize(
    "dv, dk, causal, relative",
    [
        (192, 16, False, None),
        (40, 36, True, None),
        (48, 16, False, "keys"),
        (40, 36, False, "runs"),
        (192, 16, False, "runs"),
    ],
)
def test_split_value_columns_match_whole(monkeypatch, dv, dk, causal, relative):
    """Value head dims run as two power-of-two parts (``dv_parts``, ``KVBOUND_DV_SPLIT``) give the outputs of the
    whole padded width, and those of the float64 reference, through tensor descriptors and through pointers (dk 36
    in float16: rows of 72 bytes, not 16-byte aligned), plain and with relative positions (keys, runs)."""
    from kvbound import attention
    from kvbound.models.reference import relative_position_attention_reference
    from test_relative_runs import _run_keys

    g = torch.Generator().manual_seed(dv + dk + causal)
    h, n = 2, 45
    q = torch.randn(1, h, n, dk, generator=g).to(torch.float16)
    k = torch.randn(1, h, n, dk, generator=g).to(torch.float16)
    v = torch.randn(1, h, n, dv, generator=g).to(torch.float16)
    assert tma_ready(k, v) == (dk % 8 == 0)
    kwargs = {}
    if relative is not None:
        starts = [0, 30, 44, 50, 60]
        keys = (
            _run_keys(h, 2 * n - 1, dk, starts, g) if relative == "runs" else torch.randn(h, 2 * n - 1, dk, generator=g)
        )
        u, w = torch.randn(h, dk, generator=g) * 0.5, torch.randn(h, dk, generator=g) * 0.5
        kwargs = dict(relative_keys=keys.to(torch.float16), relative_content_bias=u, relative_position_bias=w)
        if relative == "runs":
            kwargs["relative_runs"] = starts
    seen = _spy_plans(monkeypatch)
    outs = {}
    for split in ("1", "0"):
        monkeypatch.setenv("KVBOUND_DV_SPLIT", split)
        outs[split] = attention(q, k, v, causal=causal, return_lse=True, **kwargs)
    # each setting built its own plan: two parts, then one
    assert [(pad, hi) for pad, hi, _ in seen] == [dv_parts(dv), dv_parts(dv, split=False)]
    assert outs["1"][0].shape == (1, h, n, dv)
    torch.testing.assert_close(outs["1"][0], outs["0"][0], atol=2e-3, rtol=0)
    torch.testing.assert_close(outs["1"][1], outs["0"][1], atol=1e-5, rtol=0)
    if relative is None:
        check_against_reference(outs["1"][0], q, k, v, causal=causal)
    else:
        scale = dk**-0.5
        expected = relative_position_attention_reference(
            q, k, v, kwargs["relative_keys"], u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk), scale=scale
        )
        assert (outs["1"][0].double() - expected).abs().max() < 1e-2


@pytest.mark.parametrize("compressed", [False, True])
def test_fixed_and_running_maximum_agree(compressed):
    """Soft-capped attention through the fixed softmax maximum and through the running one: both match the
    reference, and they agree with each other to float16 rounding."""
    g = torch.Generator().manual_seed(30)
    q = (torch.randn(1, 4, 45, 64, generator=g) * 3).to(torch.float16)
    bias = torch.randn(1, 4, 45, 1, generator=g) * 4
    if compressed:
        _, ck, cv = _compressed_case(seed=31)
        k_ref, v_ref = ck.decompress(), cv.decompress()
        kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)

        def run(fixed_max):
            return attention_compressed_fwd(q, kop, vop, bias, 0.125, True, 5.0, fixed_max=fixed_max)
    else:
        k_ref = torch.randn(1, 2, 150, 64, generator=g).to(torch.float16)
        v_ref = torch.randn(1, 2, 150, 48, generator=g).to(torch.float16)

        def run(fixed_max):
            return attention_dense_fwd(q, k_ref, v_ref, bias, 0.125, True, 5.0, fixed_max=fixed_max)

    (fixed, fixed_lse), (running, running_lse) = run(True), run(False)
    for out in (fixed, running):
        check_against_reference(out, q, k_ref, v_ref, scale=0.125, causal=True, bias=bias, softcap=5.0)
    diff = (fixed.double() - running.double()).abs().max().item()
    lse_diff = (fixed_lse - running_lse).abs().max().item()
    print(f"fixed vs running maximum: out max diff {diff:.3e}, lse max diff {lse_diff:.3e}")
    assert diff <= 4 * 2.0**-11 * v_ref.abs().max().item()
    assert lse_diff < 1e-5


@pytest.mark.parametrize(("compressed", "tile"), [(True, 8), (False, 64)])
def test_tile_bias_smaller_and_larger_than_the_key_tile(compressed, tile):
    """A compact bias with tiles narrower and wider than the kernel's key tile (BLOCK_N 32), GQA rows."""
    g = torch.Generator().manual_seed(tile + 32)
    q, ck, cv = _compressed_case(n=150, seed=33)
    tiles = torch.randn(1, 4, -(-45 // tile), -(-150 // tile), generator=g) * 2
    full = tiles.repeat_interleave(tile, 2).repeat_interleave(tile, 3)[:, :, :45, :150]
    config = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    if compressed:
        k_ref, v_ref = ck.decompress(), cv.decompress()
        out, _ = attention_compressed_fwd(
            q,
            CompressedOperand.from_compressed(ck),
            CompressedOperand.from_compressed(cv),
            tiles,
            0.125,
            False,
            None,
            config=config,
            bias_tile=tile,
        )
    else:
        k_ref = torch.randn(1, 2, 150, 64, generator=g).to(torch.float16)
        v_ref = torch.randn(1, 2, 150, 48, generator=g).to(torch.float16)
        out, _ = attention_dense_fwd(q, k_ref, v_ref, tiles, 0.125, False, None, config=config, bias_tile=tile)
    check_against_reference(out, q, k_ref, v_ref, scale=0.125, bias=full)


@pytest.mark.parametrize("setting, expected", [("highest", "ieee"), ("high", "tf32x3"), ("medium", "tf32")])
def test_float32_products_follow_torchs_float32_matmul_precision(monkeypatch, setting, expected):
    """float32 inputs: both kernels take the product precision PyTorch's own float32 setting asks for (full float32
    by default), re-read at every call (the dense launch plan is keyed on it); 16-bit inputs are unaffected."""
    from kvbound.kernels import attention_compressed as compressed_module
    from kvbound.kernels import attention_dense as dense_module

    seen = []

    def recording(module):
        original = module.launch_tuned

        def launch(kernel, tuned, grid, args, constexprs, tune_key, config):
            seen.append(constexprs["PRECISION"])
            return original(kernel, tuned, grid, args, constexprs, tune_key, config)

        monkeypatch.setattr(module, "launch_tuned", launch)

    recording(dense_module)
    recording(compressed_module)
    before = torch.get_float32_matmul_precision()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    try:
        torch.set_float32_matmul_precision(setting)
        out, _ = attention_dense_fwd(q, k, v, None, 32**-0.5, False, None)
        check_against_reference(out, q, k, v, scale=32**-0.5)
        q32, ck, cv = _compressed_case(n=70, d=32, dv=32, block=16)
        q32 = q32.float()
        kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
        out, _ = attention_compressed_fwd(q32, kop, vop, None, 0.125, False, None)
        check_against_reference(out, q32, ck.decompress(), cv.decompress(), scale=0.125)
        attention_dense_fwd(q.half(), k.half(), v.half(), None, 32**-0.5, False, None)
        half_plans = [plan for key, plan in dense_module._PLANS.items() if torch.float16 in key]
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen[:2] == [expected, expected]
    assert half_plans and all(plan.constexprs["PRECISION"] == "tf32" for plan in half_plans)
