"""What the relative-position term costs inside the dense kernel: one Enformer and one Borzoi attention layer, with
and without the term, timed and profiled under Nsight Compute.

    python benchmarks/relative_ncu.py OUT.csv [--cases enformer-b8 borzoi-b4] [--tiles autotuned 64x64x8x3 ...]
                                              [--ncu-path ncu] [--no-profile]
    python benchmarks/relative_ncu.py OUT.csv --cpu-smoke       # tiny shapes, Triton interpreter, no profiler

Cases: ``enformer-b8`` (one Enformer layer, N = 1536, batch 8) and ``borzoi-b4`` (one Borzoi layer, N = 4096, batch
4): 8 heads, dk 64, dv 192, bfloat16, dense K/V, the inputs of ``kvbound bench --suite relative``
(``kvbound.bench.relative``). Variants of each case:

``plain``  ``kvbound.attention(scale * q + u, k, v, scale=1)``: the content logits alone, the same query-key and
           probability-value products as the others without the relative term (the kernel's ``RELATIVE = 0``).
``keys``   ``relative_position_attention(..., backend="kvbound")`` with all ``2N - 1`` relative keys: each key tile
           adds a ``[BM, BM + BN - 1]`` window product and its skew (Enformer's path).
``runs``   Borzoi only: one relative key per run of equal keys, ``relative_runs`` (the default of patched Borzoi
           layers with dense K/V): no window product, one compare and select per element and run.

``--tiles``: ``autotuned`` (the default: the autotuner's choice) and pinned tiles ``BMxBNxWARPSxSTAGES``, the only
configuration the dense kernel's autotuner then knows for every variant (``benchmarks/relative_tiles.py``'s
``pinned_tile``). Each row has the public call's time (``call_ms_p50``: ``triton.testing.do_bench`` median inside
``kvbound.deferred_checks``, so the queued finite checks are included) and its largest error on batch item 0 against
float64 (``err_max``). Then a child process calls every variant once more inside an NVTX range under ``ncu
--clock-control none`` (sections ``kvbound.bench.ncu.SECTIONS`` and ``DIAGNOSTIC_METRICS``; only kernels named
``_attention_*``), and the row gets the kernel's duration under the profiler, ``useful_tflops`` (the content and
value products, ``2 B H N^2 (dk + dv)`` flops, over that duration: the same useful work in every variant), registers,
occupancy, issue-slot and tensor-pipe utilisation, instructions, DRAM and L2 bytes, local-memory (spill) bytes and the
five largest stall reasons (``stall_1`` .. ``stall_5``, warps per issue-active cycle). Every metric of every profiled
kernel is also written next to the CSV as ``<stem>_raw.csv``, and a bar chart as ``<stem>.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and "--cpu-smoke" in sys.argv:
    # The kernels run in Triton's interpreter: decided when kvbound's kernels are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvbound.bench import ncu as ncu_tools  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relative_tiles import pinned_tile  # noqa: E402

NVTX_PREFIX = "relative_ncu:"
CASES = {"enformer-b8": ("enformer-layer", 8), "borzoi-b4": ("borzoi-layer", 4)}
SMOKE_CASES = {"enformer-b2": ("enformer-layer", 2), "borzoi-b1": ("borzoi-layer", 1)}
FIELDS = [
    "case",
    "layer",
    "N",
    "B",
    "variant",
    "tile",
    "tile_used",
    "ncu_tile_used",
    "status",
    "err_max",
    "call_ms_p50",
    "kernel",
    "duration_ms",
    "useful_tflops",
    "registers_per_thread",
    "achieved_occupancy_pct",
    "theoretical_occupancy_pct",
    "issue_active_pct",
    "tensor_pipe_pct",
    "tensor_pipe_metric",
    "instructions",
    "dram_read_bytes",
    "dram_write_bytes",
    "l2_bytes",
    "local_load_bytes",
    "local_store_bytes",
    "stall_1",
    "stall_2",
    "stall_3",
    "stall_4",
    "stall_5",
    "ncu_metrics",
    "reason",
    "device",
    "torch",
    "triton",
    "commit",
]


# ------------------------------------------------------------------------------------------------- the calls
def _spec(layer: str, smoke: bool):
    from kvbound.bench.relative import relative_specs

    return next(s for s in relative_specs(smoke) if s.name == layer)


def build_case(name: str, smoke: bool) -> dict:
    """Inputs and the variants' calls of one case: ``{"spec", "batch", "x", "calls": {variant: fn}}``."""
    from kvbound.attention import attention
    from kvbound.bench.relative import _inputs
    from kvbound.config import CompressionConfig
    from kvbound.models.relative import relative_position_attention

    layer, batch = (SMOKE_CASES if smoke else CASES)[name]
    spec = _spec(layer, smoke)
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16  # tl.dot on bf16 is wrong in the interpreter
    x = _inputs(spec, batch, device, dtype, CompressionConfig(), seed=0, share=0.5)
    u, w = x["u"][None, :, None], x["w"][None, :, None]
    q_content = x["q"] * x["scale"] + u

    def plain():
        return attention(q_content, x["k"], x["v"], scale=1.0)

    def keys():
        return relative_position_attention(
            x["q"], x["k"], x["v"], x["relative_keys"], u, w, scale=x["scale"], backend="kvbound"
        )

    calls = {"plain": plain, "keys": keys}
    if x["runs"] is not None:
        run_keys = x["relative_keys"][:, x["runs"]].contiguous()

        def runs():
            return relative_position_attention(
                x["q"], x["k"], x["v"], run_keys, u, w, scale=x["scale"], backend="kvbound", relative_runs=x["runs"]
            )

        calls["runs"] = runs
    return {"spec": spec, "batch": batch, "x": x, "q_content": q_content, "calls": calls}


def reference(case: dict, variant: str) -> torch.Tensor:
    """Batch item 0 of ``variant`` in float64."""
    from kvbound.models.reference import relative_position_attention_reference

    x = case["x"]
    if variant == "plain":  # the content query as the kernel reads it (rounded to the input dtype)
        q, k, v = (t[:1].double() for t in (case["q_content"], x["k"], x["v"]))
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    return relative_position_attention_reference(
        x["q"][:1], x["k"][:1], x["v"][:1], x["relative_keys"], x["u"], x["w"], scale=x["scale"]
    )


def useful_flops(name: str, smoke: bool = False) -> float:
    """The content and value products of one call of case ``name``: ``2 B H N^2 (dk + dv)``."""
    layer, batch = (SMOKE_CASES if smoke else CASES)[name]
    spec = _spec(layer, smoke)
    return 2.0 * batch * spec.heads * spec.tokens**2 * (spec.dk + spec.dv)


def _time_ms(fn, smoke: bool) -> float:
    import kvbound

    with kvbound.deferred_checks():
        if smoke:
            fn()
            start = time.perf_counter()
            for _ in range(2):
                fn()
            return (time.perf_counter() - start) * 1e3 / 2
        import triton.testing

        return triton.testing.do_bench(fn, quantiles=[0.5], rep=100)


def _environment(commit: str) -> dict:
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "commit": commit}


def parse_tile(text: str) -> tuple[int, int, int, int] | None:
    """``autotuned`` -> None; ``BMxBNxWARPSxSTAGES`` -> its four integers."""
    if text == "autotuned":
        return None
    parts = text.split("x")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"tile: expected 'autotuned' or BMxBNxWARPSxSTAGES (e.g. 64x64x4x1), got {text!r}")
    return tuple(int(part) for part in parts)


def _tile_name(config: dict) -> str:
    return "x".join(str(config.get(k, "?")) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))


def call_with_tile(fn):
    """``(fn(), tile)``: the tile the dense kernel's autotuner chose for this call (``BMxBNxWARPSxSTAGES``), read
    from the configurations it kept during the call; ``""`` when the call tuned nothing new (already tuned)."""
    from kvbound.kernels import attention_dense

    before = set(attention_dense._TUNED)
    out = fn()
    chosen = [config for key, config in attention_dense._TUNED.items() if key not in before]
    return out, (_tile_name(chosen[0]) if len(chosen) == 1 else "")


def timed_rows(cases: list[str], tiles: list[str], smoke: bool, commit: str, log=print) -> list[dict]:
    """One row per case, tile and variant: the public call's time and its error against float64."""
    rows = []
    env = _environment(commit)
    for name in cases:
        case = build_case(name, smoke)
        spec = case["spec"]
        for tile in tiles:
            with pinned_tile(parse_tile(tile)):
                for variant, fn in case["calls"].items():
                    row = {"case": name, "layer": spec.name, "N": spec.tokens, "B": case["batch"], "variant": variant,
                           "tile": tile, **env}  # fmt: skip
                    try:
                        out, row["tile_used"] = call_with_tile(fn)
                        row["err_max"] = f"{(out[:1].double() - reference(case, variant)).abs().max().item():.3e}"
                        row["call_ms_p50"] = f"{_time_ms(fn, smoke):.4g}"
                        row["status"] = "ok"
                    except Exception as error:  # noqa: BLE001 - a row with its reason
                        row.update(status="error", reason=f"{type(error).__name__}: {error}"[:300].replace("\n", " "))
                    log(" ".join(f"{k}={row.get(k, '')}" for k in ("case", "variant", "tile", "status", "err_max",
                                                                     "call_ms_p50")))  # fmt: skip
                    rows.append(row)
        del case
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def measurement_id(row: dict) -> str:
    return f"{row['case']}:{row['variant']}:{row['tile']}"


def child(cases: list[str], tiles: list[str], out: Path) -> int:
    """Under Nsight Compute: per case and tile, every variant warmed up (compiles, autotuning) outside the ranges,
    then called once inside ``relative_ncu:<case>:<variant>:<tile>``. A variant that fails is left out (its row
    then has no profiled kernel) and the others go on. Writes ``{measurement id: tile used or error}`` to ``out``
    (JSON)."""
    import kvbound

    used: dict[str, str] = {}
    for name in cases:
        case = build_case(name, smoke=False)
        for tile in tiles:
            with pinned_tile(parse_tile(tile)):
                working = {}
                for variant, fn in case["calls"].items():
                    key = measurement_id(dict(case=name, variant=variant, tile=tile))
                    try:
                        with kvbound.deferred_checks():
                            _, used[key] = call_with_tile(fn)
                            fn()
                        working[variant] = fn
                    except Exception as error:  # noqa: BLE001 - recorded; the parent's row says it was not profiled
                        used[key] = f"error: {type(error).__name__}: {error}"[:300]
                    out.write_text(json.dumps(used))
                torch.cuda.synchronize()
                for variant, fn in working.items():
                    with kvbound.deferred_checks():
                        torch.cuda.nvtx.range_push(
                            f"{NVTX_PREFIX}{measurement_id(dict(case=name, variant=variant, tile=tile))}"
                        )
                        fn()
                        torch.cuda.synchronize()
                        torch.cuda.nvtx.range_pop()
        del case
        torch.cuda.empty_cache()
    return 0


# -------------------------------------------------------------------------------------------- Nsight Compute
def merge_profile(rows: list[dict], text: str, flops: dict[str, float]) -> list[dict]:
    """The timed rows with the metrics of their kernel from :func:`kvbound.bench.ncu.export_raw`'s CSV (measurement
    id ``<case>:<variant>:<tile>``); ``flops``: useful flops per case. A timed row whose kernel was not profiled is an
    error row; a measurement with several kernels is an error too (one launch per call is expected)."""
    found: dict[str, list[tuple[str, dict]]] = {}
    for measurement, name, raw in ncu_tools.raw_kernel_rows(text, NVTX_PREFIX):
        found.setdefault(measurement, []).append((name, raw))
    merged = []
    for row in rows:
        row = dict(row)
        kernels = found.get(measurement_id(row), [])
        if row.get("status") != "ok":
            merged.append(row)
            continue
        if len(kernels) != 1:
            row.update(status="error", reason=f"expected one profiled kernel for this call, got {len(kernels)}")
            merged.append(row)
            continue
        name, raw = kernels[0]
        row["kernel"] = name.split("/")[-1]
        for metric, field in ncu_tools.DIAGNOSTIC_METRICS.items():
            value = ncu_tools.metric_value(raw.get(metric))
            if field == "duration_ns":
                row["duration_ms"] = None if value is None else value / 1e6
            elif field.startswith("local_") and field.endswith("_sectors"):
                row[field.replace("_sectors", "_bytes")] = None if value is None else value * 32
            else:
                row[field] = value
        if row.get("duration_ms"):
            row["useful_tflops"] = round(flops[row["case"]] / (row["duration_ms"] * 1e-3) / 1e12, 1)
        row.update(ncu_tools.pipe_utilisation(raw))
        for i, (reason, value) in enumerate(ncu_tools.stall_reasons(raw), start=1):
            row[f"stall_{i}"] = f"{reason}={value:.3g}"
        merged.append(row)
    return merged


def _run_killing_group(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """``(exit status, output tail)`` of ``cmd`` in its own process group; past ``timeout_s`` the whole group (Nsight
    Compute and the profiled Python under it) is killed and the status is None."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output.strip()[-800:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"timed out after {timeout_s:.0f} s"


def _failed(rows: list[dict], reason: str) -> list[dict]:
    """``rows`` with every ``ok`` row turned into an error with ``reason``; rows that already failed keep theirs."""
    return [dict(r, status="error", reason=reason) if r.get("status") == "ok" else r for r in rows]


def profile(
    rows: list[dict], cases: list[str], tiles: list[str], out: Path, ncu_path: str, timeout_s: float = 400, log=print
) -> list[dict]:
    """The timed rows with their kernels' Nsight Compute metrics (:func:`merge_profile`). With the named metrics
    first; when that run fails (a metric name this Nsight Compute lacks fails the whole run), once more with the
    sections alone, if time is left. Rows end as errors when nothing could be profiled."""
    ncu = ncu_tools.find_ncu(ncu_path)
    if ncu is None:
        return _failed(rows, f"Nsight Compute ({ncu_path!r}) not found")
    flops = {name: useful_flops(name) for name in cases}
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="relative-ncu-") as tmp:
        report, used_json = Path(tmp) / "report", Path(tmp) / "tiles.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), str(used_json), "--child", "--cases", *cases, "--tiles",
               *tiles]  # fmt: skip
        collected = ""
        for metrics in (ncu_tools.DIAGNOSTIC_METRICS, ()):
            left = deadline - time.monotonic()
            if left < 30:
                break
            full = ncu_tools.profile_command(
                ncu, report, cmd, nvtx_prefix=NVTX_PREFIX, kernels="regex:^_attention_", metrics=metrics
            )
            log("running: " + " ".join(full))
            status, tail = _run_killing_group(full, left)
            if status == 0 and Path(str(report) + ".ncu-rep").exists():
                collected = "metrics+sections" if metrics else "sections"
                break
            log(f"ncu run failed (exit status {status}): {tail}")
            if status is None:
                break  # out of time: no second run
        if not collected:
            return _failed(rows, "Nsight Compute wrote no report (see the log)")
        used = json.loads(used_json.read_text()) if used_json.exists() else {}
        export = ncu_tools.export_raw(ncu, report)
    if export.returncode != 0:
        return _failed(rows, f"ncu export: {export.stderr.strip()[:300]}")
    out.with_name(f"{out.stem}_raw.csv").write_text(export.stdout)
    merged = merge_profile(rows, export.stdout, flops)
    return [dict(r, ncu_metrics=collected, ncu_tile_used=used.get(measurement_id(r), "")) for r in merged]


# ------------------------------------------------------------------------------------------------------ output
_FLOAT_FIELDS = ("duration_ms", "tensor_pipe_pct", "local_load_bytes")


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by this script, with the plotted fields as floats (None when empty)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in _FLOAT_FIELDS:
            row[key] = float(row[key]) if row.get(key) else None
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in FIELDS})


def plot(rows: list[dict], path: Path) -> bool:
    """Kernel time under the profiler per case: one group of bars per tile, one bar per variant, each annotated with
    the tensor pipe's utilisation and the spilled bytes reloaded (when any)."""
    measured = [r for r in rows if r.get("status") == "ok" and r.get("duration_ms")]
    if not measured:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in measured))
    variants = list(dict.fromkeys(r["variant"] for r in measured))
    colours = dict(zip(variants, ("#4c72b0", "#dd8452", "#55a868", "#c44e52"), strict=False))
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.0), squeeze=False)
    width = 0.8 / len(variants)
    for ax, name in zip(axes[0], cases, strict=True):
        mine = [r for r in measured if r["case"] == name]
        tiles = list(dict.fromkeys(r["tile"] for r in mine))
        for j, variant in enumerate(variants):
            labelled = False
            for i, tile in enumerate(tiles):
                hit = [r for r in mine if r["variant"] == variant and r["tile"] == tile]
                if not hit:
                    continue
                r = hit[0]
                x = i + (j - (len(variants) - 1) / 2) * width
                ax.bar(x, r["duration_ms"], width, color=colours[variant], label=None if labelled else variant)
                labelled = True
                label = "" if r.get("tensor_pipe_pct") is None else f"{r['tensor_pipe_pct']:.0f}%"
                if r.get("local_load_bytes"):
                    label += f"\nspill\n{r['local_load_bytes'] / 1e6:.0f}MB"
                ax.annotate(label, (x, r["duration_ms"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(tiles)), tiles)
        ax.set_xlabel("tile (BMxBNxWARPSxSTAGES)")
        ax.set_title(f"{name} (N={mine[0]['N']})")
        ax.set_ylabel("kernel ms (Nsight Compute)")
        ax.margins(y=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Dense kernel with and without the relative term, {measured[0].get('device', '')} "
                 "(labels: tensor-pipe utilisation, spill reloads)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_rows(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = ("case", "variant", "status", "err_max", "call_ms_p50", "duration_ms", "useful_tflops",
            "registers_per_thread", "achieved_occupancy_pct", "issue_active_pct", "tensor_pipe_pct", "instructions",
            "stall_1", "stall_2", "stall_3")  # fmt: skip
    table = Table(title="Relative term in the dense kernel")
    for col in cols:
        table.add_column(col.replace("_", " "))
    for r in rows:
        table.add_row(
            *[f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v)) for v in map(r.get, cols)]
        )
    Console(width=220).print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cases", nargs="+", default=None, help=f"default: {' '.join(CASES)} ({' '.join(SMOKE_CASES)} "
                   "with --cpu-smoke)")  # fmt: skip
    p.add_argument("--tiles", nargs="+", default=["autotuned"], help="autotuned and/or BMxBNxWARPSxSTAGES tiles")
    p.add_argument("--ncu-path", default="ncu")
    p.add_argument("--no-profile", action="store_true", help="time and check only")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in float32 on the CPU, no profiler")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--profile-timeout-s", type=float, default=400, help="Nsight Compute's runs together (default 400)")
    p.add_argument("--replot", action="store_true", help="only redraw OUT's plot (OUT with .png) from OUT")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.replot:
        return 0 if plot(read_csv(args.out), args.out.with_suffix(".png")) else 1
    known = SMOKE_CASES if args.cpu_smoke else CASES
    cases = args.cases or list(known)
    unknown = [c for c in cases if c not in known]
    if unknown:
        p.error(f"--cases: expected names from {sorted(known)}, got {unknown}")
    for tile in args.tiles:
        try:
            parse_tile(tile)
        except ValueError as error:
            p.error(f"--tiles: {error}")
    repeated = sorted({t for t in args.tiles if args.tiles.count(t) > 1} | {c for c in cases if cases.count(c) > 1})
    if repeated:
        p.error(f"--cases / --tiles: each name once, got {repeated} more than once")
    if args.child:
        return child(cases, args.tiles, args.out)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("relative_ncu: no CUDA device (use --cpu-smoke on a CPU)", file=sys.stderr)
        return 2
    rows = timed_rows(cases, args.tiles, args.cpu_smoke, args.commit)
    write_csv(args.out, rows)  # the timed rows stay if the profiler's pass is cut short
    if not (args.cpu_smoke or args.no_profile):
        rows = profile(rows, cases, args.tiles, args.out, args.ncu_path, args.profile_timeout_s)
        write_csv(args.out, rows)
    if plot(rows, args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}")
    print_rows(rows)
    print(f"{len(rows)} rows written to {args.out}")
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
