"""benchmarks/relative_ncu.py: the variants' calls against float64 (in the interpreter), and how Nsight Compute's raw
export is read into its rows."""

import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)

_PATH = Path(__file__).parents[1] / "benchmarks" / "relative_ncu.py"


def _module():
    return load("relative_ncu")


def test_cpu_smoke_checks_every_variant_against_float64(tmp_path):
    out = tmp_path / "rel.csv"
    proc = subprocess.run(
        [sys.executable, str(_PATH), str(out), "--cpu-smoke", "--commit", "abc1234"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert all(r["tile"] == "autotuned" for r in rows)
    assert [(r["case"], r["variant"]) for r in rows] == [
        ("enformer-b2", "plain"),
        ("enformer-b2", "keys"),
        ("borzoi-b1", "plain"),
        ("borzoi-b1", "keys"),
        ("borzoi-b1", "runs"),
    ]
    for r in rows:
        assert r["status"] == "ok" and r["commit"] == "abc1234"
        assert float(r["err_max"]) < 1e-5  # float32 in the interpreter
        assert float(r["call_ms_p50"]) > 0
        assert r["duration_ms"] == ""  # no profiler on the CPU
        assert len(r["tile_used"].split("x")) == 4  # the autotuner's choice, recorded


def test_pinned_tile_rows(tmp_path):
    out = tmp_path / "rel.csv"
    cmd = [sys.executable, str(_PATH), str(out), "--cpu-smoke", "--cases", "borzoi-b1", "--tiles", "16x32x4x1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["variant"], r["tile"]) for r in rows] == [("plain", "16x32x4x1"), ("keys", "16x32x4x1"),
                                                         ("runs", "16x32x4x1")]  # fmt: skip
    assert all(r["status"] == "ok" and float(r["err_max"]) < 1e-5 for r in rows)
    assert all(r["tile_used"] == "16x32x4x1" for r in rows)  # the pin reached the kernel's launch


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cases", "enformer-b8"], "enformer-b2"),
        (["--tiles", "64x64"], "BMxBNxWARPSxSTAGES"),
        (["--tiles", "autotuned", "autotuned"], "more than once"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, args, needle):
    proc = subprocess.run(
        [sys.executable, str(_PATH), str(tmp_path / "x.csv"), "--cpu-smoke", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and needle in proc.stderr and args[1] in proc.stderr


def test_pinned_tile_restores_the_autotuner():
    sys.path.insert(0, str(_PATH.parent))
    try:
        from relative_tiles import pinned_tile
    finally:
        sys.path.remove(str(_PATH.parent))
    from kvbound.kernels import attention_dense

    tuner = attention_dense._attention_dense_fwd
    configs, shapes, runs = list(tuner.configs), attention_dense._RELATIVE_SHAPES, attention_dense._RUNS_SHAPES
    attention_dense._TUNED[("stale",)] = {}
    with pinned_tile((32, 16, 4, 2)):
        assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in tuner.configs] == [
            (32, 16, 4, 2)
        ]
        assert attention_dense._RELATIVE_SHAPES == attention_dense._RUNS_SHAPES == frozenset({(32, 16, 4, 2)})
        assert ("stale",) not in attention_dense._TUNED  # tuned winners cleared on entry
        attention_dense._TUNED[("inside",)] = {}
    assert list(tuner.configs) == configs and attention_dense._RELATIVE_SHAPES == shapes
    assert attention_dense._RUNS_SHAPES == runs
    assert ("inside",) not in attention_dense._TUNED  # and on exit


def test_profile_without_nsight_compute_fails_the_rows(tmp_path):
    rn = _module()
    rows = [
        {"case": "enformer-b8", "variant": "plain", "tile": "autotuned", "status": "ok"},
        {"case": "enformer-b8", "variant": "keys", "tile": "autotuned", "status": "error", "reason": "boom"},
    ]
    out = rn.profile(rows, ["enformer-b8"], ["autotuned"], tmp_path / "x.csv", "no-such-ncu-here")
    assert out[0]["status"] == "error" and "('no-such-ncu-here') not found" in out[0]["reason"]
    assert out[1] == rows[1]  # an earlier failure keeps its own reason


def test_timeout_kills_the_whole_process_group(tmp_path):
    rn = _module()
    marker = tmp_path / "late"
    start = time.monotonic()
    status, tail = rn._run_killing_group(["bash", "-c", f"(sleep 3; touch {marker}) & sleep 30"], 1.0)
    assert status is None and "timed out" in tail and time.monotonic() - start < 10
    time.sleep(3.5)
    assert not marker.exists()  # the grandchild died with the group
    assert rn._run_killing_group(["bash", "-c", "echo hello"], 10) == (0, "hello")


def test_replot_draws_from_the_csv(tmp_path):
    rn = _module()
    rows = [
        {"case": "enformer-b8", "N": 1536, "variant": "plain", "tile": "autotuned", "status": "ok",
         "duration_ms": 0.23, "tensor_pipe_pct": 46.0, "local_load_bytes": 0.0, "device": "GPU"},
        {"case": "enformer-b8", "N": 1536, "variant": "keys", "tile": "autotuned", "status": "ok",
         "duration_ms": 0.51, "tensor_pipe_pct": None, "local_load_bytes": 1.5e8, "device": "GPU"},
        {"case": "enformer-b8", "N": 1536, "variant": "keys", "tile": "64x64x8x3", "status": "error"},
    ]  # fmt: skip
    out = tmp_path / "rel.csv"
    rn.write_csv(out, rows)
    back = rn.read_csv(out)
    assert back[1]["duration_ms"] == 0.51 and back[1]["tensor_pipe_pct"] is None and back[2]["duration_ms"] is None
    proc = subprocess.run([sys.executable, str(_PATH), str(out), "--replot"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_parse_tile():
    rn = _module()
    assert rn.parse_tile("autotuned") is None and rn.parse_tile("64x32x8x3") == (64, 32, 8, 3)
    for bad in ("64x64", "64x64x0x1", "ax64x4x1", ""):
        with pytest.raises(ValueError, match="BMxBNxWARPSxSTAGES"):
            rn.parse_tile(bad)


def _raw(rows: list[list[str]]) -> str:
    header = [
        "ID",
        "Kernel Name",
        "gpu__time_duration.sum",
        "launch__registers_per_thread",
        "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    ]
    lines = ["==PROF== Disconnected", ",".join(f'"{h}"' for h in header), '"","","nsecond","","sector","","","%"']
    lines += [",".join(f'"{c}"' for c in row) for row in rows]
    return "\n".join(lines)


def test_merge_profile_reads_one_kernel_per_call():
    rn = _module()
    timed = [
        {"case": "enformer-b8", "variant": "plain", "tile": "autotuned", "status": "ok"},
        {"case": "enformer-b8", "variant": "keys", "tile": "64x64x8x3", "status": "ok"},
        {"case": "borzoi-b4", "variant": "runs", "tile": "autotuned", "status": "ok"},
        {"case": "borzoi-b4", "variant": "keys", "tile": "autotuned", "status": "error", "reason": "boom"},
    ]
    text = _raw(
        [
            [
                "0",
                "relative_ncu:enformer-b8:plain:autotuned/_attention_dense_fwd",
                "200,000",
                "168",
                "0",
                "1.5",
                "0.5",
                "60",
            ],
            [
                "1",
                "relative_ncu:enformer-b8:keys:64x64x8x3/_attention_dense_fwd",
                "500,000",
                "240",
                "4",
                "0.25",
                "2.0",
                "35",
            ],
            ["2", "relative_ncu:enformer-b8:keys:autotuned/_attention_dense_fwd", "9", "1", "0", "", "", ""],
            ["3", "relative_ncu:borzoi-b4:runs:autotuned/_attention_dense_fwd", "1,000", "128", "0", "", "", ""],
            ["4", "relative_ncu:borzoi-b4:runs:autotuned/_attention_dense_fwd", "1,000", "128", "0", "", "", ""],
            ["5", "other:range/_attention_dense_fwd", "9", "1", "0", "", "", ""],
        ]
    )
    flops = {"enformer-b8": 1e12, "borzoi-b4": 1e12}
    plain, keys, runs, failed = rn.merge_profile(timed, text, flops)
    assert plain["kernel"] == "_attention_dense_fwd" and plain["duration_ms"] == pytest.approx(0.2)
    assert plain["useful_tflops"] == pytest.approx(5000.0)  # 1e12 flops in 0.2 ms
    assert plain["registers_per_thread"] == 168 and plain["tensor_pipe_pct"] == 60
    assert plain["stall_1"] == "long_scoreboard=1.5" and plain["stall_2"] == "wait=0.5"
    assert keys["duration_ms"] == pytest.approx(0.5) and keys["local_load_bytes"] == 4 * 32
    assert keys["stall_1"] == "wait=2" and keys["tensor_pipe_pct"] == 35
    assert runs["status"] == "error" and "got 2" in runs["reason"]  # two kernels in one call's range
    assert failed == timed[3]  # rows that failed before the profiler pass through
    # a timed row whose call was not profiled at all
    (missing,) = rn.merge_profile(
        [{"case": "borzoi-b4", "variant": "plain", "tile": "autotuned", "status": "ok"}], text, flops
    )
    assert missing["status"] == "error" and "got 0" in missing["reason"]


def test_useful_flops_counts_the_content_and_value_products():
    rn = _module()
    # Enformer layer: B 8, H 8, N 1536, dk 64, dv 192
    assert rn.useful_flops("enformer-b8") == 2.0 * 8 * 8 * 1536**2 * (64 + 192)
    assert rn.useful_flops("borzoi-b4") == 2.0 * 4 * 8 * 4096**2 * (64 + 192)
