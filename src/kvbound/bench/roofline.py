"""``kvbound roofline`` / ``python -m kvbound.bench.roofline``: the card's ceilings and each provider against them.

Ceilings, measured on the card as found (written as ``mode=ceiling`` rows):

``device-copy``   ``y.copy_(x)`` of 1 GiB bf16, bytes = read + write (2 GiB), median of ``do_bench``.
``l2-copy``       the same on 12 MiB buffers (24 MiB read + written, inside L2), 100 copies back to back per
                  timed region replayed from a CUDA graph, so neither the L2 flush of ``do_bench`` nor launch
                  overhead applies: the L2 bandwidth seen by the SMs.
``bf16-matmul``   ``a @ b`` of two random 8192 x 8192 bf16 matrices, 2 * 8192**3 FLOP, median of ``do_bench``.

Points: every ``time`` row that is ``ok``, at ``flops / (dram_read_bytes + dram_write_bytes)`` from the
matching ``ncu`` row (filled marker) or ``flops / bytes_moved`` by formula when no profile exists (hollow),
and at ``flops / (l2_read_bytes + l2_write_bytes)`` on the L2 panel. The ridge is ``matmul / copy``.

    python -m kvbound.bench.roofline --results benchmarks/results/h200.csv benchmarks/results/h200-ncu.csv \\
        --out benchmarks/results/h200-ceilings.csv --plot benchmarks/plots/roofline.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

__all__ = ["main", "measure_ceilings", "ceilings_from_rows", "roofline_points", "roofline_from_rows"]


_RESIDENT_ELEMENTS = 6 * 2**20  # 12 MiB of bf16: source + destination (24 MiB) fit the H200's 60 MB L2


def _ceiling_row(provider: str, *, ms: list[float], flops: int | None = None, bytes_moved: int | None = None,
                 note: str = "") -> dict:
    from kvbound.bench.formulas import tflops

    p20, p50, p80 = ms
    return {"mode": "ceiling", "provider": provider, "shape": provider, "family": "ceiling", "status": "ok",
            "ms_p20": p20, "ms_p50": p50, "ms_p80": p80, "flops": flops, "bytes_moved": bytes_moved,
            "tflops": tflops(flops, p50) if flops else None, "note": note, "reason": "", "semantics": ""}


def _time_copy(elements: int, device, quantiles: list[float]) -> list[float]:
    import torch
    from triton.testing import do_bench

    x = torch.randn(elements, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return do_bench(lambda: y.copy_(x), warmup=50, rep=300, quantiles=quantiles)


def _time_resident_copy(elements: int, device, repeats: int = 100) -> tuple[list[float], str]:
    """p20/p50/p80 of one copy, from ``repeats`` back-to-back copies per timed region (no cache flush in
    between). The copies are replayed from a CUDA graph so that launch overhead does not bound them; if capture
    fails they are launched one by one and the note says so."""
    import torch

    x = torch.randn(elements, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            y.copy_(x)
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                y.copy_(x)
        run, how = graph.replay, "CUDA graph of copies"
    except RuntimeError:
        def run():
            for _ in range(repeats):
                y.copy_(x)

        how = "copies launched one by one (graph capture failed; launch overhead may bound this)"
    run()
    torch.cuda.synchronize()
    per_copy = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        per_copy.append(start.elapsed_time(end) / repeats)
    cuts = statistics.quantiles(per_copy, n=10, method="inclusive")
    return [cuts[1], statistics.median(per_copy), cuts[7]], how


def measure_ceilings(device=None) -> list[dict]:
    """Copy bandwidth (HBM and L2-resident) and bf16 matmul rate on the current CUDA device."""
    import torch
    from triton.testing import do_bench

    device = device or torch.device("cuda")
    quantiles = [0.2, 0.5, 0.8]
    rows = []
    rows.append(_ceiling_row("device-copy", ms=_time_copy(2**29, device, quantiles), bytes_moved=2 * 2**29 * 2,
                             note="1 GiB bf16 device-to-device copy; bytes = read + write"))
    resident_ms, how = _time_resident_copy(_RESIDENT_ELEMENTS, device)
    rows.append(_ceiling_row("l2-copy", ms=resident_ms, bytes_moved=2 * _RESIDENT_ELEMENTS * 2,
                             note=f"12 MiB bf16 copy x100 back to back, L2-resident ({how}); bytes = read + write"))
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    # A long warm-up: the card idles at low clocks, and a 100 ms warm-up once gave 672 TFLOP/s, below the
    # 740-790 this card sustains.
    ms = do_bench(lambda: a @ b, warmup=1000, rep=1000, quantiles=quantiles)
    rows.append(_ceiling_row("bf16-matmul", ms=ms, flops=2 * n**3, note="8192^3 bf16 matmul on random data"))
    return rows


def ceilings_from_rows(rows: list[dict]) -> dict | None:
    """``{"copy_tbps", "l2_tbps", "matmul_tflops", "gpu"}`` from the latest ceiling rows, or None."""
    latest: dict[str, dict] = {}
    for r in sorted((r for r in rows if r["mode"] == "ceiling" and r["status"] == "ok"),
                    key=lambda r: r.get("date") or ""):
        latest[r["provider"]] = r
    if "device-copy" not in latest or "bf16-matmul" not in latest:
        return None

    def tbps(r: dict) -> float:
        return r["bytes_moved"] / (r["ms_p50"] * 1e-3) / 1e12

    out = {"copy_tbps": tbps(latest["device-copy"]), "matmul_tflops": latest["bf16-matmul"]["tflops"],
           "gpu": latest["bf16-matmul"].get("gpu") or ""}
    if "l2-copy" in latest:
        out["l2_tbps"] = tbps(latest["l2-copy"])
    return out


def roofline_points(rows: list[dict]) -> list[dict]:
    from kvbound.bench.plots import provider_label
    from kvbound.bench.tables import index_rows

    profiled = index_rows(rows, "ncu")
    points = []
    for key, r in index_rows(rows, "time").items():
        if r["status"] != "ok" or not r.get("tflops") or not r.get("flops"):
            continue
        prof = profiled.get(key)
        dram = None
        if prof is not None and prof["status"] == "ok" and prof.get("dram_read_bytes") is not None:
            dram = prof["dram_read_bytes"] + (prof.get("dram_write_bytes") or 0.0)
        l2 = None
        if prof is not None and prof.get("l2_read_bytes") is not None:
            l2 = prof["l2_read_bytes"] + (prof.get("l2_write_bytes") or 0.0)
        denominator = dram if dram else r.get("bytes_moved")
        points.append({
            "label": provider_label(r), "shape": r["shape"], "tflops": r["tflops"],
            "dram_intensity": r["flops"] / denominator if denominator else None,
            "l2_intensity": r["flops"] / l2 if l2 else None,
            "measured": bool(dram),
        })
    return points


def roofline_from_rows(rows: list[dict], path: str | Path) -> Path | None:
    from kvbound.bench.plots import draw_roofline

    ceilings = ceilings_from_rows(rows)
    points = roofline_points(rows)
    if ceilings is None or not points:
        return None
    title = (f"roofline on {ceilings['gpu']}: bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, "
             f"copy {ceilings['copy_tbps']:.2f} TB/s")
    return draw_roofline(points, ceilings, path, title=title)


def _print_points(rows: list[dict], ceilings: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ridge = ceilings["matmul_tflops"] / ceilings["copy_tbps"]
    table = Table(title=f"roofline (ridge {ridge:.0f} FLOP per DRAM byte)")
    for col in ("provider", "shape", "TFLOP/s", "FLOP/DRAM B", "FLOP/L2 B", "bytes", "roof TFLOP/s", "% of roof"):
        table.add_column(col, justify="right" if col not in ("provider", "shape") else "left")
    for p in roofline_points(rows):
        x = p["dram_intensity"]
        roof = min(ceilings["matmul_tflops"], ceilings["copy_tbps"] * x) if x else None
        table.add_row(p["label"], p["shape"], f"{p['tflops']:.1f}", "-" if x is None else f"{x:.0f}",
                      "-" if p["l2_intensity"] is None else f"{p['l2_intensity']:.0f}",
                      "ncu" if p["measured"] else "formula", "-" if roof is None else f"{roof:.0f}",
                      "-" if roof is None else f"{p['tflops'] / roof:.0%}")
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: list[str] | None = None) -> int:
    from kvbound.bench import records

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvbound roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="*", type=Path, default=[],
                        help="bench CSVs (time and ncu rows) whose providers to place on the roofline")
    parser.add_argument("--out", type=Path, default=None, help="CSV for the measured ceilings")
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/plots/roofline.png"))
    parser.add_argument("--no-measure", action="store_true",
                        help="do not measure; take the ceilings from the --results rows (works without a GPU)")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    for path in args.results:
        if not path.is_file():
            parser.error(f"--results: expected bench CSV files, got {path}, which is not a file")
    rows = [r for path in args.results for r in records.read_rows(path)]
    if not args.no_measure:
        import torch

        if not torch.cuda.is_available():
            print("kvbound roofline: no CUDA GPU found; the ceilings are measured on the card. Use --no-measure "
                  "with --results that hold ceiling rows to redraw the plot without one.", file=sys.stderr)
            return 2
        env = records.environment(argv, program="kvbound roofline", commit=args.commit)
        measured = [{**r, **env} for r in measure_ceilings()]
        out = args.out or Path("benchmarks/results") / f"ceilings-{env['date'][:10]}.csv"
        records.write_rows(out, measured)
        print(f"ceilings written to {out}")
        rows = rows + measured
    ceilings = ceilings_from_rows(rows)
    if ceilings is None:
        print("kvbound roofline: no ceiling rows (device-copy, bf16-matmul) in --results", file=sys.stderr)
        return 2
    line = (f"{ceilings['gpu']}: copy {ceilings['copy_tbps']:.2f} TB/s (read+write), "
            f"bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    if "l2_tbps" in ceilings:
        line += f", L2-resident copy {ceilings['l2_tbps']:.2f} TB/s"
    print(line)
    if roofline_points(rows):
        _print_points(rows, ceilings)
        path = roofline_from_rows(rows, args.plot)
        print(f"roofline drawn to {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
