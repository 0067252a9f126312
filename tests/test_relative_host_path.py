"""benchmarks/relative_host_path.py on the CPU: every variant runs the path it names (the relative keys' rows that
kvbound.attention is given, what the stubbed launcher is given), and each row holds a host time."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "relative_host_path.py"
_MISSING = [name for name in ("enformer_pytorch", "borzoi_pytorch") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"ports not installed: {_MISSING} (README, 'Model ports')")
def test_each_variant_takes_its_path(tmp_path):
    out = tmp_path / "host.csv"
    done = subprocess.run([sys.executable, str(_PATH), str(out), "--calls", "3", "--repeats", "2"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {(r["model"], r["variant"]): r for r in csv.DictReader(out.open())}
    assert list(rows) == [("enformer-tiny", "default"), ("borzoi-tiny", "runs-per-run-keys"),
                          ("borzoi-tiny", "runs-full-keys"), ("borzoi-tiny", "no-runs")]  # fmt: skip
    full = str(2 * 64 - 1)  # 64 tokens: 127 relative rows
    runs = rows["borzoi-tiny", "runs-per-run-keys"]["keys_rows"]
    assert 2 < int(runs) < int(full) // 4  # Borzoi's step features: a few runs
    assert rows["enformer-tiny", "default"]["launch"] == f"keys {full}"  # smooth features: no runs
    assert rows["borzoi-tiny", "runs-per-run-keys"]["launch"] == f"runs {runs}"
    assert (rows["borzoi-tiny", "runs-full-keys"]["keys_rows"], rows["borzoi-tiny", "runs-full-keys"]["launch"]) == (
        full, f"runs {runs}")  # fmt: skip
    assert (rows["borzoi-tiny", "no-runs"]["keys_rows"], rows["borzoi-tiny", "no-runs"]["launch"]) == (
        full, f"keys {full}")  # fmt: skip
    for row in rows.values():
        times = [float(x) for x in row["host_us_runs"].split()]
        assert len(times) == 2 and all(t > 0 for t in times) and float(row["host_us_per_call"]) > 0
