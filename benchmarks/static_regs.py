"""Registers and spills of the dense kernel's variants for sm_90, compiled on any machine (no GPU needed).

    python benchmarks/static_regs.py OUT.csv [--layers enformer borzoi] [--variants plain keys]
                                             [--tiles 64x64x4x1 32x64x4x2 ...]

Each (layer, variant, tile) goes through the launcher ``kvbound.kernels.attention_dense.attention_dense_fwd`` with
CPU tensors of the layer's shape (bf16, 8 heads, dk 64, dv 192; Enformer N = 1536 at batch 8, Borzoi N = 4096 at
batch 4) and the tile pinned, but instead of launching, Triton's ``JITFunction.run`` compiles the kernel for
``GPUTarget("cuda", 90, 32)`` as it would for that launch on an H200 (the same binder, specialisation and
constexprs; the launcher is told that the device has tensor descriptors, as a Hopper GPU has, so that K and V are
read through them as there: ``use_tma``; ``dv_parts``: the value columns' parts ``DV_PAD+DV_HI`` it compiled, as
``kvbound.kernels.attention_dense.dv_parts`` and ``KVBOUND_DV_SPLIT`` chose them). Triton's own ``cuobjdump``
then reads the cubin: registers per thread,
stack bytes (spilled registers live there), the shared memory Triton allocates per program (``shared_bytes``; with
the registers it sets how many programs fit on one SM; a tile above the 227 KB a program may use is an error row,
since it cannot launch) and what ptxas reserves (``shared_static_bytes``), and in the SASS the instruction count
(the trailing padding included) and the local loads / stores (``LDL`` / ``STL``: spill traffic; a static count: code
outside the key loop counts once, and Nsight Compute may measure no reload where the SASS holds some) and ``HGMMA``
(Hopper tensor-core) instructions (none: the tile fell back to ``mma.sync``). Variants: ``plain`` (no relative
term), ``keys`` (the relative keys, Enformer's path), ``runs`` (one relative key per run of equal keys, Borzoi's
path: 31 runs, at most 16 per tile, unrolled). Register allocation depends on the Triton version: the GPU machine
runs Triton 3.6.0, so read the ``triton`` column before comparing with measured runs
(``benchmarks/relative_ncu.py``; at 3.6.0 the registers of the tiles both measured agree)."""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    # Compiled for the GPU, not interpreted, whatever the environment says: decided when triton.jit wraps kvbound's
    # kernels.
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

from kvbound.kernels.attention_dense import attention_dense_fwd  # noqa: E402

LAYERS = {"enformer": (1536, 8), "borzoi": (4096, 4)}
VARIANTS = ("plain", "keys", "runs")
# Borzoi's runs of equal relative keys at N = 4096 (31) and the most runs one tile spans (the kernel's unrolling)
RUNS, RUN_SPAN = 31, 16
TILES = ("64x64x4x1", "64x64x4x2", "64x64x8x3")
FIELDS = ["layer", "N", "B", "variant", "tile", "status", "use_tma", "dv_parts", "registers", "stack_bytes",
          "shared_bytes", "shared_static_bytes", "sass_instructions", "ldl", "stl", "hgmma", "reason", "triton",
          "commit"]  # fmt: skip
TARGET_ARCH = 90
# Shared memory a program may use on an sm_90 SM (227 KB); Triton only checks it when a kernel is loaded.
SHARED_LIMIT = 232448


def compile_instead_of_launch():
    """Replace ``JITFunction.run``: every launch compiles for sm_90 and returns the compiled kernel (appended to the
    returned list) without running it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", TARGET_ARCH, 32)
    compiled = []

    from triton import knobs

    def run(self, *args, grid, warmup, **kwargs):
        # As JITFunction.run sets them before binding (Triton 3.6 and 3.9).
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        backend = make_backend(target)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        kernel = triton_compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
        named = {self.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        compiled.append((kernel, named))
        return kernel

    JITFunction.run = run
    # The launchers read K/V through tensor descriptors on Hopper (USE_TMA), which they ask the device about; the
    # target here is sm_90, so answer as a Hopper device would (the alignment checks still apply).
    from kvbound.kernels import _common

    _common._has_tensor_descriptors = lambda device: True
    return compiled


def cubin_usage(cubin: bytes) -> dict:
    """``cuobjdump -res-usage`` and ``-sass`` of one cubin: registers, stack, ptxas's shared memory, SASS counts."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    if found is None:
        raise ValueError(f"cuobjdump -res-usage: no REG/STACK/SHARED line in {usage[-300:]!r}")
    instructions = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s", line)]
    return {
        "registers": int(found.group(1)),
        "stack_bytes": int(found.group(2)),
        "shared_static_bytes": int(found.group(3)),
        "sass_instructions": len(instructions),
        "ldl": sum(bool(re.search(r"\bLDL\b", line)) for line in instructions),
        "stl": sum(bool(re.search(r"\bSTL\b", line)) for line in instructions),
        "hgmma": sum(bool(re.search(r"\bHGMMA\b", line)) for line in instructions),
    }


def parse_tile(text: str) -> dict:
    parts = text.split("x")
    if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"tile: expected BMxBNxWARPSxSTAGES (e.g. 64x64x4x1), got {text!r}")
    return dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), map(int, parts), strict=True))


def compile_one(compiled: list, layer: str, variant: str, tile: str) -> dict:
    """Compile one variant at one pinned tile and read its cubin."""
    n, batch = LAYERS[layer]
    heads, dk, dv = 8, 64, 192
    q = torch.zeros(batch, heads, n, dk, dtype=torch.bfloat16)
    k = torch.zeros(batch, heads, n, dk, dtype=torch.bfloat16)
    v = torch.zeros(batch, heads, n, dv, dtype=torch.bfloat16)
    relative = runs = None
    if variant == "keys":
        keys = torch.zeros(heads, 2 * n - 1, dk, dtype=torch.bfloat16)
        relative = (keys, torch.zeros(heads, dk), torch.zeros(heads, dk))
    elif variant == "runs":  # the launcher's arguments as kvbound.attention builds them (values do not matter here)
        run_keys = torch.zeros(heads, RUNS, dk, dtype=torch.bfloat16)  # the kernel writes its table of run logits
        layout = torch.zeros(RUNS + 1 + 2 * n - 1, dtype=torch.int32)
        runs = (run_keys, layout, torch.zeros(heads, dk), torch.zeros(heads, dk))
    compiled.clear()
    attention_dense_fwd(q, k, v, None, dk**-0.5, False, None, config=parse_tile(tile), relative=relative,
                        relative_runs=runs, run_span=RUN_SPAN if runs is not None else 0)  # fmt: skip
    if len(compiled) != 1:
        raise RuntimeError(f"expected one compiled kernel for this launch, got {len(compiled)}")
    kernel, constexprs = compiled[0]
    row = {**cubin_usage(kernel.asm["cubin"]), "shared_bytes": kernel.metadata.shared,
           "use_tma": int(bool(constexprs.get("USE_TMA"))),
           "dv_parts": f"{constexprs.get('DV_PAD')}+{constexprs.get('DV_HI', 0)}"}  # fmt: skip
    if row["shared_bytes"] > SHARED_LIMIT:
        row.update(status="error", reason=f"needs {row['shared_bytes']} bytes of shared memory per program; an sm_90 "
                                          f"SM gives a program at most {SHARED_LIMIT}: it cannot launch")  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--tiles", nargs="+", default=list(TILES))
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    for tile in args.tiles:
        try:
            parse_tile(tile)
        except ValueError as error:
            p.error(f"--tiles: {error}")
    compiled = compile_instead_of_launch()
    rows = []
    for layer in args.layers:
        for variant in args.variants:
            for tile in args.tiles:
                n, batch = LAYERS[layer]
                row = {"layer": layer, "N": n, "B": batch, "variant": variant, "tile": tile,
                       "triton": triton.__version__, "commit": args.commit}  # fmt: skip
                try:
                    row.update({"status": "ok", **compile_one(compiled, layer, variant, tile)})
                except Exception as error:  # noqa: BLE001 - a row with its reason (a tile that does not compile)
                    row.update(status="error", reason=f"{type(error).__name__}: {error}"[:300].replace("\n", " "))
                print(" ".join(f"{k}={row.get(k, '')}" for k in FIELDS[:17]), flush=True)
                rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in FIELDS} for row in rows)
    print(f"{len(rows)} rows written to {args.out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
