"""One CSV row per measurement: the schema, writing, reading and the run's provenance.

``mode`` says what a row measured:

``time``       ``triton.testing.do_bench`` quantiles of one provider on one shape (``ms_p20/50/80``).
``ncu``        one profiled call under Nsight Compute (``dram_*_bytes``, ``l2_*_bytes``; no time columns).
``calibrate``  ``kvbound.calibrate`` over one model's layers (``ms_p50`` = the whole model load).
``ceiling``    the card's measured ceilings (``kvbound roofline``): ``device-copy`` (``bytes_moved`` over
               ``ms_p50``), ``l2-copy`` (likewise, L2-resident) and ``bf16-matmul`` (``flops`` over ``ms_p50``).
``encode``     ``--suite encoder``: compressing one layer's K and V (``encoder-triton``, ``encoder-triton-noverify``,
               ``encoder-eager``) or copying them (``device-copy``); ``gbps`` is K + V input bytes over ``ms_p50``,
               ``max_err_over_tau`` the largest ``|x - decompress(x)| / tau`` over K and V.
``model``      ``--suite models``: one whole forward of a genomic port (``unpatched``, ``patch-dense``,
               ``patch-compressed``); ``attention_ms_*`` the summed forwards of its attention modules,
               ``peak_bytes`` / ``baseline_bytes`` the CUDA allocator's peak during the forward and what was
               allocated before it, ``diff_*`` the output against the unpatched model's on the same input.
``ring``       ``--suite ring``: one context-parallel attention layer over ``world_size`` processes
               (``ring-compressed``, ``ring-dense``, ``allgather-dense``); ``ms_*`` the slowest rank per call,
               ``bytes_sent`` / ``dense_bytes_sent`` per rank.

``suite`` names the ``kvbound bench --suite`` that wrote a row (empty in rows written before suites existed:
the attention suite).

``status`` is ``ok``, ``unsupported`` (the provider cannot compute this shape; ``reason`` says why),
``check_failed`` (output differs from the float64 reference beyond the tolerance, or is not finite; still
timed, so the number is visible but flagged) or ``error`` (an exception; ``reason`` holds it).
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import shlex
import subprocess
from pathlib import Path

__all__ = ["COLUMNS", "MODES", "STATUSES", "read_rows", "write_rows", "append_row", "environment"]

# name -> type; the order is the CSV column order.
COLUMNS: dict[str, type] = {
    "mode": str,
    "measurement_id": str,
    "provider": str,
    "config": str,
    "shape": str,
    "family": str,
    "batch": int,
    "q_heads": int,
    "kv_heads": int,
    "q_len": int,
    "kv_len": int,
    "head_dim_qk": int,
    "head_dim_v": int,
    "causal": bool,
    "dtype": str,
    "bias": str,
    "softcap": float,
    "rank": int,
    "bits": int,
    "block_size": int,
    "tau": float,
    "basis": str,
    "status": str,
    "reason": str,
    "semantics": str,
    "note": str,
    "ms_p20": float,
    "ms_p50": float,
    "ms_p80": float,
    "tflops": float,
    "flops": int,
    "bytes_moved": int,
    "kv_bytes": int,
    "kv_dense_bytes": int,
    "compression_ratio": float,
    "zero_residual_share": float,
    "k_share_lowrank": float,
    "k_share_packed": float,
    "k_share_promoted": float,
    "k_share_raw": float,
    "v_share_lowrank": float,
    "v_share_packed": float,
    "v_share_promoted": float,
    "v_share_raw": float,
    "kv_max_abs_error": float,
    "err_max": float,
    "err_rel": float,
    "err_vs_dense_rel": float,
    "check_rows": int,
    "input_sets": int,
    "dram_read_bytes": float,
    "dram_write_bytes": float,
    "l2_read_bytes": float,
    "l2_write_bytes": float,
    "ncu_kernels": int,
    "ncu_ms": float,
    "suite": str,
    "input_len": int,
    "layers": int,
    "repeats": int,
    "gbps": float,
    "max_err_over_tau": float,
    "attention_ms_p20": float,
    "attention_ms_p50": float,
    "attention_ms_p80": float,
    "peak_bytes": int,
    "baseline_bytes": int,
    "diff_max_abs": float,
    "diff_rel": float,
    "ref_max_abs": float,
    "calibration_ms": float,
    "world_size": int,
    "bytes_sent": int,
    "dense_bytes_sent": int,
    "compress_ms": float,
    "gpu": str,
    "torch": str,
    "triton": str,
    "cuda": str,
    "cudnn": str,
    "commit": str,
    "date": str,
    "command": str,
}

MODES = ("time", "ncu", "calibrate", "ceiling", "encode", "model", "ring")
STATUSES = ("ok", "unsupported", "check_failed", "error")


def _format(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _parse(name: str, text: str, source: str) -> object:
    kind = COLUMNS[name]
    if text == "":
        return None
    try:
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError as err:
        raise ValueError(f"{source}: column {name!r}: expected {kind.__name__}, got {text!r}") from err
    return text


def _check_row(row: dict, where: str) -> None:
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise ValueError(f"{where}: unknown columns {sorted(unknown)}")
    if row.get("mode") not in MODES:
        raise ValueError(f"{where}: mode: expected one of {MODES}, got {row.get('mode')!r}")
    if row.get("status") not in STATUSES:
        raise ValueError(f"{where}: status: expected one of {STATUSES}, got {row.get('status')!r}")


def write_rows(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` (dicts keyed by ``COLUMNS``; missing keys are empty cells) to ``path``, replacing it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for i, row in enumerate(rows):
        _check_row(row, f"row {i}")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _format(row.get(k)) for k in COLUMNS})


def append_row(path: str | Path, row: dict) -> None:
    """Append one row, writing the header first if the file is new (so a partial run keeps what it measured)."""
    path = Path(path)
    _check_row(row, "row")
    new = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        if new:
            writer.writeheader()
        writer.writerow({k: _format(row.get(k)) for k in COLUMNS})


def read_rows(path: str | Path) -> list[dict]:
    """Read a CSV written by ``write_rows``; values come back typed (empty cells as None)."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in ("mode", "provider", "shape", "status") if c not in header]
        if missing:
            raise ValueError(f"{path}: not a kvbound bench CSV: missing columns {missing}")
        unknown = [c for c in header if c not in COLUMNS]
        if unknown:
            raise ValueError(f"{path}: unknown columns {unknown}")
        rows = []
        for line, raw in enumerate(reader, start=2):
            row = {name: _parse(name, raw.get(name) or "", f"{path}:{line}") for name in header}
            for name in COLUMNS:
                row.setdefault(name, None)
            _check_row(row, f"{path}:{line}")
            rows.append(row)
    return rows


def _git_commit() -> str:
    override = os.environ.get("KVBOUND_COMMIT")
    if override:
        return override
    try:
        root = Path(__file__).resolve().parents[3]
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def settings() -> list[str]:
    """The ``KVBOUND_*`` switches set in this process's environment (``KVBOUND_COMMIT`` aside, which only labels
    rows), as ``NAME=value`` in name order: what a row's command line needs to be run again as it was."""
    return [f"{name}={shlex.quote(value)}" for name, value in sorted(os.environ.items())
            if name.startswith("KVBOUND_") and name != "KVBOUND_COMMIT"]  # fmt: skip


def row_settings(row: dict) -> list[str]:
    """The ``KVBOUND_NAME=value`` assignments that open ``row``'s command line (:func:`settings`)."""
    found = []
    for word in (row.get("command") or "").split():
        if "=" not in word or word.startswith("-"):
            break
        if word.startswith("KVBOUND_"):
            found.append(word)
    return found


def default_settings(row: dict) -> bool:
    """Whether ``row`` was measured without ``KVBOUND_*`` switches."""
    return not row_settings(row)


def environment(argv: list[str] | None, *, program: str = "python -m kvbound.bench",
                commit: str | None = None) -> dict:
    """Provenance columns shared by every row of a run."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = "absent"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
    else:
        gpu = f"cpu ({platform.processor() or platform.machine()})"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",
        "cudnn": str(cudnn) if cudnn else "none",
        "commit": commit or _git_commit(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([*settings(), program, *map(shlex.quote, argv or [])]),
    }
