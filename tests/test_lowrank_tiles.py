"""benchmarks/lowrank_tiles.py: its CPU smoke path end to end (Triton's interpreter, tiny shapes): residual-free K/V
are built, every pinned call runs with and without the hi/lo split, and each row's error against float64 is small."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "lowrank_tiles.py"


def test_cpu_smoke_writes_checked_rows(tmp_path):
    out = tmp_path / "tiles.csv"
    done = subprocess.run([sys.executable, str(_PATH), "--cpu-smoke", str(out)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = list(csv.DictReader(out.open()))
    assert [(r["d"], r["split_rank"]) for r in rows] == [("64", "True"), ("64", "False"), ("128", "True"),
                                                        ("128", "False")]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok" and r["N"] == "256" and r["tile"] == "32x16/4w/1s"
        assert 0 < float(r["err_max"]) < 5e-3  # float16 attention on the decompressed K/V: about 1e-3
