"""Measured memory traffic: ``python -m kvbound.bench --ncu`` re-launches itself under Nsight Compute.

The child run (``--ncu-child``) prepares and checks every provider exactly like a timed run, then calls it
once more inside an NVTX range ``kvbound_bench:<measurement id>``. Nsight Compute profiles only kernels inside
such ranges (``--nvtx --nvtx-include regex:kvbound_bench:.*/``), so input generation, compression, compilation,
warm-up and the reference stay out; the export renames each kernel after its enclosing range
(``--print-nvtx-rename kernel``) and the parent sums the metrics of all kernels of one range, since a provider
may launch several (the eager path launches one per operation). ``--clock-control none`` leaves the clocks
alone; Nsight Compute's default cache control flushes L2 before each kernel, so DRAM bytes are cold-cache bytes.

Recorded per row (bytes):

``dram_read_bytes``, ``dram_write_bytes``   ``dram__bytes_read.sum``, ``dram__bytes_write.sum``: HBM traffic.
``l2_read_bytes``, ``l2_write_bytes``       32 x ``lts__t_sectors_srcunit_tex_op_read.sum`` / ``_op_write.sum``:
                                            L2 sectors requested by the SMs' L1/TEX units (L2-to-SM traffic).
``ncu_ms``                                  ``gpu__time_duration.sum``, under the profiler (not a timing).

Reading them: DRAM writes that fit in L2 stay there until after the kernel, so ``dram_write_bytes`` of a small
output can be near zero (on the H200, cuDNN at N = 4096 read 12.6 MB = Q + K + V and wrote 4.6 kB, although O
is 4 MiB). ``l1tex__m_xbar2l1tex_read_bytes.sum`` was tried and dropped: it read 260 MiB for every provider
alike, which is the profiler's own cache flush, not the kernel.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvbound.bench.runner import NVTX_PREFIX

__all__ = ["METRICS", "ncu_command", "parse_ncu_csv", "merge_metrics", "run_under_ncu"]

METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sectors_srcunit_tex_op_write.sum",
    "gpu__time_duration.sum",
)
_SECTOR_BYTES = 32


def ncu_command(ncu: str, report: Path, child: list[str], kernel_regex: str | None = None) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include",
           f"regex:{NVTX_PREFIX}.*/", "--metrics", ",".join(METRICS), "--force-overwrite", "--export", str(report)]
    if kernel_regex:
        cmd += ["--kernel-name", f"regex:{kernel_regex}"]
    return cmd + child


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() not in ("", "n/a") else 0.0


def parse_ncu_csv(text: str) -> dict[str, dict[str, float]]:
    """Sum the metrics of every kernel per measurement id, from ``ncu --import --csv --page raw
    --print-units base --print-nvtx-rename kernel`` output.

    Returns ``{measurement_id: {"kernels": n, metric: sum, ...}}``. Lines before the CSV header (``"ID",...``)
    and the units row are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("Nsight Compute CSV: no header line starting with \"ID\" found")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    name_column = "Kernel Name"
    if name_column not in (reader.fieldnames or []):
        raise ValueError(f"Nsight Compute CSV: no {name_column!r} column in {reader.fieldnames}")
    out: dict[str, dict[str, float]] = {}
    for row in reader:
        if not (row.get("ID") or "").strip().isdigit():
            continue  # the units row
        name = row[name_column]
        at = name.find(NVTX_PREFIX)
        if at < 0:
            continue
        measurement = name[at + len(NVTX_PREFIX):].split("/")[0].strip()
        entry = out.setdefault(measurement, {"kernels": 0})
        entry["kernels"] += 1
        for metric in METRICS:
            if metric in row:
                entry[metric] = entry.get(metric, 0.0) + _number(row[metric])
    return out


def merge_metrics(rows: list[dict], metrics: dict[str, dict[str, float]]) -> list[dict]:
    """Fill the traffic columns of the child's rows from ``parse_ncu_csv``'s result."""
    merged = []
    for row in rows:
        row = dict(row)
        m = metrics.get(row.get("measurement_id") or "")
        if m is not None and row["status"] in ("ok", "check_failed"):
            row.update(
                dram_read_bytes=m.get("dram__bytes_read.sum"),
                dram_write_bytes=m.get("dram__bytes_write.sum"),
                l2_read_bytes=_sectors(m.get("lts__t_sectors_srcunit_tex_op_read.sum")),
                l2_write_bytes=_sectors(m.get("lts__t_sectors_srcunit_tex_op_write.sum")),
                ncu_kernels=int(m["kernels"]),
                ncu_ms=None if m.get("gpu__time_duration.sum") is None else m["gpu__time_duration.sum"] / 1e6,
            )
        elif row["status"] == "ok":
            row.update(status="error", reason="no kernel of this measurement was profiled by Nsight Compute")
        merged.append(row)
    return merged


def _sectors(value: float | None) -> float | None:
    return None if value is None else value * _SECTOR_BYTES


def _child_argv(argv: list[str], out: Path) -> list[str]:
    """``argv`` without --ncu and --out, plus --ncu-child --out ``out``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--ncu":
            continue
        if arg in ("--out", "--ncu-path", "--ncu-kernel"):
            skip = True
            continue
        if arg.startswith(("--out=", "--ncu-path=", "--ncu-kernel=")):
            continue
        kept.append(arg)
    return [sys.executable, "-m", "kvbound.bench", *kept, "--ncu-child", "--no-calibration", "--out", str(out)]


def run_under_ncu(argv: list[str], args) -> int:
    from kvbound.bench import records

    ncu = shutil.which(args.ncu_path)
    if ncu is None:
        print(f"kvbound bench --ncu: Nsight Compute ({args.ncu_path!r}) is not on PATH", file=sys.stderr)
        return 2
    out = args.out or Path("benchmarks/results/bench-ncu.csv")
    with tempfile.TemporaryDirectory(prefix="kvbound-ncu-") as tmp:
        child_csv = Path(tmp) / "child.csv"
        report = Path(tmp) / "report"
        cmd = ncu_command(ncu, report, _child_argv(argv, child_csv), args.ncu_kernel)
        print("running: " + " ".join(cmd), file=sys.stderr)
        code = subprocess.call(cmd)
        if not child_csv.exists():
            print(f"kvbound bench --ncu: the profiled run wrote no rows (exit status {code})", file=sys.stderr)
            return code or 1
        export = subprocess.run(
            [ncu, "--import", str(report) + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base",
             "--print-fp", "--print-nvtx-rename", "kernel"],
            capture_output=True, text=True,
        )
        if export.returncode != 0:
            print(f"kvbound bench --ncu: export failed: {export.stderr.strip()[:500]}", file=sys.stderr)
            return export.returncode
        rows = merge_metrics(records.read_rows(child_csv), parse_ncu_csv(export.stdout))
    env = records.environment(argv, commit=args.commit)
    rows = [{**row, **env} for row in rows]
    records.write_rows(out, rows)
    from rich.console import Console

    from kvbound.bench.summary import print_summary

    console = Console(stderr=True, width=200 if not sys.stderr.isatty() else None)
    print_summary(rows, console)
    console.print(f"{len(rows)} rows written to {out}")
    return code
