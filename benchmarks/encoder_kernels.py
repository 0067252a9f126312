"""GPU time of the Triton encoder and of each of its kernels, on the Enformer and Borzoi K/V shapes.

For Enformer K ``[B, 8, 1536, 64]`` and V ``[B, 8, 1536, 192]`` (B = 1 and 8) and Borzoi K ``[B, 8, 4096, 64]`` and
V ``[B, 8, 4096, 192]`` (B = 1 and 4), bf16, drawn as ``kvbound bench --suite encoder`` draws them
(``kvbound.bench.encoder.encoder_inputs``: ``kvbound.bench.data.structured_kv``, half of the blocks residual-free),
with the default ``kvbound.CompressionConfig()`` and a basis from ``kvbound.calibrate`` on the same tensor:

- ``total``: ``kvbound.compress_kv(x, config, basis, impl="triton")`` end to end (host read included), the median
  of ``triton.testing.do_bench``;
- one row per kernel name: its GPU time in one ``torch.profiler`` pass over one call (summed over its launches;
  ``calls`` says how many), and ``kernels``: the sum of them all;
- checks, on one call's result: ``max_abs_error`` = max |x - decompress| (``bound_ok``: <= tau on every element)
  and ``modes_match``: the modes equal the eager encoder's.

``gbps`` is the bytes of the input ``x`` (read once) over the row's milliseconds. One CSV row per (shape, B,
tensor, kernel or total). The exit status is 1 when a check fails (the rows are written anyway), 2 without CUDA.

    python benchmarks/encoder_kernels.py OUT.csv [--commit SHA] [--shapes enformer borzoi] [--warmup-ms 25]
        [--rep-ms 100]

From a source checkout on one GPU: ``PYTHONPATH=$PWD/src python3 benchmarks/encoder_kernels.py out.csv --commit
$(git rev-parse --short HEAD)``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

# name -> (tokens, K head dim, V head dim, batches)
SHAPES = {"enformer": (1536, 64, 192, (1, 8)), "borzoi": (4096, 64, 192, (1, 4))}
HEADS = 8
FIELDS = [
    "shape", "batch", "tensor", "heads", "tokens", "head_dim", "dtype", "rank", "bits", "block_size", "tau",
    "kernel", "calls", "ms", "gbps", "input_bytes", "max_abs_error", "bound_ok", "modes_match", "lowrank_share",
    "exact_share", "commit", "device", "torch", "triton",
]


def _inputs(name: str, batch: int, device: torch.device, block_size: int) -> dict[str, torch.Tensor]:
    from kvbound.bench.encoder import encoder_inputs
    from kvbound.bench.shapes import AttentionShape

    tokens, dk, dv, _ = SHAPES[name]
    shape = AttentionShape(name=name, q_len=tokens, kv_len=tokens, head_dim_qk=dk, head_dim_v=dv, family="model",
                           batch=batch, q_heads=HEADS, kv_heads=HEADS, dtype="bfloat16")
    inputs = encoder_inputs(shape, device, block_size=block_size)
    return {"k": inputs["k"], "v": inputs["v"]}


def _kernel_times(call) -> dict[str, tuple[int, float]]:
    """name -> (launches, GPU milliseconds) in one profiled call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    times: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:120]
            calls, total = times.get(name, (0, 0.0))
            times[name] = (calls + 1, total + event.device_time_total / 1e3)
    return times


def _rows(name: str, batch: int, tensor: str, x: torch.Tensor, config, common: dict, warmup_ms: float,
          rep_ms: float) -> list[dict]:
    import triton.testing

    import kvbound

    basis = kvbound.calibrate(x, config)

    def call():
        return kvbound.compress_kv(x, config, basis, impl="triton")

    ckv = call()
    error = float((x.double() - ckv.decompress().double()).abs().max())
    eager = kvbound.compress_kv(x, config, basis)
    shares = ckv.mode_fractions()
    nbytes = x.numel() * x.element_size()
    base = {**common, "shape": name, "batch": batch, "tensor": tensor, "heads": x.shape[1], "tokens": x.shape[2],
            "head_dim": x.shape[3], "dtype": str(x.dtype).removeprefix("torch."), "rank": config.rank,
            "bits": config.bits, "block_size": config.block_size, "tau": config.tau, "input_bytes": nbytes,
            "max_abs_error": error, "bound_ok": error <= config.tau, "modes_match": torch.equal(ckv.mode, eager.mode),
            "lowrank_share": shares["lowrank"], "exact_share": shares["raw"]}
    del eager
    total_ms = float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    kernels = _kernel_times(call)
    rows = [{**base, "kernel": "total", "calls": 1, "ms": total_ms, "gbps": nbytes / (total_ms * 1e6)}]
    kernel_ms = sum(ms for _, ms in kernels.values())
    rows.append({**base, "kernel": "kernels", "calls": sum(c for c, _ in kernels.values()), "ms": kernel_ms,
                 "gbps": nbytes / (kernel_ms * 1e6) if kernel_ms > 0 else ""})
    for kernel, (calls, ms) in sorted(kernels.items(), key=lambda item: -item[1][1]):
        rows.append({**base, "kernel": kernel, "calls": calls, "ms": ms, "gbps": nbytes / (ms * 1e6) if ms > 0 else ""})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="CSV file to write")
    parser.add_argument("--commit", default="unknown", help="recorded in every row")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("encoder_kernels.py: needs a CUDA device (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2

    import triton

    import kvbound

    device = torch.device("cuda")
    config = kvbound.CompressionConfig()
    common = {"commit": args.commit, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": triton.__version__}
    failed = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for name in args.shapes:
            for batch in SHAPES[name][3]:
                inputs = _inputs(name, batch, device, config.block_size)
                for tensor, x in inputs.items():
                    rows = _rows(name, batch, tensor, x, config, common, args.warmup_ms, args.rep_ms)
                    writer.writerows(rows)
                    f.flush()
                    total, kernels = rows[0], rows[1]
                    top = ", ".join(f"{r['kernel']} {r['ms']:.3f}" for r in rows[2:6])
                    print(f"{name} B={batch} {tensor} {list(x.shape)}: total {total['ms']:.3f} ms "
                          f"({total['gbps']:.0f} GB/s), kernels {kernels['ms']:.3f} ms [{top}]; "
                          f"max error {total['max_abs_error']:.4g}, modes match {total['modes_match']}", flush=True)
                    if not (total["bound_ok"] and total["modes_match"]):
                        failed.append(f"{name} B={batch} {tensor}")
                del inputs
                torch.cuda.empty_cache()
    if failed:
        print(f"encoder_kernels.py: checks failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
