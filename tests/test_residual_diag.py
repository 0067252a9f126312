"""benchmarks/residual_diag.py: its CPU smoke path end to end (Triton's interpreter, tiny shapes), the exact
layouts it builds (and the detection of a layout that was not achieved), the run counts it records, the kernels
it compiles in parallel, and the parsing of Nsight Compute's raw export."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)
from kvbound.codec.format import MODE_PACKED, MODE_RAW

rd = load("residual_diag")

SMOKE_LAYOUTS = ["lowrank", "packed8", "packed4_scatter50", "promoted5", "raw10"]


def _build(name, *, heads=2, n=256, d=32, block=16, seed=0, value_seed=3):
    basis = torch.linalg.qr(torch.randn(heads, d, rd.RANK, dtype=torch.float64))[0].transpose(1, 2).float()
    return rd.build_compressed(
        rd.LAYOUTS[name],
        heads=heads,
        seq_len=n,
        head_dim=d,
        dtype=torch.float16,
        device="cpu",
        basis=basis,
        value_seed=value_seed,
        placement_seed=seed,
        block_size=block,
    )


def _expected_shares(name: str, num_blocks: int) -> dict[str, float]:
    names = {0: "lowrank", 1: "packed", 2: "promoted", 3: "raw"}
    out = {}
    for (mode, width), count in rd.LAYOUTS[name].expected_counts(num_blocks).items():
        out[names[mode] + (str(width) if mode in (1, 2) else "")] = count / num_blocks
    return out


def test_cpu_smoke_writes_every_row_and_the_requested_layouts(tmp_path):
    out = tmp_path / "diag.csv"
    assert rd.main(["--cpu-smoke", "--layouts", ",".join(SMOKE_LAYOUTS), str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    providers = ["uniform", "general", "public", "dense"]  # no cuDNN on the CPU
    float32_layouts = [rd.FLOAT32_LAYOUT]
    expected = {(x, "float16", p) for x in SMOKE_LAYOUTS for p in providers}
    expected |= {(x, "float32", p) for x in float32_layouts for p in providers}
    got = [(r["layout"], r["dtype"], r["provider"]) for r in rows]
    assert sorted(got) == sorted(expected)
    # The requested shares at 4 blocks per head (raw10: at least one block when the share is not 0).
    requested = {
        "lowrank": {"lowrank": 1.0},
        "packed8": {"packed8": 1.0},
        "packed4_scatter50": {"lowrank": 0.5, "packed4": 0.5},
        "promoted5": {"promoted5": 1.0},
        "raw10": {"lowrank": 0.75, "raw": 0.25},
    }
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["d"], r["N"], r["H"]) == ("32", "64", "2")
        assert 0.0 <= float(r["err"]) < 1e-2
        shares = dict(item.split("=") for item in r["shares"].split())
        assert {k: float(v) for k, v in shares.items()} == requested[r["layout"]]
        if r["provider"] in ("uniform", "general", "public"):
            assert r["runs_lowrank"] != "" and r["runs_general"] != ""
    by = {(r["layout"], r["dtype"], r["provider"]): r for r in rows}
    # Uniform runs where the configured width is met, general runs for promoted and raw blocks.
    packed8 = by[("packed8", "float16", "uniform")]
    assert (packed8["runs_lowrank"], packed8["runs_uniform"], packed8["runs_general"]) == ("0", "2", "0")
    scattered = by[("packed4_scatter50", "float16", "general")]
    assert scattered["runs_uniform"] == "0" and int(scattered["runs_general"]) >= 2
    promoted = by[("promoted5", "float16", "uniform")]
    assert (promoted["runs_uniform"], promoted["runs_general"]) == ("0", "2")


@pytest.mark.parametrize("name", list(rd.LAYOUTS))
def test_built_layouts_hold_exactly_the_request(name):
    ckv = _build(name)
    nb = ckv.num_blocks
    shares = rd.verify_layout(ckv, rd.LAYOUTS[name])
    assert shares == pytest.approx(_expected_shares(name, nb))
    layout = rd.LAYOUTS[name]
    mode, bits = ckv.mode[0], ckv.bits[0]
    residual = mode != 0
    if layout.placement == "contiguous":
        assert residual[:, : nb // 2].all() and not residual[:, nb // 2 :].any()
    if layout.placement == "alternating":
        assert residual[:, ::2].all() and not residual[:, 1::2].any()
    if layout.residual[0] == MODE_RAW:
        # Raw blocks: zero coefficients, exact values decoded as stored.
        rows = residual.repeat_interleave(16, dim=1)
        assert (ckv.coeffs[0][rows] == 0).all()
    if layout.residual[0] == MODE_PACKED:
        assert (bits[residual] == layout.config_bits).all() and ckv.config.bits == layout.config_bits
    assert torch.isfinite(ckv.decompress()).all()


def test_a_layout_that_was_not_achieved_stops_the_script():
    scattered = _build("packed4_scatter50", seed=5)
    with pytest.raises(rd.LayoutMismatch, match="contiguous placement"):
        rd.verify_layout(scattered, rd.LAYOUTS["packed4_contig50"])
    with pytest.raises(rd.LayoutMismatch, match="blocks per"):
        rd.verify_layout(scattered, rd.LAYOUTS["packed4"])
    with pytest.raises(rd.LayoutMismatch, match="config.bits"):
        rd.verify_layout(_build("packed4"), rd.LAYOUTS["packed8"])
    # One block of the right layout changed after the build: a share off by one block is caught.
    broken = _build("promoted5")
    broken.mode[0, 1, 3] = 0
    with pytest.raises(rd.LayoutMismatch):
        rd.verify_layout(broken, rd.LAYOUTS["promoted5"])


def test_recomputed_runs_match_the_block_runs_kernel():
    for name in ("packed4_scatter50", "packed4_alt50", "raw10", "lowrank"):
        ck, cv = _build(name, value_seed=1), _build(name, value_seed=2)
        k_op, v_op = rd.CompressedOperand.from_compressed(ck), rd.CompressedOperand.from_compressed(cv)
        for fast in ((4, 4), None):
            assert rd.kernel_runs(k_op, v_op, fast) == rd.expected_runs(ck, cv, fast), (name, fast)
    alt = _build("packed4_alt50")
    assert rd.expected_runs(alt, alt, (4, 4)) == [2 * 8, 2 * 8, 0]


def test_one_parallel_compile_per_distinct_kernel():
    # The GPU plan without a GPU: the default settings, built by hand.
    s = rd.Settings(
        out=Path("x.csv"),
        smoke=False,
        device=torch.device("cpu"),
        heads=8,
        block_size=128,
        dims=[64, 128],
        lengths=[16384],
        long_layouts=list(rd.LONG_LAYOUTS),
        layouts=list(rd.LAYOUTS),
        providers=list(rd.PROVIDERS),
        dtypes=[torch.bfloat16],
        budget_s=270.0,
        pin_public=True,
    )
    jobs = rd.warm_jobs(s)
    variants = [rd.kernel_variant(case, provider) for case, provider in jobs]
    assert len(set(variants)) == len(variants)
    # Per head dim: residual-free, uniform at 4 bits, uniform at 8 bits, general-only, dense.
    assert len(jobs) == 10
    assert all(provider != "public" and provider != "cudnn" for _, provider in jobs)
    cases = rd.plan(s)
    assert len(cases) == 2 * len(rd.LAYOUTS) + 2 * len(rd.LONG_LAYOUTS)
    assert [c.n for c in cases[-4:]] == [rd.LONG_N] * 4


def test_ncu_raw_export_is_parsed_per_measurement():
    header = [
        '"ID"',
        '"Kernel Name"',
        '"gpu__time_duration.sum"',
        '"launch__registers_per_thread"',
        '"l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum"',
        '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"',
        '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
        '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"',
        '"smsp__average_warps_issue_stalled_barrier_not_issued_per_issue_active.ratio"',
        '"smsp__issue_active.avg.pct_of_peak_sustained_active"',
        '"sm__pipe_tensor_cycles_active.max.pct_of_peak_sustained_active"',
        '"sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"',
        '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"',
        '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"',
    ]
    text = "\n".join(
        [
            "==PROF== Disconnected",
            ",".join(header),
            '"","","nsecond","register/thread","sector","ratio","ratio","ratio","ratio","%","%","%","%","%"',
            '"0","residual_diag:packed4:64:16384:uniform/","4,060,000","168","1024","2.5","0.5","1.25","9","71.5","30",'
            '"40","22.25","22.25"',
            '"1","residual_diag:lowrank:64:16384:dense/","1,420,000","128","0","0.1","0.2","0.3","9","40","70","80",'
            '"","55.5"',
        ]
    )
    parsed = rd.parse_ncu_raw(text)
    assert [p["measurement_id"] for p in parsed] == ["packed4:64:16384:uniform", "lowrank:64:16384:dense"]
    assert parsed[0]["duration_ns"] == 4.06e6 and parsed[0]["registers_per_thread"] == 168
    assert parsed[0]["stalls"] == [("long_scoreboard", 2.5), ("wait", 1.25), ("barrier", 0.5)]
    # the average over SMs of every tensor pipe, not the busiest SM (.max) nor an instruction rate; when that column
    # is empty, a single pipe's average; the column's name is kept
    assert parsed[0]["issue_active_pct"] == 71.5 and parsed[0]["tensor_pipe_pct"] == 22.25
    assert parsed[0]["tensor_pipe_metric"] == "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
    assert parsed[1]["tensor_pipe_pct"] == 55.5 and "hmma_cycles_active.avg" in parsed[1]["tensor_pipe_metric"]
    child = [
        dict(
            layout="packed4",
            d="64",
            N="16384",
            provider="uniform",
            status="ok",
            measurement_id="packed4:64:16384:uniform",
        ),
        dict(
            layout="promoted5",
            d="64",
            N="16384",
            provider="uniform",
            status="ok",
            measurement_id="promoted5:64:16384:uniform",
        ),
    ]
    merged = rd.merge_ncu(child, parsed)
    assert merged[0]["duration_ms"] == pytest.approx(4.06) and merged[0]["local_load_bytes"] == 1024 * 32
    assert merged[0]["stall_1"] == "long_scoreboard=2.5"
    assert merged[0]["issue_active_pct"] == 71.5 and merged[0]["tensor_pipe_pct"] == 22.25
    assert merged[1]["status"] == "error"  # nothing profiled for it
    with pytest.raises(ValueError, match="ID"):
        rd.parse_ncu_raw("no csv here")
    cmd = rd.ncu_command("ncu", Path("r"), ["python3", "x.py"], with_metrics=True)
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and cmd[-2:] == ["python3", "x.py"]
    assert "--metrics" not in rd.ncu_command("ncu", Path("r"), ["python3"], with_metrics=False)
