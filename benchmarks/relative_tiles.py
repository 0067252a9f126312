"""The dense kernel's relative-position variant (Enformer, Borzoi) at pinned tile shapes, for each way of skewing a
tile's relative logits into place (``KVBOUND_RELATIVE_SKEW``, see ``kvbound/kernels/_common.py``).

    python benchmarks/relative_tiles.py OUT.csv [--skews gather,shared,shared-banked] [--tiles 64x64x8x3,...]

Each skew runs in its own process (the skew is read when the kernels are imported). Shapes: one Enformer layer
(N = 1536, batch 1 and 8) and one Borzoi layer (N = 4096, batch 1, 2 and 4), 8 heads, dk 64, dv 192, bf16, with the
relative keys of ``kvbound bench --suite relative``. Every row records the largest error of batch item 0 against
float64 (``kvbound.models.reference.relative_position_attention_reference``) next to its time; a tile that does not
compile (shared memory, registers) is a row with its reason. Rows ``tile=autotuned`` time the public call
(``relative_position_attention(..., backend="kvbound")``), whose autotuner picks among the variant's tiles.
``variant=keys``: the relative keys (``RELATIVE = 1``, which the skew applies to; whole windows, also in the
autotuned rows: the workers run with ``KVBOUND_RELATIVE_HALVES=0``); ``variant=keys-halves`` (square tiles, written by
the first skew's worker only, since the halves are skewed by one flat gather whatever the setting): half of each
tile's window product carried to the next tile (``relative_halves=True``, ``RELATIVE = 3``); ``variant=runs``
(Borzoi only):
the runs of equal relative keys (``RELATIVE = 2``, no skew), timed through the public call with the autotuner's
tile list reduced to the pinned tile; a tile wider than the library's window (``BLOCK_M + BLOCK_N - 1 > 127``, or
191 with ``KVBOUND_RUNS_WIDE=1``; e.g. ``128x64x8x2``) gets its runs counted over its own window, unrolled up to 32
per tile."""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import subprocess
import sys
from pathlib import Path

TILES = "64x64x8x3,64x64x8x2,64x32x8x3,64x64x4x2,64x64x4x1,64x32x4x2,32x64x4x2,128x64x8x2"
SHAPES = (("enformer-layer", 1536, (1, 8), "pad"), ("borzoi-layer", 4096, (1, 2, 4), "strided"))
FIELDS = ["skew", "layer", "N", "B", "variant", "tile", "status", "ms_p50", "err_max", "reason"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--skews", default="gather,shared,shared-banked")
    p.add_argument("--tiles", default=TILES)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--halves", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            csv.DictWriter(f, fieldnames=FIELDS).writeheader()
        status = 0
        for skew in args.skews.split(","):
            # Whole windows in the public call's rows; the keys-halves rows (the first worker's only: the halves
            # are skewed in one way whatever the skew setting) ask for half windows themselves.
            env = {**os.environ, "KVBOUND_RELATIVE_SKEW": skew, "KVBOUND_RELATIVE_HALVES": "0"}
            cmd = [sys.executable, __file__, str(args.out), "--tiles", args.tiles, "--worker", skew]
            if skew == args.skews.split(",")[0]:
                cmd.append("--halves")
            status |= subprocess.run(cmd, env=env).returncode
        return status
    return _worker(args)


def _worker(args) -> int:
    import torch
    import triton.testing

    from kvbound.bench.relative import RelativeSpec, _inputs
    from kvbound.config import CompressionConfig
    from kvbound.kernels import _common
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.models.reference import relative_position_attention_reference
    from kvbound.models.relative import relative_position_attention

    assert _common.RELATIVE_SKEW_NAME == args.worker, (_common.RELATIVE_SKEW_NAME, args.worker)
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.tiles.split(",")]
    with args.out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)

        def emit(row):
            writer.writerow({k: row.get(k, "") for k in FIELDS})
            f.flush()
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

        for layer, n, batches, shift in SHAPES:
            spec = RelativeSpec(layer, n, batches, shift=shift)
            for b in batches:
                x = _inputs(spec, b, torch.device("cuda"), torch.bfloat16, CompressionConfig(), seed=0, share=0.5)
                q, k, v, rk = x["q"], x["k"], x["v"], x["relative_keys"]
                u, w = x["u"].float().contiguous(), x["w"].float().contiguous()
                ref = relative_position_attention_reference(q[:1], k[:1], v[:1], rk, x["u"], x["w"], scale=x["scale"])
                base = {"skew": args.worker, "layer": layer, "N": n, "B": b}

                def err(out, ref=ref):
                    return f"{(out[:1].double() - ref).abs().max().item():.3e}"

                def public(x=x):
                    return relative_position_attention(
                        x["q"],
                        x["k"],
                        x["v"],
                        x["relative_keys"],
                        x["u"][None, :, None],
                        x["w"][None, :, None],
                        scale=x["scale"],
                        backend="kvbound",
                    )

                try:
                    e = err(public())
                    ms = triton.testing.do_bench(public, quantiles=[0.5], rep=100)
                    emit(
                        {
                            **base,
                            "variant": "keys",
                            "tile": "autotuned",
                            "status": "ok",
                            "ms_p50": f"{ms:.4g}",
                            "err_max": e,
                        }
                    )
                except Exception as error:  # noqa: BLE001 - a row with its reason
                    emit({**base, "variant": "keys", "tile": "autotuned", "status": "error", "reason": _reason(error)})
                if x["runs"] is not None:
                    for tile_shape in [None, *tiles]:
                        tile = "autotuned" if tile_shape is None else "x".join(map(str, tile_shape))
                        try:
                            ms, e = _runs_row(x, tile_shape, err)
                            emit(
                                {
                                    **base,
                                    "variant": "runs",
                                    "tile": tile,
                                    "status": "ok",
                                    "ms_p50": f"{ms:.4g}",
                                    "err_max": e,
                                }
                            )
                        except Exception as error:  # noqa: BLE001 - a row with its reason
                            emit({**base, "variant": "runs", "tile": tile, "status": "error", "reason": _reason(error)})
                pinned = [(t, h) for t in tiles for h in (False, True) if not h or (args.halves and t[0] == t[1])]
                for (m_, n_, w_, s_), halves in pinned:
                    config = {"BLOCK_M": m_, "BLOCK_N": n_, "num_warps": w_, "num_stages": s_}
                    tile = f"{m_}x{n_}x{w_}x{s_}"
                    variant = "keys-halves" if halves else "keys"

                    def call(config=config, q=q, k=k, v=v, rk=rk, u=u, w=w, scale=x["scale"], halves=halves):
                        return attention_dense_fwd(
                            q, k, v, None, scale, False, None, config=config, relative=(rk, u, w),
                            relative_halves=halves,
                        )[0]  # fmt: skip

                    try:
                        e = err(call())
                        ms = triton.testing.do_bench(call, quantiles=[0.5], rep=100)
                        emit(
                            {
                                **base,
                                "variant": variant,
                                "tile": tile,
                                "status": "ok",
                                "ms_p50": f"{ms:.4g}",
                                "err_max": e,
                            }
                        )
                    except Exception as error:  # noqa: BLE001 - a row with its reason
                        emit({**base, "variant": variant, "tile": tile, "status": "error", "reason": _reason(error)})
                del x, q, k, v, ref
                torch.cuda.empty_cache()
    return 0


@contextlib.contextmanager
def pinned_tile(tile_shape):
    """Inside the block the dense kernel's autotuner knows only ``tile_shape`` (``(BLOCK_M, BLOCK_N, num_warps,
    num_stages)``; None: its own list), for public calls of every variant; its caches are cleared on entry and
    exit, and its list restored on exit."""
    import triton

    from kvbound.kernels import attention_dense

    api = sys.modules["kvbound.attention"]
    tuner = attention_dense._attention_dense_fwd
    saved = (tuner.configs, attention_dense._RELATIVE_SHAPES, attention_dense._RUNS_SHAPES,
             attention_dense._RELATIVE_WINDOW, attention_dense.MAX_RUN_SPAN)  # fmt: skip
    caches = (attention_dense._TUNED, attention_dense._PLANS, tuner.cache, api._RUNS_ON_DEVICE, api._RUN_LAYOUTS)
    if tile_shape is not None:
        m_, n_, w_, s_ = tile_shape
        tuner.configs = [triton.Config({"BLOCK_M": m_, "BLOCK_N": n_}, num_warps=w_, num_stages=s_)]
        attention_dense._RELATIVE_SHAPES = attention_dense._RUNS_SHAPES = frozenset({tuple(tile_shape)})
        if m_ + n_ - 1 > attention_dense._RELATIVE_WINDOW:
            # A tile wider than the library's window: its runs are counted over its own window, unrolled up to 32.
            attention_dense._RELATIVE_WINDOW = m_ + n_ - 1
            attention_dense.MAX_RUN_SPAN = 32
    for cache in caches:
        cache.clear()
    try:
        yield
    finally:
        (tuner.configs, attention_dense._RELATIVE_SHAPES, attention_dense._RUNS_SHAPES,
         attention_dense._RELATIVE_WINDOW, attention_dense.MAX_RUN_SPAN) = saved  # fmt: skip
        for cache in caches:
            cache.clear()


def _runs_row(x: dict, tile_shape, err) -> tuple[float, str]:
    """The public call with relative runs, its autotuner given only ``tile_shape`` (or its own list for None)."""
    import triton.testing

    from kvbound.models.relative import relative_position_attention

    with pinned_tile(tile_shape):

        def public():
            return relative_position_attention(
                x["q"],
                x["k"],
                x["v"],
                x["relative_keys"],
                x["u"][None, :, None],
                x["w"][None, :, None],
                scale=x["scale"],
                backend="kvbound",
                relative_runs=x["runs"],
            )

        e = err(public())
        return triton.testing.do_bench(public, quantiles=[0.5], rep=100), e


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text[:300]


if __name__ == "__main__":
    raise SystemExit(main())
