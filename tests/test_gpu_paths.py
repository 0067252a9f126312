"""GPU checks (bf16, real sizes) of the relative-position kernels, the plan cache and the deferred checks."""

from __future__ import annotations

import itertools

import pytest
import torch

import kvbound
from kvbound import CompressionConfig, calibrate, compress_kv
from kvbound.attention import attention
from test_attention import check_against_reference  # tests/ is on sys.path (rootdir conftest)
from test_relpos import relative_logits

pytestmark = pytest.mark.gpu


def _relative_case(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, dk, dv = 8, 64, 192
    q = torch.randn(1, h, n, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, h, n, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, h, n, dv, device="cuda", generator=g).bfloat16()
    table = (0.5 * torch.randn(h, 2 * n - 1, dk, device="cuda", generator=g)).bfloat16()
    u = 0.1 * torch.randn(h, dk, device="cuda", generator=g)
    w = 0.1 * torch.randn(h, dk, device="cuda", generator=g)
    return q, k, v, table, u, w


def _relative_reference_inputs(q, table, u, w, scale: float, rows: int, first: int = 0):
    """Queries ``first .. first + rows - 1`` as plain attention sees them: content query ``scale q + u`` rounded to q's
    dtype (as the kernel forms it) and the relative logits ``(scale q + w) . R[N - 1 + j - i]`` as an additive bias."""
    picked = q[:, :, first : first + rows]
    content = (scale * picked.float() + u[None, :, None, :]).to(q.dtype)
    position = scale * picked.double() + w[None, :, None, :].double()
    return content.contiguous(), relative_logits(position, table, q.shape[2], first)


@pytest.mark.parametrize("n", [1536, 4096])
@pytest.mark.parametrize("compressed", [False, True])
def test_gpu_relative_positions_bf16(n, compressed):
    q, k, v, table, u, w = _relative_case(n, 7 + n)
    scale = 64**-0.5
    if compressed:
        config = CompressionConfig()
        k, v = compress_kv(k, config, calibrate(k, config)), compress_kv(v, config, calibrate(v, config))
    out = attention(q, k, v, scale=scale, relative_keys=table, relative_content_bias=u, relative_position_bias=w)
    k_ref, v_ref = (k.decompress(), v.decompress()) if compressed else (k, v)
    rows = 64
    content, bias = _relative_reference_inputs(q, table, u, w, scale, rows)
    check_against_reference(out[:, :, :rows].contiguous(), content, k_ref, v_ref, bias=bias, scale=1.0)


@pytest.mark.parametrize(("n", "calibrated"), [(4096, True), (1000, False)])
def test_gpu_compressed_runs_bf16_borzoi_layout(n, calibrated):
    """Compressed K/V with Borzoi's runs of equal relative keys (the kernel's table of run logits and the unrolled
    runs per tile, in every loop of the compressed kernel: shared and per-block bases, a ragged length, two batch
    items): against float64 on the decoded K/V (first and last 64 queries), and against the relative keys on the
    same K/V."""
    from kvbound.models.reference import borzoi_positional_features_reference
    from kvbound.models.relative import equal_row_runs

    (q, k, v, _, u, w), (q2, k2, v2, *_) = _relative_case(n, 21 + n), _relative_case(n, 22 + n)
    q, k, v = torch.cat([q, q2]), torch.cat([k, k2]), torch.cat([v, v2])  # two batch items: per-item tables
    features = borzoi_positional_features_reference(n, 32).float().cuda()
    starts = equal_row_runs(features)
    g = torch.Generator(device="cuda").manual_seed(n)
    table = (features @ (0.2 * torch.randn(32, 8 * 64, device="cuda", generator=g))).reshape(2 * n - 1, 8, 64)
    table = table.transpose(0, 1).bfloat16().contiguous()
    config = CompressionConfig()
    if calibrated:
        k, v = compress_kv(k, config, calibrate(k, config)), compress_kv(v, config, calibrate(v, config))
    else:
        k, v = compress_kv(k, config), compress_kv(v, config)
    scale = 64**-0.5
    common = dict(scale=scale, relative_keys=table, relative_content_bias=u, relative_position_bias=w)
    runs = attention(q, k, v, relative_runs=starts, **common)
    keys = attention(q, k, v, **common)
    k_ref, v_ref = k.decompress(), v.decompress()
    rows = 64
    for first in (0, n - rows):
        content, bias = _relative_reference_inputs(q, table, u, w, scale, rows, first)
        check_against_reference(runs[:, :, first : first + rows].contiguous(), content, k_ref, v_ref, bias=bias,
                                scale=1.0)  # fmt: skip
    diff = (runs.float() - keys.float()).abs().max().item()
    print(f"N={n}, {len(starts)} runs, compressed ({'calibrated' if calibrated else 'per-block'} basis): runs "
          f"against relative keys max abs {diff:.2e}")  # fmt: skip
    assert diff < 5e-2


def _pinned_relative_tiles(n: int, halves: bool = False) -> list[str]:
    """Every tile of the dense kernel's relative variant, pinned, on a ragged length: one line per tile. The first
    and the last 64 queries are checked: the last query tile is partly padding, and its windows start before the
    first relative row (read as zeros, through the tensor descriptor with the relative keys). ``halves``: square tiles
    carry half of each window product (``relative_halves=True``)."""
    from kvbound.kernels import attention_dense

    q, k, v, table, u, w = _relative_case(n, 11 + n)
    scale = 64**-0.5
    rows = 64
    checked = [(first, *_relative_reference_inputs(q, table, u, w, scale, rows, first)) for first in (0, n - rows)]
    done = []
    for m, n_, warps, stages in sorted(attention_dense._RELATIVE_SHAPES):
        config = {"BLOCK_M": m, "BLOCK_N": n_, "num_warps": warps, "num_stages": stages}
        out, _ = attention_dense.attention_dense_fwd(
            q, k, v, None, scale, False, None, config=config, relative=(table, u, w), relative_halves=halves
        )
        for first, content, bias in checked:
            picked = out[:, :, first : first + rows].contiguous()
            check_against_reference(picked, content, k, v, bias=bias, scale=1.0)
        done.append(f"{m}x{n_}x{warps}x{stages}")
    return done


def test_gpu_every_relative_tile_with_carried_halves_bf16():
    """The square relative tiles with half of each window product carried to the next tile, against float64."""
    assert len(_pinned_relative_tiles(1500, halves=True)) == 3


@pytest.mark.parametrize("skew", ["default", "gather", "shared"])
def test_gpu_every_relative_tile_and_skew_bf16(skew):
    """Each relative tile of the dense kernel against float64, with the default skew (shared memory, rows
    interleaved) in this process and the other two (warp shuffles; shared memory row-major) in a fresh one, since the
    skew is read when the kernels are imported."""
    from kvbound.kernels import _common

    if skew == "default":
        assert _common.RELATIVE_SKEW_NAME == "shared-banked"
        assert len(_pinned_relative_tiles(1500)) == 3
        return
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r}); import test_gpu_paths as t; "
        f"from kvbound.kernels import _common; assert _common.RELATIVE_SKEW_NAME == {skew!r}; "
        "print(t._pinned_relative_tiles(1500))"
    )
    env = {**os.environ, "KVBOUND_RELATIVE_SKEW": skew}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_gpu_plan_cache_with_other_strides_bf16():
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 8, 4096, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 8, 4096, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 8, 4096, 64, device="cuda", generator=g).bfloat16()
    first = attention(q, k, v)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    second = attention(q, k_strided, v)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    check_against_reference(second[:, :, :64].contiguous(), q[:, :, :64].contiguous(), k, v)


def test_gpu_value_columns_split_then_whole_in_one_process_bf16(monkeypatch):
    """The value columns in two parts (dv 192 as 128 + 64), then whole, at one shape in one process: each is tuned on
    its own (a tile tuned split, 128 x 128 on 3 stages, needs more shared memory than a program has when whole), and
    the two give the same outputs, within float32 summation order, near float64."""
    from kvbound.kernels import attention_dense

    g = torch.Generator(device="cuda").manual_seed(6)
    q, k = (torch.randn(2, 8, 16384, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(2, 8, 16384, 192, device="cuda", generator=g).bfloat16()
    monkeypatch.setattr(attention_dense, "_PLANS", {})
    monkeypatch.setattr(attention_dense, "_TUNED", {})
    outs = []
    for split in ("1", "0"):
        monkeypatch.setenv("KVBOUND_DV_SPLIT", split)
        outs.append(attention(q, k, v))
        torch.cuda.synchronize()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-2)
    check_against_reference(outs[0][:, :, :64].contiguous(), q[:, :, :64].contiguous(), k, v)
    check_against_reference(outs[1][:, :, :64].contiguous(), q[:, :, :64].contiguous(), k, v)


def test_gpu_deferred_checks_raise_at_the_end():
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 8, 2048, 64, device="cuda", generator=g).bfloat16() for _ in range(3))
    v_bad = v.clone()
    v_bad[0, 3, 100, 7] = float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(ValueError, match=r"^v: expected finite values.*call 2 of 2"):
        with kvbound.deferred_checks():
            attention(q, k, v)
            with torch.cuda.stream(side):  # queued on another stream than the one that reads
                attention(q, k, v_bad)


def _tile_shapes(d: int, dv: int, residual: bool) -> list[tuple[int, int, int, int]]:
    """Every (BLOCK_M, BLOCK_N, warps, stages) the compressed kernel's autotuner may pick for these head dims."""
    from kvbound.kernels.attention_compressed import _prune_compressed_configs, _shape_of, compressed_configs

    dv_pad = max(16, 1 << (dv - 1).bit_length())
    args = dict(BLOCK_SIZE_K=128, BLOCK_SIZE_V=128, DV_PAD=dv_pad, K_RESIDUAL=residual, V_RESIDUAL=residual)
    return [_shape_of(c) for c in _prune_compressed_configs(compressed_configs(False), args)]


@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 128), (128, 192)])
def test_gpu_every_tile_through_every_residual_loop_bf16(dk, dv):
    """Each tile shape the autotuner may keep, pinned, on K/V whose super-blocks drive all three loops: uniform
    (blocks packed at the configured 4 bits, some beside low-rank ones), general (promoted 5, 6, 8 bits) and
    residual-free; bf16, block 128, GQA, outputs against the float64 oracle. The compact [BLOCK_N, words] decode
    that these shapes once ran miscompiled at d = 128 (NaN, wrong values or illegal addresses by tile)."""
    from test_kernels_residual import L, P, W, build, run_kinds

    n, heads, block, bits = 1024, 2, 128, 4
    # super-block classes: uniform, uniform, low-rank, general, general, uniform, general, uniform
    k_modes = [[P(4), P(4), L, W(6), P(4), L, W(8), P(4)]] * heads
    v_modes = [[P(4), L, L, P(4), W(5), P(4), L, P(4)]] * heads
    ck = build(k_modes, n=n, d=dk, bits=bits, block=block, dtype=torch.bfloat16, seed=21).to("cuda")
    cv = build(v_modes, n=n, d=dv, bits=bits, block=block, dtype=torch.bfloat16, seed=22).to("cuda")
    assert all(count > 0 for count in run_kinds(ck, cv)), run_kinds(ck, cv)
    _check_every_tile(ck, cv, heads * 2, seed=23, uniforms=(False, True))


@pytest.mark.parametrize("bits, dk, dv", [(2, 64, 64), (8, 128, 192)])
def test_gpu_byte_decode_every_tile_at_2_and_8_bits_bf16(bits, dk, dv):
    """The byte decode's other widths (2 bits: four planes; 8 bits: one) through every tile shape the autotuner
    may keep, uniform runs by default, beside low-rank blocks and a ragged last block; bf16, outputs against the
    float64 oracle."""
    from test_kernels_residual import L, P, build, run_kinds

    n, heads, block = 1000, 2, 128
    k_modes = [[P(bits), P(bits), L, P(bits), L, L, P(bits), P(bits)]] * heads
    v_modes = [[P(bits), L, P(bits), P(bits), L, P(bits), L, P(bits)]] * heads
    ck = build(k_modes, n=n, d=dk, bits=bits, block=block, dtype=torch.bfloat16, seed=31).to("cuda")
    cv = build(v_modes, n=n, d=dv, bits=bits, block=block, dtype=torch.bfloat16, seed=32).to("cuda")
    assert run_kinds(ck, cv)[1] > 0, run_kinds(ck, cv)
    _check_every_tile(ck, cv, heads * 2, seed=33, uniforms=(None,))


def test_gpu_plain_decode_through_the_byte_decode_checks():
    """The compiler's byte decode (KVBOUND_ASM_DECODE=0; the PTX decode is the default) through the byte-decode
    checks above, in a fresh process (the flag is read at import and is part of every kernel's cache key)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tests = ["tests/test_gpu_paths.py", "-k", "(byte_decode or every_tile) and not plain_decode"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env={**os.environ, "KVBOUND_ASM_DECODE": "0"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout[-3000:], done.stderr[-2000:])
    assert done.returncode == 0


def _check_every_tile(ck, cv, q_heads: int, *, seed: int, uniforms) -> None:
    """bf16 queries against compressed K/V at every residual tile shape the autotuner may keep, pinned, with each
    ``uniform`` policy; the first 256 query rows against the float64 oracle. (The launcher keeps uniform runs off
    the tile shapes that miscompiled, so those check the general loop.)"""
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd

    dk, dv = ck.head_dim, cv.head_dim
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(1, q_heads, ck.seq_len, dk, device="cuda", generator=generator) * 1.5).bfloat16()
    k_ref, v_ref = ck.decompress(), cv.decompress()
    shapes = _tile_shapes(dk, dv, residual=True)
    assert shapes
    for (m, bn, warps, stages), uniform in itertools.product(shapes, uniforms):
        out, _ = attention_compressed_fwd(
            q,
            CompressedOperand.from_compressed(ck),
            CompressedOperand.from_compressed(cv),
            None,
            dk**-0.5,
            False,
            None,
            config=dict(BLOCK_M=m, BLOCK_N=bn, num_warps=warps, num_stages=stages),
            uniform=uniform,
        )
        torch.cuda.synchronize()
        print(f"tile {(m, bn, warps, stages)} uniform={uniform}:", end=" ")
        check_against_reference(out[:, :, :256].contiguous(), q[:, :, :256].contiguous(), k_ref, v_ref, scale=dk**-0.5)
