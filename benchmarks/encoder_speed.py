"""Time the Triton encoder against the eager float64 encoder and against a plain copy of the same tensor.

    python benchmarks/encoder_speed.py --out encoder.csv

One CSV row per (encoder, shape): ms (median), effective GB/s over the input bytes, compression ratio, mode shares,
max error / tau. K/V are low-rank-plus-noise activations at unit scale (rank 6 structure, noise std 0.02).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess

import torch
import triton

import kvbound

SHAPES = [(1, 8, 65536, 64), (1, 8, 16384, 128), (1, 1, 8192, 128), (1, 1, 8192, 192), (1, 8, 1536, 64)]


def _data(shape, gen):
    b, h, n, d = shape
    basis = torch.randn(h, 6, d, generator=gen) / 6**0.5
    x = torch.einsum("bhnr,hrd->bhnd", torch.randn(b, h, n, 6, generator=gen), basis)
    return (x + 0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16).cuda()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    config = kvbound.CompressionConfig()
    commit = os.environ.get("KVBOUND_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stamp = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
             "commit": commit or "unknown", "date": datetime.date.today().isoformat()}
    rows = []
    for shape in SHAPES:
        x = _data(shape, gen)
        basis = kvbound.calibrate(x[:, :, :4096], config)
        copy_ms = triton.testing.do_bench(lambda x=x: x.clone(), warmup=50, rep=200)
        for impl in ("triton", "eager"):
            fn = lambda x=x, impl=impl, basis=basis: kvbound.compress_kv(x, config, basis, impl=impl)  # noqa: E731
            ms = triton.testing.do_bench(fn, warmup=50, rep=300 if impl == "triton" else 100)
            ckv = fn()
            shares = ckv.mode_fractions()
            row = {"encoder": impl, "shape": "x".join(map(str, shape)), "ms": round(ms, 4),
                   "input_GBps": round(x.numel() * x.element_size() / ms / 1e6, 1), "copy_ms": round(copy_ms, 4),
                   "ratio": round(ckv.compression_ratio, 3), "lowrank": round(shares["lowrank"], 3),
                   "packed": round(shares["packed"], 3), "promoted": round(shares["promoted"], 3),
                   "raw": round(shares["raw"], 3), "max_err_over_tau": round(ckv.max_abs_error(x) / config.tau, 4),
                   **stamp}
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
