"""The dense kernel's runs variant (``RELATIVE = 2``, Borzoi) at pinned tiles, including tiles wider than the
window the library counts runs for (``attention_dense.relative_window()``, 127 distances for its 64 x 64 tiles).

    python benchmarks/relative_runs_wide_tiles.py OUT.csv [--tiles 64x64x4x1,128x64x8x2,...]

For each tile the process widens the window to ``BLOCK_M + BLOCK_N - 1`` (never below the library's 127) and the
unroll limit to 32 runs, so
that ``RUN_SPAN`` counts the runs that tile really spans, gives the autotuner only that tile, and times the public
call (``relative_position_attention(..., backend="kvbound", relative_runs=...)``) with
``triton.testing.do_bench`` (checks not deferred, so the call's host path is included). One Borzoi layer (N 4096,
8 heads, dk 64, dv 192, bf16), batch 1 and 4, inputs of ``kvbound bench --suite relative``; ``err``: largest error of
batch item 0 against float64."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

TILES = "64x64x4x1,64x64x8x3,128x64x8x2,128x64x8x3,128x32x8x2"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tiles", default=TILES)
    p.add_argument("--batches", default="1,4")
    args = p.parse_args()

    import torch
    import triton
    import triton.testing

    from kvbound.bench.relative import RelativeSpec, _inputs
    from kvbound.config import CompressionConfig
    from kvbound.kernels import attention_dense
    from kvbound.models.reference import relative_position_attention_reference
    from kvbound.models.relative import relative_position_attention

    api = sys.modules["kvbound.attention"]
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    batches = tuple(int(b) for b in args.batches.split(","))
    tuner = attention_dense._attention_dense_fwd
    saved = (tuner.configs, attention_dense._RELATIVE_SHAPES, attention_dense._RELATIVE_WINDOW,
             attention_dense.MAX_RUN_SPAN)  # fmt: skip
    spec = RelativeSpec("borzoi-layer", 4096, batches, shift="strided")
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["B", "tile", "window", "span", "ms_p50", "err", "status"])
            for b in batches:
                x = _inputs(spec, b, torch.device("cuda"), torch.bfloat16, CompressionConfig(), seed=0, share=0.5)
                ref = relative_position_attention_reference(
                    x["q"][:1], x["k"][:1], x["v"][:1], x["relative_keys"], x["u"], x["w"], scale=x["scale"]
                )

                def public(x=x):
                    return relative_position_attention(
                        x["q"], x["k"], x["v"], x["relative_keys"], x["u"][None, :, None], x["w"][None, :, None],
                        scale=x["scale"], backend="kvbound", relative_runs=x["runs"],
                    )  # fmt: skip

                for tile in tiles:
                    m, n, warps, stages = tile
                    attention_dense._RELATIVE_WINDOW = max(saved[2], m + n - 1)
                    attention_dense.MAX_RUN_SPAN = 32
                    attention_dense._RELATIVE_SHAPES = frozenset({tile})
                    tuner.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)]
                    caches = (
                        attention_dense._TUNED,
                        attention_dense._PLANS,
                        tuner.cache,
                        api._RUNS_ON_DEVICE,
                        api._RUN_LAYOUTS,
                    )
                    for cache in caches:
                        cache.clear()
                    span = attention_dense.relative_run_span(x["runs"], 2 * 4096 - 1)
                    row = [b, "x".join(map(str, tile)), attention_dense._RELATIVE_WINDOW, span]
                    try:
                        err = (public()[:1].double() - ref).abs().max().item()
                        ms = triton.testing.do_bench(public, quantiles=[0.5], rep=200)
                        row += [f"{ms:.4f}", f"{err:.3e}", "ok"]
                    except Exception as error:  # noqa: BLE001 - a row with its reason
                        row += ["", "", f"{type(error).__name__}: {str(error)[:200]}"]
                    writer.writerow(row)
                    f.flush()
                    print(*row, flush=True)
                del x, ref
                torch.cuda.empty_cache()
    finally:
        (tuner.configs, attention_dense._RELATIVE_SHAPES, attention_dense._RELATIVE_WINDOW,
         attention_dense.MAX_RUN_SPAN) = saved  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
