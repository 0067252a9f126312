"""Registers and spills of the compressed kernel's residual variants for sm_90, compiled on any machine (no GPU).

    python benchmarks/static_regs_compressed.py OUT.csv [--layouts packed8 packed4] [--tiles 128x64x8x3 ...]
        [--general on off] [--dv-split on off] [--shape alphagenome]

Each (shape, layout, general runs, tile) goes through the launcher ``attention_compressed_fwd`` with CPU tensors
built in the storage format (``benchmarks/residual_diag.py``'s layouts: every block packed at 8 or 4 bits), the
tile pinned and the residual flags given, and is compiled for sm_90 instead of launched, as
``benchmarks/static_regs.py`` does for the dense kernel (the same hook, the same ``cuobjdump`` counts).
``--general off`` compiles the kernel without its general-run loop and with the uniform decode in its masked
tail (``general_runs=False``: what a call whose residual blocks are all packed at the configured byte width
gets). ``--dv-split on`` holds the value columns in two parts (``dv_parts``: dv 192 as 128 + 64), ``off`` in one
padded part (256). Shapes: ``alphagenome`` (8 query heads on one K/V head, dk 128, dv 192, the 16 x 16 tile bias, soft-cap 5,
N = 8192), ``d64`` and ``d128`` (one query head per K/V head, dk = dv, no bias). Read the ``triton`` column before
comparing with GPU runs (register allocation depends on the Triton version; the GPU machine runs 3.6.0)."""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from residual_diag import LAYOUTS, build_compressed  # noqa: E402
from static_regs import SHARED_LIMIT, compile_instead_of_launch, cubin_usage, parse_tile  # noqa: E402

from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd  # noqa: E402

# (query heads, K/V heads, dk, dv, N, tile bias, soft-cap)
SHAPES = {
    "alphagenome": (8, 1, 128, 192, 8192, 16, 5.0),
    "d64": (8, 8, 64, 64, 16384, 0, None),
    "d128": (8, 8, 128, 128, 16384, 0, None),
}
TILES = ("128x64x8x3", "64x64x4x3", "128x64x8x2")
FIELDS = ["shape", "layout", "general_runs", "dv_split", "tile", "status", "registers", "stack_bytes", "shared_bytes",
          "shared_static_bytes", "sass_instructions", "ldl", "stl", "hgmma", "constexprs", "reason", "triton", "commit"]  # fmt: skip


def _operand(layout: str, heads: int, n: int, d: int, seed: int) -> CompressedOperand:
    basis = torch.linalg.qr(torch.randn(heads, d, 8))[0].transpose(1, 2).contiguous()
    ckv = build_compressed(LAYOUTS[layout], heads=heads, seq_len=n, head_dim=d, dtype=torch.bfloat16,
                           device="cpu", basis=basis, value_seed=seed)  # fmt: skip
    return CompressedOperand.from_compressed(ckv)


def compile_one(compiled: list, shape: str, layout: str, general: bool, tile: str, dv_split: bool = False) -> dict:
    hq, hkv, dk, dv, n, bias_tile, softcap = SHAPES[shape]
    k = _operand(layout, hkv, n, dk, 1)
    v = _operand(layout, hkv, n, dv, 2)
    q = torch.zeros(1, hq, n, dk, dtype=torch.bfloat16)
    bias = torch.zeros(1, hq, n // bias_tile, n // bias_tile) if bias_tile else None
    compiled.clear()
    attention_compressed_fwd(q, k, v, bias, dk**-0.5, False, softcap, residual=(True, True), config=parse_tile(tile),
                             bias_tile=bias_tile or 1, split=False, general_runs=general, dv_split=dv_split)  # fmt: skip
    kernels = [(kernel, named) for kernel, named in compiled if kernel.name == "_attention_compressed_fwd"]
    if len(kernels) != 1:
        raise RuntimeError(f"expected one compiled attention kernel for this launch, got {len(kernels)}")
    kernel, named = kernels[0]
    keys = ("FAST_BITS_K", "FAST_BITS_V", "K_PLANES", "V_PLANES", "RUN_KINDS", "GENERAL_RUNS", "DV_PAD", "DV_HI",
            "USE_TMA", "FIXED_MAX")  # fmt: skip
    row = {**cubin_usage(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared,
           "constexprs": " ".join(f"{key}={named.get(key)}" for key in keys)}  # fmt: skip
    if row["shared_bytes"] > SHARED_LIMIT:
        row.update(status="error", reason=f"needs {row['shared_bytes']} bytes of shared memory per program")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", nargs="+", default=["alphagenome"], choices=list(SHAPES))
    p.add_argument("--layouts", nargs="+", default=["packed8"], choices=["packed8", "packed4"])
    p.add_argument("--general", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--dv-split", nargs="+", default=["off", "on"], choices=["on", "off"])
    p.add_argument("--tiles", nargs="+", default=list(TILES))
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    for tile in args.tiles:
        parse_tile(tile)
    compiled = compile_instead_of_launch()
    try:
        commit = args.commit
        if commit == "unknown":
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
    except OSError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for shape in args.shape:
            for layout in args.layouts:
                for general in args.general:
                    for dv_split in args.dv_split:
                        for tile in args.tiles:
                            base = {"shape": shape, "layout": layout, "general_runs": general, "dv_split": dv_split,
                                    "tile": tile, "triton": triton.__version__, "commit": commit}  # fmt: skip
                            try:
                                row = {"status": "ok", **compile_one(compiled, shape, layout, general == "on", tile,
                                                                     dv_split == "on")}  # fmt: skip
                            except Exception as err:  # one failed compile is a row, not the end of the sweep
                                row = {"status": "error", "reason": f"{type(err).__name__}: {str(err)[:300]}"}
                            writer.writerow({**base, **row})
                            f.flush()
                            print(" ".join(f"{k}={v}" for k, v in {**base, **row}.items()
                                           if k not in ("triton", "commit")), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
