"""The split launch of compressed attention (``split=True`` / ``KVBOUND_SPLIT_LOWRANK=1``): low-rank-only runs in
a kernel without residual code, the rest in the residual-capable kernel, merged by log-sum-exp. It must compute
the same attention as one launch, within the 2x criterion against float64, on every mode and option; by default
it runs when at least ``SPLIT_MIN_SHARE`` of the super-blocks are proven low rank only."""

from __future__ import annotations

import importlib
import math
import pickle
from types import SimpleNamespace

import pytest
import torch

from kvbound import CompressionConfig, calibrate, compress_kv
from kvbound.attention import attention
from kvbound.kernels import attention_compressed as kernels
from kvbound.kernels.attention_compressed import joint_lowrank_share, merge_partials, split_setting, worth_splitting
from kvbound.models.reference import relative_position_attention_reference
from test_attention import (  # tests/ is on sys.path (rootdir conftest)
    all_modes,
    check_against_reference,
    every_mode_case,
    expand_tile_bias,
    structured,
)


def _launches(monkeypatch) -> list[int]:
    """The PASS of every kernel launch from now on."""
    passes: list[int] = []
    original = kernels.launch_tuned

    def spy(kernel, tuned, grid, args, constexprs, tune_key, config):
        passes.append(constexprs["PASS"])
        return original(kernel, tuned, grid, args, constexprs, tune_key, config)

    monkeypatch.setattr(kernels, "launch_tuned", spy)
    return passes


@pytest.mark.parametrize(
    "causal, softcap, bias_tile", [(False, None, 0), (True, 5.0, 1), (False, 30.0, 1), (False, 5.0, 16)]
)
def test_split_matches_one_launch_and_float64_every_mode_gqa(monkeypatch, causal, softcap, bias_tile):
    """Without a bias, with a bias broadcast over the queries (``bias_tile=1``) and with a compact bias constant over
    16 x 16 tiles (``bias_tile=16``, AlphaGenome's pair bias), checked against float64 given the expanded bias."""
    q, ck, cv = every_mode_case()
    g = torch.Generator().manual_seed(5)
    bias = None
    if bias_tile == 1:
        bias = torch.randn(1, 4, 1, 200, generator=g)
    elif bias_tile:
        bias = torch.randn(1, 4, 3, 13, generator=g) * 3  # ceil(37 / 16) x ceil(200 / 16) tiles
    kwargs = dict(causal=causal, bias=bias, softcap=softcap)
    tile = dict(bias_tile=bias_tile) if bias_tile else {}
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")  # one launch
    one, one_lse = attention(q, ck, cv, return_lse=True, **kwargs, **tile)
    passes = _launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split, split_lse = attention(q, ck, cv, return_lse=True, **kwargs, **tile)
    assert passes == [1, 2]  # the low-rank runs, then the rest
    if bias_tile > 1:
        kwargs["bias"] = expand_tile_bias(bias, bias_tile, q.shape[2], ck.seq_len)
    check_against_reference(split, q, ck.decompress(), cv.decompress(), **kwargs)
    # the same function as one launch: outputs within a few float16 roundings, log-sum-exp to float32 precision
    assert float((split.float() - one.float()).abs().max()) <= 4 * 2.0**-11 * float(one.float().abs().max())
    assert torch.allclose(split_lse, one_lse, rtol=1e-5, atol=1e-5)


def test_split_per_block_basis_mqa_fp32(monkeypatch):
    cfg = CompressionConfig(block_size=16, rank=8, bits=4)
    k = structured(2, 1, 77, 40, torch.float32, 3)
    v = structured(2, 1, 77, 192, torch.float32, 4)
    ck, cv = compress_kv(k, cfg), compress_kv(v, cfg)
    assert not ck.shared_basis and all_modes(ck) and all_modes(cv)
    q = torch.randn(2, 8, 37, 40, generator=torch.Generator().manual_seed(6))
    passes = _launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    out = attention(q, ck, cv)
    assert passes == [1, 2]
    check_against_reference(out, q, ck.decompress(), cv.decompress())


def test_split_relative_positions(monkeypatch):
    g = torch.Generator().manual_seed(9)
    h, n, dk, dv = 2, 96, 32, 48
    cfg = CompressionConfig(block_size=16, rank=8)
    k = structured(1, h, n, dk, torch.float32, 11)
    v = structured(1, h, n, dv, torch.float32, 12)
    ck = compress_kv(k, cfg, calibrate(structured(1, h, n, dk, torch.float32, 11, spikes=False), cfg))
    cv = compress_kv(v, cfg, calibrate(structured(1, h, n, dv, torch.float32, 12, spikes=False), cfg))
    assert 0 < ck.mode_fractions()["lowrank"] < 1
    q = torch.randn(1, h, n, dk, generator=g)
    table = torch.randn(h, 2 * n - 1, dk, generator=g) * 0.3
    u, w = torch.randn(h, dk, generator=g) * 0.5, torch.randn(h, dk, generator=g) * 0.5
    relative = dict(relative_keys=table, relative_content_bias=u, relative_position_bias=w)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")  # one launch
    one = attention(q, ck, cv, **relative)
    passes = _launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    out = attention(q, ck, cv, **relative)
    assert passes == [1, 2]
    expected = relative_position_attention_reference(
        q, ck.decompress(), cv.decompress(), table, u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk), scale=dk**-0.5
    )
    err, one_err = (float((x.double() - expected).abs().max()) for x in (out, one))
    print(f"relative max err: split {err:.3e}, one launch {one_err:.3e}")
    assert err <= 2 * one_err + 1e-6


def test_the_default_does_not_split_with_relative_positions(monkeypatch):
    """K/V whose low-rank share splits plain attention by default run relative-position attention in one launch
    (the split measured slower inside the patched Borzoi); asked for, the split still runs and agrees."""
    monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK", raising=False)
    g = torch.Generator().manual_seed(31)
    h, n, dk, dv = 2, 256, 32, 48
    cfg = CompressionConfig(block_size=16, rank=8, bits=4)
    k, v = structured(1, h, n, dk, torch.float32, 21), structured(1, h, n, dv, torch.float32, 22)
    bases = [calibrate(structured(1, h, n, d, torch.float32, s, spikes=False), cfg) for d, s in ((dk, 21), (dv, 22))]
    ck, cv = compress_kv(k, cfg, bases[0]), compress_kv(v, cfg, bases[1])
    q = torch.randn(1, h, n, dk, generator=g)
    table = torch.randn(h, 2 * n - 1, dk, generator=g) * 0.3
    u, w = torch.randn(h, dk, generator=g) * 0.5, torch.randn(h, dk, generator=g) * 0.5
    relative = dict(relative_keys=table, relative_content_bias=u, relative_position_bias=w)
    passes = _launches(monkeypatch)
    attention(q, ck, cv)
    assert passes == [1, 2]  # plain attention on these K/V splits by default
    default = attention(q, ck, cv, **relative)
    assert passes[2:] == [0]
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split = attention(q, ck, cv, **relative)
    assert passes[3:] == [1, 2]
    expected = relative_position_attention_reference(
        q, ck.decompress(), cv.decompress(), table, u.reshape(1, h, 1, dk), w.reshape(1, h, 1, dk), scale=dk**-0.5
    )
    err, one_err = (float((x.double() - expected).abs().max()) for x in (split, default))
    assert err <= 2 * one_err + 1e-6 and one_err < 1e-4


def test_split_without_a_low_rank_run_and_without_a_residual(monkeypatch):
    """Every block coded: both passes still run (no host read decides it) and pass 1 adds nothing. Every block
    low rank: nothing to split, one launch."""
    cfg = CompressionConfig(block_size=16, rank=0, bits=4)
    k = structured(1, 2, 64, 32, torch.float16, 13)
    ck = compress_kv(k, cfg)
    assert ck.mode_fractions()["lowrank"] == 0
    q = torch.randn(1, 2, 20, 32, generator=torch.Generator().manual_seed(14)).to(torch.float16)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")  # one launch
    one, one_lse = attention(q, ck, ck, return_lse=True)
    passes = _launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split, split_lse = attention(q, ck, ck, return_lse=True)
    assert torch.equal(split, one) and torch.allclose(split_lse, one_lse, rtol=1e-6, atol=1e-6)
    low = structured(1, 2, 64, 32, torch.float16, 15, spikes=False)
    cfg8 = CompressionConfig(block_size=16, rank=8)
    cl = compress_kv(low, cfg8, calibrate(low, cfg8))
    assert cl.mode_fractions()["lowrank"] == 1
    attention(q, cl, cl)
    assert passes == [1, 2, 0]


@pytest.mark.parametrize("rows", [(64, 32), (32, 64), (128, 32)])
def test_split_causal_when_the_passes_tile_rows_differently(monkeypatch, rows):
    """The passes are tuned apart and may choose different BLOCK_M: a causal row must still see every key once."""
    q, ck, cv = every_mode_case()
    q = torch.cat([q, q, q, q], dim=2)[:, :, :140].contiguous()  # more rows than one tile of 128
    kwargs = dict(causal=True, softcap=30.0)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")  # one launch
    one, one_lse = attention(q, ck, cv, return_lse=True, **kwargs)
    block_m = {1: rows[0], 2: rows[1]}

    def pinned(kernel, tuned, grid, args, constexprs, tune_key, config):
        tile = dict(BLOCK_M=block_m[constexprs["PASS"]], BLOCK_N=16)
        kernel.fn[grid](*args, **constexprs, **tile, num_warps=4, num_stages=1)

    monkeypatch.setattr(kernels, "launch_tuned", pinned)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split, split_lse = attention(q, ck, cv, return_lse=True, **kwargs)
    check_against_reference(split, q, ck.decompress(), cv.decompress(), **kwargs)
    assert float((split.float() - one.float()).abs().max()) <= 4 * 2.0**-11 * float(one.float().abs().max())
    assert torch.allclose(split_lse, one_lse, rtol=1e-5, atol=1e-5)


def test_merge_partials_is_attention_over_the_union():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, 9, generator=g, dtype=torch.float64)
    values = torch.randn(2, 3, 9, 4, generator=g, dtype=torch.float64)
    logits[0, 0, 0, :4] = -math.inf  # a row that sees no key of the first set
    parts = []
    for keys in (slice(0, 4), slice(4, 9)):
        lse = torch.logsumexp(logits[..., keys], dim=-1)
        weights = torch.softmax(logits[..., keys], dim=-1).nan_to_num(0.0)
        parts.append(((weights @ values[:, :, keys]).float(), lse.float()))
    out, lse = torch.empty(2, 3, 5, 4), torch.empty(2, 3, 5)
    merge_partials(parts, out, lse)
    assert torch.allclose(out.double(), torch.softmax(logits, dim=-1) @ values, atol=1e-6)
    assert torch.allclose(lse.double(), torch.logsumexp(logits, dim=-1), atol=1e-6)
    # a row that no set saw: a zero output and -inf, as one launch gives
    empty = [(torch.zeros(1, 1, 1, 2), torch.full((1, 1, 1), -math.inf)) for _ in range(2)]
    out, lse = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1)
    merge_partials(empty, out, lse)
    assert torch.equal(out, torch.zeros(1, 1, 1, 2)) and lse.item() == -math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_kernel_matches_the_pytorch_merge(dtype):
    """The one-kernel merge of two partials (the split launch's: float32, in q's memory order, a value head dim that
    is not a power of two) against the PyTorch operations it replaces: the same log-sum-exps and outputs up to the
    last bits of exp and log (so the rounded outputs may differ by one unit in the last place), rows that one or no
    set saw included; the partials are left as they were."""
    g = torch.Generator().manual_seed(5)
    b, h, n, dv = 2, 3, 37, 24

    def in_q_order(t: torch.Tensor) -> torch.Tensor:  # [B, N, H, D] in memory, [B, H, N, D] as seen
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    partial = []
    for _ in range(2):
        part = in_q_order(torch.randn(b, h, n, dv, generator=g))
        part_lse = torch.randn(b, h, n, generator=g) * 4
        partial.append((part, part_lse))
    partial[0][1][0, 1, 3] = -math.inf  # the first set saw no key of this row
    partial[1][0][0, 1, 3] = 0.0
    partial[1][1][1, 2, 5] = -math.inf
    partial[0][0][1, 2, 5] = 0.0
    for part, part_lse in partial:
        part_lse[1, 0, 7] = -math.inf  # no set saw this row
        part[1, 0, 7] = 0.0
    kept = [(p.clone(), lse.clone()) for p, lse in partial]
    out, lse = in_q_order(torch.empty(b, h, n, dv, dtype=dtype)), torch.empty(b, h, n)
    assert kernels._mergeable_in_one_kernel(partial, out, lse)
    merge_partials(partial, out, lse)
    for (p, p_lse), (k, k_lse) in zip(partial, kept, strict=True):
        assert torch.equal(p, k) and torch.equal(p_lse, k_lse)
    # the PyTorch path: three partials of which one saw nothing give the same merge
    nothing = (torch.zeros_like(kept[0][0]), torch.full_like(kept[0][1], -math.inf))
    want, want_lse = torch.empty(b, h, n, dv, dtype=dtype), torch.empty(b, h, n)
    merge_partials([*kept, nothing], want, want_lse)
    torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6)
    # float32 results a bit apart may round to neighbouring values: one unit in the last place of the dtype
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.float(), want.float(), rtol=ulp, atol=ulp)
    assert lse[1, 0, 7].item() == -math.inf and torch.equal(out[1, 0, 7].float(), torch.zeros(dv))
    assert lse[0, 1, 3].item() == kept[1][1][0, 1, 3].item()


def test_split_setting_reads_the_environment(monkeypatch):
    monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK", raising=False)
    assert split_setting() == "auto"
    cases = [("1", "on"), ("TRUE", "on"), (" on ", "on"), ("yes", "on"), ("0", "off"), ("false", "off"),
             ("Off", "off"), ("no", "off"), ("", "auto"), ("auto", "auto")]  # fmt: skip
    for value, expected in cases:
        monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", value)
        assert split_setting() == expected, value
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "sometimes")
    with pytest.raises(ValueError, match=r"^KVBOUND_SPLIT_LOWRANK: expected one of .*auto, got 'sometimes'$"):
        split_setting()


@pytest.mark.parametrize("seed", range(20))
def test_joint_lowrank_share_never_overstates_the_super_blocks_without_residual(seed):
    """Against the true share of super-blocks whose K and V blocks are all low rank, on random modes."""
    g = torch.Generator().manual_seed(seed)
    bk, bv = [(16, 16), (16, 32), (64, 16), (32, 32)][seed % 4]
    sb = max(bk, bv)
    n = sb * int(torch.randint(1, 40, (1,), generator=g))
    density = torch.rand(2, generator=g) * 0.6
    mode_k = (torch.rand(n // bk, generator=g) < density[0]).to(torch.int8)
    mode_v = (torch.rand(n // bv, generator=g) < density[1]).to(torch.int8)
    free_k = (mode_k.reshape(n // sb, sb // bk) == 0).all(dim=1)
    free_v = (mode_v.reshape(n // sb, sb // bv) == 0).all(dim=1)
    true = float((free_k & free_v).double().mean())
    shares = [float((m == 0).double().mean()) for m in (mode_k, mode_v)]
    bound = joint_lowrank_share(SimpleNamespace(block_size=bk), SimpleNamespace(block_size=bv), shares)
    assert 0.0 <= bound <= true + 1e-12
    if bk == bv:  # the same blocks free in K and V: the bound is exact when the residual blocks are the same
        same = joint_lowrank_share(SimpleNamespace(block_size=bk), SimpleNamespace(block_size=bk), [shares[0]] * 2)
        assert same == max(0.0, 2 * shares[0] - 1)
    assert joint_lowrank_share(SimpleNamespace(block_size=16), SimpleNamespace(block_size=16), [-1.0, 1.0]) == 0.0


def test_the_default_splits_from_seventy_percent_of_each_operand():
    one = SimpleNamespace(block_size=16)
    assert kernels.SPLIT_MIN_SHARE == 0.4
    assert worth_splitting(one, one, [0.7, 0.7])  # 0.3999999999999999 in floating point
    assert not worth_splitting(one, one, [0.69, 0.7])
    assert worth_splitting(one, one, [1.0, 0.4]) and not worth_splitting(one, one, [1.0, 0.39])
    assert not worth_splitting(one, SimpleNamespace(block_size=32), [0.7, 0.7])  # 1 - 0.3 * 2 - 0.3 < 0.4
    assert not worth_splitting(one, one, [-1.0, 1.0])


@pytest.mark.parametrize("n, splits", [(256, True), (96, False)])
def test_the_default_splits_from_split_min_share_of_the_super_blocks_low_rank(monkeypatch, n, splits):
    """Rows 16-79 of ``structured`` need a residual: 12 of 16 blocks are low rank at n = 256 (split), 2 of 6 at
    n = 96 (one launch). The shares come from the call's check, are recorded on the K/V and reused; inference
    tensors, which keep no record, are checked on each call and decide the same way."""
    monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK", raising=False)
    cfg = CompressionConfig(block_size=16, rank=8, bits=4)
    k, v = structured(1, 2, n, 32, torch.float16, 21), structured(1, 2, n, 48, torch.float16, 22)
    bases = [calibrate(structured(1, 2, n, d, torch.float16, s, spikes=False), cfg) for d, s in ((32, 21), (48, 22))]
    ck, cv = compress_kv(k, cfg, bases[0]), compress_kv(v, cfg, bases[1])
    shares = [c.mode_fractions()["lowrank"] for c in (ck, cv)]
    operand = SimpleNamespace(block_size=16)
    assert (joint_lowrank_share(operand, operand, shares) >= kernels.SPLIT_MIN_SHARE) is splits, shares
    q = torch.randn(1, 2, 40, 32, generator=torch.Generator().manual_seed(23)).to(torch.float16)
    passes = _launches(monkeypatch)
    out = attention(q, ck, cv)
    assert passes == ([1, 2] if splits else [0])
    assert [ck._checked_lowrank_share(), cv._checked_lowrank_share()] == pytest.approx(shares, abs=1e-12)
    check_against_reference(out, q, ck.decompress(), cv.decompress())
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")
    attention(q, ck, cv)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    attention(q, ck, cv)
    assert passes[-3:] == [0, 1, 2]
    monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK")
    attention_module = importlib.import_module("kvbound.attention")  # the module (kvbound.attention is the function)
    reads = []
    original = attention_module._queue_checks

    def counted(*args, **kwargs):
        reads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "_queue_checks", counted)
    with torch.inference_mode():
        ci, vi, qi = compress_kv(k, cfg, bases[0]), compress_kv(v, cfg, bases[1]), q.clone()
        assert ci._checked is None
        del passes[:]
        torch.testing.assert_close(attention(qi, ci, vi), out, rtol=0, atol=0)
    assert passes == ([1, 2] if splits else [0])
    assert len(reads) == 1  # q, K and V checked, and the shares read, in the call's one host read


def test_a_pickled_or_copied_record_is_checked_again():
    """A check record names this process's storages: a pickled copy carries none, and a record in an older
    layout is treated as absent instead of failing the call."""
    cfg = CompressionConfig(block_size=16, rank=4, bits=4)
    k = structured(1, 2, 64, 32, torch.float32, 31)
    ck = compress_kv(k, cfg)
    q = torch.randn(1, 2, 8, 32, generator=torch.Generator().manual_seed(32))
    expected = attention(q, ck, ck)
    assert ck._checked_residual() is not None and ck._checked_lowrank_share() is not None
    copy = pickle.loads(pickle.dumps(ck))
    assert copy._checked is None and ck._checked is not None
    torch.testing.assert_close(attention(q, copy, copy), expected, rtol=0, atol=0)
    ck._checked = (ck._stamps(), True)  # two fields, as records were before the share
    assert ck._checked_residual() is None and ck._checked_lowrank_share() is None
    torch.testing.assert_close(attention(q, ck, ck), expected, rtol=0, atol=0)
    assert ck._checked_lowrank_share() == pytest.approx(ck.mode_fractions()["lowrank"], abs=1e-12)


def _half_lowrank(h: int, n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Rank-8 rows, with noise that needs residual codes in every other block of 128 keys."""
    basis = torch.linalg.qr(torch.randn(h, d, 8, generator=g))[0].transpose(1, 2)
    x = torch.randn(1, h, n, 8, generator=g) * math.sqrt(d / 8) @ basis
    noisy = (torch.arange(n) // 128) % 2 == 1
    x[:, :, noisy] += torch.randn(1, h, int(noisy.sum()), d, generator=g) * 0.05
    return x.to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_split_lowrank_bf16(monkeypatch, d):
    g = torch.Generator().manual_seed(d)
    h, n = 8, 8192
    k, v = _half_lowrank(h, n, d, g).cuda(), _half_lowrank(h, n, d, g).cuda()
    cfg = CompressionConfig()
    ck, cv = compress_kv(k, cfg, calibrate(k, cfg)), compress_kv(v, cfg, calibrate(v, cfg))
    assert 0.3 < ck.mode_fractions()["lowrank"] < 0.7, ck.mode_fractions()
    q = torch.randn(1, h, n, d, generator=g).to(torch.bfloat16).cuda()
    for causal in (False, True):
        monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")
        one = attention(q, ck, cv, causal=causal)
        passes = _launches(monkeypatch)
        monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
        split = attention(q, ck, cv, causal=causal)
        monkeypatch.delenv("KVBOUND_SPLIT_LOWRANK")
        assert passes == [1, 2]
        rows = slice(0, 128)  # against float64 (with causal, these rows see keys 0 .. row)
        k_ref, v_ref = (ck.decompress()[:, :, rows], cv.decompress()[:, :, rows]) if causal else (ck.decompress(),
                                                                                                cv.decompress())
        check_against_reference(split[:, :, rows].contiguous(), q[:, :, rows].contiguous(), k_ref.contiguous(),
                                v_ref.contiguous(), causal=causal)
        # every row against one launch
        assert float((split.float() - one.float()).abs().max()) <= 4 * 2.0**-8 * float(one.float().abs().max())


@pytest.mark.parametrize("batch", [1, 2])
def test_split_with_a_head_split_query_writes_the_output_in_its_layout(monkeypatch, batch):
    """The output follows q's memory order (a head-split view of [B, N, H * D] in the ports); the split launch's
    partial outputs must take the same strides, which the kernel writes through."""
    cfg = CompressionConfig(block_size=16, rank=8)
    k = torch.cat([structured(1, 2, 200, 64, torch.float16, 1 + i) for i in range(batch)])
    v = torch.cat([structured(1, 2, 200, 40, torch.float16, 3 + i) for i in range(batch)])
    ck = compress_kv(k, cfg, calibrate(structured(1, 2, 200, 64, torch.float16, 1, spikes=False), cfg))
    cv = compress_kv(v, cfg, calibrate(structured(1, 2, 200, 40, torch.float16, 3, spikes=False), cfg))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, 37, 4 * 64, generator=g).to(torch.float16).view(batch, 37, 4, 64).transpose(1, 2)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "0")
    one = attention(q, ck, cv)
    passes = _launches(monkeypatch)
    monkeypatch.setenv("KVBOUND_SPLIT_LOWRANK", "1")
    split = attention(q, ck, cv)
    assert passes == [1, 2]
    assert split.stride() == one.stride() and split.transpose(1, 2).is_contiguous()
    check_against_reference(split, q, ck.decompress(), cv.decompress())
    assert float((split.float() - one.float()).abs().max()) <= 4 * 2.0**-11 * float(one.float().abs().max())
