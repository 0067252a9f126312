# Device command (one call to the device machine, about 5 + 3 minutes; the second part reuses the first part's
# compiled kernels from Triton's disk cache):
# PYTHONPATH=src python3 benchmarks/residual_diag.py $OUT/residual_diag.csv && PYTHONPATH=src python3 benchmarks/residual_diag.py --ncu $OUT/residual_ncu.csv  # noqa: E501
"""Why residual tiles are slow: the compressed kernel on K/V whose block modes and code widths are set exactly.

Device command: the comment above this docstring (timing CSV, then the Nsight Compute CSV).

CPU check of the whole script (Triton's interpreter, tiny shapes, no timing, no cuDNN, no Nsight Compute)::

    python benchmarks/residual_diag.py --cpu-smoke /tmp/residual_diag_smoke.csv

K and V are built directly in the storage format (``kvbound.codec.format``): every block of every head gets the
requested ``(mode, width)``, with random codes over their whole range, random coefficients on an orthonormal rank-8
basis and large steps, so a wrong decode moves the output far beyond the tolerance. K and V share the placement
(the kernel walks super-blocks whose class is the larger of K's and V's). The achieved shares and placement are
read back off the built tensors and the run's counts of runs are recomputed from the modes; any difference from
the request stops the script (``LayoutMismatch``).

Layouts (block 128, rank 8, shared basis; the configured width is 4 bits unless stated):

=====================  ==========================================================================================
``lowrank``            every block low-rank only (the residual-free kernel; the ceiling)
``packed4``            every block packed at 4 bits: uniform loop only, one run per head
``packed8``            every block packed at 8 bits with an 8-bit configuration (4 codes per word): uniform loop
``packed4_contig50``   the first half of each head packed at 4 bits, the rest low-rank: one run of each kind
``packed4_scatter50``  half the blocks packed at 4 bits, at random places: many short runs of both kinds
``packed4_alt50``      every other block packed at 4 bits: the most runs possible (NB/2 of each kind)
``promoted5``          every block promoted to 5 bits (6 codes per word): general loop only
``promoted6``          every block promoted to 6 bits (5 codes per word): general loop only
``raw10``              10 % of the blocks exact (raw), at random places, the rest low-rank: short general runs
=====================  ==========================================================================================

Providers per layout: ``uniform`` / ``general`` (``attention_compressed_fwd`` with ``uniform=True`` / ``False``,
one pinned tile per head dim and variant), ``public`` (``kvbound.attention``, same tile: the difference is the
host path), ``dense`` (kvbound's dense kernel on the decompressed K/V) and ``cudnn`` (SDPA's cuDNN backend on
them). Every output is compared with ``reference_attention`` (float64) on the first 128 query rows.

What each hypothesis predicts, and the rows that decide it (d = 64 and 128, N = 16384 unless stated):

H1 fragmentation (each run entry pays a pipeline prologue): ``packed4_scatter50`` and ``packed4_alt50`` are much
   slower than ``packed4_contig50`` (same tiles, 1 run of each kind per head against ~NB/4 and NB/2), and
   ``packed4_contig50`` is near the mean of ``lowrank`` and ``packed4``. Refuted if scatter/alt are within ~10 %
   of contig. The same at N = 65536 (``packed4_scatter50`` against ``packed4``/``lowrank``).
H2 the uniform loop is slow per tile: ``packed4`` (uniform, one run per head) far above ``dense`` and above the
   1.3-1.6x of a dense tile that its SASS predicts; worse at d = 128 than at 64 in proportion (spills); in
   ``--ncu``: local-memory bytes, registers, achieved occupancy and the top stall reasons of the uniform kernel
   against the residual-free one. Refuted if ``packed4`` uniform is within ~1.6x of ``dense``.
H3 the general loop dominates real data: ``promoted5`` / ``promoted6`` (and ``uniform=False`` on ``packed4``)
   several times ``packed4`` uniform; ``raw10`` far above ``lowrank`` although 90 % of its blocks are low-rank.
   Refuted if promoted5 is within ~1.3x of packed4 uniform.
H4 the 8-bit width costs more than 4 bits in the uniform loop: ``packed8`` uniform against ``packed4`` uniform
   (twice the code bytes, half the unpacking levels). Refuted if within ~10 %.

Defaults keep the GPU run under about 5 minutes: the distinct kernels are compiled first by child processes in
parallel (Triton's disk cache then serves the measuring process), one tile per kernel, and measurements stop
once ``--budget-s`` is spent (the rest are written with status ``skipped_budget``). ``--ncu`` re-runs a small
subset, one child process per layout, under ``ncu --clock-control none`` and writes a second CSV.

``--ncu`` subset (about 3 minutes): layouts ``lowrank``, ``packed4``, ``packed4_scatter50``, ``promoted5`` at d = 64
and 128, N = 16384; providers ``uniform``, ``general`` (not for ``lowrank``: the same kernel), ``dense`` and
``cudnn`` (once each). Sections SpeedOfLight, Occupancy, LaunchStats, WarpStateStats, MemoryWorkloadAnalysis,
SchedulerStats (issue-slot utilisation), ComputeWorkloadAnalysis (tensor-pipe utilisation), InstructionStats
(``kvbound.bench.ncu.SECTIONS``) plus explicit metrics (duration, achieved/theoretical occupancy, registers per
thread, local load/store sectors x 32 bytes, DRAM read/write bytes, L2 bytes, instructions); if this Nsight Compute
rejects a metric name the layout is profiled again with the sections only (column ``ncu_metrics``). The five largest
stall reasons per kernel are ``stall_1`` .. ``stall_5`` (warps per issue-active cycle). Every metric of every
profiled kernel is also written next to the CSV as ``<out stem>_raw_<layout>.csv`` (Nsight Compute's raw page).

CSV columns (timing): layout, dtype, d, N, H, provider, tile, ms_p20/50/80 (``triton.testing.do_bench``),
runs_lowrank/uniform/general (``block_runs`` summed over heads, checked against a recount from the modes),
err (max abs against float64 on 128 query rows), plain_err (plain attention in the same dtype), status (ok,
check_failed, runs_mismatch, error, skipped_budget), reason, shares (achieved, per mode and width).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and "--cpu-smoke" in sys.argv:
    # The kernels run in Triton's interpreter: decided when kvbound's kernels are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

import kvbound  # noqa: E402
from kvbound import CompressionConfig, reference_attention  # noqa: E402
from kvbound.bench import data as bench_data  # noqa: E402
from kvbound.bench import ncu as ncu_tools  # noqa: E402
from kvbound.codec.eager import _pack  # noqa: E402
from kvbound.codec.format import (  # noqa: E402
    MODE_LOWRANK,
    MODE_PACKED,
    MODE_PROMOTED,
    MODE_RAW,
    CompressedKV,
    words_per_row,
)
from kvbound.kernels import attention_compressed as compressed_kernels  # noqa: E402
from kvbound.kernels.attention_compressed import (  # noqa: E402
    CompressedOperand,
    attention_compressed_fwd,
    block_runs,
    byte_planes,
    uniform_width,
)
from kvbound.kernels.attention_dense import attention_dense_fwd  # noqa: E402

SCRIPT = Path(__file__).resolve()
NVTX_PREFIX = "residual_diag:"
RANK = 8
BLOCK_SIZE = 128
HEADS = 8
ROWS_CHECKED = 128
# Error floor added to twice plain attention's error (as the kernel tests do).
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3}
PROVIDERS = ("uniform", "general", "public", "dense", "cudnn")
LONG_N = 65536
LONG_LAYOUTS = ("packed4", "packed4_scatter50")
FLOAT32_LAYOUT = "packed4_scatter50"
NCU_LAYOUTS = ("lowrank", "packed4", "packed4_scatter50", "promoted5")
NCU_PROVIDERS = ("uniform", "general", "dense", "cudnn")

# Pinned tiles (BLOCK_M, BLOCK_N, warps, stages): the H200 winners of kernels/README.md. Compressed kernels with
# residual code at d = 128 take 128 x 64 on 8 warps (64 x 64 on 8 warps spills least but miscompiles with
# uniform runs, which the launcher then turns off); the dense kernel 128 x 64.
COMPRESSED_TILES = {
    (64, False): (64, 64, 4, 3),
    (64, True): (64, 64, 4, 3),
    (128, False): (64, 64, 4, 3),
    (128, True): (128, 64, 8, 3),
}
DENSE_TILES = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
INTERPRETER_TILE = (32, 16, 4, 1)


# ------------------------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """Which blocks of each head carry ``residual = (mode, width)``; the others are ``MODE_LOWRANK``.

    ``placement``: ``all``, ``contiguous`` (the first blocks), ``scattered`` (random, a different draw per head)
    or ``alternating`` (every ``round(1 / share)``-th block from block 0). ``config_bits``: the configuration's
    code width (the width the uniform loop decodes)."""

    name: str
    residual: tuple[int, int]
    share: float
    placement: str
    config_bits: int = 4
    description: str = ""

    def residual_count(self, num_blocks: int) -> int:
        """Blocks per head that carry the residual: the share rounded, at least one when the share is not 0."""
        if self.residual[0] == MODE_LOWRANK:
            return 0
        if self.placement == "all":
            return num_blocks
        return max(1, round(self.share * num_blocks))

    def expected_counts(self, num_blocks: int) -> dict[tuple[int, int], int]:
        """Blocks per head of each ``(mode, width)``, from the request alone."""
        count = self.residual_count(num_blocks)
        counts = {(MODE_LOWRANK, 0): num_blocks - count}
        if count:
            counts[self.residual] = count
        return {key: c for key, c in counts.items() if c > 0}


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("lowrank", (MODE_LOWRANK, 0), 0.0, "all", description="no residual (the ceiling)"),
        Layout("packed4", (MODE_PACKED, 4), 1.0, "all", description="uniform loop, one run per head"),
        Layout("packed8", (MODE_PACKED, 8), 1.0, "all", config_bits=8, description="uniform loop at 8 bits"),
        Layout("packed4_contig50", (MODE_PACKED, 4), 0.5, "contiguous", description="1 run of each kind"),
        Layout("packed4_scatter50", (MODE_PACKED, 4), 0.5, "scattered", description="~NB/4 runs of each kind"),
        Layout("packed4_alt50", (MODE_PACKED, 4), 0.5, "alternating", description="NB/2 runs of each kind"),
        Layout("promoted5", (MODE_PROMOTED, 5), 1.0, "all", description="general loop, 6 codes per word"),
        Layout("promoted6", (MODE_PROMOTED, 6), 1.0, "all", description="general loop, 5 codes per word"),
        Layout("raw10", (MODE_RAW, 0), 0.1, "scattered", description="short general runs of exact blocks"),
    )
}


class LayoutMismatch(RuntimeError):
    """The built K/V do not hold the requested modes, widths or placement."""


def _residual_mask(layout: Layout, heads: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Bool [heads, num_blocks]: the blocks that carry the layout's residual."""
    count = layout.residual_count(num_blocks)
    blocks = torch.arange(num_blocks)
    if count == 0:
        row = torch.zeros(num_blocks, dtype=torch.bool)
    elif layout.placement == "all":
        row = torch.ones(num_blocks, dtype=torch.bool)
    elif layout.placement == "contiguous":
        row = blocks < count
    elif layout.placement == "alternating":
        row = blocks % round(1 / layout.share) == 0
    elif layout.placement == "scattered":
        g = torch.Generator().manual_seed(seed)
        return torch.rand(heads, num_blocks, generator=g).argsort(dim=-1).argsort(dim=-1) < count
    else:
        raise ValueError(f"layout.placement: expected all/contiguous/scattered/alternating, got {layout.placement!r}")
    return row.expand(heads, num_blocks).clone()


def build_compressed(
    layout: Layout,
    *,
    heads: int,
    seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    basis: torch.Tensor,
    value_seed: int,
    placement_seed: int = 0,
    block_size: int = BLOCK_SIZE,
    rank: int = RANK,
) -> CompressedKV:
    """A ``CompressedKV`` [1, heads, seq_len, head_dim] with exactly the layout's modes and widths.

    ``basis`` [heads, rank, head_dim] (orthonormal rows). Coefficients have unit-variance elements after the
    projection; codes are uniform over their range with step ``0.5 / 2**(width - 1)``; raw blocks are standard
    normal values (their coefficients are zero, as the format requires). Blocks are stored in (head, block)
    order, as the encoders store them."""
    if seq_len % block_size:
        raise ValueError(f"seq_len: expected a multiple of the block size {block_size}, got {seq_len}")
    device = torch.device(device)
    nb = seq_len // block_size
    g = torch.Generator(device="cpu").manual_seed(value_seed)
    mode_value, width = layout.residual
    mask = _residual_mask(layout, heads, nb, placement_seed)
    count = int(mask.sum())

    coeffs = torch.randn(1, heads, seq_len, rank, generator=g) * math.sqrt(head_dim / rank)
    mode = torch.where(mask, mode_value, MODE_LOWRANK).to(torch.int8)[None]
    bits = torch.zeros(1, heads, nb, dtype=torch.int8)
    scale = torch.zeros(1, heads, nb, dtype=torch.float32)
    offset = torch.full((1, heads, nb), -1, dtype=torch.int64)
    codes = torch.zeros(0, dtype=torch.int32)
    raw = torch.zeros(0, dtype=dtype)
    if mode_value in (MODE_PACKED, MODE_PROMOTED) and count:
        wpr = words_per_row(width, head_dim)
        q = torch.randint(-(1 << (width - 1)), 1 << (width - 1), (count, block_size, head_dim), generator=g)
        codes = _pack(q.to(device), width).reshape(-1)
        bits[0][mask] = width
        scale[0][mask] = 0.5 / (1 << (width - 1))
        offset[0][mask] = torch.arange(count, dtype=torch.int64) * (block_size * wpr)
    elif mode_value == MODE_RAW and count:
        raw = torch.randn(count, block_size, head_dim, generator=g).to(dtype).reshape(-1)
        offset[0][mask] = torch.arange(count, dtype=torch.int64) * (block_size * head_dim)
        keep = (~mask).repeat_interleave(block_size, dim=1)  # [heads, seq_len]
        coeffs = coeffs * keep[None, :, :, None]
    return CompressedKV(
        shape=(1, heads, seq_len, head_dim),
        dtype=dtype,
        config=CompressionConfig(block_size=block_size, rank=rank, bits=layout.config_bits),
        coeffs=coeffs.to(device=device, dtype=torch.float16),
        basis=basis.to(device=device, dtype=torch.float16),
        mode=mode.to(device),
        scale=scale.to(device),
        bits=bits.to(device),
        offset=offset.to(device),
        codes=codes.to(device),
        raw=raw.to(device),
        shared_basis=True,
    )


def achieved_shares(ckv: CompressedKV) -> dict[str, float]:
    """Share of blocks per ``mode/width`` as stored, e.g. ``{"lowrank": 0.5, "packed4": 0.5}``."""
    names = {MODE_LOWRANK: "lowrank", MODE_PACKED: "packed", MODE_PROMOTED: "promoted", MODE_RAW: "raw"}
    mode = ckv.mode.reshape(-1).long().cpu()
    bits = ckv.bits.reshape(-1).long().cpu()
    total = mode.numel()
    out: dict[str, float] = {}
    for m, b in sorted(set(zip(mode.tolist(), bits.tolist(), strict=True))):
        key = names[m] + (str(b) if m in (MODE_PACKED, MODE_PROMOTED) else "")
        out[key] = int(((mode == m) & (bits == b)).sum()) / total
    return out


def verify_layout(ckv: CompressedKV, layout: Layout, name: str = "ckv") -> dict[str, float]:
    """Raise ``LayoutMismatch`` unless ``ckv`` holds exactly what ``layout`` requests: per head the requested
    number of blocks of each ``(mode, width)``, widths 0 outside packed modes, offsets -1 exactly on low-rank
    blocks, the configured width, and the placement (contiguous: the first blocks; alternating: every k-th).
    Returns the achieved shares."""
    _, heads, _, _ = ckv.shape
    nb = ckv.num_blocks
    mode = ckv.mode.reshape(heads, nb).long().cpu()
    bits = ckv.bits.reshape(heads, nb).long().cpu()
    offset = ckv.offset.reshape(heads, nb).cpu()
    problems = []
    if ckv.config.bits != layout.config_bits:
        problems.append(f"config.bits {ckv.config.bits} (expected {layout.config_bits})")
    expected = layout.expected_counts(nb)
    for h in range(heads):
        got: dict[tuple[int, int], int] = {}
        for m, b in zip(mode[h].tolist(), bits[h].tolist(), strict=True):
            got[(m, b)] = got.get((m, b), 0) + 1
        if got != expected:
            problems.append(
                f"head {h}: blocks per (mode, width) {sorted(got.items())}, expected {sorted(expected.items())}"
            )
            break
    packed = (mode == MODE_PACKED) | (mode == MODE_PROMOTED)
    if bool((bits[~packed] != 0).any()):
        problems.append("nonzero width on a block that is not packed")
    if bool(((offset < 0) != (mode == MODE_LOWRANK)).any()):
        problems.append("offset -1 not exactly on the low-rank blocks")
    residual = mode != MODE_LOWRANK if layout.residual[0] != MODE_LOWRANK else torch.zeros_like(packed)
    blocks = torch.arange(nb)
    if layout.placement == "contiguous":
        want = blocks < layout.residual_count(nb)
        if not bool((residual == want).all()):
            problems.append("contiguous placement: residual blocks are not the first blocks of each head")
    elif layout.placement == "alternating":
        want = blocks % round(1 / layout.share) == 0
        if not bool((residual == want).all()):
            problems.append("alternating placement: residual blocks are not every other block")
    if problems:
        raise LayoutMismatch(f"{name}: layout {layout.name!r} not achieved: " + "; ".join(problems))
    return achieved_shares(ckv)


def expected_runs(ck: CompressedKV, cv: CompressedKV, fast_bits: tuple[int, int] | None) -> list[int]:
    """Runs of each kind summed over heads, recomputed in Python from the modes (block size = super-block):
    ``[low-rank, uniform, general]`` with ``fast_bits``, ``[low-rank, 0, residual]`` without."""
    _, heads, _, _ = ck.shape
    nb = ck.num_blocks

    def classes(ckv, fast):
        mode = ckv.mode.reshape(heads, nb).long().cpu()
        bits = ckv.bits.reshape(heads, nb).long().cpu()
        if fast is None:
            return (mode != MODE_LOWRANK).long() * 2
        uniform = ((mode == MODE_PACKED) | (mode == MODE_PROMOTED)) & (bits == fast)
        return torch.where(mode == MODE_LOWRANK, 0, torch.where(uniform, 1, 2))

    flag = torch.maximum(
        classes(ck, None if fast_bits is None else fast_bits[0]),
        classes(cv, None if fast_bits is None else fast_bits[1]),
    )
    starts = torch.ones_like(flag, dtype=torch.bool)
    starts[:, 1:] = flag[:, 1:] != flag[:, :-1]
    return [int((starts & (flag == kind)).sum()) for kind in range(3)]


def kernel_runs(k_op: CompressedOperand, v_op: CompressedOperand, fast_bits: tuple[int, int] | None) -> list[int]:
    """What ``block_runs`` (the launcher's kernel) builds, as ``[low-rank, uniform, general]`` over all heads."""
    align = (1, 1)
    if fast_bits is not None:
        # As the launcher: blocks read by the byte decode must start on a 16-byte boundary.
        align = tuple(4 if byte_planes(w, op.head_dim) else 1 for w, op in zip(fast_bits, (k_op, v_op), strict=True))
    _, counts = block_runs(k_op, v_op, max(k_op.block_size, v_op.block_size), fast_bits, align)
    kinds = counts.sum(0).tolist()
    return kinds if fast_bits is not None else [kinds[0], 0, kinds[1]]


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class Settings:
    out: Path
    smoke: bool
    device: torch.device
    heads: int
    block_size: int
    dims: list[int]
    lengths: list[int]
    long_layouts: list[str]
    layouts: list[str]
    providers: list[str]
    dtypes: list[torch.dtype]
    budget_s: float
    pin_public: bool
    warm_only: bool = False
    ncu_child: bool = False


def _names(text: str, allowed, what: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"--{what}: unknown {bad}; expected names from {sorted(allowed)}")
    return items


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="CSV to write (with --ncu: the Nsight Compute CSV)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Triton's interpreter, no timing")
    p.add_argument("--ncu", action="store_true", help="profile a subset under Nsight Compute instead of timing")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--dims", default="64,128")
    p.add_argument("--lengths", default="16384")
    p.add_argument("--long-layouts", default=",".join(LONG_LAYOUTS), help=f"layouts also run at N={LONG_N}")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--ncu-layouts", default=",".join(NCU_LAYOUTS), help="with --ncu: one child process each")
    p.add_argument("--ncu-path", default="ncu")
    p.add_argument("--budget-s", type=float, default=270.0, help="stop measuring after this many seconds")
    p.add_argument("--autotune-public", action="store_true", help="let kvbound.attention autotune (slow)")
    p.add_argument("--no-warm", action="store_true", help="compile in the measuring process only")
    p.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    smoke = args.cpu_smoke
    layouts = _names(args.layouts, LAYOUTS, "layouts")
    providers = _names(args.providers, PROVIDERS, "providers")
    if smoke:
        providers = [p for p in providers if p != "cudnn"]
    return Settings(
        out=args.out,
        smoke=smoke,
        device=torch.device("cpu" if smoke else "cuda"),
        heads=2 if smoke else HEADS,
        block_size=16 if smoke else BLOCK_SIZE,
        dims=[32] if smoke else [int(x) for x in args.dims.split(",") if x],
        lengths=[64] if smoke else [int(x) for x in args.lengths.split(",") if x],
        long_layouts=[] if smoke else _names(args.long_layouts, LAYOUTS, "long-layouts"),
        layouts=layouts,
        providers=providers,
        dtypes=[torch.float16, torch.float32] if smoke else [torch.bfloat16],
        budget_s=args.budget_s,
        pin_public=not args.autotune_public,
        warm_only=args.warm_child,
        ncu_child=args.ncu_child,
    )


@dataclass(frozen=True)
class Case:
    layout: str
    d: int
    n: int
    dtype: torch.dtype


def plan(s: Settings) -> list[Case]:
    """Most telling first (the budget cuts from the end): every layout at the first length per head dim, then the
    long layouts. In the CPU smoke float32 runs one layout (float32 operands through the uniform, general and
    residual-free loops)."""
    cases = []
    for dtype in s.dtypes:
        layouts = s.layouts if dtype != torch.float32 else [x for x in s.layouts if x == FLOAT32_LAYOUT]
        for d in s.dims:
            for n in s.lengths:
                cases += [Case(name, d, n, dtype) for name in layouts]
    for d in s.dims:
        cases += [Case(name, d, LONG_N, s.dtypes[0]) for name in s.long_layouts if LONG_N not in s.lengths]
    return cases


# ------------------------------------------------------------------------------------------------ inputs
@dataclass
class Inputs:
    q: torch.Tensor
    ck: CompressedKV
    cv: CompressedKV
    k_op: CompressedOperand
    v_op: CompressedOperand
    k_dense: torch.Tensor
    v_dense: torch.Tensor
    scale: float
    shares: dict[str, float]
    reference: torch.Tensor
    plain_err: float


def make_inputs(case: Case, s: Settings) -> Inputs:
    layout = LAYOUTS[case.layout]
    dev = s.device
    k_sub = bench_data.kv_subspace(s.heads, case.d, rank=RANK, seed=1, device=dev)
    v_sub = bench_data.kv_subspace(s.heads, case.d, rank=RANK, seed=2, device=dev)
    common = dict(
        heads=s.heads,
        seq_len=case.n,
        head_dim=case.d,
        dtype=case.dtype,
        device=dev,
        placement_seed=case.d * 7 + case.n,
        block_size=s.block_size,
    )
    ck = build_compressed(layout, basis=k_sub, value_seed=11, **common)
    cv = build_compressed(layout, basis=v_sub, value_seed=12, **common)
    shares = verify_layout(ck, layout, "k")
    if verify_layout(cv, layout, "v") != shares:
        raise LayoutMismatch(f"v: shares differ from k's for layout {layout.name!r}")
    q = bench_data.structured_queries(1, s.heads, case.n, k_sub, dtype=case.dtype, seed=6)
    scale = case.d**-0.5
    k_dense, v_dense = ck.decompress(), cv.decompress()
    rows = min(ROWS_CHECKED, case.n)
    qs = q[:, :, :rows]
    reference = reference_attention(qs, k_dense, v_dense, scale=scale)
    logits = (qs.float() @ k_dense.to(case.dtype).float().transpose(-1, -2)) * scale
    plain = (torch.softmax(logits, -1).to(case.dtype).float() @ v_dense.to(case.dtype).float()).to(case.dtype)
    plain_err = float((plain.double() - reference).abs().max())
    return Inputs(
        q,
        ck,
        cv,
        CompressedOperand.from_compressed(ck),
        CompressedOperand.from_compressed(cv),
        k_dense.to(case.dtype),
        v_dense.to(case.dtype),
        scale,
        shares,
        reference,
        plain_err,
    )


# --------------------------------------------------------------------------------------------- providers
def _tile(shape: tuple[int, int, int, int]) -> dict:
    m, n, w, st = shape
    return dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)


def compressed_tile(d: int, residual: bool, smoke: bool) -> tuple[int, int, int, int]:
    return INTERPRETER_TILE if smoke else COMPRESSED_TILES[(d if d in (64, 128) else 128, residual)]


def dense_tile(d: int, smoke: bool) -> tuple[int, int, int, int]:
    return INTERPRETER_TILE if smoke else DENSE_TILES[d if d in (64, 128) else 128]


@contextmanager
def pinned_compressed_autotune(shape: tuple[int, int, int, int] | None) -> Iterator[None]:
    """Restrict the compressed kernel's autotune space to one tile, so ``kvbound.attention`` compiles and runs the
    same kernel as the launcher rows (the difference is then the public call's host path)."""
    kernel = compressed_kernels._attention_compressed_fwd
    if shape is None:
        yield
        return
    saved = kernel.configs
    m, n, w, st = shape
    kernel.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)]
    try:
        yield
    finally:
        kernel.configs = saved


def kernel_variant(case: Case, provider: str) -> tuple | None:
    """What decides which compiled kernel a provider runs (None: not ours). Providers with equal variants share
    one compile."""
    layout = LAYOUTS[case.layout]
    residual = layout.residual[0] != MODE_LOWRANK
    if provider == "dense":
        return ("dense", case.d, case.dtype)
    if provider == "cudnn":
        return None
    fast = uniform_width(layout.config_bits, case.d) if residual and provider == "uniform" else 0
    return ("compressed", case.d, case.dtype, residual, fast)


def run_info(case: Case, provider: str, inputs: Inputs) -> tuple[list[int], list[int]] | None:
    """``(kernel's runs, recomputed runs)`` as ``[low-rank, uniform, general]`` for the compressed providers."""
    if provider not in ("uniform", "general", "public"):
        return None
    layout = LAYOUTS[case.layout]
    fast = None
    # kvbound.attention ("public") takes the general loop (attention_compressed_fwd's default).
    if provider == "uniform":
        widths = (uniform_width(layout.config_bits, case.d), uniform_width(layout.config_bits, case.d))
        fast = widths if any(widths) else None
    return kernel_runs(inputs.k_op, inputs.v_op, fast), expected_runs(inputs.ck, inputs.cv, fast)


def make_call(case: Case, provider: str, inputs: Inputs, s: Settings) -> Callable[[], torch.Tensor]:
    layout = LAYOUTS[case.layout]
    residual_flags = [layout.residual[0] != MODE_LOWRANK] * 2
    q, scale = inputs.q, inputs.scale
    if provider in ("uniform", "general"):
        tile = _tile(compressed_tile(case.d, residual_flags[0], s.smoke))
        uniform = provider == "uniform"

        def call():
            return attention_compressed_fwd(
                q,
                inputs.k_op,
                inputs.v_op,
                None,
                scale,
                False,
                None,
                residual=residual_flags,
                config=tile,
                uniform=uniform,
            )[0]
    elif provider == "public":

        def call():
            return kvbound.attention(q, inputs.ck, inputs.cv, scale=scale)
    elif provider == "dense":
        tile = _tile(dense_tile(case.d, s.smoke))

        def call():
            return attention_dense_fwd(q, inputs.k_dense, inputs.v_dense, None, scale, False, None, config=tile)[0]
    elif provider == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, inputs.k_dense, inputs.v_dense, scale=scale)
    else:
        raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")
    return call


def check_output(out: torch.Tensor, inputs: Inputs, dtype: torch.dtype) -> tuple[float, bool]:
    """Max |out - reference| on the checked rows, and whether it passes (finite and within twice plain attention's
    error in the same dtype plus a floor)."""
    rows = inputs.reference.shape[2]
    err = float((out[:, :, :rows].double() - inputs.reference).abs().max())
    return err, math.isfinite(err) and err <= 2 * inputs.plain_err + FLOOR[dtype]


# -------------------------------------------------------------------------------------------- measurement
FIELDS = (
    "layout",
    "dtype",
    "d",
    "N",
    "H",
    "provider",
    "tile",
    "ms_p20",
    "ms_p50",
    "ms_p80",
    "runs_lowrank",
    "runs_uniform",
    "runs_general",
    "err",
    "plain_err",
    "status",
    "reason",
    "shares",
    "first_call_s",
    "measurement_id",
)


def _fmt_shares(shares: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(shares.items()))


def _sync(s: Settings) -> None:
    if not s.smoke:
        torch.cuda.synchronize()


class Log:
    def __init__(self) -> None:
        self.t0 = time.time()

    def elapsed(self) -> float:
        return time.time() - self.t0

    def __call__(self, *parts) -> None:
        print(f"[{self.elapsed():6.1f}s]", *parts, flush=True)


def measure(s: Settings, log: Log) -> list[dict]:
    cases = plan(s)
    rows: list[dict] = []
    total = len(cases) * len(s.providers)
    done = 0
    for case in cases:
        base = dict(layout=case.layout, dtype=str(case.dtype).removeprefix("torch."), d=case.d, N=case.n, H=s.heads)
        if log.elapsed() > s.budget_s:
            for provider in s.providers:
                rows.append(dict(base, provider=provider, status="skipped_budget", reason=f"after {s.budget_s:.0f} s"))
            done += len(s.providers)
            continue
        inputs = make_inputs(case, s)  # a LayoutMismatch stops the script here
        residual = LAYOUTS[case.layout].residual[0] != MODE_LOWRANK
        pin = compressed_tile(case.d, residual, s.smoke) if s.pin_public else None
        for provider in s.providers:
            done += 1
            mid = f"{case.layout}:{case.d}:{case.n}:{provider}"
            row = dict(base, provider=provider, shares=_fmt_shares(inputs.shares), measurement_id=mid)
            if provider in ("uniform", "general") or (provider == "public" and pin is not None):
                row["tile"] = "x".join(map(str, compressed_tile(case.d, residual, s.smoke)))
            elif provider == "dense":
                row["tile"] = "x".join(map(str, dense_tile(case.d, s.smoke)))
            if log.elapsed() > s.budget_s and not s.warm_only:
                rows.append(dict(row, status="skipped_budget", reason=f"after {s.budget_s:.0f} s"))
                continue
            runs = run_info(case, provider, inputs)
            if runs is not None:
                row.update(runs_lowrank=runs[0][0], runs_uniform=runs[0][1], runs_general=runs[0][2])
            try:
                with pinned_compressed_autotune(pin):
                    call = make_call(case, provider, inputs, s)
                    t0 = time.time()
                    out = call()
                    _sync(s)
                    row["first_call_s"] = round(time.time() - t0, 2)
                    if s.warm_only:
                        rows.append(dict(row, status="warm"))
                        continue
                    err, ok = check_output(out, inputs, case.dtype)
                    row.update(err=err, plain_err=inputs.plain_err, status="ok" if ok else "check_failed")
                    if not ok:
                        row["reason"] = f"max error {err:.3e} > 2 x plain {inputs.plain_err:.3e} + floor"
                    if runs is not None and runs[0] != runs[1]:
                        row.update(status="runs_mismatch", reason=f"block_runs {runs[0]} != recomputed {runs[1]}")
                    if s.ncu_child:
                        torch.cuda.nvtx.range_push(NVTX_PREFIX + mid)
                        call()
                        torch.cuda.synchronize()
                        torch.cuda.nvtx.range_pop()
                    elif not s.smoke:
                        p20, p50, p80 = triton.testing.do_bench(call, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
                        row.update(ms_p20=p20, ms_p50=p50, ms_p80=p80)
            except Exception as exc:  # noqa: BLE001 (one failing provider must not lose the other rows)
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
            log(
                f"{done}/{total} {case.layout} d={case.d} N={case.n} {row['dtype']} {provider}: "
                f"{row.get('ms_p50', float('nan')):.3f} ms err {row.get('err', float('nan')):.2e} "
                f"runs {[row.get('runs_lowrank'), row.get('runs_uniform'), row.get('runs_general')]} {row['status']}"
                + (f" ({row['reason']})" if row.get("reason") else "")
            )
        del inputs
    return rows


def write_csv(path: Path, rows: list[dict], fields: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = [k for r in rows for k in r if k not in fields]
    names = list(fields) + list(dict.fromkeys(extra))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------- warm compile
def warm_jobs(s: Settings) -> list[tuple[Case, str]]:
    """One ``(case, provider)`` per distinct compiled kernel of the plan (the first that needs it)."""
    seen, jobs = set(), []
    for case in plan(s):
        for provider in s.providers:
            variant = kernel_variant(case, provider)
            if variant is not None and variant not in seen:
                seen.add(variant)
                jobs.append((case, "uniform" if provider == "public" else provider))
    return jobs


def warm_compile(s: Settings, log: Log, timeout_s: float = 420.0) -> None:
    """Compile every distinct kernel in parallel child processes (ptxas dominates and runs outside Python);
    the measuring process then loads them from Triton's disk cache."""
    jobs = warm_jobs(s)
    log(f"compiling {len(jobs)} kernels in parallel child processes")
    procs = []
    with tempfile.TemporaryDirectory(prefix="residual-diag-warm-") as tmp:
        for i, (case, provider) in enumerate(jobs):
            cmd = [
                sys.executable,
                str(SCRIPT),
                str(Path(tmp) / f"warm{i}.csv"),
                "--warm-child",
                "--layouts",
                case.layout,
                "--dims",
                str(case.d),
                "--lengths",
                str(case.n),
                "--long-layouts",
                "",
                "--providers",
                provider,
            ]
            procs.append(
                (case, provider, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            )
        deadline = time.time() + timeout_s
        for case, provider, proc in procs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            if proc.returncode != 0:
                log(f"warm {case.layout} d={case.d} {provider}: exit {proc.returncode}: {output.strip()[-400:]}")
    log("compiled")


# --------------------------------------------------------------------------------------------- reporting
def print_report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="residual tiles: ms p50 (status marks: ! check failed or error, - skipped)")
    for col in ("layout", "d", "N", "runs L/U/G", "uniform", "general", "public", "dense", "cudnn", "max err"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["layout"], r["d"], r["N"], r["dtype"]), {})[r["provider"]] = r
    for (layout, d, n, _), by in groups.items():

        def cell(p, by=by):
            r = by.get(p)
            if r is None:
                return ""
            if r.get("status") == "skipped_budget":
                return "-"
            ms = r.get("ms_p50")
            text = f"{ms:.3f}" if isinstance(ms, float) else r.get("status", "")
            return text if r.get("status") in ("ok", "warm") else f"[red]{text} ![/red]"

        runs = by.get("uniform") or by.get("public") or {}
        errs = [r["err"] for r in by.values() if isinstance(r.get("err"), float)]
        table.add_row(
            layout,
            str(d),
            str(n),
            f"{runs.get('runs_lowrank', '')}/{runs.get('runs_uniform', '')}/{runs.get('runs_general', '')}",
            *[cell(p) for p in PROVIDERS],
            f"{max(errs):.1e}" if errs else "",
        )
    console.print(table)
    print_indicators(rows, console)


def _p50(rows, layout, d, n, provider):
    for r in rows:
        if (r["layout"], r["d"], r["N"], r["provider"]) == (layout, d, n, provider) and r.get("status") == "ok":
            return r.get("ms_p50")
    return None


def indicators(rows: list[dict]) -> list[tuple[str, int, int, str, float | None]]:
    """Ratios that decide H1-H4 (module docstring), per (d, N)."""
    out = []
    for d, n in sorted({(r["d"], r["N"]) for r in rows}):

        def ratio(a, pa, b, pb, d=d, n=n):
            x, y = _p50(rows, a, d, n, pa), _p50(rows, b, d, n, pb)
            return None if x is None or y is None or y == 0 else x / y

        low, full = _p50(rows, "lowrank", d, n, "uniform"), _p50(rows, "packed4", d, n, "uniform")
        contig = _p50(rows, "packed4_contig50", d, n, "uniform")
        mean = None if low is None or full is None else (low + full) / 2
        out += [
            (
                "H1 scatter50 / contig50 (uniform)",
                d,
                n,
                "> 1.1: fragmentation",
                ratio("packed4_scatter50", "uniform", "packed4_contig50", "uniform"),
            ),
            (
                "H1 alt50 / contig50 (uniform)",
                d,
                n,
                "> 1.1: fragmentation",
                ratio("packed4_alt50", "uniform", "packed4_contig50", "uniform"),
            ),
            (
                "H1 contig50 / mean(lowrank, packed4)",
                d,
                n,
                "~1: run entry is cheap",
                None if contig is None or not mean else contig / mean,
            ),
            (
                "H1 scatter50 / mean(lowrank, packed4)",
                d,
                n,
                "> 1.1: fragmentation",
                None
                if mean is None or _p50(rows, "packed4_scatter50", d, n, "uniform") is None
                else _p50(rows, "packed4_scatter50", d, n, "uniform") / mean,
            ),
            (
                "H2 packed4 uniform / dense",
                d,
                n,
                "> 1.6: uniform loop slow per tile",
                ratio("packed4", "uniform", "lowrank", "dense"),
            ),
            (
                "H2 packed4 uniform / lowrank",
                d,
                n,
                "cost of residual per tile",
                ratio("packed4", "uniform", "lowrank", "uniform"),
            ),
            (
                "H3 promoted5 / packed4 uniform",
                d,
                n,
                "> 1.3: general loop dominates",
                ratio("promoted5", "uniform", "packed4", "uniform"),
            ),
            (
                "H3 packed4 general / uniform",
                d,
                n,
                "general loop's own cost",
                ratio("packed4", "general", "packed4", "uniform"),
            ),
            ("H3 raw10 / lowrank", d, n, "cost of 10 % exact blocks", ratio("raw10", "uniform", "lowrank", "uniform")),
            (
                "H4 packed8 / packed4 (uniform)",
                d,
                n,
                "> 1.1: 8-bit width costs",
                ratio("packed8", "uniform", "packed4", "uniform"),
            ),
        ]
    return out


def print_indicators(rows: list[dict], console) -> None:
    from rich.table import Table

    table = Table(title="hypothesis indicators (ratios of ms p50)")
    for col in ("indicator", "d", "N", "reading", "ratio"):
        table.add_column(col)
    for name, d, n, reading, value in indicators(rows):
        if value is not None:
            table.add_row(name, str(d), str(n), reading, f"{value:.2f}")
    console.print(table)


# ----------------------------------------------------------------------------------------- Nsight Compute
NCU_SECTIONS = ncu_tools.SECTIONS
# Kernels profiled inside each measurement's NVTX range: kvbound's (``_attention_...``) and cuDNN's SDPA kernel.
NCU_KERNELS = "regex:^_attention_|cudnn|sdpa|fmha|flash"
NCU_METRICS = ncu_tools.DIAGNOSTIC_METRICS
NCU_FIELDS = (
    "layout",
    "d",
    "N",
    "provider",
    "kernel",
    "duration_ms",
    "achieved_occupancy_pct",
    "theoretical_occupancy_pct",
    "registers_per_thread",
    "local_load_bytes",
    "local_store_bytes",
    "dram_read_bytes",
    "dram_write_bytes",
    "l2_bytes",
    "instructions",
    "issue_active_pct",
    "tensor_pipe_pct",
    "tensor_pipe_metric",
    "stall_1",
    "stall_2",
    "stall_3",
    "stall_4",
    "stall_5",
    "runs_lowrank",
    "runs_uniform",
    "runs_general",
    "err",
    "status",
    "reason",
    "ncu_metrics",
)


def ncu_command(ncu: str, report: Path, child: list[str], with_metrics: bool) -> list[str]:
    return ncu_tools.profile_command(
        ncu, report, child, nvtx_prefix=NVTX_PREFIX, kernels=NCU_KERNELS, metrics=NCU_METRICS if with_metrics else ()
    )


def parse_ncu_raw(text: str) -> list[dict]:
    """Rows of ``ncu --import --csv --page raw --print-units base --print-nvtx-rename kernel``: one dict per
    profiled kernel with ``measurement_id``, ``kernel`` and the NCU_FIELDS metrics."""
    out = []
    for measurement, name, row in ncu_tools.raw_kernel_rows(text, NVTX_PREFIX):
        entry = {"measurement_id": measurement, "kernel": name}
        for metric, field in NCU_METRICS.items():
            entry[field] = ncu_tools.metric_value(row.get(metric))
        entry["stalls"] = ncu_tools.stall_reasons(row)
        entry.update(ncu_tools.pipe_utilisation(row))
        out.append(entry)
    return out


def merge_ncu(child_rows: list[dict], profiled: list[dict]) -> list[dict]:
    by_id: dict[str, list[dict]] = {}
    for p in profiled:
        by_id.setdefault(p["measurement_id"], []).append(p)
    merged = []
    for row in child_rows:
        base = {k: row.get(k) for k in NCU_FIELDS if k in row}
        found = by_id.get(row.get("measurement_id") or "", [])
        if not found and row.get("status") == "ok":
            merged.append(dict(base, status="error", reason="no kernel of this measurement was profiled"))
        for p in found:
            entry = dict(base, kernel=p["kernel"].split("/")[-1])
            for field in NCU_METRICS.values():
                entry[field] = p.get(field)
            if p.get("duration_ns") is not None:
                entry["duration_ms"] = p["duration_ns"] / 1e6
            for side in ("load", "store"):
                sectors = p.get(f"local_{side}_sectors")
                entry[f"local_{side}_bytes"] = None if sectors is None else sectors * 32
            for field in ("issue_active_pct", "tensor_pipe_pct", "tensor_pipe_metric"):
                entry[field] = p.get(field)
            for i, (reason, value) in enumerate(p["stalls"], start=1):
                entry[f"stall_{i}"] = f"{reason}={value:.3g}"
            merged.append(entry)
    return merged


def run_ncu(s: Settings, args: argparse.Namespace, log: Log) -> int:
    ncu = ncu_tools.find_ncu(args.ncu_path)
    if ncu is None:
        print(f"residual_diag --ncu: Nsight Compute ({args.ncu_path!r}) not found", file=sys.stderr)
        return 2
    layouts = _names(args.ncu_layouts, LAYOUTS, "ncu-layouts")
    providers = [p for p in NCU_PROVIDERS if p in s.providers]
    sub = Settings(**{**s.__dict__, "layouts": layouts, "providers": providers, "long_layouts": []})
    if not args.no_warm:
        warm_compile(sub, log)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="residual-diag-ncu-") as tmp:
        for i, layout in enumerate(layouts):
            # The residual-free kernel is the same for both loops, and dense does not depend on the layout.
            chosen = [p for p in providers if not (layout == "lowrank" and p == "general")]
            chosen = [p for p in chosen if p not in ("dense", "cudnn") or i == 0]
            child_csv, report = Path(tmp) / f"child{i}.csv", Path(tmp) / f"report{i}"
            child = [
                sys.executable,
                str(SCRIPT),
                str(child_csv),
                "--ncu-child",
                "--layouts",
                layout,
                "--dims",
                ",".join(map(str, s.dims)),
                "--lengths",
                ",".join(map(str, s.lengths)),
                "--long-layouts",
                "",
                "--providers",
                ",".join(chosen),
            ]
            collected = ""
            for with_metrics in (True, False):
                # Without the explicit metrics (a name this Nsight Compute lacks fails the whole run): sections only.
                cmd = ncu_command(ncu, report, child, with_metrics)
                log("running: " + " ".join(cmd))
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    tail = (proc.stdout + proc.stderr).strip()[-800:]
                except subprocess.TimeoutExpired:
                    tail = "timed out after 300 s"
                if Path(str(report) + ".ncu-rep").exists() and child_csv.exists():
                    collected = "metrics+sections" if with_metrics else "sections"
                    break
                log(f"ncu run failed: {tail}")
            if not collected:
                rows.append(dict(layout=layout, status="error", reason="the profiled child wrote no report or rows"))
                continue
            with open(child_csv, newline="") as f:
                child_rows = list(csv.DictReader(f))
            export = ncu_tools.export_raw(ncu, report)
            if export.returncode != 0:
                rows += [
                    dict(r, status="error", reason=f"ncu export: {export.stderr.strip()[:300]}") for r in child_rows
                ]
                continue
            # Every metric of every section, for reading beyond the summary columns.
            s.out.with_name(f"{s.out.stem}_raw_{layout}.csv").write_text(export.stdout)
            rows += [dict(r, ncu_metrics=collected) for r in merge_ncu(child_rows, parse_ncu_raw(export.stdout))]
    write_csv(s.out, rows, NCU_FIELDS)
    print_ncu(rows)
    log(f"{len(rows)} rows written to {s.out}")
    return 0


def print_ncu(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Nsight Compute (--clock-control none)")
    cols = (
        "layout",
        "d",
        "provider",
        "duration_ms",
        "achieved_occupancy_pct",
        "registers_per_thread",
        "local_load_bytes",
        "local_store_bytes",
        "dram_read_bytes",
        "l2_bytes",
        "instructions",
        "issue_active_pct",
        "tensor_pipe_pct",
        "stall_1",
        "stall_2",
        "stall_3",
    )
    for col in cols:
        table.add_column(col.replace("_", " "))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    for r in rows:
        table.add_row(*[fmt(r.get(c)) for c in cols])
    Console(width=220).print(table)


# ----------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    s = settings_from(args)
    log = Log()
    if not s.smoke and not torch.cuda.is_available():
        print("residual_diag: no CUDA device (use --cpu-smoke on a CPU)", file=sys.stderr)
        return 2
    if args.ncu and not s.smoke:
        return run_ncu(s, args, log)
    if not s.smoke:
        log(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
        if not (args.no_warm or s.warm_only or s.ncu_child):
            warm_compile(s, log)
    rows = measure(s, log)
    write_csv(s.out, rows, FIELDS)
    if not (s.warm_only or s.ncu_child):
        print_report(rows)
        log(f"{len(rows)} rows written to {s.out}")
    bad = [r for r in rows if r.get("status") not in ("ok", "warm", "skipped_budget")]
    if bad:
        # Loud, but exit 0: the Nsight Compute run chained after this one with && still runs.
        print(
            f"residual_diag: {len(bad)} of {len(rows)} rows FAILED (status column): "
            + ", ".join(sorted({f"{r['layout']}/{r['provider']}:{r['status']}" for r in bad})[:20])
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
