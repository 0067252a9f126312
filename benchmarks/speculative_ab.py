"""Compressed whole forwards of the patched ports with speculative encoding on and off, in one process.

Separate ``kvbound bench --suite models`` runs of the compressed variant have differed by up to 1.5x at batch 1
(the autotuner's picks and the host's speed vary from process to process), which hides a change of the encoding
path. Here one model is patched once (default config, calibrated), and forwards with ``handle.speculative`` True
and False alternate in rounds, so both settings run the same compiled kernels on the same host within seconds of
each other. Beside them: the unpatched port, the dense patch, and the speculative encoder in five launches per tensor
(``patch-compressed-speculative``: ``handle.one_pass_encode = False``), in one
(``patch-compressed-speculative-one-pass``: ``True``) and as chosen by default, one launch up to 6 Mi elements
(``patch-compressed-speculative-default``: ``None``), in the same rounds. Each row:
model, batch, variant, the median and spread of the per-round medians (CUDA events around each forward,
synchronised after it), host time per forward (``host_ms``: forwards queued back to back, wall clock; each forward
ends with one host read, so this includes one wait for the device), the patched modules' encoder time per timed
forward (device time between the events around the encoder calls; with synchronous encoding that window also holds
the host's work after each read, while the device waits), and the number of forwards run again
(``speculative_retries``).

    python benchmarks/speculative_ab.py OUT.csv [--models enformer borzoi] [--batches 1 8] [--rounds 5]

Needs a CUDA device and the ports (``pip install kvbound[models]``); ``--cpu-smoke`` runs the ports' small configs
on the CPU (the eager encoder there: nothing is speculative) to check the script.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

FIELDS = ["model", "batch", "variant", "ms_p50", "ms_min", "ms_max", "host_ms", "encode_ms", "speculative_retries",
          "rounds", "calls_per_round", "commit"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--models", nargs="+", default=["enformer", "borzoi"])
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: each model's own (1 and max)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="timed forwards per round and setting")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--cpu-smoke", action="store_true", help="the ports' small configs on the CPU (a dry run)")
    args = parser.parse_args(argv)

    import torch

    from kvbound.bench.ports import PORT_MODELS, SMOKE_PORT_MODELS

    if args.cpu_smoke:
        device, models = torch.device("cpu"), SMOKE_PORT_MODELS
    elif torch.cuda.is_available():
        device, models = torch.device("cuda"), PORT_MODELS
    else:
        print("benchmarks/speculative_ab.py: needs a CUDA device (or --cpu-smoke); none is present", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for spec in models:
            if spec.name.removesuffix("-tiny") not in args.models:
                continue
            torch.manual_seed(0)
            model = spec.build().to(device)
            for batch in args.batches or spec.batches:
                for row in _batch_rows(spec, model, batch, device, args):
                    writer.writerow(row)
                    f.flush()
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            model.cpu()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


def _batch_rows(spec, model, batch: int, device, args) -> list[dict]:
    import torch

    import kvbound
    from kvbound.bench.ports import _forward
    from kvbound.bench.runner import time_calls

    inputs = spec.make_input(batch, 1, device)
    sample = spec.make_input(1, 2, device)

    def forward():
        return _forward(spec, model, inputs, device)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # The default config; the small configs' head dims (8) need a lower rank and shorter blocks.
    config = kvbound.CompressionConfig(rank=4, block_size=16) if args.cpu_smoke else kvbound.CompressionConfig()
    calibrated = kvbound.patch(model, config, calibrate_on=lambda m: _forward(spec, m, sample, device))
    calibrated.undo()
    settings = {
        "unpatched": lambda: None,
        "patch-dense": lambda: kvbound.patch(model, compress=False),
        "patch-compressed-speculative": lambda: _repatch(kvbound, model, calibrated, True),
        "patch-compressed-speculative-one-pass": lambda: _repatch(kvbound, model, calibrated, True, one_pass=True),
        "patch-compressed-speculative-default": lambda: _repatch(kvbound, model, calibrated, True, one_pass=None),
        "patch-compressed-synchronous": lambda: _repatch(kvbound, model, calibrated, False),
    }
    times = {name: [] for name in settings}
    hosts = {name: [] for name in settings}
    encode = {name: [0.0, 0] for name in settings}
    retries = dict.fromkeys(settings, 0)
    for _ in range(args.rounds):
        for name, make in settings.items():
            handle = make()
            try:
                # One untimed forward first: a setting's first forward in the process compiles its kernels, and
                # on CUDA that host time falls between the encoder's events (the device waits for the launches).
                forward()
                synchronize()
                before = _encode_ms(handle)
                calls = time_calls(forward, device, warmup=0, repeats=args.calls)
                times[name].append(statistics.median(calls))
                synchronize()
                start = time.perf_counter()
                for _ in range(args.calls):
                    forward()
                hosts[name].append((time.perf_counter() - start) * 1e3 / args.calls)
                synchronize()
                if handle is not None and handle.compress:
                    encode[name][0] += _encode_ms(handle) - before
                    encode[name][1] += 2 * args.calls
                    retries[name] += handle.speculative_retries
            finally:
                if handle is not None:
                    handle.undo()
    rows = []
    for name in settings:
        rows.append({
            "model": spec.name,
            "batch": batch,
            "variant": name,
            "ms_p50": f"{statistics.median(times[name]):.3f}",
            "ms_min": f"{min(times[name]):.3f}",
            "ms_max": f"{max(times[name]):.3f}",
            "host_ms": f"{statistics.median(hosts[name]):.3f}",
            "encode_ms": f"{encode[name][0] / encode[name][1]:.3f}" if encode[name][1] else "",
            "speculative_retries": retries[name] if encode[name][1] else "",
            "rounds": args.rounds,
            "calls_per_round": args.calls,
            "commit": args.commit,
        })  # fmt: skip
    return rows


def _encode_ms(handle) -> float:
    """The patched modules' encoder time so far (0 for the unpatched model and the dense patch)."""
    if handle is None or not handle.compress:
        return 0.0
    return sum(r.encode_seconds for r in handle.modules) * 1e3


def _repatch(kvbound, model, calibrated, speculative: bool, one_pass: bool | None = False):
    """The model patched compressed with the bases of ``calibrated`` (no second calibration), speculation and the
    one-launch encoder set."""
    handle = kvbound.patch(model, calibrated.config)
    for record, source in zip(handle.modules, calibrated.modules, strict=True):
        record.basis_k, record.basis_v = source.basis_k, source.basis_v
    handle.speculative = speculative
    handle.one_pass_encode = one_pass
    return handle


if __name__ == "__main__":
    sys.exit(main())
