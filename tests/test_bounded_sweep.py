"""benchmarks/bounded_sweep.py: its CPU smoke path end to end (Triton's interpreter, float32, tiny shapes):
residual-free K/V are built, both kernels run with the bounded maximum on and off, and each row's error against
float64 is small."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bounded_sweep.py"


def test_cpu_smoke_writes_checked_rows(tmp_path):
    out = tmp_path / "bounded.csv"
    done = subprocess.run([sys.executable, str(_PATH), "--cpu-smoke", str(out)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = list(csv.DictReader(out.open()))
    expected = [(d, n, provider, setting) for d in ("64", "128") for n in ("256", "384")
                for provider in ("kvbound-compressed", "kvbound-dense") for setting in ("off", "on")]  # fmt: skip
    assert [(r["d"], r["N"], r["provider"], r["bounded"]) for r in rows] == expected
    for r in rows:
        assert r["status"] == "ok" and not r["ms_p50"]  # no timing in the interpreter
        assert r["launched"] == ("bounded" if r["bounded"] == "on" else "running max")  # what actually ran
        assert 0 <= float(r["err_max"]) < 1e-4  # float32 attention on the decompressed K/V
