"""The table printed at the end of a run (rich), one line per measurement, grouped by shape.

``vs cuDNN`` is cuDNN SDPA's median time over this provider's median time on the same shape, so above 1
means faster than cuDNN. On the models' shapes cuDNN runs plain attention without the bias (a floor), so the
ratio there compares against a kernel that does less work.
"""

from __future__ import annotations

__all__ = ["print_summary", "speed_vs_cudnn", "format_bytes"]


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def speed_vs_cudnn(rows: list[dict]) -> dict[int, float]:
    """``id(row) -> cuDNN p50 / row p50`` for timed rows whose shape has an ok cuDNN row."""
    cudnn = {r["shape"]: r["ms_p50"] for r in rows
             if r["mode"] == "time" and r["provider"] == "sdpa-cudnn" and r["status"] == "ok" and r["ms_p50"]}
    out = {}
    for r in rows:
        if r["mode"] == "time" and r.get("ms_p50") and r["shape"] in cudnn:
            out[id(r)] = cudnn[r["shape"]] / r["ms_p50"]
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_summary(rows: list[dict], console) -> None:
    from rich.table import Table

    measured = [r for r in rows if r["mode"] in ("time", "ncu")]
    ncu = any(r["mode"] == "ncu" for r in measured)
    table = Table(title="kvbound bench" + (" (Nsight Compute bytes)" if ncu else ""), show_lines=False)
    for col in ("shape", "provider", "config", "status"):
        table.add_column(col)
    if ncu:
        for col in ("DRAM read", "DRAM write", "L2->SM read", "formula bytes", "kernels"):
            table.add_column(col, justify="right")
    else:
        for col in ("p50 ms", "p20-p80 ms", "TFLOP/s", "vs cuDNN"):
            table.add_column(col, justify="right")
    for col in ("rel err", "K/V ratio", "zero tiles", "note"):
        table.add_column(col, justify="right" if col != "note" else "left")
    ratios = speed_vs_cudnn(measured)
    last_shape = None
    for r in measured:
        if last_shape is not None and r["shape"] != last_shape:
            table.add_section()
        last_shape = r["shape"]
        status = r["status"]
        colour = {"ok": "green", "unsupported": "yellow", "check_failed": "red", "error": "red"}[status]
        if status == "ok":
            note = r.get("semantics") if r.get("semantics") not in (None, "", "exact") else ""
        else:
            note = (r.get("reason") or "")[:70]
        cells = [r["shape"], r["provider"], r.get("config") or "", f"[{colour}]{status}[/{colour}]"]
        if ncu:
            cells += [format_bytes(r.get("dram_read_bytes")), format_bytes(r.get("dram_write_bytes")),
                      format_bytes(r.get("l2_read_bytes")), format_bytes(r.get("bytes_moved")),
                      _fmt(r.get("ncu_kernels"), "d")]
        else:
            spread = "-" if r.get("ms_p20") is None else f"{r['ms_p20']:.3g}-{r['ms_p80']:.3g}"
            ratio = ratios.get(id(r))
            cells += [_fmt(r.get("ms_p50"), ".4g"), spread, _fmt(r.get("tflops"), ".1f"),
                      "-" if ratio is None else f"{ratio:.2f}x"]
        cells += [_fmt(r.get("err_rel"), ".2e"), _fmt(r.get("compression_ratio"), ".2f"),
                  _fmt(r.get("zero_residual_share"), ".0%"), note]
        table.add_row(*cells)
    console.print(table)
    calib = [r for r in rows if r["mode"] == "calibrate"]
    if calib:
        t = Table(title="kvbound.calibrate per model load")
        for col in ("model", "seconds", "what"):
            t.add_column(col)
        for r in calib:
            t.add_row(r["shape"], f"{r['ms_p50'] / 1e3:.3f}", r.get("note") or "")
        console.print(t)
    if not ncu and any(r["provider"] == "sdpa-cudnn" for r in measured):
        console.print("vs cuDNN = cuDNN SDPA p50 / provider p50 on the same shape (> 1: faster than cuDNN). "
                      "On model shapes cuDNN runs without bias or soft-cap (a floor).")
