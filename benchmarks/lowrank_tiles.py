# Device command (one call, about 3 minutes with compiles):
# PYTHONPATH=src python3 benchmarks/lowrank_tiles.py $OUT/lowrank_tiles.csv
"""Residual-free compressed attention (every K/V block low rank only, rank 8) with the tile shape pinned: which
query tile, warp count and pipeline depth the low-rank loop wants, and what the float16 hi/lo split of the
rank-space queries (``split_rank``) costs, beside cuDNN on the same decompressed K/V.

The autotuner of ``attention_compressed_fwd`` searches ``_GENERAL_SHAPES`` (64 or 128 query rows, 4 or 8 warps,
3 stages). This script also times shapes outside that list (256 rows, 2 and 4 stages), so that a shape that wins
here can be added to it. Inputs: ``kvbound.bench.data`` (the seed shapes' generator: K/V in a rank-8 subspace of
each head, queries mostly in it), encoded with a shared basis calibrated on another draw and a tolerance raised
until no block keeps a residual, as the ``lowrank-r8`` configuration of ``kvbound bench`` does. Every pinned call
is checked against the float64 reference on the decompressed K/V (first 128 queries of every head); its error is
in the row. CSV columns: ``d, N, tile (BLOCK_M x BLOCK_N / warps / stages), split_rank, status, ms_p50, ms_p20,
ms_p80, vs_cudnn, err_max, reason``.

CPU check (Triton's interpreter, tiny sizes, no timing)::

    python benchmarks/lowrank_tiles.py --cpu-smoke /tmp/lowrank_tiles.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

FIELDS = ["d", "N", "tile", "split_rank", "status", "ms_p50", "ms_p20", "ms_p80", "vs_cudnn", "err_max", "reason"]
# (BLOCK_M, BLOCK_N, warps, stages)
TILES = [
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 64, 4, 4),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (256, 64, 8, 3),
    (256, 64, 8, 2),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--dims", default="64,128")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes in Triton's interpreter, no timing")
    args = p.parse_args()
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    import torch
    import triton.testing

    from kvbound.bench import data as bench_data
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd
    from kvbound.reference import reference_attention

    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float16 if smoke else torch.bfloat16
    n = 256 if smoke else args.n
    heads, block = (2 if smoke else 8), 128
    tiles = [(32, 16, 4, 1)] if smoke else TILES
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()

        def emit(row):
            writer.writerow({k: row.get(k, "") for k in FIELDS})
            f.flush()
            rows.append(row)
            print(" ".join(f"{k}={row.get(k, '')}" for k in FIELDS if row.get(k, "") != ""), flush=True)

        for d in (int(x) for x in args.dims.split(",")):
            start = time.time()
            try:
                q, ck, cv, tau = bench_data.residual_free_case(
                    heads, n, d, dtype=dtype, device=device, block_size=block
                )
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
            k_dec, v_dec = ck.decompress(), cv.decompress()
            kop, vop = CompressedOperand.from_compressed(ck), CompressedOperand.from_compressed(cv)
            scale = d**-0.5
            check = slice(0, min(128, n))
            expected = reference_attention(q[:, :, check], k_dec, v_dec, scale=scale)
            print(f"d={d}: inputs ready (tau {tau:g}) in {time.time() - start:.1f} s", flush=True)

            cudnn_ms = None
            if not smoke:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                k_op, v_op = k_dec.to(dtype), v_dec.to(dtype)  # cuDNN on the decompressed K/V in q's dtype

                def cudnn(q=q, k_op=k_op, v_op=v_op, scale=scale):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k_op, v_op, scale=scale)

                err = (cudnn()[:, :, check].double() - expected).abs().max().item()
                p20, p50, p80 = triton.testing.do_bench(cudnn, quantiles=[0.2, 0.5, 0.8], rep=300)
                cudnn_ms = p50
                emit(dict(d=d, N=n, tile="cudnn", split_rank="", status="ok", ms_p50=f"{p50:.4f}",
                          ms_p20=f"{p20:.4f}", ms_p80=f"{p80:.4f}", vs_cudnn="1.00", err_max=f"{err:.3e}"))  # fmt: skip
            for m, bn, warps, stages in tiles:
                for split_rank in (True, False):
                    tile = f"{m}x{bn}/{warps}w/{stages}s"
                    row = dict(d=d, N=n, tile=tile, split_rank=split_rank)
                    pinned = dict(BLOCK_M=m, BLOCK_N=bn, num_warps=warps, num_stages=stages)

                    def call(split_rank=split_rank, pinned=pinned, q=q, kop=kop, vop=vop, scale=scale):
                        return attention_compressed_fwd(q, kop, vop, None, scale, False, None, (False, False),
                                                        split_rank=split_rank, config=pinned)[0]  # fmt: skip

                    try:
                        out = call()
                        err = (out[:, :, check].double() - expected).abs().max().item()
                        row.update(status="ok", err_max=f"{err:.3e}")
                        if not smoke:
                            p20, p50, p80 = triton.testing.do_bench(call, quantiles=[0.2, 0.5, 0.8], rep=300)
                            row.update(ms_p50=f"{p50:.4f}", ms_p20=f"{p20:.4f}", ms_p80=f"{p80:.4f}",
                                       vs_cudnn=f"{cudnn_ms / p50:.2f}")  # fmt: skip
                    except Exception as exc:  # a shape that does not compile or fit is a row, not the end
                        row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    emit(row)
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows)} rows written to {args.out}; {len(failed)} failed")
    return 0 if rows and (not smoke or not failed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
