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
import glob
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvbound.bench.runner import NVTX_PREFIX

__all__ = [
    "METRICS",
    "SECTIONS",
    "DIAGNOSTIC_METRICS",
    "ncu_command",
    "parse_ncu_csv",
    "merge_metrics",
    "run_under_ncu",
    "find_ncu",
    "profile_command",
    "export_raw",
    "raw_kernel_rows",
    "metric_value",
    "stall_reasons",
    "pipe_utilisation",
]

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


# ------------------------------------------------------------------------------------------------------------
# Kernel diagnostics (benchmarks/residual_diag.py --ncu, benchmarks/relative_ncu.py): Nsight Compute's sections
# beside a few named metrics, read back one row per profiled kernel.

# Sections read by the diagnostics: speed of light, occupancy, launch (registers, shared memory), warp states (stall
# reasons), memory, scheduler (issue slots), compute workload (pipe utilisation) and instruction statistics.
SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "MemoryWorkloadAnalysis",
    "SchedulerStats",
    "ComputeWorkloadAnalysis",
    "InstructionStats",
)


# Named metrics of the diagnostics (raw-page column -> field): time, occupancy, registers, local-memory (spill)
# sectors, DRAM and L2 bytes, instructions.
DIAGNOSTIC_METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers_per_thread",
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum": "local_load_sectors",
    "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum": "local_store_sectors",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_bytes.sum": "l2_bytes",
    "smsp__inst_executed.sum": "instructions",
}


def find_ncu(name: str = "ncu") -> str | None:
    """``name`` on PATH, else the newest Nsight Compute under the usual CUDA install folders, else None."""
    found = shutil.which(name)
    if found:
        return found
    for pattern in ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def profile_command(
    ncu: str,
    report: Path,
    child: list[str],
    *,
    nvtx_prefix: str,
    kernels: str,
    metrics=(),
    sections=SECTIONS,
) -> list[str]:
    """``ncu`` profiling the kernels matching ``kernels`` (an Nsight Compute ``--kernel-name`` filter) inside the
    NVTX ranges ``<nvtx_prefix>...`` of ``child``, clocks left alone, with ``sections`` and ``metrics`` (a name this
    Nsight Compute lacks fails the whole run: callers retry without them)."""
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include",
           f"regex:{nvtx_prefix}.*/", "--kernel-name", kernels, "--force-overwrite", "--export", str(report)]
    for section in sections:
        cmd += ["--section", section]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    return cmd + child


def export_raw(ncu: str, report: Path) -> subprocess.CompletedProcess:
    """Every metric of every kernel of ``report`` (``.ncu-rep`` appended) as CSV on stdout, one row per kernel,
    base units, each kernel named after its NVTX range."""
    return subprocess.run(
        [ncu, "--import", str(report) + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base",
         "--print-nvtx-rename", "kernel"],
        capture_output=True, text=True,
    )  # fmt: skip


def raw_kernel_rows(text: str, nvtx_prefix: str) -> list[tuple[str, str, dict[str, str]]]:
    """``(measurement id, kernel name, row)`` per kernel of an :func:`export_raw` CSV whose NVTX range starts with
    ``nvtx_prefix``; the measurement id is the range's name after the prefix. Kernels outside such ranges and the
    units row are skipped; no header line raises ``ValueError``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('Nsight Compute CSV: no header line starting with "ID"')
    out = []
    for row in csv.DictReader(lines[start:]):
        if not (row.get("ID") or "").strip().isdigit():
            continue  # the units row
        name = row.get("Kernel Name", "")
        at = name.find(nvtx_prefix)
        if at < 0:
            continue
        out.append((name[at + len(nvtx_prefix) :].split("/")[0].strip(), name, row))
    return out


def metric_value(text: str | None) -> float | None:
    """A raw-page cell as a float (thousands separators allowed); None when empty, ``n/a`` or not a number."""
    if text is None or text.strip() in ("", "n/a"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def stall_reasons(row: dict[str, str], top: int = 5) -> list[tuple[str, float]]:
    """Top stall reasons from a raw-page row: the ``..issue_stalled_<reason>..`` columns of the family with the
    most of them (Nsight Compute versions name them ``smsp__average_warps_issue_stalled_<r>_per_issue_active``
    or ``smsp__average_warp_latency_issue_stalled_<r>``); ``not_issued`` variants are left out."""
    families: dict[str, dict[str, float]] = {}
    for column, text in row.items():
        if not column or "issue_stalled_" not in column or "not_issued" in column:
            continue
        value = metric_value(text)
        if value is None:
            continue
        head, _, tail = column.partition("issue_stalled_")
        reason = tail.split(".")[0]
        family_suffix = ""
        for suffix in ("_per_issue_active", "_per_warp_active"):
            if reason.endswith(suffix):
                reason, family_suffix = reason[: -len(suffix)], suffix
        family = head + "|" + family_suffix + "|" + (column.split(".", 1)[1] if "." in column else "")
        families.setdefault(family, {})[reason] = value
    if not families:
        return []
    best = max(families.values(), key=len)
    return sorted(best.items(), key=lambda kv: -kv[1])[:top]


def pipe_utilisation(row: dict[str, str]) -> dict:
    """Issue-slot and tensor-pipe utilisation from a raw-page row (SchedulerStats, ComputeWorkloadAnalysis), averages
    over the SMs: ``issue_active_pct`` = ``smsp__issue_active.avg.pct_of_peak_sustained_active``;
    ``tensor_pipe_pct`` = ``sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active`` (every tensor pipe),
    else the busiest single ``sm__pipe_tensor.._cycles_active.avg..`` column (named in ``tensor_pipe_metric``: the
    names differ between Nsight Compute versions). The ``.max.`` / ``.min.`` columns (the busiest and idlest SM) and
    the instruction rates (``sm__inst_executed_pipe_..``) are not read."""
    out: dict = {"issue_active_pct": metric_value(row.get("smsp__issue_active.avg.pct_of_peak_sustained_active"))}
    out["tensor_pipe_pct"] = out["tensor_pipe_metric"] = None
    # every tensor pipe together first; else the largest single pipe's busy cycles (never instruction rates)
    preferred = ["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"]
    suffix = "_cycles_active.avg.pct_of_peak_sustained_active"
    pipes = (c for c in row if c and c.startswith("sm__pipe_tensor") and c.endswith(suffix))
    preferred += sorted(pipes, key=lambda c: -(metric_value(row.get(c)) or 0.0))
    for column in preferred:
        value = metric_value(row.get(column))
        if value is not None:
            out["tensor_pipe_pct"], out["tensor_pipe_metric"] = value, column
            break
    return out
