"""Where the time of one attention module of Enformer / Borzoi goes, unpatched and patched (dense and compressed K/V).

Builds the port at its full config (random weights, as ``kvbound bench --suite models`` does), takes its first
attention module on the GPU, and runs it on ``[B, N, dim]`` inputs under bfloat16 autocast (as the model benchmark
does): the module's time (CUDA events, median of 20), the host time per call (``host_ms``: 50 calls queued back to
back, wall clock over the calls before the final synchronisation; when it exceeds the GPU time, the module is
bound by Python and launch overhead), and, from one ``torch.profiler`` pass, the GPU time of each kernel name inside
it. One CSV row per (model, batch, variant, kernel), plus a ``total`` row per variant. With ``--cprofile DIR`` the
host side of 50 calls of each variant is also profiled (``cProfile``, the 40 functions with the most own time, as
text: ``DIR/<model>_b<batch>_<variant>.txt``). ``patch-compressed`` calibrates on the timed input (default config,
Triton encoder); the module is patched as the model, so its forwards encode speculatively (``kvbound.patch``).

    python benchmarks/attention_module_profile.py OUT.csv [--models enformer borzoi] [--variants ...] [--cprofile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

FIELDS = [
    "model",
    "batch",
    "tokens",
    "variant",
    "kernel",
    "calls",
    "gpu_ms",
    "share",
    "module_ms_p50",
    "host_ms",
    "commit",
]


VARIANTS = ("unpatched", "patch-dense", "patch-compressed")


def _host_ms(module, x, calls: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        module(x)
    host = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return host


def _cprofile(module, x, path: Path, calls: int = 50) -> None:
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        module(x)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    path.write_text(f"{calls} calls\n" + text.getvalue())


def _module_ms(module, x, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(module, x) -> list[tuple[str, int, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        module(x)
        torch.cuda.synchronize()
    rows = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:120]
            calls, total = rows.get(name, (0, 0.0))
            rows[name] = (calls + 1, total + event.device_time_total / 1e3)
    return sorted(((n, c, t) for n, (c, t) in rows.items()), key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", nargs="+", default=["enformer", "borzoi"])
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--cprofile", type=Path, default=None, help="folder for cProfile text of the host side")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2

    import kvbound
    from kvbound.bench.ports import PORT_MODELS

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for spec in PORT_MODELS:
            if spec.name not in args.models:
                continue
            torch.manual_seed(0)
            model = spec.build()
            cls = spec.attention_class()
            module = next(m for m in model.modules() if type(m) is cls).cuda()
            del model
            dim = module.to_q.in_features
            for batch in spec.batches:
                x = torch.randn(batch, spec.tokens, dim, device="cuda")
                for variant in args.variants:
                    handle = None
                    try:
                        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                            if variant == "patch-dense":
                                handle = kvbound.patch(module, compress=False)
                            elif variant == "patch-compressed":
                                handle = kvbound.patch(module, calibrate_on=lambda m, x=x: m(x))
                            for _ in range(3):
                                module(x)
                            ms = _module_ms(module, x)
                            host = _host_ms(module, x)
                            kernels = _kernels(module, x)
                            if args.cprofile is not None:
                                args.cprofile.mkdir(parents=True, exist_ok=True)
                                _cprofile(module, x, args.cprofile / f"{spec.name}_b{batch}_{variant}.txt")
                    finally:
                        if handle is not None:
                            handle.undo()
                    total = sum(t for _, _, t in kernels)
                    base = {
                        "model": spec.name,
                        "batch": batch,
                        "tokens": spec.tokens,
                        "variant": variant,
                        "module_ms_p50": f"{ms:.4f}",
                        "host_ms": f"{host:.4f}",
                        "commit": args.commit,
                    }
                    writer.writerow(
                        {
                            **base,
                            "kernel": "total",
                            "calls": sum(c for _, c, _ in kernels),
                            "gpu_ms": f"{total:.4f}",
                            "share": "1.0",
                        }
                    )
                    print(
                        f"{spec.name} B={batch} {variant}: module {ms:.3f} ms, host {host:.3f} ms a call, "
                        f"kernels {total:.3f} ms",
                        flush=True,
                    )
                    for name, calls, t in kernels:
                        writer.writerow(
                            {
                                **base,
                                "kernel": name,
                                "calls": calls,
                                "gpu_ms": f"{t:.4f}",
                                "share": f"{t / total:.3f}" if total else "",
                            }
                        )
                        print(f"    {t:8.3f} ms  x{calls:<3d} {name}", flush=True)
                    f.flush()
                del x
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
