"""The compressed kernel's value columns in two parts (``attention_compressed_fwd(dv_split=True)``, ``dv_parts``: dv
48 as 32 + 16, 192 as 128 + 64): every path that touches the value columns (rank-space values and their epilogue,
per-block bases, uniform runs in natural and plane order, the general and predicated residual tiles, exact tiles,
the bounded maximum's packed pair, the split launch, relative positions) against the float64 oracle on the decoded
K/V, and against the same launch with one padded part. CPU: Triton's interpreter (conftest)."""

from __future__ import annotations

import math

import pytest
import torch

import kvbound
from kvbound.kernels import attention_compressed as compressed
from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd
from kvbound.kernels.attention_dense import dv_parts
from kvbound.models.reference import relative_position_attention_reference
from test_attention import FLOOR, check_against_reference  # tests/ is on sys.path (rootdir conftest)
from test_general_runs import alphagenome_reference
from test_kernels_residual import L, P, R, W, build, run_kinds
from test_relpos import _port_style
from test_relpos_compressed import _relative_inputs


def _spy(monkeypatch) -> list[tuple[int, int, int]]:
    """``(DV_PAD, DV_HI, PASS)`` of each compressed-kernel launch from now on (the kernel still runs)."""
    seen = []
    original = compressed.launch_tuned

    def spy(kernel, tuned, grid, args, constexprs, tune_key, config):
        if kernel is compressed._attention_compressed_fwd:
            seen.append((constexprs["DV_PAD"], constexprs["DV_HI"], constexprs["PASS"]))
        return original(kernel, tuned, grid, args, constexprs, tune_key, config)

    monkeypatch.setattr(compressed, "launch_tuned", spy)
    return seen


def _both(q, ck, cv, seen, *, scale=None, causal=False, softcap=None, reference_kw=None, **kwargs):
    """The launch with the value columns whole and in two parts: each within the oracle's tolerance, the two equal
    up to float32 summation order (the same products per output column), and the parts as ``dv_parts`` says."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outs = []
    for split in (False, True):
        seen.clear()
        out, lse = attention_compressed_fwd(
            q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), None, scale, causal,
            softcap, dv_split=split, **kwargs,
        )  # fmt: skip
        assert seen and all((pad, hi) == dv_parts(cv.head_dim, split) for pad, hi, _ in seen), (split, seen)
        check_against_reference(
            out, q, ck.decompress(), cv.decompress(), scale=scale, causal=causal, softcap=softcap,
            **(reference_kw or {}),
        )  # fmt: skip
        outs.append((out, lse))
    (whole, lse_whole), (parts, lse_parts) = outs
    assert torch.equal(lse_whole, lse_parts)
    assert (whole.double() - parts.double()).abs().max().item() <= 2e-3
    return seen


def test_parts_of_the_value_columns():
    assert dv_parts(192) == (128, 64) and dv_parts(48) == (32, 16) and dv_parts(40) == (32, 16)
    assert dv_parts(64) == (64, 0) and dv_parts(96) == (64, 32) and dv_parts(192, split=False) == (256, 0)


@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_uniform_and_general_runs_in_two_parts(bits, causal, monkeypatch):
    """Uniform runs (4 bits: plane order, whose second part starts inside the second plane; 8 bits: one plane;
    3 bits: the word decode in natural order), with promoted and exact V blocks in general runs, GQA, ragged N."""
    seen = _spy(monkeypatch)
    wider = W(8) if bits < 8 else R
    ck = build([[P(bits), L, P(bits), wider, P(bits)]] * 2, n=75, d=32, bits=bits, block=16, dtype=torch.float16,
               seed=1)  # fmt: skip
    cv = build([[P(bits), P(bits), L, R, wider]] * 2, n=75, d=48, bits=bits, block=16, dtype=torch.float16, seed=2)
    q = (torch.randn(1, 4, 75, 32, generator=torch.Generator().manual_seed(3)) * 1.5).half()
    kinds = run_kinds(ck, cv)
    assert kinds[1] > 0 and kinds[2] > 0, kinds
    _both(q, ck, cv, seen, causal=causal, split=False, uniform=True)


def test_predicated_tiles_and_exact_tiles_in_float32(monkeypatch):
    seen = _spy(monkeypatch)
    ck = build([[P(8), R, P(8), L, P(8), P(8)]], n=90, d=32, bits=8, block=16, dtype=torch.float32, seed=4)
    cv = build([[R, P(8), P(8), P(8), L, R]], n=90, d=40, bits=8, block=16, dtype=torch.float32, seed=5)
    q = torch.randn(1, 3, 50, 32, generator=torch.Generator().manual_seed(6))
    _both(q, ck, cv, seen, predicated=True, uniform=False, split=False)
    qh = q.half()
    ck16 = build([[P(4), R, P(4), L, W(6), P(4)]], n=90, d=32, bits=4, block=16, dtype=torch.float16, seed=4)
    cv16 = build([[R, P(4), W(8), P(4), L, R]], n=90, d=48, bits=4, block=16, dtype=torch.float16, seed=5)
    _both(qh, ck16, cv16, seen, predicated=True, uniform=False, split=False)


@pytest.mark.parametrize("uniform", [True, False])
def test_per_block_bases_in_two_parts(uniform, monkeypatch):
    seen = _spy(monkeypatch)
    ck = build([[P(4), L, P(4), P(4)]], n=60, d=32, bits=4, block=16, dtype=torch.float16, shared=False, seed=7)
    cv = build([[L, P(4), R if not uniform else P(4), P(4)]], n=60, d=48, bits=4, block=16, dtype=torch.float16,
               shared=False, seed=8)  # fmt: skip
    q = torch.randn(1, 2, 60, 32, generator=torch.Generator().manual_seed(9)).half()
    _both(q, ck, cv, seen, uniform=uniform, split=False, causal=True)


def test_low_rank_only_and_the_split_launch(monkeypatch):
    """No residual anywhere (the rank-space epilogue alone), and a split launch: the low-rank pass without residual
    code and the residual pass, both in two parts, merged."""
    seen = _spy(monkeypatch)
    q = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(10)).half()
    ck = build([[L] * 4], n=64, d=32, bits=4, block=16, dtype=torch.float16, seed=11)
    cv = build([[L] * 4], n=64, d=48, bits=4, block=16, dtype=torch.float16, seed=12)
    _both(q, ck, cv, seen, residual=(False, False), bounded_max=False)
    cv = build([[L, L, L, P(4)]], n=64, d=48, bits=4, block=16, dtype=torch.float16, seed=12)
    ck = build([[L, L, P(4), L]], n=64, d=32, bits=4, block=16, dtype=torch.float16, seed=11)
    launches = _both(q, ck, cv, seen, split=True, causal=True)
    assert sorted(p for _, _, p in launches) == [1, 2]


def test_bounded_maximum_with_the_packed_value_pair(monkeypatch):
    """The bounded maximum's V coefficients as a pair [hi | lo] (float32 here, ``pack_values=True``): the epilogue's
    doubled basis in two parts."""
    seen = _spy(monkeypatch)
    q = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(13))
    ck = build([[L] * 4], n=64, d=32, bits=4, block=16, dtype=torch.float32, seed=14)
    cv = build([[L] * 4], n=64, d=48, bits=4, block=16, dtype=torch.float32, seed=15)
    _both(q, ck, cv, seen, residual=(False, False), bounded_max=True, pack_values=True)


def test_softcap_fixed_maximum_in_two_parts(monkeypatch):
    seen = _spy(monkeypatch)
    ck = build([[P(4), L, R, P(4)]], n=60, d=32, bits=4, block=16, dtype=torch.float16, seed=16)
    cv = build([[P(4), R, L, P(4)]], n=60, d=48, bits=4, block=16, dtype=torch.float16, seed=17)
    q = (torch.randn(1, 2, 60, 32, generator=torch.Generator().manual_seed(18)) * 3).half()
    _both(q, ck, cv, seen, softcap=2.0, split=False)


def test_relative_positions_in_two_parts(monkeypatch):
    """Transformer-XL relative keys (the window; two parts only when asked: ``dv_split_default``) with residual
    blocks of every kind in V: one part and two agree, and each is within the oracle's tolerance on the decoded K/V."""
    seen = _spy(monkeypatch)
    n = 37
    ck = build([[L, P(4), R]], n=n, d=40, bits=4, block=16, dtype=torch.float32, seed=19)
    cv = build([[P(4), L, W(6)]], n=n, d=48, bits=4, block=16, dtype=torch.float32, seed=20)
    q, relative_keys, u, w = _relative_inputs(1, n, 40, torch.float32, 21)
    scale = 40**-0.5
    relative = (relative_keys, u.reshape(1, 40).float().contiguous(), w.reshape(1, 40).float().contiguous())
    outs = []
    for split in (False, True):
        seen.clear()
        out, _ = attention_compressed_fwd(
            q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), None, scale, False, None,
            relative=relative, dv_split=split,
        )  # fmt: skip
        assert [(pad, hi) for pad, hi, _ in seen] == [dv_parts(48, split)]
        outs.append(out)
    seen.clear()
    attention_compressed_fwd(
        q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), None, scale, False, None,
        relative=relative,
    )  # fmt: skip
    assert [(pad, hi) for pad, hi, _ in seen] == [dv_parts(48, False)]  # the window's default: one part
    assert (outs[0].double() - outs[1].double()).abs().max().item() <= 1e-5
    k_ref, v_ref = ck.decompress(), cv.decompress()
    expected = relative_position_attention_reference(q, k_ref, v_ref, relative_keys, u, w, scale=scale)
    plain = _port_style(q, k_ref, v_ref, relative_keys, u, w, scale)
    plain_err = (plain.double() - expected).abs().max().item()
    for out in outs:
        assert torch.isfinite(out).all()
        assert (out.double() - expected).abs().max().item() <= 2 * plain_err + FLOOR[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_alphagenome_shape_in_two_parts_bf16(causal, monkeypatch):
    """AlphaGenome's attention shape (8 query heads on one K/V head, dk 128, dv 192 as 128 + 64, the 16 x 16 tile
    bias, soft-cap 5) in bfloat16 from the Triton encoder at 8 and 4 bits (a ragged last block), with the general
    loop and, where no block needs it, without: each launch against float64 and against the one-part launch."""
    seen = _spy(monkeypatch)
    torch.manual_seed(0)
    n = 1008
    q = torch.randn(1, 8, n, 128, device="cuda").to(torch.bfloat16)
    bias = torch.randn(1, 8, n // 16, n // 16, device="cuda") * 0.5
    full_bias = bias.repeat_interleave(16, 2).repeat_interleave(16, 3)
    for bits in (8, 4):
        config = kvbound.CompressionConfig(block_size=128, rank=8, bits=bits, tau=2.0**-5)
        x_k, x_v = (torch.randn(1, 1, n, d, device="cuda").to(torch.bfloat16) for d in (128, 192))
        ck = kvbound.compress_kv(x_k, config, kvbound.calibrate(x_k, config), impl="triton")
        cv = kvbound.compress_kv(x_v, config, kvbound.calibrate(x_v, config), impl="triton")
        reference, tolerance = alphagenome_reference(q, ck.decompress(), cv.decompress(), full_bias, causal)
        # Without the general loop only where no block needs it (the encoder's record): every block at 8 bits.
        needs_general = ck._checked_general() or cv._checked_general()
        assert needs_general is False or bits != 8
        for general in (True,) if needs_general else (True, False):
            outs = {}
            for split in (False, True):
                seen.clear()
                outs[split], _ = attention_compressed_fwd(
                    q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), bias,
                    128**-0.5, causal, 5.0, residual=(True, True), bias_tile=16, split=False, general_runs=general,
                    dv_split=split,
                )  # fmt: skip
                assert [(pad, hi) for pad, hi, _ in seen] == [dv_parts(192, split)]
                err = float((outs[split].double() - reference).abs().max())
                assert math.isfinite(err) and err <= tolerance, (bits, general, split, err, tolerance)
            assert float((outs[True].double() - outs[False].double()).abs().max()) <= 2e-2
