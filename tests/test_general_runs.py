"""The compressed kernel without its general-run loop (``attention_compressed_fwd(general_runs=False)``): compiled
only where no block needs that loop (``general_blocks``), which ``kvbound.attention`` learns from the call's checks
or the operands' records, and the speculative encoder from its forecast, with a retry where the forecast was wrong.
CPU: Triton's interpreter, float16 operands."""

from __future__ import annotations

import math

import pytest
import torch

import kvbound
from kvbound import _checks
from kvbound.codec.encode_triton import encode_triton_deferred
from kvbound.kernels import attention_compressed as compressed
from kvbound.kernels.attention_compressed import (
    CompressedOperand,
    attention_compressed_fwd,
    fast_width,
    general_blocks,
    general_loop,
)

BLOCK = 16
CONFIG = kvbound.CompressionConfig(block_size=BLOCK, rank=4, bits=4, tau=0.05)


def _data(scales, heads=2, d=32, tail=8, seed=0) -> torch.Tensor:
    """``[1, heads, N, d]``: a rank-4 part plus, per block of ``BLOCK`` rows, noise of the given scale (0.1 packs at
    4 bits with tau 0.05, 1.0 needs more bits: promoted or exact; 0 leaves the block low rank on the basis
    ``_basis`` calibrates), and ``tail`` more rows (a ragged last block) at the last scale. The rank-4 part depends
    on the seed and the number of blocks only."""
    g = torch.Generator().manual_seed(seed)
    rows = [BLOCK] * len(scales) + ([tail] if tail else [])
    scale_of = scales + scales[-1:]  # the tail at the last block's scale
    noise = torch.cat([s * torch.randn(heads, r, d, generator=g) for s, r in zip(scale_of, rows, strict=False)], 1)
    low = torch.randn(heads, sum(rows), 4, generator=g) @ torch.randn(heads, 4, d, generator=g)
    return (low + noise)[None]


def _basis(scales, seed):
    """The basis calibrated on the rank-4 part of ``_data(scales, seed=seed)`` alone."""
    return kvbound.calibrate(_data([0.0] * len(scales), seed=seed), CONFIG)


def _launches(monkeypatch) -> list[bool]:
    """``GENERAL_RUNS`` of each compressed-kernel launch from now on (the kernel still runs)."""
    seen = []
    original = compressed.launch_tuned

    def spy(kernel, tuned, grid, args, constexprs, tune_key, config):
        if kernel is compressed._attention_compressed_fwd:
            seen.append(constexprs["GENERAL_RUNS"])
        return original(kernel, tuned, grid, args, constexprs, tune_key, config)

    monkeypatch.setattr(compressed, "launch_tuned", spy)
    return seen


def _tolerance(q, k, v, reference, **kwargs) -> float:
    """Twice plain float16 attention's error on the decoded K/V, plus a floor."""
    group = q.shape[1] // k.shape[1]
    k16, v16 = (t.to(q.dtype).repeat_interleave(group, 1) for t in (k, v))
    plain = torch.nn.functional.scaled_dot_product_attention(q.float(), k16.float(), v16.float(), **kwargs)
    return 2 * float((plain.to(q.dtype).double() - reference).abs().max()) + 2e-3


def test_general_blocks_names_what_the_uniform_runs_cannot_read():
    mode = torch.tensor([0, 1, 1, 2, 3, 1], dtype=torch.int8)
    bits = torch.tensor([0, 4, 8, 5, 0, 4], dtype=torch.int8)
    offset = torch.tensor([-1, 0, 64, 128, 0, 130])
    # low rank / packed at 4 from a 16-byte boundary / another width / promoted / exact / off the boundary
    assert general_blocks(mode, bits, offset, 4, 32).tolist() == [0, 0, 1, 1, 1, 1]
    # 3-bit codes have no uniform runs: every residual block takes the general loop
    assert fast_width(3, 32) == 0 and general_blocks(mode, bits, offset, 3, 32).tolist() == [0, 1, 1, 1, 1, 1]
    assert fast_width(4, 30) == 0 and fast_width(8, 192) == 8 and fast_width(4, 32) == 4
    assert general_loop(0, True, 4, 32) is False and general_loop(1, True, 4, 32) is True
    assert general_loop(0, True, 3, 32) is True and general_loop(0, False, 3, 32) is False


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_without_general_runs_matches_the_reference(causal, monkeypatch):
    """Every residual block packed at the configured 4 bits, some low rank, a ragged last block (the masked tail,
    which decodes as the uniform runs do without general runs), and causal rows (the tail spans the diagonal)."""
    scales_k, scales_v = [0.1, 0.0, 0.1, 0.1, 0.0, 0.1], [0.1, 0.1, 0.0, 0.1, 0.1, 0.1]
    x_k, x_v = _data(scales_k, seed=1), _data(scales_v, seed=2)
    basis_k, basis_v = _basis(scales_k, 1), _basis(scales_v, 2)
    ck, cv = kvbound.compress_kv(x_k, CONFIG, basis_k), kvbound.compress_kv(x_v, CONFIG, basis_v)
    for ckv in (ck, cv):
        assert int(general_blocks(ckv.mode, ckv.bits, ckv.offset, CONFIG.bits, 32).sum()) == 0
        assert bool((ckv.mode == 1).any()) and bool((ckv.mode == 0).any())
    n = x_k.shape[2]
    q = torch.randn(1, 4, n, 32, generator=torch.Generator().manual_seed(3)).half()
    k_dec, v_dec = ck.decompress(), cv.decompress()
    reference = kvbound.reference_attention(q, k_dec, v_dec, causal=causal)
    tolerance = _tolerance(q, k_dec, v_dec, reference, is_causal=causal, enable_gqa=True)
    launched = _launches(monkeypatch)
    outs = {}
    for general in (True, False):
        outs[general], _ = attention_compressed_fwd(
            q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), None, 32**-0.5, causal,
            None, residual=(True, True), split=False, general_runs=general,
        )  # fmt: skip
        err = float((outs[general].double() - reference).abs().max())
        assert math.isfinite(err) and err <= tolerance, (general, err, tolerance)
    assert launched == [True, False]
    # the same products, summed in the same order but for the tail's row multiplier: float16 roundings apart
    assert float((outs[True].double() - outs[False].double()).abs().max()) <= 1e-3


def test_attention_compiles_general_runs_only_for_blocks_that_need_them(monkeypatch):
    """``kvbound.attention`` reads whether some block needs the general loop with its checks (eager encodes carry no
    record) or from the Triton encoder's record, and runs the kernel without it only where none does; a promoted
    block in either operand brings it back, and the outputs stay within tolerance of float64 either way."""
    n_blocks = 5
    clean = [0.1] * n_blocks
    promoted = [0.1, 0.1, 1.0, 0.1, 0.1]
    launched = _launches(monkeypatch)
    q = torch.randn(1, 2, n_blocks * BLOCK + 8, 32, generator=torch.Generator().manual_seed(4)).half()
    for impl in ("eager", "triton"):
        for k_scales, v_scales, expected in ((clean, clean, False), (clean, promoted, True), (promoted, clean, True)):
            x_k, x_v = _data(k_scales, seed=5), _data(v_scales, seed=6)
            ck = kvbound.compress_kv(x_k, CONFIG, _basis(k_scales, 5), impl=impl)
            cv = kvbound.compress_kv(x_v, CONFIG, _basis(v_scales, 6), impl=impl)
            needs = [bool(general_blocks(c.mode, c.bits, c.offset, CONFIG.bits, 32).any()) for c in (ck, cv)]
            assert any(needs) is expected, (impl, needs)
            if impl == "triton":  # the synchronous encoder records it
                assert [c._checked_general() for c in (ck, cv)] == needs
            else:
                assert ck._checked_general() is None
            launched.clear()
            out = kvbound.attention(q, ck, cv)
            assert launched == [expected], (impl, needs)
            if impl == "eager":  # the call's check recorded it
                assert [c._checked_general() for c in (ck, cv)] == needs
            reference = kvbound.reference_attention(q, ck.decompress(), cv.decompress())
            tolerance = _tolerance(q, ck.decompress(), cv.decompress(), reference, enable_gqa=True)
            assert float((out.double() - reference).abs().max()) <= tolerance


def test_speculative_encoder_retries_a_general_block_where_none_was_forecast():
    x = _data([0.1, 0.1, 1.0, 0.1], seed=7)
    clean = _data([0.1, 0.1, 0.1, 0.1], seed=7)
    basis = _basis([0.1] * 4, 7)
    with pytest.raises(_checks.Retry, match="K: a block for the attention kernel's general loop where none was"):
        with _checks._block(speculative=True) as scope:
            ckv = encode_triton_deferred(x, CONFIG, basis, scope, general=False, name="K")
            assert ckv._checked_general() is False
    sizes = []
    with _checks._block(speculative=True) as scope:  # forecast right: nothing to retry
        ckv = encode_triton_deferred(clean, CONFIG, basis, scope, general=False, sizes=lambda *a: sizes.append(a))
    assert sizes[0][3] == 0 and ckv._checked_general() is False
    with _checks._block(speculative=True) as scope:  # told there may be one: nothing to retry either
        ckv = encode_triton_deferred(x, CONFIG, basis, scope, general=True, sizes=lambda *a: sizes.append(a))
    assert sizes[1][3] == int(general_blocks(ckv.mode, ckv.bits, ckv.offset, CONFIG.bits, 32).sum()) > 0
    # 3-bit codes have no uniform runs: a forecast of none is not believed, and nothing is retried
    three = kvbound.CompressionConfig(block_size=BLOCK, rank=4, bits=3, tau=0.05)
    with _checks._block(speculative=True) as scope:
        ckv = encode_triton_deferred(clean, three, basis, scope, general=False)
        assert ckv._checked_general() is True


def test_ab_script_cpu_smoke_checks_every_variant_against_float64(tmp_path):
    """benchmarks/general_runs_ab.py in Triton's interpreter: one row per (case, provider), every output within
    tolerance of float64, nothing timed."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "general_runs_ab.py"
    out = tmp_path / "ab.csv"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), str(out), "--cpu-smoke", "--commit", "abc1234"],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["case"], r["provider"]) for r in rows] == [
        (case, provider)
        for case in ("alphagenome-packed8", "d64-packed4")
        for provider in ("general", "uniform-only", "general+dv-split", "uniform-only+dv-split", "dense")
    ]
    for row in rows:
        assert row["status"] == "ok" and float(row["err"]) <= float(row["tolerance"]) and row["ms_p50"] == ""
        assert row["commit"] == "abc1234"


def alphagenome_reference(q, k_dec, v_dec, full_bias, causal) -> tuple[torch.Tensor, float]:
    """The float64 reference at AlphaGenome's attention (dk 128, the given full bias, soft-cap 5) on decoded K/V, and
    the tolerance: twice plain attention's error in q's dtype on the same K/V, plus a floor."""
    n = q.shape[2]
    reference = kvbound.reference_attention(q, k_dec, v_dec, bias=full_bias, softcap=5.0, causal=causal)
    logits = (q @ k_dec.to(q.dtype).transpose(-1, -2)).float() * 128**-0.5 + full_bias
    logits = 5.0 * torch.tanh(logits / 5.0)
    if causal:
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    plain = torch.softmax(logits, -1).to(q.dtype) @ v_dec.to(q.dtype)
    return reference, 2 * float((plain.double() - reference).abs().max()) + 2e-3


@pytest.mark.gpu
def test_gpu_alphagenome_shape_without_general_runs_bf16(monkeypatch):
    """AlphaGenome's attention shape (8 query heads on one K/V head, dk 128, dv 192, the 16 x 16 tile bias, soft-cap
    5) in bfloat16, K and V from the Triton encoder at 8 bits (every residual block packed, a ragged last block),
    causal and not: the kernel without general runs against float64 and against the kernel with them, and
    ``kvbound.attention`` choosing it from the encoder's record."""
    torch.manual_seed(0)
    n, config = 1008, kvbound.CompressionConfig(block_size=128, rank=8, bits=8, tau=2.0**-5)  # a ragged last block
    x_k, x_v = (torch.randn(1, 1, n, d, device="cuda").to(torch.bfloat16) for d in (128, 192))
    ck = kvbound.compress_kv(x_k, config, kvbound.calibrate(x_k, config), impl="triton")
    cv = kvbound.compress_kv(x_v, config, kvbound.calibrate(x_v, config), impl="triton")
    for ckv in (ck, cv):
        assert ckv._checked_general() is False and bool((ckv.mode == 1).all())
    q = torch.randn(1, 8, n, 128, device="cuda").to(torch.bfloat16)
    bias = torch.randn(1, 8, n // 16, n // 16, device="cuda") * 0.5
    k_dec, v_dec = ck.decompress(), cv.decompress()
    full_bias = bias.repeat_interleave(16, 2).repeat_interleave(16, 3)
    launched = _launches(monkeypatch)
    for causal in (False, True):
        reference, tolerance = alphagenome_reference(q, k_dec, v_dec, full_bias, causal)
        outs = {}
        for general in (True, False):
            outs[general], _ = attention_compressed_fwd(
                q, CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv), bias, 128**-0.5,
                causal, 5.0, residual=(True, True), bias_tile=16, split=False, general_runs=general,
            )  # fmt: skip
            err = float((outs[general].double() - reference).abs().max())
            assert math.isfinite(err) and err <= tolerance, (causal, general, err, tolerance)
        assert float((outs[True].double() - outs[False].double()).abs().max()) <= 2e-2
        launched.clear()
        out = kvbound.attention(q, ck, cv, bias=bias, bias_tile=16, softcap=5.0, causal=causal)
        assert launched == [False]
        assert float((out.double() - reference).abs().max()) <= tolerance
