"""Correctness of the compressed kernel's byte decode (uniform residual runs) at every tile shape, one shape per
process, so that an illegal address cannot poison the next check.

Each child builds K and V in the storage format with ``residual_diag``'s layouts (every block packed at 4 or 8 bits,
or half the blocks packed and half low-rank), runs ``attention_compressed_fwd`` with one pinned tile and uniform
runs on (the byte decode), and compares the first 128 query rows with ``reference_attention`` (float64); the
tolerance is twice plain attention's error in the same dtype on the decoded K/V, plus a floor::

    python benchmarks/byte_decode_tiles.py OUT.csv                  # GPU: every case, bf16, in parallel
    python benchmarks/byte_decode_tiles.py OUT.csv --cpu-smoke      # two tiny cases in Triton's interpreter

One CSV row per case: head dims, query heads per K/V head, layout, tile, whether the launcher ran uniform runs
there (it keeps them off the tiles that miscompiled, ``uniform_safe``; such cases check the general loop), status
(ok, wrong, nan, crash, timeout), max error, tolerance, seconds. Exit status 1 when any case is not ok.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCRIPT = Path(__file__).resolve()
# (dk, dv, query heads per K/V head, layout, (BLOCK_M, BLOCK_N, warps, stages))
TILES_64 = ((64, 64, 4, 3), (128, 64, 8, 3))
TILES_WIDE = ((64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 8, 3), (64, 64, 8, 2))
CASES = (
    [(64, 64, 1, layout, tile) for layout in ("packed4", "packed8", "packed4_contig50") for tile in TILES_64]
    + [(128, 128, 1, layout, tile) for layout in ("packed4", "packed8", "packed4_contig50") for tile in TILES_WIDE]
    + [(128, 192, 8, layout, tile) for layout in ("packed4", "packed4_contig50") for tile in TILES_WIDE]
)
CPU_CASES = [(32, 32, 1, "packed4", (32, 16, 4, 1)), (32, 48, 2, "packed8", (32, 16, 4, 1))]


def child(spec: dict) -> dict:
    """Run one case in this process; returns its result row."""
    if spec["cpu"]:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(SCRIPT.parent))
    import residual_diag as diag
    import torch

    from kvbound import reference_attention
    from kvbound.bench import data as bench_data
    from kvbound.kernels._common import tma_ready
    from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd, uniform_safe

    dk, dv, group, layout_name = spec["dk"], spec["dv"], spec["group"], spec["layout"]
    m, n_tile, warps, stages = spec["tile"]
    device = "cpu" if spec["cpu"] else "cuda"
    dtype = torch.float16 if spec["cpu"] else torch.bfloat16
    heads, n, block = (1, 64, 32) if spec["cpu"] else (2, 2048, 128)
    layout = diag.LAYOUTS[layout_name]
    k_sub = bench_data.kv_subspace(heads, dk, rank=diag.RANK, seed=1, device=device)
    v_sub = bench_data.kv_subspace(heads, dv, rank=diag.RANK, seed=2, device=device)
    common = dict(heads=heads, seq_len=n, dtype=dtype, device=device, placement_seed=5, block_size=block)
    ck = diag.build_compressed(layout, basis=k_sub, head_dim=dk, value_seed=11, **common)
    cv = diag.build_compressed(layout, basis=v_sub, head_dim=dv, value_seed=12, **common)
    q = bench_data.structured_queries(1, heads * group, n, k_sub, dtype=dtype, seed=6)
    scale = dk**-0.5
    out, _ = attention_compressed_fwd(
        q,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        None,
        scale,
        False,
        None,
        config=dict(BLOCK_M=m, BLOCK_N=n_tile, num_warps=warps, num_stages=stages),
        uniform=True,
    )
    if device == "cuda":
        torch.cuda.synchronize()
    # Whether the launcher compiled uniform runs for this tile at all (it refuses the tiles that miscompiled).
    config = dict(BLOCK_M=m, BLOCK_N=n_tile, num_warps=warps, num_stages=stages)
    uniform = uniform_safe(tma_ready(ck.coeffs) and tma_ready(cv.coeffs), config)
    rows = 128 if not spec["cpu"] else n
    k_dense, v_dense = ck.decompress(), cv.decompress()
    qs = q[:, :, :rows]
    reference = reference_attention(qs, k_dense, v_dense, scale=scale)
    k_plain = k_dense.to(dtype).float().repeat_interleave(group, 1)
    v_plain = v_dense.to(dtype).float().repeat_interleave(group, 1)
    logits = (qs.float() @ k_plain.transpose(-1, -2)) * scale
    plain = (torch.softmax(logits, -1).to(dtype).float() @ v_plain).to(dtype)
    plain_err = float((plain.double() - reference).abs().max())
    got = out[:, :, :rows]
    tolerance = 2 * plain_err + diag.FLOOR[dtype]
    if not bool(torch.isfinite(got).all()):
        return dict(status="nan", err=float("nan"), tolerance=tolerance, uniform=uniform)
    err = float((got.double() - reference).abs().max())
    return dict(status="ok" if err <= tolerance else "wrong", err=err, tolerance=tolerance, uniform=uniform)


def run_case(case, cpu: bool, timeout: float) -> dict:
    dk, dv, group, layout, tile = case
    spec = dict(dk=dk, dv=dv, group=group, layout=layout, tile=list(tile), cpu=cpu)
    row = dict(dk=dk, dv=dv, group=group, layout=layout, tile="x".join(map(str, tile)))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode == 0 and lines:
            row.update(json.loads(lines[-1][len("RESULT ") :]))
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            row.update(status="crash", err=float("nan"), tolerance=float("nan"), reason=tail[:200])
    except subprocess.TimeoutExpired:
        row.update(status="timeout", err=float("nan"), tolerance=float("nan"))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--jobs", type=int, default=8, help="cases checked at the same time")
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.out is None:
        parser.error("OUT.csv is required")
    cases = CPU_CASES if args.cpu_smoke else CASES
    fields = ["dk", "dv", "group", "layout", "tile", "uniform", "status", "err", "tolerance", "seconds", "reason"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    with open(args.out, "w", newline="") as handle, ThreadPoolExecutor(args.jobs) as pool:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        futures = [pool.submit(run_case, case, args.cpu_smoke, args.timeout_s) for case in cases]
        for index, future in enumerate(futures, 1):
            row = future.result()
            writer.writerow(row)
            handle.flush()
            failed += row["status"] != "ok"
            print(
                f"[{index}/{len(cases)}] dk {row['dk']} dv {row['dv']} G {row['group']} {row['layout']} "
                f"tile {row['tile']} uniform {row.get('uniform', '?')}: {row['status']} "
                f"err {row['err']:.2e} (tol {row['tolerance']:.2e}) "
                f"{row['seconds']} s {row.get('reason', '')}",
                flush=True,
            )
    print(f"{len(cases) - failed} of {len(cases)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
