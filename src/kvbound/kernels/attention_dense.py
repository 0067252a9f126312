"""Dense fused attention forward: FlashAttention-2 style, one kernel for every backend Triton targets.

Reads top to bottom like Triton's tutorial 06-fused-attention: the inner loop over key tiles, the autotune
space and its prune function, the kernel, the launcher.

Semantics (same as ``kvbound.reference_attention``): ``logits = scale * q k^T (+ bias)``, then
``softcap * tanh(logits / softcap)`` when a soft-cap is given, then the top-left aligned causal mask, softmax
over keys, times ``v``; a compact tile bias (``bias_tile = T``) adds ``bias[..., i // T, j // T]``. Accumulation
is float32; the softmax uses ``exp2`` with ``scale * log2(e)`` folded into one multiply-add per logit, and under
a small soft-cap a fixed maximum instead of the running one (``_common.fixed_softmax_max``). Work per FLOP:
``4 * B * Hq * Nq * Nk * (Dk + Dv) / 2`` (two matrix products).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvbound.kernels._common import (
    BOUND_RETRY_SUM,
    LN2,
    RUN_CHUNK,
    bounded_by_default,
    broadcast_strides,
    cdiv,
    fixed_softmax_max,
    float32_dot_precision,
    fold_scale_sign,
    interpreting,
    key_loop_bounds,
    launch_tuned,
    logit_multipliers,
    next_power_of_2,
    output_order,
    output_strides,
    relative_halves_default,
    relative_logits_tile,
    relative_logits_tile_tma,
    relative_runs_bounds,
    relative_runs_first,
    relative_runs_tile,
    relative_skew_halves,
    relative_window_half,
    run_logits_table,
    softcap_form,
    softmax_step,
    tma_ready,
    write_run_table,
)

__all__ = ["attention_dense_fwd", "dense_configs"]


def _setting(name: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


# Read once per process (they select kernel code). KVBOUND_Q_SCRATCH: the relative variants' query forms (scale q + u,
# and for the relative keys scale q + v) are computed in registers; "auto" (the default) passes those of the relative
# keys through the program's own output rows, written over at the end, so that the key loop's products read them from
# shared memory instead of reloading registers at every tile (on the H200, bf16, one Enformer layer at batch 8:
# 0.632-0.652 against 0.716-0.758 ms; benchmarks/results/h200_2026-12-03_07c3a98/); "1" does it for the runs too
# (there it measured mixed: -8 % at Borzoi batch 4, +2 % at batch 16), "0" for neither.
# KVBOUND_RUNS_ADD: "1" (the default) starts a runs tile's product from zero and adds the runs after the first only
# where the tile spans more than one (Borzoi layer, batch 4: 0.908 against 0.996 ms; batch 16: 3.358 against
# 3.395), "0" starts every product from the filled relative tile.
_Q_SCRATCH_SETTING = _setting("KVBOUND_Q_SCRATCH", ("auto", "1", "0"))
_Q_SCRATCH_KEYS = tl.constexpr(_Q_SCRATCH_SETTING != "0")
_Q_SCRATCH_RUNS = tl.constexpr(_Q_SCRATCH_SETTING == "1")
_RUNS_ADD = tl.constexpr(_setting("KVBOUND_RUNS_ADD", ("1", "0")) == "1")


@triton.jit
def _attention_dense_inner(
    accumulator,
    accumulator_hi,
    running_sum,
    running_max,
    q,
    k_head,
    v_head,
    k_desc,
    v_desc,
    v_desc_hi,
    bias_rows,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    stride_bias_key,
    row_query,
    row_valid,
    row_mult,
    lo,
    hi,
    N_K,
    bias_mult,
    softcap_log2,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    DV_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    q_position,
    relative_head,
    relative_runs,
    stride_rel_row,
    stride_rel_d,
    row_start,
    N_Q,
    N_REL,
    RELATIVE: tl.constexpr,
    RUN_SPAN: tl.constexpr,
):
    """Key tiles ``[lo, hi)``; ``MASK`` selects the masked variant (ragged last tile, causal diagonal).
    With ``USE_TMA`` the K/V tiles come through tensor descriptors (bulk copies that zero-fill rows past
    ``N_K`` and columns past the head dim, and need no per-element addresses in registers). With ``RELATIVE``
    each tile's raw logits start from its relative-position term: 1, from the relative keys
    (``_common.relative_logits_tile``); 2, from a table per query and run of distances
    (``_common.relative_runs_tile``; ``N_REL`` is then the number of runs, ``RUN_SPAN`` the most runs a tile
    spans or 0); 3, as 1, but with square tiles (``BLOCK_M == BLOCK_N``) each tile multiplies only the upper half of
    its window and carries it to the next tile as that tile's lower half (``attention_dense_fwd``'s
    ``relative_halves``). With ``DV_HI > 0`` the value columns are two parts, ``[0, DV_PAD)`` into ``accumulator``
    and ``[DV_PAD, DV_PAD + DV_HI)`` into ``accumulator_hi`` (``dv_parts``); else ``accumulator_hi`` is passed
    through untouched."""
    offs_n = tl.arange(0, BLOCK_N)
    # Relative keys with square tiles: each tile computes the upper half of its window product and carries it as
    # the next tile's lower half (relative_window_half), so the loop multiplies half of the window per tile.
    HALVES: tl.constexpr = RELATIVE == 3 and q.shape[0] == BLOCK_N
    if HALVES:
        # (the masked call's range is often empty: no key tile, no product)
        carried = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
        if lo < hi:
            carried = relative_window_half(
                q_position,
                relative_head,
                stride_rel_row,
                stride_rel_d,
                (N_Q - 1) + lo - row_start - (BLOCK_N - 1),
                N_REL,
                HEAD_DIM_K,
                DK_PAD,
                BLOCK_N,
                PRECISION,
            )
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    dk_ok = offs_dk < HEAD_DIM_K
    dv_ok = offs_dv < HEAD_DIM_V
    offs_dv_hi = DV_PAD + tl.arange(0, DV_HI if DV_HI > 0 else 16)
    dv_hi_ok = offs_dv_hi < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        row_shift = row_mult  # unused placeholder; the runs' first logit per row with RELATIVE == 2
        key_base = start_n.to(tl.int64)
        key_ok = (start_n + offs_n) < N_K
        if USE_TMA:
            k = tl.trans(k_desc.load([start_n, 0]))
        else:
            # K tile transposed: [DK_PAD, BLOCK_N].
            k_ptrs = k_head + key_base * stride_kn + (offs_n * stride_kn)[None, :] + (offs_dk * stride_kd)[:, None]
            if MASK:
                k = tl.load(k_ptrs, mask=dk_ok[:, None] & key_ok[None, :], other=0.0)
            elif DK_PAD != HEAD_DIM_K:
                k = tl.load(k_ptrs, mask=dk_ok[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
        if RELATIVE == 2:
            # This tile's runs, read here: the key loop's software pipelining then fetches them, and the row shift
            # they address, ahead of the tile (cp.async into shared memory; 230 registers against 244 at 64x64x4x2
            # when they were read one tile ahead by hand and carried, which fetched the row shift at the end of the
            # tile before and waited for it at the start of this one). On an H100 it measured the same or a few per
            # cent faster (kernels/README.md, "The runs read inside the key loop"). With the inner loop over runs
            # (RUN_SPAN == 0) carried bounds also gave wrong outputs on an H200 (Triton 3.6; error 3.7 against
            # float64 in test_gpu_runs_bf16_ragged_causal_and_inner_loop).
            first_run, last_run = relative_runs_bounds(
                relative_runs, row_start, start_n, N_Q, N_K, N_REL, q.shape[0], BLOCK_N
            )
            # The first run's logit of each row is the softmax's row shift; the tile holds the other runs' excess.
            row_shift = relative_runs_first(relative_head, stride_rel_row, first_run, row_start, N_Q, q.shape[0])
            if _RUNS_ADD:
                x = tl.dot(q, k, input_precision=PRECISION)
                if first_run < last_run:
                    x = x + relative_runs_tile(
                        relative_head,
                        stride_rel_row,
                        relative_runs,
                        first_run,
                        last_run,
                        row_shift,
                        row_start,
                        start_n,
                        N_Q,
                        q.shape[0],
                        BLOCK_N,
                        RUN_SPAN,
                    )
            else:
                relative = relative_runs_tile(
                    relative_head,
                    stride_rel_row,
                    relative_runs,
                    first_run,
                    last_run,
                    row_shift,
                    row_start,
                    start_n,
                    N_Q,
                    q.shape[0],
                    BLOCK_N,
                    RUN_SPAN,
                )
                x = tl.dot(q, k, relative, input_precision=PRECISION)
        elif HALVES:
            upper = relative_window_half(
                q_position,
                relative_head,
                stride_rel_row,
                stride_rel_d,
                (N_Q - 1) + start_n + 1 - row_start,
                N_REL,
                HEAD_DIM_K,
                DK_PAD,
                BLOCK_N,
                PRECISION,
            )
            relative = relative_skew_halves(carried, upper)
            carried = upper
            x = tl.dot(q, k, relative, input_precision=PRECISION)
        elif RELATIVE == 1 and USE_TMA:
            # relative_head: a tensor descriptor over the head's relative keys (the kernel's relative_source)
            relative = relative_logits_tile_tma(q_position, relative_head, row_start, start_n, N_Q, BLOCK_N, PRECISION)
            x = tl.dot(q, k, relative, input_precision=PRECISION)
        elif RELATIVE:
            relative = relative_logits_tile(
                q_position,
                relative_head,
                stride_rel_row,
                stride_rel_d,
                row_start,
                start_n,
                N_Q,
                N_REL,
                HEAD_DIM_K,
                DK_PAD,
                BLOCK_N,
                PRECISION,
            )
            x = tl.dot(q, k, relative, input_precision=PRECISION)
        else:
            x = tl.dot(q, k, input_precision=PRECISION)
        p, alpha, running_max, running_sum = softmax_step(
            x,
            row_mult,
            running_max,
            running_sum,
            bias_rows,
            start_n,
            offs_n,
            stride_bias_key,
            row_query,
            row_valid,
            N_K,
            bias_mult,
            softcap_log2,
            HAS_BIAS,
            SOFTCAP,
            CAUSAL,
            MASK,
            BIAS_TILE,
            FIXED_MAX,
            row_shift,
            RELATIVE == 2,
        )
        if USE_TMA:
            v = v_desc.load([start_n, 0])
        else:
            v_rows = v_head + key_base * stride_vn + (offs_n * stride_vn)[:, None]
            v_ptrs = v_rows + (offs_dv * stride_vd)[None, :]
            if MASK:
                v = tl.load(v_ptrs, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
            elif DV_PAD <= HEAD_DIM_V:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if not FIXED_MAX:
            accumulator = accumulator * alpha[:, None]
        accumulator = tl.dot(p.to(v.dtype), v, accumulator, input_precision=PRECISION)
        if DV_HI > 0:
            if USE_TMA:
                v_hi = v_desc_hi.load([start_n, DV_PAD])
            else:
                v_hi_ptrs = v_rows + (offs_dv_hi * stride_vd)[None, :]
                if MASK:
                    v_hi = tl.load(v_hi_ptrs, mask=key_ok[:, None] & dv_hi_ok[None, :], other=0.0)
                else:
                    v_hi = tl.load(v_hi_ptrs, mask=dv_hi_ok[None, :], other=0.0)
            if not FIXED_MAX:
                accumulator_hi = accumulator_hi * alpha[:, None]
            accumulator_hi = tl.dot(p.to(v_hi.dtype), v_hi, accumulator_hi, input_precision=PRECISION)
    return accumulator, accumulator_hi, running_sum, running_max


# ----------------------------------------------------------------------------------------------- autotune
# Tile shapes of the plain variant (no relative positions), (BLOCK_M, BLOCK_N, warps, stages): see dense_configs.
_PLAIN_SHAPES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3))
# Those of the relative keys' window (RELATIVE 1 and 3): see dense_configs.
_RELATIVE_SHAPES = frozenset({(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 8, 3)})
# 128-row tiles on two warpgroups, as plain attention takes, for the runs of equal relative keys (RELATIVE 2): the
# runs need no skew, which holds the window's variant to 64 rows. Searched with KVBOUND_RUNS_WIDE=1 (runs_wide_setting).
_RUNS_WIDE_SHAPES = frozenset({(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2)})


def runs_wide_setting() -> bool:
    """``KVBOUND_RUNS_WIDE``: ``1`` adds 128-row tiles to the runs' tile search (``_RUNS_WIDE_SHAPES``; their runs
    are then counted over 191 distances, Borzoi's 18 unrolled as 24); ``0`` or unset: the relative keys' 64-row tiles
    only, as before. Off by default until timed on a GPU (kernels/README.md, "The runs on 128-row tiles"). Read when
    the kernels are imported; empty is unset."""
    value = os.environ.get("KVBOUND_RUNS_WIDE", "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"KVBOUND_RUNS_WIDE: expected 0 or 1, got {value!r}")
    return value == "1"


# Those of the runs of equal relative keys (RELATIVE 2).
_RUNS_SHAPES = _RELATIVE_SHAPES | (_RUNS_WIDE_SHAPES if runs_wide_setting() else frozenset())


def _variant_shapes(relative: int) -> Collection[tuple[int, int, int, int]]:
    """The tile shapes searched for one value of the kernel's ``RELATIVE``."""
    return _RUNS_SHAPES if relative == 2 else _RELATIVE_SHAPES if relative else _PLAIN_SHAPES


# The most distances one tile of the runs' variant spans (BLOCK_M + BLOCK_N - 1 over its tile shapes; the
# interpreter's tile is smaller): the runs of a layout are counted over windows of this many distances.
_RELATIVE_WINDOW = max(m + n - 1 for m, n, _, _ in _RUNS_SHAPES)
# Up to this many runs per tile the runs are unrolled (relative_run_span); beyond it, an inner loop. 32 with the
# 128-row tiles (Borzoi's layout spans 18 runs in their 191 distances), else 16.
MAX_RUN_SPAN = 32 if _RELATIVE_WINDOW > 127 else 16


def relative_window() -> int:
    """The most consecutive distances one tile of the runs' variant spans."""
    return _RELATIVE_WINDOW


def relative_run_span(starts: Sequence[int], rows: int, window: int | None = None, limit: int | None = None) -> int:
    """``RUN_SPAN`` for run starts (first rows of runs, increasing from 0, below ``rows``): the most runs that any
    tile spans (a window of ``window`` consecutive rows; None: ``relative_window()``), rounded up by
    ``round_run_span``, or 0 above ``limit`` (None: ``MAX_RUN_SPAN``)."""
    window = _RELATIVE_WINDOW if window is None else window
    limit = MAX_RUN_SPAN if limit is None else limit
    run_of = np.searchsorted(np.asarray(starts, dtype=np.int64), np.arange(rows), side="right") - 1
    ends = np.minimum(np.arange(rows) + (window - 1), rows - 1)
    span = int((run_of[ends] - run_of).max()) + 1 if rows else 1
    return 0 if span > limit else round_run_span(span)


def round_run_span(span: int) -> int:
    """The unrolled ``RUN_SPAN`` for tiles spanning at most ``span`` runs: a power of two (at least 2) up to 16, a
    multiple of 8 above (each value is one more compiled kernel; 18 runs unroll as 24, not 32)."""
    return max(2, next_power_of_2(span)) if span <= 16 else -(-span // 8) * 8


def valid_run_span(run_span: int) -> bool:
    """Whether ``run_span`` is a value ``round_run_span`` gives, within ``MAX_RUN_SPAN``."""
    return 2 <= run_span <= MAX_RUN_SPAN and round_run_span(run_span) == run_span


def dv_parts(head_dim_v: int, split: bool = True) -> tuple[int, int]:
    """The value columns as the kernel's two parts ``(DV_PAD, DV_HI)``: the first padded to a power of two (at least
    16), the second ``DV_HI`` wide or 0. Split (``split``): the largest power of two not above ``head_dim_v``, then
    the rest padded to a power of two, where the two together are narrower than ``head_dim_v`` padded whole (192:
    128 + 64 against 256, a quarter fewer value columns in the value product, its accumulator and its tiles). Else
    ``(next power of two, 0)``."""
    whole = max(16, next_power_of_2(head_dim_v))
    if not split or head_dim_v <= 16 or whole == head_dim_v:
        return whole, 0
    low = whole // 2
    high = max(16, next_power_of_2(head_dim_v - low))
    return (low, high) if low + high < whole else (whole, 0)


def dv_split_default(relative_keys: bool) -> bool:
    """``KVBOUND_DV_SPLIT``: ``1`` splits the value head dim in two parts where that pads less (``dv_parts``), ``0``
    pads it whole to a power of two (one value product per key tile); ``auto`` (or unset, the default) splits it
    except with the relative keys' window (``relative_keys``; ``RELATIVE`` 1 and 3). On an H200 (bf16, dk 64,
    dv 192; kernels/README.md, "Value columns in two parts") the split made plain attention 12-20 % and the runs
    6-7 % faster, and the relative keys 8 % slower at Enformer's layer. Read at each launch; empty is unset."""
    value = os.environ.get("KVBOUND_DV_SPLIT", "").strip() or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"KVBOUND_DV_SPLIT: expected 0, 1 or auto, got {value!r}")
    return value == "1" or (value == "auto" and not relative_keys)


def dense_configs(interpret: bool) -> list[triton.Config]:
    """Tile shapes to search. The interpreter gets one small tile (tests stay fast, several tiles per axis)."""
    if interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # The tile shapes that won on an H200 (Triton 3.6; kernels/README.md has the numbers): BLOCK_M 128 with
    # BLOCK_N 64; 8 warps once the accumulator is wide (Dv padded to 256 spills on 4). 128 x 128 x 8 x 3 for d = 128
    # (dense_tiles.py, H200, N = 65536: 34.5 ms against 35.7 ms for the next tile). _PLAIN_SHAPES.
    shapes = list(_PLAIN_SHAPES)
    # Relative positions (Enformer, Borzoi) only. With the relative table skewed through shared memory (the
    # default, _common.RELATIVE_SKEW_NAME) one warpgroup holds a 64-row tile: 64 x 64 on 4 warps and one stage
    # (255 registers, 96 B of stack, 56 KiB of shared memory: two programs per SM) was the fastest tile at every
    # Enformer and Borzoi shape measured (H200, benchmarks/relative_tiles.py: 0.51 ms per Enformer layer at batch
    # 8 against 0.74 for 64 x 64 on 8 warps, whose two warpgroups both compute the logits of the same 64 rows).
    # With the warp-shuffle skew (KVBOUND_RELATIVE_SKEW=gather) 4 warps spill (696 B) and 64 x 64 x 8 x 3 wins.
    # With KVBOUND_RUNS_WIDE=1 the runs (RELATIVE 2, Borzoi) also try 128-row tiles on 8 warps (_RUNS_SHAPES). The
    # prune function keeps each variant to its own list; a shape in several lists is searched once.
    shapes += sorted((_RELATIVE_SHAPES | _RUNS_SHAPES) - set(_PLAIN_SHAPES), reverse=True)
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _shape_of(config: triton.Config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


_SHARED_MEMORY_BYTES = 227 * 1024


def _prune_dense_configs(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    dv_pad, dk_pad = args["DV_PAD"] + args.get("DV_HI", 0), args["DK_PAD"]
    element = args["Q"].element_size() if hasattr(args.get("Q"), "element_size") else 2
    keep = []
    for config in configs:
        # Each variant gets its own tile list (see dense_configs).
        if _shape_of(config) not in _variant_shapes(args["RELATIVE"]):
            continue
        block_m, block_n = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        # A float32 accumulator of BLOCK_M x DV_PAD over 4 warps spills from 128 x 128 on (Triton 3.6, sm_90).
        if block_m * dv_pad >= 128 * 128 and config.num_warps < 8 and not args["RELATIVE"]:
            continue
        # Large V tiles times deep pipelines exceed shared memory (dv_pad: both parts' width).
        if dv_pad >= 256 and block_n >= 128 and config.num_stages > 2:
            continue
        # Wide key tiles on 3+ stages (128 x 128 / 8 / 3, for bf16 at d = 128, or dk 64 with dv 192 in two parts):
        # their pipelined K and V tiles and the Q tile must fit the SM's shared memory (227 KiB on Hopper).
        too_big = (config.num_stages * block_n * (dk_pad + dv_pad) + block_m * dk_pad) * element > _SHARED_MEMORY_BYTES
        if block_n >= 128 and config.num_stages > 2 and too_big:
            continue
        keep.append(config)
    return keep or configs[:1]


# The autotuner's key; the launcher keeps its own cache of the winners under the same values (plus the dtypes).
DENSE_TUNE_KEY = [
    "TUNE_N_Q",
    "TUNE_N_K",
    "HEAD_DIM_K",
    "HEAD_DIM_V",
    # the value columns' parts (dv_parts): a tile that fits split may not fit whole, so each is tuned on its own
    "DV_HI",
    "GROUP",
    "HAS_BIAS",
    "BIAS_TILE",
    "SOFTCAP",
    "FIXED_MAX",
    "BOUNDED",
    "CAUSAL",
    "RELATIVE",
    "RUN_SPAN",
]


@triton.autotune(
    configs=dense_configs(interpreting()),
    key=DENSE_TUNE_KEY,
    prune_configs_by={"early_config_prune": _prune_dense_configs},
)
@triton.jit
def _attention_dense_fwd(
    Q,
    K,
    V,
    Bias,
    Out,
    Lse,
    RelKeys,
    RelContentBias,
    RelPositionBias,
    KMaxNorm,
    RunKeys,
    RunPositionBias,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_bb,
    stride_bh,
    stride_bq,
    stride_bk,
    stride_ob,
    stride_oh,
    stride_on,
    stride_od,
    stride_rh,
    stride_rh_row,
    stride_rh_d,
    N_Q,
    N_K,
    H_KV,
    query_scale,
    logit_mult,
    bias_mult,
    softcap_log2,
    fixed_max,
    TUNE_N_Q,
    TUNE_N_K,
    HEAD_DIM_K: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    DV_HI: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    BOUNDED: tl.constexpr,
    CAUSAL: tl.constexpr,
    RELATIVE: tl.constexpr,
    RUN_SPAN: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(DK_PAD >= 16 and DV_PAD >= 16, "tl.dot needs head dims padded to >= 16")
    if BOUNDED:
        tl.static_assert(
            not (HAS_BIAS or SOFTCAP or RELATIVE or FIXED_MAX), "a bounded maximum needs plain logits q . k"
        )
    if RELATIVE:
        tl.static_assert(GROUP == 1, "relative positions need one query head per K/V head")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot needs tiles >= 16")
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H_KV).to(tl.int64)
    kv_head = pid_bh % H_KV
    row_start = pid_m * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    row_head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
    row_valid = row_query < N_Q
    offs_dk = tl.arange(0, DK_PAD)
    offs_dv = tl.arange(0, DV_PAD)

    q_rows = Q + batch * stride_qb + row_head * stride_qh + row_query.to(tl.int64) * stride_qn
    q = tl.load(
        q_rows[:, None] + (offs_dk * stride_qd)[None, :],
        mask=row_valid[:, None] & (offs_dk < HEAD_DIM_K)[None, :],
        other=0.0,
    )
    if RELATIVE:
        # Transformer-XL's two query forms, rounded once to the operand dtype: q_content = scale q + u reads the
        # keys, q_position = scale q + v the relative keys; the logit scale is already in them (logit_mult).
        # With RELATIVE == 2 the position query enters through the table of run logits (RelKeys, [B * H, runs,
        # N_Q]), which each program writes for its own queries first; RelPositionBias holds the runs' starts (int32)
        # and stride_rh_d is the number of runs.
        head_bias = kv_head * HEAD_DIM_K + offs_dk
        bias_ok = offs_dk < HEAD_DIM_K
        content_bias = tl.load(RelContentBias + head_bias, mask=bias_ok, other=0.0)
        q_scaled = q.to(tl.float32) * query_scale
        if RELATIVE == 2:
            q_position = q  # unused placeholder
            relative_head = RelKeys + (batch * H_KV + kv_head) * stride_rh
            n_relative = stride_rh_d
            # This program's rows of the run table (RelKeys, written here, read by the key loop), from the runs'
            # keys (RunKeys [H, R, Dk] contiguous, q's dtype) and w (RunPositionBias [H, Dk] float32).
            write_run_table(
                q,
                RunKeys + kv_head.to(tl.int64) * n_relative * HEAD_DIM_K,
                tl.load(RunPositionBias + head_bias, mask=bias_ok, other=0.0),
                relative_head,
                stride_rh_row,
                row_query,
                row_valid,
                n_relative,
                query_scale,
                HEAD_DIM_K,
                DK_PAD,
                RUN_CHUNK,
                PRECISION,
            )
        else:
            position_bias = tl.load(RelPositionBias + head_bias, mask=bias_ok, other=0.0)
            q_position = (q_scaled + position_bias[None, :]).to(q.dtype)
            relative_head = RelKeys + kv_head.to(tl.int64) * stride_rh
            n_relative = N_Q + N_K - 1
        q = (q_scaled + content_bias[None, :]).to(q.dtype)
        SCRATCH: tl.constexpr = (_Q_SCRATCH_RUNS if RELATIVE == 2 else _Q_SCRATCH_KEYS) and HEAD_DIM_V >= (
            DK_PAD if RELATIVE == 2 else 2 * DK_PAD
        )
        if SCRATCH:
            # The query forms through this program's own output rows (written over at the end): loaded back, they
            # are the key loop's shared-memory operands instead of registers reloaded at every tile.
            scratch = Out + batch * stride_ob + row_head * stride_oh + row_query.to(tl.int64) * stride_on
            q_cols = scratch[:, None] + (offs_dk * stride_od)[None, :]
            q_mask = row_valid[:, None] & (offs_dk < HEAD_DIM_K)[None, :]
            tl.store(q_cols, q, mask=q_mask)
            if RELATIVE != 2:
                tl.store(q_cols + DK_PAD * stride_od, q_position, mask=q_mask)
            tl.debug_barrier()
            q = tl.load(q_cols, mask=q_mask, other=0.0)
            if RELATIVE != 2:
                q_position = tl.load(q_cols + DK_PAD * stride_od, mask=q_mask, other=0.0)
    else:
        q_position = q  # unused placeholders
        relative_head = RelKeys
        n_relative = N_Q + N_K - 1
    k_head = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_head = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(
            k_head, shape=[N_K, HEAD_DIM_K], strides=[stride_kn, 1], block_shape=[BLOCK_N, DK_PAD]
        )
        v_desc = tl.make_tensor_descriptor(
            v_head, shape=[N_K, HEAD_DIM_V], strides=[stride_vn, 1], block_shape=[BLOCK_N, DV_PAD]
        )
        if DV_HI > 0:
            v_desc_hi = tl.make_tensor_descriptor(
                v_head, shape=[N_K, HEAD_DIM_V], strides=[stride_vn, 1], block_shape=[BLOCK_N, DV_HI]
            )
        else:
            v_desc_hi = v_desc  # unused placeholder
    else:
        k_desc = k_head  # unused placeholders
        v_desc = v_head
        v_desc_hi = v_head
    if RELATIVE == 1 and USE_TMA:
        # The relative keys' windows through a tensor descriptor too (relative_logits_tile_tma).
        WINDOW: tl.constexpr = 2 * BLOCK_M if BLOCK_M >= BLOCK_N else 2 * BLOCK_N
        relative_source = tl.make_tensor_descriptor(
            relative_head, shape=[n_relative, HEAD_DIM_K], strides=[stride_rh_row, 1], block_shape=[WINDOW, DK_PAD]
        )
    else:
        relative_source = relative_head
    if HAS_BIAS:
        bias_row = (row_query // BIAS_TILE).to(tl.int64)
        bias_rows = Bias + batch * stride_bb + row_head * stride_bh + bias_row * stride_bq
    else:
        bias_rows = q_rows  # unused placeholder of the right type

    row_mult = tl.zeros([BLOCK_M], dtype=tl.float32) + logit_mult
    if BOUNDED:
        # Cauchy-Schwarz: every logit q_i . k_j (log2 units) is at most |q_i| max_j |k_j| times the multiplier, a
        # constant maximum (no row maximum tracked, nothing rescaled). P = exp2(x - bound) may lie far below 1; it
        # enters the value product in V's dtype, bfloat16 or float32, whose range holds it (float16 is never bounded).
        q_float = q.to(tl.float32)
        k_max_norm = tl.load(KMaxNorm + batch * H_KV + kv_head)
        start_max = tl.sqrt(tl.sum(q_float * q_float, 1)) * k_max_norm * tl.abs(logit_mult)
    elif FIXED_MAX:
        start_max = tl.zeros([BLOCK_M], dtype=tl.float32) + fixed_max
    else:
        start_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    running_max = start_max
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    # The value columns past DV_PAD (dv_parts); else an unused placeholder.
    accumulator_hi = tl.zeros([BLOCK_M, DV_HI], dtype=tl.float32) if DV_HI > 0 else accumulator
    # With BOUNDED a second attempt, with the running maximum, for a program in which some row's sum ended below
    # BOUND_RETRY_SUM (the bound overshot the true maximum so far that terms of P could be lost).
    for attempt in tl.static_range(1 + BOUNDED):
        if attempt == 0:
            go = True
        else:
            go = tl.min(running_sum, 0) < BOUND_RETRY_SUM
        if go:
            if FIXED_MAX or (BOUNDED and attempt == 0):
                running_max = start_max
            else:
                running_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            accumulator = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
            if DV_HI > 0:
                accumulator_hi = tl.zeros([BLOCK_M, DV_HI], dtype=tl.float32)
            unmasked_end, end = key_loop_bounds(row_start, N_Q, N_K, GROUP, BLOCK_M, BLOCK_N, CAUSAL)
            accumulator, accumulator_hi, running_sum, running_max = _attention_dense_inner(
                accumulator,
                accumulator_hi,
                running_sum,
                running_max,
                q,
                k_head,
                v_head,
                k_desc,
                v_desc,
                v_desc_hi,
                bias_rows,
                stride_kn,
                stride_kd,
                stride_vn,
                stride_vd,
                stride_bk,
                row_query,
                row_valid,
                row_mult,
                0,
                unmasked_end,
                N_K,
                bias_mult,
                softcap_log2,
                HEAD_DIM_K,
                HEAD_DIM_V,
                DK_PAD,
                DV_PAD,
                DV_HI,
                BLOCK_N,
                HAS_BIAS,
                SOFTCAP,
                CAUSAL,
                False,
                PRECISION,
                USE_TMA,
                BIAS_TILE,
                FIXED_MAX or (BOUNDED and attempt == 0),
                q_position,
                relative_source,
                RelPositionBias,
                stride_rh_row,
                stride_rh_d,
                row_start,
                N_Q,
                n_relative,
                RELATIVE,
                RUN_SPAN,
            )
            accumulator, accumulator_hi, running_sum, running_max = _attention_dense_inner(
                accumulator,
                accumulator_hi,
                running_sum,
                running_max,
                q,
                k_head,
                v_head,
                k_desc,
                v_desc,
                v_desc_hi,
                bias_rows,
                stride_kn,
                stride_kd,
                stride_vn,
                stride_vd,
                stride_bk,
                row_query,
                row_valid,
                row_mult,
                unmasked_end,
                end,
                N_K,
                bias_mult,
                softcap_log2,
                HEAD_DIM_K,
                HEAD_DIM_V,
                DK_PAD,
                DV_PAD,
                DV_HI,
                BLOCK_N,
                HAS_BIAS,
                SOFTCAP,
                CAUSAL,
                True,
                PRECISION,
                USE_TMA,
                BIAS_TILE,
                FIXED_MAX or (BOUNDED and attempt == 0),
                q_position,
                relative_source,
                RelPositionBias,
                stride_rh_row,
                stride_rh_d,
                row_start,
                N_Q,
                n_relative,
                RELATIVE,
                RUN_SPAN,
            )

    # Epilogue: every valid row saw key 0, so running_sum >= 1 there (>= 2**-14 with the soft-cap's fixed maximum,
    # >= BOUND_RETRY_SUM with the bounded one); padding rows are never stored.
    if FIXED_MAX or BOUNDED:
        running_max = tl.where(running_sum > 0.0, running_max, float("-inf"))
    running_sum = tl.where(running_sum > 0.0, running_sum, 1.0)
    out = accumulator / running_sum[:, None]
    out_rows = Out + batch * stride_ob + row_head * stride_oh + row_query.to(tl.int64) * stride_on
    tl.store(
        out_rows[:, None] + (offs_dv * stride_od)[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_valid[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
    )
    if DV_HI > 0:
        offs_dv_hi = DV_PAD + tl.arange(0, DV_HI)
        tl.store(
            out_rows[:, None] + (offs_dv_hi * stride_od)[None, :],
            (accumulator_hi / running_sum[:, None]).to(Out.dtype.element_ty),
            mask=row_valid[:, None] & (offs_dv_hi < HEAD_DIM_V)[None, :],
        )
    lse = (running_max + tl.math.log2(running_sum)) * LN2
    lse_ptrs = Lse + (batch * (H_KV * GROUP) + row_head) * N_Q + row_query
    tl.store(lse_ptrs, lse, mask=row_valid)


# ----------------------------------------------------------------------------------------------- launcher
# Winning configurations by tuning key (DENSE_TUNE_KEY's values and the dtypes that vary): after the first call
# of a key the jit function is launched directly, skipping the autotuner's per-call key building.
_TUNED: dict[tuple, dict] = {}


# The bounded maximum is the default from BOUNDED_MIN_KEYS keys on. Side by side on the H200 (8 heads, bf16,
# benchmarks/bounded_sweep.py's decompressed K/V), the running maximum's time over the bounded maximum's at N = 4096,
# 8192, 16384, 32768, 65536, at 341cd17 (retry below a row sum of 2**-90; benchmarks/results/h200_2026-12-01_341cd17/
# bounded/): d = 64 0.63, 0.95, 1.33, 1.27, 1.25; d = 128 0.83, 1.15, 1.08, 1.11, 1.11. (At e5f554b, retrying below
# 2**-60, d = 128 lost from 16384 on: 8-11 % of its programs retried on these K/V, benchmarks/bound_gap.py.)
BOUNDED_MIN_KEYS = 16384


def key_norms(k: torch.Tensor) -> torch.Tensor:
    """The largest key norm of each (batch, K/V head) of ``k`` ``[B, Hkv, N, Dk]``: float32 ``[B, Hkv]``."""
    return torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax(dim=-1).contiguous()


def attention_dense_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool,
    softcap: float | None,
    config: dict | None = None,
    *,
    bias_tile: int = 1,
    fixed_max: bool = True,
    relative: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    before_launch: Callable[[], object] | None = None,
    relative_runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    run_span: int = 0,
    bounded_max: bool | None = None,
    relative_halves: bool | None = None,
    dv_split: bool | None = None,
    run_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the dense kernel. Inputs are validated by ``kvbound.attention``; ``bias`` is None or a 4-d tensor
    whose every dimension is either 1 (read with stride 0) or full: ``[B, Hq, Nq, Nk]``, or with
    ``bias_tile = T > 1`` the compact ``[B, Hq, ceil(Nq / T), ceil(Nk / T)]`` (``T`` a power of two). Returns
    ``(out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] float32)``. ``config`` (``BLOCK_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``) bypasses the autotuner (benchmarks use it to time one tile shape).
    ``fixed_max``: use the soft-cap's fixed softmax maximum when the soft-cap allows it (``_common``).
    ``relative``: ``(relative_keys [H, Nq + Nk - 1, Dk] in q's dtype, content_bias [H, Dk], position_bias [H, Dk]``
    float32 contiguous) for Transformer-XL relative positions (``Hq == Hkv``): the logit of ``(i, j)`` becomes
    ``(scale q_i + content_bias) . k_j + (scale q_i + position_bias) . relative_keys[Nq - 1 + j - i]`` (+ bias).
    ``before_launch``: called once after all host-side preparation, right before the launch (``kvbound.attention``
    reads its input checks there, so that the preparation overlaps the device work queued before it).
    ``relative_runs``: instead of ``relative``, the same relative term when the relative keys are constant over runs
    of distances: ``(run_keys [H, R, Dk] contiguous in q's dtype, run_starts [R + 1] int32, content_bias [H, Dk]
    float32, position_bias [H, Dk] float32)``, ``run_keys[h, r] = relative_keys[h, Nq - 1 + run_starts[r]]`` (the
    key of run ``r``) and run ``r`` holding the distances ``j - i`` in ``[run_starts[r], run_starts[r + 1])``;
    ``run_starts`` is followed by the run of each distance ``-(Nq - 1) .. Nk - 1`` (``Nq + Nk - 1`` more int32).
    Each program first writes its queries' rows of the table of run logits, ``table[b, h, r, i] = scale (q_i .
    run_keys[h, r]) + position_bias[h] . run_keys[h, r]`` (float32, runs-major ``[B, H, R, Nq]``: a key tile reads
    one run's logits of its queries in one coalesced load), into ``run_table`` (a new tensor when None; tests pass
    one to read it), then its key loop reads them. ``run_span``: with ``relative_runs``,
    ``relative_run_span(run_starts)`` (the kernel then unrolls the runs of a tile and pipelines its loads), or 0
    (any layout, an inner loop per tile).
    ``bounded_max``: for plain logits (no bias, soft-cap or relative positions) in bfloat16 or float32, replace the
    running row maximum by the Cauchy-Schwarz bound ``|q_i| max_j |k_j|`` (one norm reduction over K per call): no
    maximum is tracked and nothing rescaled; P enters the value product in V's dtype, whose range holds the gap; a
    program in which a row's sum ends below ``BOUND_RETRY_SUM`` redoes its keys with the running maximum. True /
    False: where it applies / never. None: ``KVBOUND_BOUNDED_MAX`` (``bounded_setting``): ``on`` / ``off`` as True /
    False; ``auto`` (the default) from ``BOUNDED_MIN_KEYS`` keys on.
    ``relative_halves``: with ``relative`` and square tiles, compute half of each tile's window product and carry the
    other half from the tile before (``RELATIVE = 3``; the same values, column by column); None:
    ``KVBOUND_RELATIVE_HALVES`` (``_common.relative_halves_default``, off unless set to 1; measured slower on the
    H200).
    ``dv_split``: a value head dim that is not a power of two runs as two power-of-two parts where that pads less
    (``dv_parts``: 192 as 128 + 64, not 256); None: ``KVBOUND_DV_SPLIT`` (``dv_split_default``: split except with
    the relative keys)."""
    q, scale = fold_scale_sign(q, scale, relative is not None or relative_runs is not None)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    wanted = bounded_max if bounded_max is not None else bounded_by_default(k_shape[-2], BOUNDED_MIN_KEYS)
    bounded = bool(
        wanted
        and bias is None
        and softcap is None
        and relative is None
        and relative_runs is None
        and q.dtype in (torch.bfloat16, torch.float32)
        and v.dtype == q.dtype
    )
    if run_span and not valid_run_span(run_span):
        allowed = [x for x in range(2, MAX_RUN_SPAN + 1) if valid_run_span(x)]
        raise ValueError(f"run_span: expected 0, {', '.join(map(str, allowed[:-1]))} or {allowed[-1]}, got {run_span}")
    if run_span and config is not None and config["BLOCK_M"] + config["BLOCK_N"] - 1 > _RELATIVE_WINDOW:
        # relative_run_span counts the runs of windows of _RELATIVE_WINDOW distances; a wider tile could span more.
        raise ValueError(
            f"config: with run_span a tile spans at most {_RELATIVE_WINDOW} distances (BLOCK_M + BLOCK_N - 1), got "
            f"{config['BLOCK_M']} x {config['BLOCK_N']}"
        )
    window_keys = relative_runs is None and relative is not None
    split = dv_split_default(window_keys) if dv_split is None else bool(dv_split)
    halves = False
    if relative_runs is not None:
        if relative is not None:
            raise ValueError("relative, relative_runs: expected at most one of them")
        run_keys, run_starts, content_bias, run_position_bias = relative_runs
        relative_keys, position_bias = run_logits_table(q, run_keys.shape[1], run_table), run_starts
        relative = (run_keys, content_bias, run_starts)
        relative_layout = ("runs", run_keys.shape, run_keys.dtype, run_span)
    elif relative is not None:
        relative_keys, content_bias, position_bias = relative
        halves = relative_halves_default() if relative_halves is None else bool(relative_halves)
        relative_layout = (relative_keys.stride(), relative_keys.dtype, halves)
    else:
        # None arguments become constexpr: without relative positions the kernel's signature and code are the
        # same as a kernel that never had them.
        relative_keys = content_bias = position_bias = None
        relative_layout = None
    if relative_runs is None:
        run_keys = run_position_bias = None
    plan_key = (
        q_shape,
        q.stride(),
        k_shape,
        k.stride(),
        v_shape,
        v.stride(),
        None if bias is None else (bias.shape, bias.stride(), bias.dtype),
        q.dtype,
        k.dtype,  # kvbound.attention gives all three one dtype; the launcher alone may be given others
        v.dtype,
        relative_layout,
        scale,
        causal,
        softcap,
        bias_tile,
        fixed_max,
        float32_dot_precision() if q.dtype == torch.float32 else None,
        bounded,
        split,
    )
    plan = _PLANS.get(plan_key) if config is None else None
    if plan is None:
        plan = _plan(
            q,
            k,
            v,
            bias,
            scale,
            causal,
            softcap,
            bias_tile,
            fixed_max,
            relative,
            run_span if relative_runs is not None else None,
            bounded,
            halves,
            split,
        )
        if config is None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[plan_key] = plan
    out = torch.empty_permuted(plan.out_shape, plan.out_order, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device)
    args = (
        q,
        k,
        v,
        q if bias is None else bias,
        out,
        lse,
        relative_keys,
        content_bias,
        position_bias,
        # the largest key norm of each (batch, K/V head), float32 [B, Hkv]
        key_norms(k) if bounded else None,
        run_keys,
        run_position_bias,
        *plan.scalar_args,
    )
    # The relative keys' windows are read through a descriptor too (RELATIVE = 1), so they must allow one.
    window_tma = window_keys and not halves
    use_tma = tma_ready(k, v, *((relative_keys,) if window_tma else ()))
    if before_launch is not None:
        before_launch()
    if config is None and plan.launch is not None:
        grid, constexprs = plan.launch[use_tma]
        _attention_dense_fwd.fn[grid](*args, **constexprs)
        return out, lse
    constexprs = {**plan.constexprs, "USE_TMA": use_tma}
    launch_tuned(_attention_dense_fwd, _TUNED, plan.grid, args, constexprs, plan.tune_key, config)
    if config is None:
        plan.set_winner(_TUNED[plan.tune_key])
    return out, lse


# Launch plans by call signature (shapes, strides, dtypes, scalars: everything the kernel's arguments derive from
# except the data pointers), so that repeated calls of one signature skip the argument building.
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


class _Plan:
    """Everything of one launch that depends only on the call signature (``attention_dense_fwd``'s plan key)."""

    __slots__ = ("out_shape", "out_order", "lse_shape", "scalar_args", "constexprs", "tune_key", "grid", "launch")

    def __init__(self, out_shape, out_order, lse_shape, scalar_args, constexprs, tune_key, grid) -> None:
        self.out_shape, self.out_order, self.lse_shape, self.scalar_args = out_shape, out_order, lse_shape, scalar_args
        self.constexprs, self.tune_key, self.grid = constexprs, tune_key, grid
        # (grid, constexprs with the winning configuration) for USE_TMA False / True, once the winner is known.
        self.launch: tuple | None = None

    def set_winner(self, best: dict) -> None:
        grid = self.grid({**self.constexprs, **best})
        self.launch = tuple((grid, {**self.constexprs, "USE_TMA": use_tma, **best}) for use_tma in (False, True))


def _plan(
    q, k, v, bias, scale, causal, softcap, bias_tile, fixed_max, relative, run_span: int | None = None,
    bounded: bool = False, halves: bool = False, dv_split: bool = True,
) -> _Plan:  # fmt: skip
    runs = run_span is not None
    batch, q_heads, n_q, head_dim_k = q.shape
    kv_heads, n_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    out_shape = (batch, q_heads, n_q, head_dim_v)
    out_order = output_order(q)  # a new tensor in q's memory order
    out_strides = output_strides(out_shape, out_order)
    # With relative positions the scale is applied to q in the kernel, before the two biases.
    logit_mult, bias_mult, softcap_log2 = logit_multipliers(1.0 if relative is not None else scale, softcap)
    max_value = fixed_softmax_max(softcap) if fixed_max else None
    dv_pad, dv_hi = dv_parts(head_dim_v, split=dv_split)
    relative_strides = relative[0].stride() if relative is not None else (None, None, None)
    if runs:  # the run table [B, H, R, Nq] as [B * H, R, Nq]: (head stride, run stride, number of runs R)
        n_runs = relative[0].shape[-2]
        relative_strides = (n_q * n_runs, n_q, n_runs)

    def grid(meta):
        return (cdiv(n_q * group, meta["BLOCK_M"]), batch * kv_heads)

    scalar_args = (
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *broadcast_strides(bias),
        *out_strides,
        *relative_strides,
        n_q,
        n_k,
        kv_heads,
        float(scale) if relative is not None else None,
        logit_mult,
        bias_mult,
        softcap_log2,
        0.0 if max_value is None else max_value,
        next_power_of_2(n_q * group),
        next_power_of_2(n_k),
    )
    constexprs = dict(
        HEAD_DIM_K=head_dim_k,
        HEAD_DIM_V=head_dim_v,
        DK_PAD=max(16, next_power_of_2(head_dim_k)),
        DV_PAD=dv_pad,
        DV_HI=dv_hi,
        GROUP=group,
        HAS_BIAS=bias is not None,
        BIAS_TILE=bias_tile if bias is not None else 1,
        SOFTCAP=softcap_form(softcap, q.dtype),
        FIXED_MAX=max_value is not None,
        BOUNDED=bounded,
        CAUSAL=causal,
        RELATIVE=2 if runs else (3 if halves else 1) if relative is not None else 0,
        RUN_SPAN=run_span if runs else 0,
        PRECISION=float32_dot_precision() if q.dtype == torch.float32 else "tf32",
    )
    bias_dtype = q.dtype if bias is None else bias.dtype
    tune_key = (
        scalar_args[-2],
        scalar_args[-1],
        *[constexprs[name] for name in DENSE_TUNE_KEY[2:]],
        q.dtype,
        bias_dtype,
    )
    return _Plan(out_shape, out_order, (batch, q_heads, n_q), scalar_args, constexprs, tune_key, grid)
