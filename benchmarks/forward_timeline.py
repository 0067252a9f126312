"""Where a whole forward's time goes on the GPU: busy, idle, and which kernels, unpatched and patched (dense K/V,
and with ``--variants ... patch-compressed`` compressed K/V, calibrated as the models suite does).

For each port at its full config (random weights, the models suite's inputs, bf16 autocast, ``no_grad``), one
forward is traced by ``torch.profiler`` after warm-up. From the trace:

- ``forward_ms``: CUDA events around the forward (median of ``--repeats``), ``host_ms``: the Python call's wall time
  to its return (before the final synchronisation; when it is close to ``forward_ms`` the forward is bound by the
  host), ``syncs``: the host waits for the device during the traced forward (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and device-to-host ``cudaMemcpy*``).
- ``busy_ms``: the union of the kernel and copy intervals on the device; ``idle_ms``: the traced span (first
  kernel start to last kernel end) minus it.
- The same over the transformer's span (``tower_*``: from the first to the last kernel of the attention modules,
  found by forward hooks that mark each module's calls with ``record_function``), where a patched layer's host path
  could leave the device waiting.
- One ``kernels`` row per (variant, kernel category) with the device time of the traced forward.
- ``module`` rows: what runs inside the attention modules, by kernel name (the ten longest and the rest in one row):
  the attention kernel, projections, casts, checks.

    python benchmarks/forward_timeline.py OUT.csv [--models enformer borzoi] [--batches 8 4] [--commit SHA]
        [--variants unpatched patch-dense patch-compressed]
    python benchmarks/forward_timeline.py OUT.csv --replot      # only redraw OUT.png from OUT.csv
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
import time
from pathlib import Path

import torch

FIELDS = ["model", "batch", "variant", "row", "name", "calls", "ms", "commit"]
VARIANTS = ("unpatched", "patch-dense", "patch-compressed")
DEFAULT_VARIANTS = ("unpatched", "patch-dense")
# Kernels listed per variant in the ``module`` rows (the rest summed in one row), and the characters of a name kept.
MODULE_KERNELS = 10
KERNEL_NAME_CHARS = 90
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
CATEGORIES = (
    ("attention kernel", r"^_attention|^_fused|kvbound"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|gemv|sm90_"),
    ("convolution", r"conv|implicit|winograd|fft|cudnn"),
    ("softmax", r"softmax"),
    ("norm", r"norm|welford"),
    ("copy / cast", r"copy|Memcpy|cast|transpose|cat|Memset|Fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of ``(start_us, end_us)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def mark_modules(modules):
    """Forward hooks that open ``record_function('kvbound.tower')`` around each call of ``modules``."""
    handles, open_ = [], []

    def before(module, args):
        ctx = torch.profiler.record_function("kvbound.tower")
        ctx.__enter__()
        open_.append(ctx)

    def after(module, args, output):
        open_.pop().__exit__(None, None, None)

    for module in modules:
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    return handles


def trace_rows(prof, spec_name: str, batch: int, variant: str, commit: str) -> list[dict]:
    events = prof.profiler.kineto_results.events()
    # Device-side events, without the device-side copies of the record_function marks (user annotations), which span
    # whole modules and would hide their gaps.
    device = [
        e
        for e in events
        if e.device_type() == torch.autograd.DeviceType.CUDA
        and not e.is_user_annotation()
        and e.name() != "kvbound.tower"
    ]
    host = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    intervals = [(e.start_ns() / 1e3, e.end_ns() / 1e3) for e in device]
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e3 if intervals else 0.0
    busy = union_ms(intervals)
    syncs = sum(1 for e in host if e.name() in SYNC_CALLS)
    dtoh = sum(1 for e in device if "DtoH" in e.name())
    # Device work launched inside the attention modules' record_function ranges (the launching runtime call, found
    # by correlation id, starts within one); the tower's span is from the first to the last of it, and every device
    # interval inside that span counts as the tower's (the layers' other kernels run between the modules).
    marks = [(e.start_ns(), e.end_ns()) for e in host if e.name() == "kvbound.tower"]
    launches = {e.correlation_id(): e.start_ns() for e in host if e.name().startswith(("cuda", "cu"))}
    inside = [
        e for e in device if (t := launches.get(e.correlation_id())) is not None and any(s <= t <= f for s, f in marks)
    ]
    tower = []
    if inside:
        first, last = min(e.start_ns() for e in inside), max(e.end_ns() for e in inside)
        tower = [(max(s, first / 1e3), min(f, last / 1e3)) for s, f in intervals if f * 1e3 > first and s * 1e3 < last]
    tower_span = (max(e for _, e in tower) - min(s for s, _ in tower)) / 1e3 if tower else 0.0
    tower_busy = union_ms(tower)
    base = {"model": spec_name, "batch": batch, "variant": variant, "commit": commit}
    rows = [
        {**base, "row": "timeline", "name": "span_ms", "ms": f"{span:.3f}"},
        {**base, "row": "timeline", "name": "busy_ms", "ms": f"{busy:.3f}"},
        {**base, "row": "timeline", "name": "idle_ms", "ms": f"{span - busy:.3f}"},
        {**base, "row": "timeline", "name": "tower_span_ms", "ms": f"{tower_span:.3f}"},
        {**base, "row": "timeline", "name": "tower_busy_ms", "ms": f"{tower_busy:.3f}"},
        {**base, "row": "timeline", "name": "tower_idle_ms", "ms": f"{tower_span - tower_busy:.3f}"},
        {
            **base,
            "row": "timeline",
            "name": "attention_launched_ms",
            "calls": len(inside),
            "ms": f"{sum(e.end_ns() - e.start_ns() for e in inside) / 1e6:.3f}",
        },
        {**base, "row": "timeline", "name": "syncs", "calls": syncs + dtoh, "ms": ""},
    ]
    sums: dict[str, tuple[int, float]] = {}
    for e in device:
        label = category(e.name())
        calls, total = sums.get(label, (0, 0.0))
        sums[label] = (calls + 1, total + (e.end_ns() - e.start_ns()) / 1e6)
    for label, (calls, total) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        rows.append({**base, "row": "kernels", "name": label, "calls": calls, "ms": f"{total:.3f}"})
    rows += module_kernel_rows(inside, base)
    return rows


def module_kernel_rows(inside, base: dict, top: int = MODULE_KERNELS) -> list[dict]:
    """``module`` rows: the device work launched inside the attention modules by kernel name (its first
    ``KERNEL_NAME_CHARS`` characters), the ``top`` longest, then one ``other`` row for the rest."""
    sums: dict[str, tuple[int, float]] = {}
    for e in inside:
        name = e.name()[:KERNEL_NAME_CHARS]
        calls, total = sums.get(name, (0, 0.0))
        sums[name] = (calls + 1, total + (e.end_ns() - e.start_ns()) / 1e6)
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][1])
    rows = [{**base, "row": "module", "name": name, "calls": calls, "ms": f"{total:.3f}"}
            for name, (calls, total) in ranked[:top]]  # fmt: skip
    rest = ranked[top:]
    if rest:
        rows.append({**base, "row": "module", "name": f"other ({len(rest)} kernels)",
                     "calls": sum(c for _, (c, _) in rest), "ms": f"{sum(t for _, (_, t) in rest):.3f}"})  # fmt: skip
    return rows


def plot(csv_path: Path) -> Path:
    """A bar per (model, batch, variant) from ``csv_path``'s timeline rows: the device time of the work launched in
    the attention modules, the rest of the device's busy time and its idle time in the traced forward, with the
    untraced forward's median above each bar. Written next to the CSV (``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values: dict[tuple, dict[str, float]] = {}
    for row in csv.DictReader(csv_path.open()):
        if row["row"] == "timeline" and row["ms"]:
            values.setdefault((row["model"], row["batch"], row["variant"]), {})[row["name"]] = float(row["ms"])
    keys = list(values)
    attention = [values[k].get("attention_launched_ms", 0.0) for k in keys]
    other = [values[k].get("busy_ms", 0.0) - a for k, a in zip(keys, attention, strict=True)]
    idle = [values[k].get("idle_ms", 0.0) for k in keys]
    fig, ax = plt.subplots(figsize=(1.6 * len(keys) + 2, 4.5))
    x = range(len(keys))
    ax.bar(x, attention, label="attention modules (device)", color="tab:red")
    ax.bar(x, other, bottom=attention, label="rest of the forward (device)", color="tab:blue")
    ax.bar(x, idle, bottom=[a + o for a, o in zip(attention, other, strict=True)], label="device idle", color="0.8")
    for i, k in enumerate(keys):
        top = attention[i] + other[i] + idle[i]
        ax.text(i, top, f"{values[k].get('forward_ms', 0.0):.1f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{m} b{b}\n{v}" for m, b, v in keys], fontsize=8)
    ax.set_ylabel("ms (one traced forward)")
    ax.set_title("Whole forward on the device: attention modules, the rest, idle")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = csv_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", nargs="+", default=["enformer", "borzoi"])
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="one per model (default: its largest)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--replot", action="store_true", help="only redraw OUT's plot (OUT with .png) from OUT")
    args = parser.parse_args(argv)
    if args.replot:
        print(plot(args.out))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    import kvbound
    from kvbound.bench.ports import PORT_MODELS, _forward

    device = torch.device("cuda")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    specs = [s for s in PORT_MODELS if s.name in args.models]
    batches = args.batches or [max(s.batches) for s in specs]
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for spec, batch in zip(specs, batches, strict=True):
            torch.manual_seed(0)
            model = spec.build().to(device).eval()
            cls = spec.attention_class()
            modules = [m for m in model.modules() if type(m) is cls]
            inputs = spec.make_input(batch, 0, device)

            def forward(spec=spec, model=model, inputs=inputs):  # the models suite's forward (bf16 autocast, no_grad)
                return _forward(spec, model, inputs, device)

            calibration = spec.make_input(1, 2, device)  # another input, as the models suite calibrates

            def calibrate(m, spec=spec, calibration=calibration):
                _forward(spec, m, calibration, device)

            for variant in args.variants:
                handle = None
                if variant == "patch-dense":
                    handle = kvbound.patch(model, compress=False)
                elif variant == "patch-compressed":
                    handle = kvbound.patch(model, kvbound.CompressionConfig(), compress=True, calibrate_on=calibrate)
                try:
                    for _ in range(2):
                        forward()
                    torch.cuda.synchronize()
                    times, hosts = [], []
                    for _ in range(args.repeats):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        t0 = time.perf_counter()
                        forward()
                        hosts.append((time.perf_counter() - t0) * 1e3)
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                    hooks = mark_modules(modules)
                    try:
                        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                            forward()
                            torch.cuda.synchronize()
                    finally:
                        for h in hooks:
                            h.remove()
                finally:
                    if handle is not None:
                        handle.undo()
                base = {"model": spec.name, "batch": batch, "variant": variant, "commit": args.commit}
                rows = [
                    {**base, "row": "timeline", "name": "forward_ms", "ms": f"{statistics.median(times):.3f}"},
                    {**base, "row": "timeline", "name": "host_ms", "ms": f"{statistics.median(hosts):.3f}"},
                    *trace_rows(prof, spec.name, batch, variant, args.commit),
                ]
                writer.writerows(rows)
                f.flush()
                for r in rows:
                    print(
                        f"{spec.name} b{batch} {variant:12s} {r['row']:8s} {r['name']:18s} "
                        f"{r.get('calls', '') or '':>6} {r['ms']}",
                        flush=True,
                    )
            del model, inputs, forward
            torch.cuda.empty_cache()
    print(plot(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
