"""The largest batch of each port's full-size forward that fits in device memory: unpatched, and patched with exact
and with compressed K/V.

    python benchmarks/largest_batch.py OUT.csv [--models enformer borzoi alphagenome] [--limit 256] [--commit SHA]
        [--probe-timeout-s 180]

Per model and variant (``kvbound bench --suite models``'s models, inputs and variants: random weights, bf16
autocast, ``no_grad``, one-hot random DNA; the compressed variant calibrated once on another input), one forward per
probed batch: the batch doubles from 1 until a forward runs out of memory (or passes ``--limit``), then is bisected
between the last batch that ran and the first that did not (``kvbound.bench.ports.largest_fitting``). Rows: model,
variant, ``largest_batch``, ``first_out_of_memory`` (empty when the limit was reached), ``peak_gib``
(``torch.cuda.max_memory_allocated`` of the forward at the largest batch), ``probes``, ``seconds``; a forward that
fails for another reason than memory stops that variant's search (``status=error``, ``failed_batch``, ``reason``,
and the largest batch that ran before it). The models suite can then time each model at that batch (``--batches 1
N``), if its timing loop fits there too: it holds more than one forward does (on the H200, Enformer's forward fits at
batch 69, but the models suite ran out of memory at batch 64 in all three variants).

Each model and variant searches in its own process, and a probe that gives no answer (neither an output nor
out-of-memory) within ``--probe-timeout-s`` seconds ends that search: the process is killed and the row says
``status=timeout``, ``failed_batch`` the batch in flight. On the H200, Borzoi's forward at batch 32 had not returned
after minutes, unpatched and patched alike (its input to the first attention layer, ``[32, 4096, 1536]``, has 2^31
elements), where batch 24 took one second.

``--cpu-smoke``: the ports' small configs on the CPU up to ``--limit`` (default 4 there): a dry run of the search
(nothing runs out of memory on the CPU).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

FIELDS = ["model", "variant", "status", "largest_batch", "first_out_of_memory", "peak_gib", "probes", "limit",
          "failed_batch", "input_len", "seconds", "reason", "device", "torch", "commit"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--models", nargs="+", default=["*"], help="model names or patterns (default: all three)")
    p.add_argument("--variants", nargs="+", default=None, help="default: unpatched patch-dense patch-compressed")
    p.add_argument("--limit", type=int, default=None, help="largest batch tried (default 256; 4 with --cpu-smoke)")
    p.add_argument("--probe-timeout-s", type=float, default=180.0,
                   help="seconds one probe may run before its search is ended (0: no limit; default 180)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # MODEL:VARIANT, one search in this process
    args = p.parse_args(argv)

    import torch

    from kvbound.bench.ports import VARIANTS, port_models

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("largest_batch.py: no CUDA device (use --cpu-smoke for a dry run on the CPU)", file=sys.stderr)
        return 2
    specs = tuple(s for s in port_models(args.cpu_smoke) if any(fnmatch(s.name, m) for m in args.models))
    variants = tuple(args.variants or VARIANTS)
    if not specs or set(variants) - set(VARIANTS):
        print(f"largest_batch.py: nothing to run (models {args.models}, variants {list(variants)}; variants: "
              f"{list(VARIANTS)})", file=sys.stderr)  # fmt: skip
        return 2
    limit = args.limit if args.limit is not None else (4 if args.cpu_smoke else 256)
    if limit < 1:
        print(f"largest_batch.py: --limit: expected >= 1, got {limit}", file=sys.stderr)
        return 2
    if args.probe_timeout_s < 0:
        print(f"largest_batch.py: --probe-timeout-s: expected >= 0, got {args.probe_timeout_s:g}", file=sys.stderr)
        return 2
    if args.worker is not None:
        return _worker(args, specs, limit)
    return _searches(args, specs, variants, limit)


def _searches(args, specs, variants, limit: int) -> int:
    """One process per model and variant (a forward that never returns ends only its own search)."""
    import torch

    from kvbound.bench.ports import watched_search

    device = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(0)
    stamp = {"device": device, "torch": torch.__version__, "commit": args.commit}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    status = 0
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for spec in specs:
            for variant in variants:
                cmd = [sys.executable, __file__, str(args.out), "--worker", f"{spec.name}:{variant}",
                       "--limit", str(limit), "--models", spec.name, "--commit", args.commit]  # fmt: skip
                if args.cpu_smoke:
                    cmd.append("--cpu-smoke")
                started = time.perf_counter()
                row = watched_search(cmd, args.probe_timeout_s or None, progress=lambda line: print(line, flush=True))
                row = {"model": spec.name, "variant": variant, "input_len": spec.input_len, "limit": limit, **row,
                       **stamp, "seconds": f"{time.perf_counter() - started:.1f}"}  # fmt: skip
                if isinstance(row.get("peak_gib"), float):
                    row["peak_gib"] = f"{row['peak_gib']:.2f}"
                status |= row.get("status") != "ok"
                writer.writerow(row)
                f.flush()
                print(" ".join(f"{k}={'' if row.get(k) is None else row[k]}" for k in FIELDS[:9]), flush=True)
    return int(status)


def _worker(args, specs, limit: int) -> int:
    import torch

    from kvbound.bench.ports import ROW_PREFIX, largest_batch_rows
    from kvbound.config import DEFAULT_TAU, CompressionConfig

    name, variant = args.worker.split(":", 1)
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda")
    # The models suite's configs: default, or its CPU smoke config (the tiny Borzoi's keys are 8-dimensional).
    config = CompressionConfig(block_size=16, rank=4, tau=DEFAULT_TAU) if args.cpu_smoke else CompressionConfig()
    spec = next(s for s in specs if s.name == name)
    for row in largest_batch_rows((spec,), device, config, limit=limit, variants=(variant,),
                                  progress=lambda line: print(line, flush=True)):  # fmt: skip
        row.pop("seconds", None)
        print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
