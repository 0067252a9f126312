"""What the relative-position term costs inside the dense kernel (Enformer, Borzoi): the kernel timed at pinned tiles
with parts of its relative tile removed from a copy of the source.

    python benchmarks/relative_term_cost.py OUT.csv

Variants (each in its own process, on a copy of ``src/`` whose ``kvbound/kernels/_common.py`` is edited):
``base`` (the library as it is; also plain attention without the relative term, autotuned, at the same shapes:
``tile=plain-autotuned``), ``noskew`` (the window product is computed but summed over its two halves instead of
skewed into place), ``norel`` (no window load, no product, no skew: the relative tile is zero) and ``fp16`` (the
window product rounded to float16 before the skew through shared memory, widened after). ``noskew``, ``norel`` and
``plain-autotuned`` compute other functions: their ``err_max`` against the relative-position reference is large by
construction; only their times mean something. Shapes: one Enformer layer (N 1536, batch 8 and 1) and one Borzoi
layer with its relative keys (N 4096, batch 4), 8 heads, dk 64, dv 192, bf16, inputs of ``kvbound bench --suite
relative``; ``triton.testing.do_bench`` medians of ``attention_dense_fwd`` with a pinned tile (no host checks), whole
windows (``relative_halves=False``).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIELDS = ["variant", "layer", "B", "tile", "ms_p50", "err_max", "status"]
SRC = Path(__file__).resolve().parent.parent / "src"
ANCHOR_SKEW = "    if _SKEW_MODE == 1:\n        flat = tl.reshape(table, [BLOCK_M * WINDOW])"
ANCHOR_TOP = "    BLOCK_M: tl.constexpr = q_position.shape[0]\n"
FP16_STORE = "        flat = tl.reshape(t4, [BLOCK_M * WINDOW])"
FP16_LOAD = (
    "        return tl.reshape(tl.gather(flat, idx, axis=0), [BLOCK_M, BLOCK_N])\n"
    "    return tl.gather(table, skew, axis=1)"
)


def _variant_source(name: str, text: str) -> str:
    for anchor in (ANCHOR_SKEW, ANCHOR_TOP, FP16_STORE, FP16_LOAD):
        if text.count(anchor) != 1:
            raise RuntimeError(f"relative_logits_tile changed: {anchor!r} not found once in _common.py")
    if name == "noskew":
        return text.replace(
            ANCHOR_SKEW,
            "    if True:\n        return tl.sum(tl.reshape(table, [BLOCK_M, 2, WINDOW // 2]), axis=1)\n" + ANCHOR_SKEW,
        )
    if name == "norel":
        return text.replace(
            ANCHOR_TOP, ANCHOR_TOP + "    if True:\n        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)\n"
        )
    if name == "fp16":
        text = text.replace(FP16_STORE, FP16_STORE.replace("(t4,", "(t4.to(tl.float16),"))
        return text.replace(
            FP16_LOAD, FP16_LOAD.replace("[BLOCK_M, BLOCK_N])\n", "[BLOCK_M, BLOCK_N]).to(tl.float32)\n")
        )
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--variants", default="base,noskew,norel,fp16")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        return _worker(args.out, args.worker)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        csv.writer(f).writerow(FIELDS)
    status = 0
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(SRC, src)
            common = src / "kvbound" / "kernels" / "_common.py"
            common.write_text(_variant_source(name, common.read_text()))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
            status |= subprocess.run([sys.executable, __file__, str(args.out), "--worker", name], env=env).returncode
    return status


def _worker(out: Path, variant: str) -> int:
    import torch

    shapes = (
        ("enformer-layer", 1536, 8, "pad"),
        ("enformer-layer", 1536, 1, "pad"),
        ("borzoi-layer", 4096, 4, "strided"),
    )
    with out.open("a", newline="") as f:
        writer = csv.writer(f)
        for layer, n, batch, shift in shapes:
            for row in _shape_rows(variant, layer, n, batch, shift):
                writer.writerow(row)
                f.flush()
                print(*row, flush=True)
            torch.cuda.empty_cache()
    return 0


def _shape_rows(variant: str, layer: str, n: int, batch: int, shift: str) -> list[list]:
    import torch
    import triton.testing

    from kvbound.bench.relative import RelativeSpec, _inputs
    from kvbound.config import CompressionConfig
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.models.reference import relative_position_attention_reference

    spec = RelativeSpec(layer, n, (batch,), shift=shift)
    x = _inputs(spec, batch, torch.device("cuda"), torch.bfloat16, CompressionConfig(), seed=0, share=0.5)
    q, k, v, rk, scale = x["q"], x["k"], x["v"], x["relative_keys"], x["scale"]
    u, w = x["u"].float().contiguous(), x["w"].float().contiguous()
    ref = relative_position_attention_reference(q[:1], k[:1], v[:1], rk, x["u"], x["w"], scale=scale)
    tiles = [(64, 64, 4, 1), (64, 64, 4, 2)] + ([(64, 64, 8, 3), None] if variant == "base" else [])
    rows = []
    for tile in tiles:
        if tile is None:  # plain attention without the relative term, autotuned

            def call():
                # the value columns whole, as the relative keys run them (dv_split_default)
                return attention_dense_fwd(q, k, v, None, scale, False, None, dv_split=False)[0]

            label = "plain-autotuned"
        else:
            config = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tile, strict=True))

            def call(config=config):
                return attention_dense_fwd(
                    q, k, v, None, scale, False, None, config=config, relative=(rk, u, w), relative_halves=False
                )[0]

            label = "x".join(map(str, tile))
        try:
            err = (call()[:1].double() - ref).abs().max().item()
            ms = triton.testing.do_bench(call, quantiles=[0.5], rep=150)
            rows.append([variant, layer, batch, label, f"{ms:.4f}", f"{err:.3e}", "ok"])
        except Exception as error:  # noqa: BLE001 - a row with its reason
            rows.append([variant, layer, batch, label, "", "", f"{type(error).__name__}: {str(error)[:150]}"])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
