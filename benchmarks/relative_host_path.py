"""Host time of one patched Enformer / Borzoi attention layer, the kernel launcher stubbed: what a forward costs the
CPU before the fused kernel, by variant of the relative-position path. Runs on the CPU (no GPU needed).

    python benchmarks/relative_host_path.py OUT.csv [--tokens 64] [--calls 300] [--repeats 3]

The ports' small configs (``kvbound bench --suite models --cpu-smoke``'s models: widths of 64-96, so that the
projections' arithmetic is negligible and the time is Python, dispatch and small tensor ops), their first attention
module called on ``[1, tokens, dim]`` under ``no_grad`` after ``kvbound.patch(model, compress=False,
backend="kvbound")``, with ``kvbound.kernels.attention_dense.attention_dense_fwd`` (the launcher, its plan lookup
included, and the kernel) replaced by a stub that runs the call's check read and returns empty outputs, on one
CPU thread. Each row: median over ``--repeats`` of the mean host time of ``--calls`` calls.

Variants (Borzoi, whose step-function features give runs of equal relative keys; Enformer has no runs):
``runs-per-run-keys`` (the default: one relative key per run), ``runs-full-keys`` (the ``[H, 2N - 1, Dk]`` keys
with the runs, checked against them on the device in every call: the path before per-run keys), ``no-runs``
(``KVBOUND_RELATIVE_RUNS=0``: the relative keys and the per-tile window). The variants take turns within each
repeat. ``keys_rows``: the rows of the relative keys that ``kvbound.attention`` was given; ``launch``: what the
launcher was given (``runs R``: a table of R runs; ``keys M``: M relative keys).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

FIELDS = ["model", "variant", "tokens", "calls", "host_us_per_call", "host_us_runs", "keys_rows", "launch", "torch",
          "commit"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    if args.tokens < 8 or args.calls < 1 or args.repeats < 1:
        print("relative_host_path.py: expected --tokens >= 8, --calls >= 1, --repeats >= 1", file=sys.stderr)
        return 2

    # kvbound.attention accepts CPU tensors only for Triton's interpreter; no kernel runs here (stubbed).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import kvbound
    from kvbound.bench.ports import port_models
    from kvbound.kernels import attention_dense
    from kvbound.kernels._common import empty_output
    from kvbound.models import _backend
    from kvbound.models.patch import PatchHandle

    seen: dict[str, object] = {}

    def stub(q, k, v, *args, before_launch=None, relative=None, relative_runs=None, **kwargs):
        if before_launch is not None:
            before_launch()
        if relative_runs is not None:
            seen["launch"] = f"runs {relative_runs[0].shape[-2]}"
        elif relative is not None:
            seen["launch"] = f"keys {relative[0].shape[1]}"
        return empty_output(q, v.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)

    fused = _backend._kvbound_attention()

    def spy(q, k, v, **kwargs):  # the relative keys' rows that kvbound.attention is given
        seen["keys_rows"] = kwargs["relative_keys"].shape[1]
        return fused(q, k, v, **kwargs)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    specs = {s.name: s for s in port_models(True)}
    cases = (
        ("enformer-tiny", "default", None),
        ("borzoi-tiny", "runs-per-run-keys", None),
        ("borzoi-tiny", "runs-full-keys", None),
        ("borzoi-tiny", "no-runs", "0"),
    )
    original_fwd = attention_dense.attention_dense_fwd
    original_run_features = PatchHandle._run_features
    original_attention = _backend._kvbound_attention
    modules = {}
    for name in dict.fromkeys(name for name, _, _ in cases):
        spec = specs[name]
        model = spec.build()
        module = next(m for m in model.modules() if isinstance(m, spec.attention_class()))
        modules[name] = (model, module, torch.randn(1, args.tokens, module.to_q.in_features))
    times: dict[tuple[str, str], list[float]] = {(name, variant): [] for name, variant, _ in cases}
    paths: dict[tuple[str, str], tuple[object, object]] = {}
    previous = os.environ.get("KVBOUND_RELATIVE_RUNS")
    try:
        attention_dense.attention_dense_fwd = stub
        _backend._kvbound_attention = lambda: spy
        for _ in range(args.repeats):  # the variants take turns, so that a drift of the machine hits them alike
            for name, variant, runs_setting in cases:
                model, module, x = modules[name]
                # runs-full-keys: every row's features, so full keys, checked against the runs in every call
                PatchHandle._run_features = (
                    (lambda self, features, runs: features) if variant == "runs-full-keys" else original_run_features
                )
                if runs_setting is None:
                    os.environ.pop("KVBOUND_RELATIVE_RUNS", None)
                else:
                    os.environ["KVBOUND_RELATIVE_RUNS"] = runs_setting
                with torch.no_grad(), kvbound.patch(model, compress=False, backend="kvbound"):
                    for _ in range(20):
                        module(x)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        module(x)
                    times[name, variant].append((time.perf_counter() - start) / args.calls * 1e6)
                paths[name, variant] = (seen.pop("keys_rows", None), seen.pop("launch", None))
    finally:
        attention_dense.attention_dense_fwd = original_fwd
        _backend._kvbound_attention = original_attention
        PatchHandle._run_features = original_run_features
        if previous is None:
            os.environ.pop("KVBOUND_RELATIVE_RUNS", None)
        else:
            os.environ["KVBOUND_RELATIVE_RUNS"] = previous
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for (name, variant), runs in times.items():
            row = {"model": name, "variant": variant, "tokens": args.tokens, "calls": args.calls,
                   "host_us_per_call": f"{statistics.median(runs):.1f}",
                   "host_us_runs": " ".join(f"{r:.1f}" for r in runs), "keys_rows": paths[name, variant][0],
                   "launch": paths[name, variant][1], "torch": torch.__version__, "commit": args.commit}  # fmt: skip
            writer.writerow(row)
            print(" ".join(f"{k}={row[k]}" for k in FIELDS[:8]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
