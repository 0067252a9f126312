"""How far the bounded maximum's bounds sit above the true row maxima on the benchmark's K/V: the smallest row sum
``sum_j exp2(x_j - bound_i)`` of each program (a block of consecutive query rows), in log2, for the dense kernel's
Cauchy-Schwarz bound (``|q_i| max_j |k_j|``) and the compressed kernel's rank-space box bound, and the share of
programs whose smallest row sum falls below the retry thresholds ``2**-60`` (before 341cd17) and ``2**-90`` (since).
A program retries when any of its rows falls below the threshold.

    python benchmarks/bound_gap.py OUT.csv [--dims 64,128] [--length 65536] [--programs 64] [--device cpu]

K/V: ``kvbound.bench.data.residual_free_case`` (``bounded_sweep.py``'s data: 8 heads, bf16 queries, rank-8 residual-free
compressed K/V; the dense rows use the decompressed K/V in bf16). ``--programs``: programs sampled evenly per head and
program height (64 and 128 rows); 0 takes every program."""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dims", default="64,128")
    p.add_argument("--length", type=int, default=65536)
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import torch
    from tqdm import tqdm

    from kvbound.bench import data as bench_data

    log2e = 1 / math.log(2)
    fields = ["d", "N", "bound", "rows_per_program", "programs", "min_log2_sum", "median_log2_sum",
              "share_below_2^-60", "share_below_2^-90"]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for d in (int(x) for x in args.dims.split(",")):
            q, ck, _cv, _ = bench_data.residual_free_case(
                8, args.length, d, dtype=torch.bfloat16, device=args.device, block_size=128
            )
            q = q[0].float()
            k = ck.decompress()[0].bfloat16().float()
            scale = d**-0.5 * log2e
            basis, coeffs = ck.basis.float(), ck.coeffs[0].float()
            q_rank = q @ basis.transpose(-1, -2)
            bounds = {
                "dense cauchy-schwarz": q.norm(dim=-1) * k.norm(dim=-1).amax(-1, keepdim=True) * scale,
                "compressed box": torch.maximum(q_rank * coeffs.amax(1, keepdim=True),
                                                q_rank * coeffs.amin(1, keepdim=True)).sum(-1) * scale,  # fmt: skip
            }
            keys = {"dense cauchy-schwarz": k, "compressed box": coeffs @ basis}
            for rows in (64, 128):
                total = args.length // rows
                picks = range(total) if args.programs == 0 else [round(i * (total - 1) / max(1, args.programs - 1))
                                                                  for i in range(args.programs)]  # fmt: skip
                for name, bound in bounds.items():
                    mins, everything = [], []
                    for h in tqdm(range(8), desc=f"d={d} {name} {rows}-row programs", leave=False):
                        for i in picks:
                            sl = slice(i * rows, (i + 1) * rows)
                            x = (q[h, sl] @ keys[name][h].T) * scale
                            sums = torch.logsumexp(x.double() / log2e, -1) * log2e - bound[h, sl].double()
                            mins.append(float(sums.min()))
                            everything.append(sums)
                    every = torch.cat(everything)
                    lows = torch.tensor(mins)
                    row = {"d": d, "N": args.length, "bound": name, "rows_per_program": rows, "programs": len(mins),
                           "min_log2_sum": f"{lows.min():.1f}", "median_log2_sum": f"{every.median():.1f}",
                           "share_below_2^-60": f"{float((lows < -60).float().mean()):.4f}",
                           "share_below_2^-90": f"{float((lows < -90).float().mean()):.4f}"}  # fmt: skip
                    writer.writerow(row)
                    f.flush()
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
