"""Tiles of the runs variant that span many runs (``KVBOUND_RUNS_ONEHOT``, default ``_common.RUNS_ONEHOT_DEFAULT``)
take their relative term from a product with a one-hot matrix of the runs (``_common.relative_runs_onehot``)
instead of one compare and select per element and run. The product is exact (three tf32 parts), so the kernel's
outputs are the same bits with the one-hot tiles on or off. CPU: the kernels run in Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kvbound.attention import _derive_run_layout
from kvbound.kernels._common import (
    ONEHOT_SPAN,
    relative_runs_bounds,
    relative_runs_first,
    relative_runs_onehot,
)

ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _onehot_tile_kernel(
    Table, Runs, Out, stride_run, start_m, start_n, N_Q, N_K, N_RUNS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    first_run, last_run = relative_runs_bounds(Runs, start_m, start_n, N_Q, N_K, N_RUNS, BLOCK_M, BLOCK_N)
    first_value = relative_runs_first(Table, stride_run, first_run, start_m, N_Q, BLOCK_M)
    tile = relative_runs_onehot(
        Table, stride_run, Runs, first_run, last_run, first_value, start_m, start_n, N_Q, N_K, N_RUNS,
        BLOCK_M, BLOCK_N, ONEHOT_SPAN,
    )  # fmt: skip
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(Out + offs, tile)


def _layout(starts: list[int], n_q: int, n_k: int):
    rows = n_q + n_k - 1
    runs = torch.tensor(starts)
    _, run_of_row, buffer, _ = _derive_run_layout(runs, rows, n_q, n_k, 0)
    return run_of_row, buffer


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 16), (16, 32)])
def test_onehot_tile_is_exactly_each_runs_excess(block_m, block_n):
    """Every tile of a layout whose runs are 1 to 6 distances long near the diagonal, table values spread over
    twelve orders of magnitude (the tf32 parts must rebuild every float32 bit): the helper's tile equals
    ``table[run(d), row] - table[first run of the tile, row]`` bit for bit; rows past ``N_Q`` are 0."""
    n_q, n_k = 37, 29
    starts = [0, 10, 20, 25, 28, 30, 31, 33, 34, 35, 36, 37, 39, 42, 48, 55]
    run_of_row, buffer = _layout(starts, n_q, n_k)
    g = torch.Generator().manual_seed(0)
    table = torch.randn(len(starts), n_q, generator=g) * torch.logspace(-6, 6, len(starts))[:, None]
    checked = 0
    for start_m in range(0, n_q, block_m):
        for start_n in range(0, n_k, block_n):
            distance = (start_n + torch.arange(block_n))[None, :] - (start_m + torch.arange(block_m))[:, None]
            d_lo = max(start_n - start_m - (block_m - 1), -(n_q - 1))
            d_hi = min(start_n + block_n - 1 - start_m, n_k - 1)
            first, last = int(run_of_row[d_lo + n_q - 1]), int(run_of_row[d_hi + n_q - 1])
            if last - first + 1 > ONEHOT_SPAN:
                continue
            out = torch.empty(block_m, block_n)
            _onehot_tile_kernel[(1,)](table, buffer, out, n_q, start_m, start_n, n_q, n_k, len(starts),
                                      BLOCK_M=block_m, BLOCK_N=block_n)  # fmt: skip
            rows = start_m + torch.arange(block_m)
            valid = (distance >= -(n_q - 1)) & (distance <= n_k - 1) & (rows < n_q)[:, None]
            run = run_of_row[(distance + n_q - 1).clamp(0, n_q + n_k - 2)]
            row = rows.clamp(max=n_q - 1)[:, None].expand_as(run)
            expected = table[run, row] - table[first, row]
            assert torch.equal(out[valid], expected[valid]), (start_m, start_n)
            assert (out[(rows >= n_q)] == 0).all()
            checked += int(last > first)
    assert checked >= 3  # tiles that span several runs were among them


_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import triton, triton.language as tl
    from kvbound.kernels import _common
    if sys.argv[2] == "zero":  # the one-hot tiles replaced by zeros: proves that the kernels take them
        @triton.jit
        def _zeros(table_head, stride_table_run, runs, first_run, last_run, first_value, start_m, start_n, N_Q,
                   N_K, N_RUNS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
            return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        _common.relative_runs_onehot = _zeros
    from kvbound.attention import attention
    from kvbound.compress import compress_kv
    from kvbound.config import CompressionConfig
    g = torch.Generator().manual_seed(7)
    h, n, dk, dv = 2, 70, 16, 24
    starts = [0, 40, 55, 62, 65, 67, 68, 69, 70, 71, 72, 74, 77, 81, 90, 110]
    q, k, v = (torch.randn(1, h, n, d, generator=g) for d in (dk, dk, dv))
    keys = torch.randn(h, len(starts), dk, generator=g)
    u, w = torch.randn(h, dk, generator=g) * 0.5, torch.randn(h, dk, generator=g) * 0.5
    common = dict(relative_keys=keys, relative_content_bias=u, relative_position_bias=w, relative_runs=starts,
                  return_lse=True)
    dense = attention(q, k, v, **common)
    config = CompressionConfig(block_size=16, rank=4, bits=4, tau=2.0**-5)
    compressed = attention(q, compress_kv(k, config), compress_kv(v, config), **common)
    torch.save({"onehot": _common.RUNS_ONEHOT, "dense": dense, "compressed": compressed}, sys.argv[1])
    """
)


def _run(tmp_path: Path, setting: str | None, variant: str = "plain") -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("KVBOUND_RUNS_ONEHOT", None)
    if setting is not None:
        env["KVBOUND_RUNS_ONEHOT"] = setting
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / f"{setting}-{variant}.pt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), variant], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_kernels_give_the_same_bits_with_onehot_tiles_on_and_off(tmp_path):
    off = _run(tmp_path, "0")
    every = _run(tmp_path, "2")  # every tile of two runs or more
    default = _run(tmp_path, None)
    assert (off["onehot"], every["onehot"]) == (0, 2) and default["onehot"] >= 2
    for name in ("dense", "compressed"):
        for result in (every, default):
            for got, expected in zip(result[name], off[name], strict=True):
                assert torch.equal(got, expected), name
    # the kernels do take the one-hot tiles: with them replaced by zeros the outputs change
    sabotaged = _run(tmp_path, "2", "zero")
    for name in ("dense", "compressed"):
        assert (sabotaged[name][0] - off[name][0]).abs().max() > 1e-3, name


@pytest.mark.parametrize("value", ["1", "17", "x", "-2"])
def test_bad_setting_is_refused(tmp_path, value):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "KVBOUND_RUNS_ONEHOT": value}
    proc = subprocess.run([sys.executable, "-c", "import kvbound.kernels._common"], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert f"KVBOUND_RUNS_ONEHOT: expected 0 or an integer from 2 to 16, got '{value}'" in proc.stderr


_GPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from kvbound.attention import attention
    from kvbound.compress import compress_kv
    from kvbound.config import CompressionConfig
    from kvbound.kernels import _common
    from kvbound.models.reference import borzoi_positional_features_reference
    from kvbound.models.relative import equal_row_runs
    n, h, dk, dv = 4096, 8, 64, 192
    features = borzoi_positional_features_reference(n, 32).float()
    starts = equal_row_runs(features)
    g = torch.Generator().manual_seed(9)
    keys = (features @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
    per_run = keys[:, starts].to(torch.bfloat16).cuda().contiguous()
    q, k = (torch.randn(2, h, n, dk, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
    v = torch.randn(2, h, n, dv, generator=g).to(torch.bfloat16).cuda()
    u, w = ((torch.randn(h, dk, generator=g) * 0.3).cuda() for _ in range(2))
    common = dict(relative_keys=per_run, relative_content_bias=u, relative_position_bias=w, relative_runs=starts,
                  return_lse=True)
    dense = attention(q, k, v, **common)
    config = CompressionConfig()
    compressed = attention(q, compress_kv(k, config), compress_kv(v, config), **common)
    torch.save({"onehot": _common.RUNS_ONEHOT, "dense": [t.cpu() for t in dense],
                "compressed": [t.cpu() for t in compressed]}, sys.argv[1])
    """
)


@pytest.mark.gpu
def test_gpu_onehot_tiles_give_the_same_bits_at_borzoi_shape(tmp_path):
    """On the GPU (bf16, Borzoi's runs at N = 4096, batch 2, dense and compressed K/V): the tensor cores' tf32
    products and float32 sums of the one-hot tiles rebuild every bit, so the outputs and log-sum-exps equal those
    of the compare-and-select fill."""
    results = {}
    for setting in ("0", "2", None):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("KVBOUND_RUNS_ONEHOT", None)
        if setting is not None:
            env["KVBOUND_RUNS_ONEHOT"] = setting
        out = tmp_path / f"{setting}.pt"
        proc = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(out)], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[setting] = torch.load(out)
    assert results["0"]["onehot"] == 0 and results["2"]["onehot"] == 2
    for setting in ("2", None):
        for name in ("dense", "compressed"):
            for got, expected in zip(results[setting][name], results["0"][name], strict=True):
                assert torch.equal(got, expected), (setting, name)
