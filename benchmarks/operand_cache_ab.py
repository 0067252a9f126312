"""Whole patched forwards with the kept operands on and off (``KVBOUND_OPERAND_CACHE``, read at each call), in one
process, taking turns: Enformer and Borzoi at full size, random weights (the models suite's inputs, bf16 autocast,
``no_grad``), dense and compressed K/V. Needs a CUDA GPU.

    python benchmarks/operand_cache_ab.py OUT.csv [--models enformer borzoi] [--batches 1 8 1 4] [--rounds 3]
        [--calls 10] [--variants patch-dense patch-compressed] [--commit C]

``--batches`` pairs with ``--models`` in order: the first model's batches come first up to the first batch not
larger than the one before (``1 8 1 4``: Enformer 1 and 8, Borzoi 1 and 4). Each row: one setting in one round, the
median of ``--calls`` forwards (CUDA events, after two untimed ones), the peak memory of one forward
(``max_memory_allocated``) and the bytes the handle keeps (``handle.operand_bytes``); the unpatched port's forward is
timed once per model and batch in the same process.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
from pathlib import Path

FIELDS = ["model", "batch", "variant", "operand_cache", "round", "forward_ms_p50", "forward_ms_all", "peak_gib",
          "operand_mib", "vs_unpatched", "gpu", "torch", "triton", "commit", "date"]


def _groups(models: list[str], batches: list[int]) -> list[tuple[str, list[int]]]:
    groups: list[list[int]] = [[]]
    for b in batches:
        if groups[-1] and b <= groups[-1][-1]:
            groups.append([])
        groups[-1].append(b)
    if len(groups) != len(models):
        raise SystemExit(f"--batches: expected {len(models)} increasing runs (one per model), got {groups}")
    return list(zip(models, groups, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--models", nargs="+", default=["enformer", "borzoi"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 1, 4])
    p.add_argument("--variants", nargs="+", default=["patch-dense", "patch-compressed"],
                   choices=["patch-dense", "patch-compressed"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)

    import torch
    import triton

    import kvbound
    from kvbound.bench.ports import PORT_MODELS, _forward
    from kvbound.bench.runner import time_calls

    if not torch.cuda.is_available():
        print("operand_cache_ab.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    specs = {s.name: s for s in PORT_MODELS}
    common = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "commit": args.commit, "date": datetime.date.today().isoformat()}
    rows = []

    def timed(spec, model, inputs) -> list[float]:
        return time_calls(lambda: _forward(spec, model, inputs, device), device, warmup=2, repeats=args.calls)

    def peak(spec, model, inputs) -> float:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        _forward(spec, model, inputs, device)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**30

    for name, batches in _groups(args.models, args.batches):
        spec = specs[name]
        model = spec.build().to(device).eval()
        calibration = spec.make_input(1, 2, device)
        for batch in batches:
            inputs = spec.make_input(batch, 1, device)
            base = statistics.median(timed(spec, model, inputs))
            rows.append({**common, "model": name, "batch": batch, "variant": "unpatched", "operand_cache": "",
                         "round": 0, "forward_ms_p50": base, "peak_gib": peak(spec, model, inputs)})
            print(f"{name} b{batch} unpatched {base:.2f} ms", flush=True)
            for variant in args.variants:
                compress = variant == "patch-compressed"
                handle = kvbound.patch(model, compress=compress,
                                       calibrate_on=(lambda m, s=spec, c=calibration: _forward(s, m, c, device))
                                       if compress else None)
                try:
                    for r in range(1, args.rounds + 1):
                        for setting in (("0", "1") if r % 2 else ("1", "0")):
                            os.environ["KVBOUND_OPERAND_CACHE"] = setting
                            if setting == "0":
                                handle.clear_operands()
                            times = timed(spec, model, inputs)
                            ms = statistics.median(times)
                            row = {**common, "model": name, "batch": batch, "variant": variant,
                                   "operand_cache": "on" if setting == "1" else "off", "round": r,
                                   "forward_ms_p50": ms, "forward_ms_all": " ".join(f"{t:.3f}" for t in times),
                                   "peak_gib": peak(spec, model, inputs),
                                   "operand_mib": handle.operand_bytes / 2**20, "vs_unpatched": base / ms}
                            rows.append(row)
                            print(f"{name} b{batch} {variant} cache {row['operand_cache']} round {r}: {ms:.2f} ms "
                                  f"({base / ms:.2f}x), peak {row['peak_gib']:.2f} GiB, kept "
                                  f"{row['operand_mib']:.0f} MiB", flush=True)
                finally:
                    os.environ.pop("KVBOUND_OPERAND_CACHE", None)
                    handle.undo()
            del inputs
        del model
        torch.cuda.empty_cache()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
