"""The ``python -m kvbound.bench`` command line: the CPU smoke path end to end, and the no-GPU exit."""

import os
import re
import subprocess
import sys

import pytest
import torch

from kvbound.bench import cli, records
from kvbound.bench.shapes import default_shape_files, load_shapes


def _run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "kvbound.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cpu_smoke_runs_every_provider_through_the_gpu_code_path(tmp_path):
    out = tmp_path / "smoke.csv"
    done = _run("--cpu-smoke", "--out", str(out), "--configs", "r8b4", "quant-r0b4")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = records.read_rows(out)
    timed = [r for r in rows if r["mode"] == "time"]
    shapes = {s.name: s for s in load_shapes(default_shape_files(cpu_smoke=True))}
    assert {r["shape"] for r in timed} == set(shapes)
    for r in timed:
        assert r["status"] in ("ok", "unsupported"), (r["provider"], r["shape"], r["reason"])
        assert r["gpu"].startswith("cpu") and r["command"].startswith("python -m kvbound.bench --cpu-smoke")
        if r["status"] == "ok":
            assert r["err_rel"] < 3e-2 and r["ms_p50"] > 0 and r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
            assert r["flops"] > 0 and r["bytes_moved"] > 0
        else:
            assert r["reason"]
    by = {(r["provider"], r.get("config") or "", r["shape"]): r for r in timed}
    # Stock kernels that cannot run a shape say why instead of vanishing.
    flash = by[("sdpa-flash", "", "smoke-tile-softcap")]
    assert flash["status"] == "unsupported" and "same last dimension" in flash["reason"]
    for name in shapes:
        assert by[("flex", "eager (CPU)", name)]["status"] == "ok"
    for name in ("smoke-tile-softcap", "smoke-relpos"):
        assert by[("eager", "", name)]["status"] == "ok" and by[("sdpa-bias", "", name)]["status"] == "ok"
    compressed = [r for r in timed if r["provider"] == "kvbound-compressed"]
    if compressed:  # kvbound.attention importable: every compressed row is checked and within the bound
        assert {r["config"] for r in compressed} == {"r8b4", "quant-r0b4"}
        for r in compressed:
            assert r["status"] == "ok", r["reason"]
            assert r["compression_ratio"] > 1 and r["kv_max_abs_error"] <= r["tau"]
            assert 0.0 <= r["zero_residual_share"] <= 1.0 and r["err_vs_dense_rel"] < 3e-2
        assert by[("kvbound-compressed", "r8b4", "smoke-plain")]["zero_residual_share"] == 0.0
        # the deferred-check variants: the same calls, checks read once per timing loop; default config only here
        assert by[("kvbound-compressed-deferred", "r8b4", "smoke-plain")]["status"] == "ok"
        assert ("kvbound-compressed-deferred", "quant-r0b4", "smoke-plain") not in by
    for name in shapes:
        assert by[("kvbound-dense-deferred", "", name)]["status"] == by[("kvbound-dense", "", name)]["status"]
    calibration = [r for r in rows if r["mode"] == "calibrate"]
    assert len(calibration) == 1 and calibration[0]["ms_p50"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed when no CUDA GPU is present")
def test_without_gpu_exits_nonzero_with_a_clear_message(tmp_path):
    done = _run("--out", str(tmp_path / "x.csv"), timeout=60)
    assert done.returncode == 2
    assert "no CUDA GPU found" in done.stderr and "--cpu-smoke" in done.stderr
    assert not (tmp_path / "x.csv").exists()


def test_list_and_unknown_names(capsys):
    assert cli.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("kvbound-compressed", "kvbound-dense", "kvbound-compressed-deferred", "kvbound-dense-deferred",
                 "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex", "sdpa-bias", "eager"):
        assert name in listed


def test_resume_skips_measured_tasks_and_appends(tmp_path):
    out = tmp_path / "r.csv"
    records.write_rows(out, [{"mode": "time", "provider": "flex", "shape": "smoke-relpos", "status": "ok"}])
    done = _run("--cpu-smoke", "--only", "smoke-relpos", "--providers", "flex", "eager", "--resume", "1",
                "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = records.read_rows(out)
    assert [(r["provider"], r["status"]) for r in rows] == [("flex", "ok"), ("eager", "ok")]
    assert rows[1]["measurement_id"] == "m0001" and "--resume" not in rows[1]["command"]


def test_option_stripping():
    assert cli._without(["--out", "a", "--resume", "3", "--x", "--resume=4"], "--resume") == ["--out", "a", "--x"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tau", "-1"], r"--tau: expected a finite value > 0, got -1.0"),
        (["--block-size", "48"], r"--block-size: expected a power of two >= 16, got 48"),
        (["--bits", "5"], r"--bits: expected one of \(2, 3, 4, 8\), got 5"),
        (["--bits", "0"], r"--bits: expected one of \(2, 3, 4, 8\), got 0"),
        (["--rank", "-1"], r"--rank: expected >= 0, got -1"),
        (["--suite", "encoder", "--rank", "999"],
         r"--rank: expected a rank below every head dim the encoder suite compresses \(the smallest is 16, K of "
         r"shape smoke-causal\), got 999"),
        (["--suite", "encoder", "--rank", "16", "--only", "smoke-plain", "smoke-causal"],
         r"--rank: .*the smallest is 16, K of shape smoke-causal\), got 16"),
        (["--suite", "relative", "--rank", "16"],
         r"--rank: .*relative suite .*the smallest is 16, K of enformer-layer"),
        (["--suite", "ring", "--rank", "32"], r"--rank: .*ring suite .*the smallest is 32, K and V of --head-dim"),
        (["--suite", "encoder", "--shapes", "no/such/shapes.toml"], r"--shapes: shape file: no/such/shapes.toml"),
    ],
)
def test_bad_compression_arguments_exit_2_before_anything_runs(args, message, tmp_path, capsys):
    out = tmp_path / "x.csv"
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu-smoke", "--out", str(out), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"kvbound bench: error: " + message, err), err
    assert not out.exists()


def test_a_rank_below_the_chosen_shapes_head_dims_is_accepted():
    parser = cli.build_parser()
    for args in (["--suite", "encoder", "--rank", "16", "--only", "smoke-plain"], ["--suite", "encoder"],
                 ["--suite", "relative", "--rank", "15"], ["--suite", "ring", "--rank", "63", "--head-dim", "64"],
                 ["--suite", "attention", "--rank", "999"]):  # the attention suite takes its configs elsewhere
        cli._check_compression_args(parser, parser.parse_args(["--cpu-smoke", *args]))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--suite", "models", "--batches", "-1"], r"argument --batches: expected a value >= 1, got -1"),
        (["--suite", "models", "--repeats", "0"], r"argument --repeats: expected a value >= 1, got 0"),
        (["--suite", "models", "--warmup", "-3"], r"argument --warmup: expected a value >= 0, got -3"),
        (["--suite", "ring", "--world-sizes", "0"], r"argument --world-sizes: expected a value >= 1, got 0"),
        (["--suite", "ring", "--lengths", "x"], r"argument --lengths: expected an integer, got 'x'"),
        (["--warmup-ms", "-5"], r"argument --warmup-ms: expected a value >= 0.0, got -5"),
        (["--shapes", "no/such/shapes.json"], r"--shapes: expected a shape file, got no/such/shapes.json, which does"),
    ],
)
def test_bad_counts_and_paths_exit_2_before_anything_runs(args, message, tmp_path, capsys):
    out = tmp_path / "x.csv"
    with pytest.raises(SystemExit) as info:
        cli.main(["--cpu-smoke", "--out", str(out), *args])
    assert info.value.code == 2
    assert re.search(r"kvbound bench: error: " + message, capsys.readouterr().err)
    assert not out.exists()


def test_out_is_never_replaced_unless_asked(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for out, message in (
        (notes, r"--out: .*notes.txt exists; pass --overwrite to replace it, or choose another path"),
        (tmp_path, r"--out: expected a CSV file to write, got the directory "),
        (tmp_path / "missing" / "x.csv", r"--out: expected a file in an existing directory, got .*missing does not"),
    ):
        with pytest.raises(SystemExit) as info:
            cli.main(["--cpu-smoke", "--suite", "encoder", "--out", str(out)])
        assert info.value.code == 2
        assert re.search(r"kvbound bench: error: " + message, capsys.readouterr().err)
    assert notes.read_text() == "my notes\n"
