"""benchmarks/h200.sh, the script of the GPU runs: its parts, the command lines it builds (GPU and CPU smoke), and
that a failing or skipped step is reported loudly while whatever was measured is still packed."""

import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "h200.sh"
PARTS = (
    "verify",
    "attention",
    "traffic",
    "sweep",
    "sweep-d128",
    "share",
    "bounded",
    "relative",
    "relative-ncu",
    "asm",
    "models",
    "models2",
    "alphagenome",
    "halves",
    "largest",
    "largest-alphagenome",
    "alternatives",
    "timeline",
    "ring",
)

# Stands in for python3: logs its arguments and writes a one-row CSV to --out, so the script's plumbing runs in
# a second without torch.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$ARGS_LOG"
out="" prev=""
for a in "$@"; do [[ "$prev" == --out ]] && out="$a"; prev="$a"; done
[[ -n "$out" ]] && printf 'mode,provider,shape,status\\ntime,x,s,ok\\n' > "$out"
exit "${FAKE_STATUS:-0}"
"""


def _run(part, tmp_path, *, smoke, python=None, **env):
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    full_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(out), "KVBOUND_COMMIT": "abc1234",
                "KVBOUND_SMOKE": "1" if smoke else "0", "PYTHON": python or str(fake),
                "ARGS_LOG": str(tmp_path / "args.log"), "TRITON_CACHE_DIR": str(tmp_path / "triton"), **env}
    proc = subprocess.run(["bash", str(SCRIPT), part], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=60)
    args = (tmp_path / "args.log").read_text().splitlines() if (tmp_path / "args.log").exists() else []
    return proc, out, [a for a in args if "-m kvbound.bench" in a]


def _members(out: Path, part: str) -> list[str]:
    with tarfile.open(out / f"{part}_abc1234.tar.gz") as tar:
        return tar.getnames()


def test_list_and_usage():
    listed = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0
    for part in PARTS:
        assert f"\n  {part} " in listed.stdout
    assert "min" in listed.stdout and "KVBOUND_COMMIT" in listed.stdout
    wrong = subprocess.run(["bash", str(SCRIPT), "everything"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "usage" in wrong.stderr


def test_attention_part_gpu_command_lines(tmp_path):
    proc, out, calls = _run("attention", tmp_path, smoke=False)
    assert proc.returncode == 0, proc.stdout[-2000:]
    roofline, seed, encoder = calls
    assert "kvbound.bench.roofline --commit abc1234" in roofline
    assert "--shapes benchmarks/shapes/seed.toml --configs r8b4 quant-r0b4 lowrank-r8" in seed
    assert "--only" not in seed  # no shape filter: the calibration per model load runs too
    assert "--suite encoder" in encoder and "--commit abc1234" in encoder
    names = _members(out, "attention")
    prefix = "benchmarks/results/h200_"
    assert any(n.startswith(prefix) and n.endswith("_abc1234/attention/attention_seed.csv") for n in names)
    assert any(n.endswith("/attention/status.txt") for n in names)
    assert sorted(p.name for p in out.iterdir()) == ["attention.log", "attention_abc1234.tar.gz", "status.txt"]
    assert "attention-seed 0" in (out / "status.txt").read_text()


def test_smoke_substitutions(tmp_path):
    proc, _, calls = _run("traffic", tmp_path, smoke=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert len(calls) == 2
    for call in calls:
        assert call.endswith(".csv") and "--cpu-smoke" in call
        assert "--ncu" not in call and "--shapes" not in call and "--only" not in call
        assert "--providers kvbound-compressed kvbound-dense sdpa-cudnn sdpa-flash sdpa-efficient" in call


@pytest.mark.parametrize("smoke", [False, True])
def test_ring_and_models_keep_their_selection(tmp_path, smoke):
    _, _, calls = _run("ring", tmp_path, smoke=smoke)
    lengths = "--lengths 256" if smoke else "--lengths 65536 131072 262144 524288"
    assert [c.count(lengths) for c in calls] == [1, 1]
    assert "--world-sizes 1" in calls[0] and "--world-sizes 2" in calls[1]
    (tmp_path / "models").mkdir()
    _, _, calls = _run("models2", tmp_path / "models", smoke=smoke)
    assert len(calls) == (2 if smoke else 3)
    assert all("--only alphagenome*" in c or "--only enformer*" in c or "--only borzoi*" in c for c in calls)
    assert ("--batches" in " ".join(calls)) is not smoke
    (tmp_path / "alphagenome").mkdir()
    _, _, calls = _run("alphagenome", tmp_path / "alphagenome", smoke=smoke)
    assert len(calls) == 1 and "--only alphagenome*" in calls[0]
    assert ("--batches 1" in calls[0]) is not smoke


def test_failing_step_is_loud_and_results_are_still_packed(tmp_path):
    proc, out, calls = _run("sweep", tmp_path, smoke=True, FAKE_STATUS="3")
    assert proc.returncode == 1
    assert "!! FAILED sweep-d64: exit status 3; 1 rows kept" in proc.stdout
    assert "sweep-d64 3" in (out / "status.txt").read_text()
    assert any(n.endswith("/sweep/sweep_d64.csv") for n in _members(out, "sweep"))


def test_step_skipped_past_the_deadline(tmp_path):
    proc, out, calls = _run("ring", tmp_path, smoke=True, KVBOUND_DEADLINE_S="20")
    assert proc.returncode == 1 and calls == []
    assert "!! SKIPPED ring-1gpu" in proc.stdout and "ring-2gpu skipped" in (out / "status.txt").read_text()
    assert any(n.endswith("/ring/ring.log") for n in _members(out, "ring"))


@pytest.mark.parametrize("smoke", [False, True])
def test_verify_part_runs_the_gpu_tests_then_the_tile_check(tmp_path, smoke):
    proc, out, _ = _run("verify", tmp_path, smoke=smoke)
    assert proc.returncode == 0, proc.stdout[-2000:]
    calls = [line for line in (tmp_path / "args.log").read_text().splitlines() if not line.startswith("-c ")]
    assert calls[0] == "-m pytest -m gpu -v -rA -p no:cacheprovider tests -k not plain_decode"  # part asm runs that one
    assert calls[1].startswith("benchmarks/byte_decode_tiles.py ") and "/verify/byte_decode_tiles.csv" in calls[1]
    assert calls[1].endswith("--cpu-smoke") == smoke
    status = (out / "status.txt").read_text()
    assert "gpu-tests 0" in status and "byte-decode-tiles 0" in status


@pytest.mark.parametrize("smoke", [False, True])
def test_asm_part_runs_the_gpu_check_then_both_timings(tmp_path, smoke):
    proc, out, _ = _run("asm", tmp_path, smoke=smoke)
    assert proc.returncode == 0, proc.stdout[-2000:]
    calls = [line for line in (tmp_path / "args.log").read_text().splitlines() if not line.startswith("-c ")]
    assert calls[0].startswith("-m pytest") and calls[0].endswith("tests/test_gpu_paths.py -k plain_decode")
    assert [c.split()[0] for c in calls[1:]] == ["benchmarks/residual_diag.py"] * 2
    assert calls[1].split()[-1].endswith("residual_ptx.csv") and calls[2].split()[-1].endswith("residual_plain.csv")
    assert ("--cpu-smoke" in calls[1]) == smoke
    status = (out / "status.txt").read_text()
    assert "asm-tests 0" in status and "residual-ptx 0" in status and "residual-plain 0" in status


@pytest.mark.parametrize("smoke", [False, True])
def test_bounded_part_runs_the_sweep(tmp_path, smoke):
    proc, out, _ = _run("bounded", tmp_path, smoke=smoke)
    assert proc.returncode == 0, proc.stdout[-2000:]
    calls = [line for line in (tmp_path / "args.log").read_text().splitlines() if not line.startswith("-c ")]
    assert len(calls) == 1 and calls[0].startswith("benchmarks/bounded_sweep.py ")
    assert calls[0].split()[1].endswith("/bounded/bounded.csv")
    assert ("--cpu-smoke" in calls[0]) == smoke and ("--plot" in calls[0]) == (not smoke)
    assert "bounded 0" in (out / "status.txt").read_text()


def _calls(tmp_path) -> list[str]:
    """The fake interpreter's calls but the version probe and the wheels' installation (which happens only where
    the repository has a .whl/ folder: both parts install the ports' wheels, and without them exit 1 after running
    every step)."""
    lines = (tmp_path / "args.log").read_text().splitlines()
    return [line for line in lines if not line.startswith("-c ") and not line.startswith("-m pip ")]


@pytest.mark.parametrize("smoke", [False, True])
def test_halves_part_runs_its_tests_tiles_and_forwards(tmp_path, smoke):
    proc, out, bench_calls = _run("halves", tmp_path, smoke=smoke)
    calls = _calls(tmp_path)
    assert calls[0].startswith("-m pytest -m gpu") and "carried_halves or every_relative_tile_and_skew" in calls[0]
    tiles = [c for c in calls if c.startswith("benchmarks/relative_tiles.py ")]
    assert len(tiles) == (0 if smoke else 1) and len(calls) == (2 if smoke else 3)
    assert len(bench_calls) == 1 and "--suite models --only enformer*" in bench_calls[0]
    assert ("--cpu-smoke" in bench_calls[0]) == smoke and ("--batches" in bench_calls[0]) == (not smoke)
    status = (out / "status.txt").read_text()
    assert "halves-tests 0" in status and "ports-enformer-halves 0" in status
    assert ("relative-tiles 0" in status) == (not smoke)
    assert "env KVBOUND_RELATIVE_HALVES=1" in proc.stdout  # the forwards' step, echoed with its command line


@pytest.mark.parametrize("smoke", [False, True])
def test_largest_part_runs_the_search(tmp_path, smoke):
    _, out, _ = _run("largest", tmp_path, smoke=smoke)
    calls = _calls(tmp_path)
    assert len(calls) == 1 and calls[0].startswith("benchmarks/largest_batch.py ")
    assert calls[0].split()[1].endswith("/largest/largest_batch.csv") and "--commit abc1234" in calls[0]
    assert ("--cpu-smoke" in calls[0]) == smoke
    assert "--probe-timeout-s 90 --models enformer* borzoi*" in calls[0]
    assert "largest-batch 0" in (out / "status.txt").read_text()


def test_largest_alphagenome_part_searches_alphagenome_only(tmp_path):
    _, out, _ = _run("largest-alphagenome", tmp_path, smoke=False)
    calls = _calls(tmp_path)
    assert len(calls) == 1 and calls[0].startswith("benchmarks/largest_batch.py ")
    assert calls[0].split()[1].endswith("/largest-alphagenome/largest_batch.csv")
    assert calls[0].endswith("--models alphagenome*")
    assert "largest-batch 0" in (out / "status.txt").read_text()


@pytest.mark.parametrize("smoke", [False, True])
def test_alternatives_part_times_the_stock_cores_beside_the_patch(tmp_path, smoke):
    _, out, _ = _run("alternatives", tmp_path, smoke=smoke)
    calls = [c for c in _calls(tmp_path) if c.startswith("-m kvbound.bench ")]
    assert len(calls) == 3 and all("--suite models" in c and "--alternatives" in c for c in calls)
    assert ("--batches" in calls[0]) == (not smoke) and ("--cpu-smoke" in calls[0]) == smoke
    assert "--only alphagenome*" in calls[2] and "--variants unpatched patch-dense flex-tile-bias" in calls[2]
    if not smoke:
        assert "--only enformer*" in calls[0] and "--only borzoi*" in calls[1]
    status = (out / "status.txt").read_text()
    assert "alternatives-enformer 0" in status and "alternatives-borzoi 0" in status
    assert "alternatives-alphagenome 0" in status


@pytest.mark.parametrize("smoke", [False, True])
def test_relative_ncu_part_command_line(tmp_path, smoke):
    proc, _, _ = _run("relative-ncu", tmp_path, smoke=smoke)
    assert proc.returncode == 0, proc.stdout[-2000:]
    (call,) = [c for c in _calls(tmp_path) if "relative_ncu.py" in c]
    assert call.startswith("benchmarks/relative_ncu.py ") and "/relative-ncu/relative_ncu.csv --commit abc1234" in call
    if smoke:
        assert call.endswith("--tiles autotuned --cpu-smoke")
    else:
        assert call.endswith("--tiles autotuned 64x64x4x2 64x64x8x3 64x32x4x1 64x16x4x1 64x16x4x2")


@pytest.mark.parametrize("smoke", [False, True])
def test_timeline_part_traces_the_forwards_on_the_gpu_only(tmp_path, smoke):
    proc, out, _ = _run("timeline", tmp_path, smoke=smoke)
    calls = [c for c in _calls(tmp_path) if c.startswith("benchmarks/forward_timeline.py ")]
    status = (out / "status.txt").read_text()
    if smoke:
        assert calls == [] and "GPU only" in proc.stdout
        assert not [c for c in _calls(tmp_path) if "fused_norm_ab.py" in c]
        return
    assert len(calls) == 3 and all("--commit abc1234" in c for c in calls)
    assert calls[0].split()[1].endswith("/timeline/forward_timeline.csv") and "--batches" not in calls[0]
    assert "--batches 1 1" in calls[1] and "--models alphagenome --batches 1" in calls[2]
    (ab,) = [c for c in _calls(tmp_path) if c.startswith("benchmarks/fused_norm_ab.py ")]
    assert ab.split()[1].endswith("/timeline/fused_norm_ab.csv") and ab.endswith("--commit abc1234")
    assert all(f"{name} 0" in status for name in ("timeline", "timeline-b1", "timeline-alphagenome", "fused-norm"))
