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
N``), if its timing loop fits there too (on the H200, the search ran Enformer's unpatched forward at batch 69, but
the models suite's unpatched forward ran out of memory at batch 64, asking for 36 GiB with 29.9 GiB free, while
the patched forwards ran there: ``benchmarks/results/h200_2026-12-04_04451e4/``; the suite holds only its reference
output beyond one forward, so memory stranded by the process's history is the likely difference, and the suite now
runs one batch-1 forward first, as this search's climb does).

Each model and variant searches in worker processes. A probe that gives no answer (neither an output nor
out-of-memory) within ``--probe-timeout-s`` seconds of its start counts as not fitting: its process group is killed
and the search resumes in a new worker, bisecting below that batch (``first_timeout``: the smallest batch without an
answer; ``first_out_of_memory`` counts only batches seen running out of memory). On the H200, Borzoi's unpatched
forward at batch 32 had not returned after 85 s (and the dense patch's search stalled at 32 too), where batch 24
took one second (``benchmarks/results/h200_2026-12-02_b07ccf7/big/borzoi_b32.log``). A SIGTERM (a time limit) ends
the script and the worker in flight.

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

FIELDS = ["model", "variant", "status", "largest_batch", "first_out_of_memory", "first_timeout", "peak_gib", "probes",
          "limit", "failed_batch", "input_len", "seconds", "reason", "device", "torch", "commit"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--models", nargs="+", default=["*"], help="model names or patterns (default: all three)")
    p.add_argument("--variants", nargs="+", default=None, help="default: unpatched patch-dense patch-compressed")
    p.add_argument("--limit", type=int, default=None, help="largest batch tried (default 256; 4 with --cpu-smoke)")
    p.add_argument("--probe-timeout-s", type=float, default=180.0,
                   help="seconds one probe may run before it counts as not fitting (0: no limit; default 180)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # MODEL:VARIANT, one search in this process
    p.add_argument("--known-largest", type=int, default=0, help=argparse.SUPPRESS)  # resumes a worker's search
    p.add_argument("--known-failing", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch

    from kvbound.bench.ports import VARIANTS, port_models

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("largest_batch.py: no CUDA device (use --cpu-smoke for a dry run on the CPU)", file=sys.stderr)
        return 2
    known = port_models(args.cpu_smoke)
    specs = tuple(s for s in known if any(fnmatch(s.name, m) for m in args.models))
    variants = tuple(args.variants or VARIANTS)
    if not specs or set(variants) - set(VARIANTS):
        print(f"largest_batch.py: nothing to run (models {args.models}, variants {list(variants)}; models"
              f"{' with --cpu-smoke' if args.cpu_smoke else ''}: {[s.name for s in known]}, variants: "
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
    """One process per model and variant (a forward that never returns ends only its own process); a probe without
    an answer in time counts as not fitting, and the search resumes in a new process below it."""
    import signal

    import torch

    # A time limit's SIGTERM ends this process through SystemExit, whose unwinding kills the search in flight.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    device = "cpu" if args.cpu_smoke else torch.cuda.get_device_name(0)
    stamp = {"device": device, "torch": torch.__version__, "commit": args.commit}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    status = 0
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        for spec in specs:
            for variant in variants:
                started = time.perf_counter()
                row = _search(args, spec.name, variant, limit)
                row = {"model": spec.name, "variant": variant, "input_len": spec.input_len, "limit": limit, **row,
                       **stamp, "seconds": f"{time.perf_counter() - started:.1f}"}  # fmt: skip
                status |= row.get("status") != "ok"
                writer.writerow(row)
                f.flush()
                print(" ".join(f"{k}={'' if row.get(k) is None else row[k]}" for k in FIELDS[:10]), flush=True)
    return int(status)


def _search(args, name: str, variant: str, limit: int) -> dict:
    """One model and variant: worker processes until the search ends; each timed-out probe is an upper bound."""
    from kvbound.bench.ports import watched_search

    largest, out_of_memory, timeouts, probes, peaks = 0, None, [], 0, {}
    row = {"status": "timeout"}
    while row["status"] == "timeout":
        failing = min([b for b in (out_of_memory, *timeouts) if b is not None], default=None)
        if timeouts and failing - largest <= 1:  # nothing left between what fitted and what did not answer
            row = {"status": "ok"}
            break
        cmd = [sys.executable, __file__, str(args.out), "--worker", f"{name}:{variant}", "--limit", str(limit),
               "--models", name, "--commit", args.commit, "--known-largest", str(largest)]  # fmt: skip
        if failing is not None:
            cmd += ["--known-failing", str(failing)]
        if args.cpu_smoke:
            cmd.append("--cpu-smoke")
        row = watched_search(cmd, args.probe_timeout_s or None, progress=lambda line: print(line, flush=True))
        largest = max(largest, row.pop("seen_largest"))
        out_of_memory = min([b for b in (out_of_memory, row.pop("seen_out_of_memory")) if b is not None], default=None)
        peaks.update(row.pop("seen_peaks"))
        probes += row.get("probes") or 0
        if row["status"] == "timeout":
            timeouts.append(row["failed_batch"])
            probes += 1
            print(f"{name} {variant} batch {row['failed_batch']}: {row['reason']}; resuming below it", flush=True)
    row.update(largest_batch=largest, first_out_of_memory=out_of_memory, probes=probes,
               first_timeout=min(timeouts) if timeouts else None, peak_gib=peaks.get(largest, row.get("peak_gib")))
    if isinstance(row.get("peak_gib"), float):
        row["peak_gib"] = f"{row['peak_gib']:.2f}"
    return row


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
                                  progress=lambda line: print(line, flush=True), known_largest=args.known_largest,
                                  known_failing=args.known_failing):  # fmt: skip
        row.pop("seconds", None)
        print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
