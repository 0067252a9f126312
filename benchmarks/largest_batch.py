"""The largest batch of each port's full-size forward that fits in device memory: unpatched, and patched with exact
and with compressed K/V.

    python benchmarks/largest_batch.py OUT.csv [--models enformer borzoi alphagenome] [--limit 256] [--commit SHA]

Per model and variant (``kvbound bench --suite models``'s models, inputs and variants: random weights, bf16
autocast, ``no_grad``, one-hot random DNA; the compressed variant calibrated once on another input), one forward per
probed batch: the batch doubles from 1 until a forward runs out of memory (or passes ``--limit``), then is bisected
between the last batch that ran and the first that did not (``kvbound.bench.ports.largest_fitting``). Rows: model,
variant, ``largest_batch``, ``first_out_of_memory`` (empty when the limit was reached), ``peak_gib``
(``torch.cuda.max_memory_allocated`` of the forward at the largest batch), ``probes``, ``seconds``; a forward that
fails for another reason than memory stops that variant's search (``status=error``, ``failed_batch``, ``reason``,
and the largest batch that ran before it). The models suite can then time each model at that batch (``--batches 1
N``).

``--cpu-smoke``: the ports' small configs on the CPU up to ``--limit`` (default 4 there): a dry run of the search
(nothing runs out of memory on the CPU).
"""

from __future__ import annotations

import argparse
import csv
import sys
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
    p.add_argument("--commit", default="unknown")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)

    import torch

    from kvbound.bench.ports import VARIANTS, largest_batch_rows, port_models
    from kvbound.config import DEFAULT_TAU, CompressionConfig

    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
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
    # The models suite's configs: default, or its CPU smoke config (the tiny Borzoi's keys are 8-dimensional).
    config = CompressionConfig(block_size=16, rank=4, tau=DEFAULT_TAU) if args.cpu_smoke else CompressionConfig()
    stamp = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "commit": args.commit}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        rows = largest_batch_rows(specs, device, config, limit=limit, variants=variants,
                                  progress=lambda line: print(line, flush=True))  # fmt: skip
        for row in rows:
            row = {**row, **stamp}
            if row.get("peak_gib") is not None:
                row["peak_gib"] = f"{row['peak_gib']:.2f}"
            row["seconds"] = f"{row['seconds']:.1f}"
            writer.writerow(row)
            f.flush()
            print(" ".join(f"{k}={'' if row.get(k) is None else row[k]}" for k in FIELDS[:8]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
