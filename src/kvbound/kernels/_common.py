"""Pieces shared by the dense and the compressed attention kernels.

Conventions used by both kernels:

* Query rows of one program are the G = Hq / Hkv query heads of one K/V head interleaved with the query
  index: row ``t`` of the flattened ``[Nq * G]`` axis is query ``t // G`` of head ``kv_head * G + t % G``.
  A program therefore loads each K/V tile once for all heads of its group (GQA/MQA), and the causal
  bounds of a tile stay contiguous in the query index.
* Logits live in "log2 units": ``x = logit * log2(e)`` so that the softmax uses ``exp2``. With a soft-cap the
  kernel first forms ``t = logit / softcap`` and then ``x = softcap * log2(e) * tanh(t)``.
* ``running_max`` is the row maximum of ``x`` seen so far; ``running_sum`` the sum of ``exp2(x - running_max)``.
  With a small soft-cap (``FIXED_MAX``) it is instead a constant that bounds every logit (see
  ``fixed_softmax_max``): the maximum is never tracked and nothing accumulated is ever rescaled.
* A bias is read through per-row pointers (``bias_rows``) plus a key stride; size-1 (broadcast) dimensions have
  stride 0. With ``BIAS_TILE = T > 1`` the bias is the compact ``[.., ceil(Nq / T), ceil(Nk / T)]`` form: row
  pointers address query tile ``query // T`` and column ``c`` of a key tile reads key tile ``key // T``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: jit code may read it


# The soft-cap's two forms of tanh (``SOFTCAP`` 1 and 2, chosen by ``softcap_form``).
SOFTCAP_EXP = 1
SOFTCAP_SERIES = 2
# Below this |t| the series form sums tanh's Taylor series through t**15, whose next term is under 2**-24 of tanh(t).
SERIES_LIMIT = tl.constexpr(0.55)


@triton.jit
def soft_capped(t, softcap_log2, SOFTCAP: tl.constexpr):
    """``softcap_log2 * tanh(t)``. Form 1: ``tanh(t) = 1 - 2 / (1 + e^(2t))`` (exp2 overflow to inf gives exactly 1,
    underflow to 0 gives -1), whose absolute error is a few 2**-24 at every t, so near t = 0 it is a relative error of
    a few 2**-24 / |t|. Form 2 sums the odd Taylor series below ``|t| < 0.55``, where form 1 would cancel, so the
    relative error stays a few 2**-24 at every t (``softcap_form``)."""
    y = 1.0 - 2.0 / (1.0 + tl.math.exp2(t * (2.0 * 1.4426950408889634)))
    if SOFTCAP == 2:  # SOFTCAP_SERIES
        s = t * t
        series = -929569.0 / 638512875.0
        series = series * s + 21844.0 / 6081075.0
        series = series * s - 1382.0 / 155925.0
        series = series * s + 62.0 / 2835.0
        series = series * s - 17.0 / 315.0
        series = series * s + 2.0 / 15.0
        series = series * s - 1.0 / 3.0
        series = t + t * (s * series)
        y = tl.where(tl.abs(t) < SERIES_LIMIT, series, y)
    return softcap_log2 * y


@triton.jit
def pow2_floor(x):
    """Largest power of two <= x for finite x > 0 (exact: keeps the float32 exponent bits only)."""
    bits = x.to(tl.int32, bitcast=True) & 0x7F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def row_normaliser(x):
    """Per-row power-of-two ``scale`` with ``|x / scale| < 256`` row-wise, so ``x / scale`` fits float16 with
    its full 11-bit precision (scaling by a power of two is exact). Returns ``(scale, 1 / scale)``."""
    row_max = tl.max(tl.abs(x), 1)
    # A floor for rows of zeros. Callers divide other quantities by the scale (K steps, 1 / scale), so it stays far
    # from float32's limits (2**-118 gave NaN for zero query rows). Rows below the floor (the bounded maximum's rank
    # accumulators can be, with row sums down to 2**-90) lose float16 precision only below about 2**-124 absolute.
    row_max = tl.maximum(row_max, 1.0e-30)
    scale = pow2_floor(row_max) * (1.0 / 128.0)
    return scale, 1.0 / scale


@triton.jit
def load_bias_tile(
    bias_rows, start_n, offs_n, stride_bias_key, row_valid, N_K, MASK: tl.constexpr, BIAS_TILE: tl.constexpr
):
    """Bias values [BLOCK_M, BLOCK_N] as float32; ``bias_rows`` holds one pointer per query row (stride-0 along
    broadcast dimensions, so a broadcast bias is read, never expanded).

    With ``BIAS_TILE = T > 1`` the bias is compact and key ``j`` reads column ``j // T``. Only the distinct values
    are loaded: one per row when the key tile lies inside one bias tile (``T >= BLOCK_N``; ``start_n`` is a
    multiple of ``BLOCK_N``, both powers of two), else ``BLOCK_N / T`` per row, widened in registers by a
    broadcast and a reshape (in the sm_90 code for AlphaGenome's tile: 23 global loads instead of 206 for the
    same values gathered at ``offs_n // T``, 9 % fewer instructions in all)."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    if BIAS_TILE == 1:
        ptrs = bias_rows[:, None] + start_n.to(tl.int64) * stride_bias_key + (offs_n * stride_bias_key)[None, :]
        if MASK:
            keep = row_valid[:, None] & ((start_n + offs_n) < N_K)[None, :]
        else:
            keep = row_valid[:, None]
        return tl.load(ptrs, mask=keep, other=0.0).to(tl.float32)
    elif BIAS_TILE >= BLOCK_N:
        values = tl.load(bias_rows + (start_n // BIAS_TILE).to(tl.int64) * stride_bias_key, mask=row_valid, other=0.0)
        return tl.broadcast_to(values.to(tl.float32)[:, None], [values.shape[0], BLOCK_N])
    else:
        TILES: tl.constexpr = BLOCK_N // BIAS_TILE
        offs_tile = tl.arange(0, TILES)
        first = bias_rows + (start_n // BIAS_TILE).to(tl.int64) * stride_bias_key
        ptrs = first[:, None] + (offs_tile * stride_bias_key)[None, :]
        if MASK:
            # A bias tile exists when its first key does (keys past N_K are masked out of the logits later).
            keep = row_valid[:, None] & ((start_n + offs_tile * BIAS_TILE) < N_K)[None, :]
        else:
            keep = row_valid[:, None]
        compact = tl.load(ptrs, mask=keep, other=0.0).to(tl.float32)
        wide = tl.broadcast_to(compact[:, :, None], [compact.shape[0], TILES, BIAS_TILE])
        return tl.reshape(wide, [compact.shape[0], BLOCK_N])


@triton.jit
def finish_logits(
    x,
    row_mult,
    bias_rows,
    start_n,
    offs_n,
    stride_bias_key,
    row_query,
    row_valid,
    N_K,
    bias_mult,
    softcap_log2,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    BIAS_TILE: tl.constexpr,
):
    """Turn raw dot products ``x`` (in units of ``row_mult``) into masked log2-unit logits."""
    x = x * row_mult[:, None]
    if HAS_BIAS:
        x += load_bias_tile(bias_rows, start_n, offs_n, stride_bias_key, row_valid, N_K, MASK, BIAS_TILE) * bias_mult
    if SOFTCAP:
        x = soft_capped(x, softcap_log2, SOFTCAP)
    if MASK:
        key = start_n + offs_n
        keep = (key < N_K)[None, :]
        if CAUSAL:
            keep = keep & (key[None, :] <= row_query[:, None])
        x = tl.where(keep, x, float("-inf"))
    return x


@triton.jit
def softmax_step(
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
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    BIAS_TILE: tl.constexpr,
    FIXED_MAX: tl.constexpr,
    row_shift=None,
    SHIFTED: tl.constexpr = False,
):
    """One online-softmax step over a tile of raw dot products ``x`` [BLOCK_M, BLOCK_N] (``row_mult >= 0``: the
    launchers fold a negative scale into ``q``, ``fold_scale_sign``). With ``SHIFTED`` the raw dot products are
    ``x + row_shift[:, None]`` (one value per row, in the units of ``x``): on a plain tile the shift enters only
    per-row terms, the maximum and the value each row subtracts, not each element; with a bias, soft-cap or mask it
    is added to ``x`` first.

    Returns ``(p, alpha, new_max, new_sum)``: ``p = exp2(logits - new_max)`` (float32) and the factor
    ``alpha`` that rescales what was accumulated under the previous maximum. With ``FIXED_MAX`` the maximum
    is the constant ``running_max`` the kernel started with (the soft-cap's, or the compressed kernel's bound on
    each row's logits), ``alpha`` is 1 and callers skip the rescaling.
    """
    if HAS_BIAS or SOFTCAP or MASK:
        if SHIFTED:
            x = x + row_shift[:, None]
        x = finish_logits(
            x,
            row_mult,
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
        )
        if FIXED_MAX:
            p = tl.math.exp2(x - running_max[:, None])
            return p, tl.zeros_like(running_sum) + 1.0, running_max, running_sum + tl.sum(p, 1)
        new_max = tl.maximum(running_max, tl.max(x, 1))
        # A row that has seen only masked keys keeps -inf; subtract 0 instead so that no inf - inf appears.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(x - safe_max[:, None])
    else:
        # Plain tile: fold the row multiplier (and the row shift) into the subtraction (one FMA per element).
        subtract = running_max
        if SHIFTED:
            shift = row_shift * row_mult
            subtract = running_max - shift
        if FIXED_MAX:
            p = tl.math.exp2(x * row_mult[:, None] - subtract[:, None])
            return p, tl.zeros_like(running_sum) + 1.0, running_max, running_sum + tl.sum(p, 1)
        row_max = tl.max(x, 1) * row_mult
        if SHIFTED:
            row_max = row_max + shift
        new_max = tl.maximum(running_max, row_max)
        safe_max = new_max
        subtract = new_max
        if SHIFTED:
            subtract = new_max - shift
        p = tl.math.exp2(x * row_mult[:, None] - subtract[:, None])
    alpha = tl.math.exp2(running_max - safe_max)
    new_sum = running_sum * alpha + tl.sum(p, 1)
    return p, alpha, new_max, new_sum


# How a tile's relative logits are skewed into place (relative_logits_tile), read once per process from
# KVBOUND_RELATIVE_SKEW: "gather" (tl.gather along the window, lowered to warp shuffles and selects), "shared" (the
# window product stored row-major to shared memory and read back at each logit's address: one load per logit, its
# addresses fixed per thread), "shared-banked" (the same with the rows interleaved by eight, so that the stores of a
# warp hit distinct banks).
RELATIVE_SKEWS = ("gather", "shared", "shared-banked")
RELATIVE_SKEW_NAME = os.environ.get("KVBOUND_RELATIVE_SKEW", "shared-banked")
if RELATIVE_SKEW_NAME not in RELATIVE_SKEWS:
    raise ValueError(f"KVBOUND_RELATIVE_SKEW: expected one of {', '.join(RELATIVE_SKEWS)}, got {RELATIVE_SKEW_NAME!r}")
_SKEW_MODE = tl.constexpr(RELATIVE_SKEWS.index(RELATIVE_SKEW_NAME))


def relative_halves_default() -> bool:
    """``KVBOUND_RELATIVE_HALVES``: ``1`` lets the dense kernel's key loop compute each square tile's relative window
    product one half at a time, the other half carried from the tile before (``relative_window_half``,
    ``relative_skew_halves``); ``0`` or unset: every tile computes its whole window (``relative_logits_tile``), as the
    compressed kernel always does. Off by default: on the H200 it was 14-19 % slower at the autotuner's tile
    (kernels/README.md, "What the relative term costs"). Read at each launch; empty is unset."""
    value = os.environ.get("KVBOUND_RELATIVE_HALVES", "").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"KVBOUND_RELATIVE_HALVES: expected 0 or 1, got {value!r}")
    return value == "1"


@triton.jit
def relative_logits_tile(
    q_position,
    relative_head,
    stride_rel_row,
    stride_rel_d,
    start_m,
    start_n,
    N_Q,
    N_REL,
    HEAD_DIM_K: tl.constexpr,
    DK_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Relative-position logits ``[BLOCK_M, BLOCK_N]`` (float32) of query rows ``start_m + a`` against keys
    ``start_n + c``: ``q_position[a] . relative_keys[N_Q - 1 + (start_n + c) - (start_m + a)]`` (Transformer-XL).

    The tile reads only the ``BLOCK_M + BLOCK_N - 1`` relative rows ``m0 .. m0 + BLOCK_M + BLOCK_N - 2``,
    ``m0 = N_Q - 1 + start_n - start_m - (BLOCK_M - 1)``, as one ``[DK_PAD, WINDOW]`` operand (``WINDOW`` the next
    power of two; the padding columns and rows outside ``[0, N_REL)`` load as zeros and are only read by padding
    queries or keys, which the caller never keeps). One product ``table = q_position @ window`` then gives every
    distance the tile needs, and ``table[a, c - a + BLOCK_M - 1]`` skews it into the tile on chip (``tl.gather``
    along the window axis). Rows are the query index: one query head per row (no GQA interleave).

    ``q_position``: ``[BLOCK_M, DK_PAD]`` in the operand dtype (``scale q + position_bias``); ``relative_head``:
    pointer to ``relative_keys[head, 0, 0]``. Used by the dense and the compressed kernels alike."""
    BLOCK_M: tl.constexpr = q_position.shape[0]
    WINDOW: tl.constexpr = 2 * BLOCK_M if BLOCK_M >= BLOCK_N else 2 * BLOCK_N  # next power of two >= BM + BN - 1
    offs_w = tl.arange(0, WINDOW)
    offs_d = tl.arange(0, DK_PAD)
    first_row = (N_Q - 1) + start_n - start_m - (BLOCK_M - 1)
    rel_row = first_row + offs_w
    row_ok = (offs_w < BLOCK_M + BLOCK_N - 1) & (rel_row >= 0) & (rel_row < N_REL)
    ptrs = relative_head + (rel_row.to(tl.int64) * stride_rel_row)[None, :] + (offs_d * stride_rel_d)[:, None]
    window = tl.load(ptrs, mask=row_ok[None, :] & (offs_d < HEAD_DIM_K)[:, None], other=0.0)
    table = tl.dot(q_position, window, input_precision=PRECISION)  # [BLOCK_M, WINDOW] float32
    return relative_skew(table, BLOCK_N)


@triton.jit
def relative_logits_tile_tma(
    q_position,
    relative_desc,
    start_m,
    start_n,
    N_Q,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """:func:`relative_logits_tile` with the window read through a tensor descriptor over one head's relative keys
    (``[N_REL, HEAD_DIM_K]``, block ``[WINDOW, DK_PAD]``): one bulk copy per tile instead of a load with an address
    per element in registers. Rows outside ``[0, N_REL)`` (a negative first row included) and columns past the head
    dim read as zeros; the window's last row (``WINDOW - 1 >= BLOCK_M + BLOCK_N - 1``), which the pointer load masks,
    is read here but never selected by the skew."""
    BLOCK_M: tl.constexpr = q_position.shape[0]
    first_row = (N_Q - 1) + start_n - start_m - (BLOCK_M - 1)
    window = tl.trans(relative_desc.load([first_row, 0]))  # [DK_PAD, WINDOW]
    table = tl.dot(q_position, window, input_precision=PRECISION)  # [BLOCK_M, WINDOW] float32
    return relative_skew(table, BLOCK_N)


@triton.jit
def relative_skew(table, BLOCK_N: tl.constexpr):
    """``table[a, c - a + BLOCK_M - 1]`` (``[BLOCK_M, BLOCK_N]``) of a window product ``table`` (``[BLOCK_M, WINDOW]``
    float32), in the way ``KVBOUND_RELATIVE_SKEW`` selects."""
    BLOCK_M: tl.constexpr = table.shape[0]
    WINDOW: tl.constexpr = table.shape[1]
    offs_a = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)
    skew = (BLOCK_M - 1) + offs_c[None, :] - offs_a[:, None]  # in [0, BLOCK_M + BLOCK_N - 2]
    if _SKEW_MODE == 1:
        flat = tl.reshape(table, [BLOCK_M * WINDOW])
        idx = tl.reshape(offs_a[:, None] * WINDOW + skew, [BLOCK_M * BLOCK_N])
        return tl.reshape(tl.gather(flat, idx, axis=0), [BLOCK_M, BLOCK_N])
    if _SKEW_MODE == 2 and BLOCK_M >= 8:
        t4 = tl.permute(tl.reshape(table, [BLOCK_M // 8, 8, WINDOW // 8, 8]), (0, 2, 1, 3))
        flat = tl.reshape(t4, [BLOCK_M * WINDOW])
        a2 = offs_a[:, None]
        pos = (((a2 // 8) * (WINDOW // 8) + skew // 8) * 8 + a2 % 8) * 8 + skew % 8
        idx = tl.reshape(pos, [BLOCK_M * BLOCK_N])
        return tl.reshape(tl.gather(flat, idx, axis=0), [BLOCK_M, BLOCK_N])
    return tl.gather(table, skew, axis=1)


@triton.jit
def relative_window_half(
    q_position,
    relative_head,
    stride_rel_row,
    stride_rel_d,
    first_row,
    N_REL,
    HEAD_DIM_K: tl.constexpr,
    DK_PAD: tl.constexpr,
    WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``q_position @ relative_keys[first_row + w]^T`` for ``w`` in ``[0, WIDTH)``: ``[BLOCK_M, WIDTH]`` float32, rows
    outside ``[0, N_REL)`` read as zeros (only padding queries or keys read them). One half of a tile's window
    product (``relative_logits_tile``): with ``BLOCK_M == BLOCK_N == WIDTH`` the window of the key tile at
    ``start_n`` starts at ``first_row = N_Q - 1 + start_n - start_m - (BLOCK_M - 1)``, and its upper half is the lower
    half of the next key tile's window, so a key loop computes one half per tile and carries the other."""
    offs_w = tl.arange(0, WIDTH)
    offs_d = tl.arange(0, DK_PAD)
    rel_row = first_row + offs_w
    row_ok = (rel_row >= 0) & (rel_row < N_REL)
    ptrs = relative_head + (rel_row.to(tl.int64) * stride_rel_row)[None, :] + (offs_d * stride_rel_d)[:, None]
    window = tl.load(ptrs, mask=row_ok[None, :] & (offs_d < HEAD_DIM_K)[:, None], other=0.0)
    return tl.dot(q_position, window, input_precision=PRECISION)


@triton.jit
def relative_skew_halves(lower, upper):
    """The relative logits ``[BLOCK_M, BLOCK_N]`` of a tile from its window product in two halves ``[BLOCK_M,
    BLOCK_N]`` (``BLOCK_M == BLOCK_N``; ``relative_window_half``): with ``table = [lower | upper]``, ``out[a, c] =
    table[a, BLOCK_M - 1 + c - a]``. The halves are joined (``[BLOCK_M, BLOCK_N, 2]``, column ``h * BLOCK_N + j`` at
    ``(a, j, h)``), flattened, and gathered along their one axis, which Triton lowers to one store to shared memory
    and one load per logit (the way of the ``shared`` skew of ``relative_logits_tile``, without the row
    interleaving of the default ``shared-banked``)."""
    BLOCK_M: tl.constexpr = lower.shape[0]
    BLOCK_N: tl.constexpr = lower.shape[1]
    flat = tl.reshape(tl.join(lower, upper), [BLOCK_M * BLOCK_N * 2])
    offs_a = tl.arange(0, BLOCK_M)[:, None]
    skew = (BLOCK_M - 1) + tl.arange(0, BLOCK_N)[None, :] - offs_a  # in [0, 2 BLOCK_N - 2]
    idx = tl.reshape((offs_a * BLOCK_N + skew % BLOCK_N) * 2 + skew // BLOCK_N, [BLOCK_M * BLOCK_N])
    return tl.reshape(tl.gather(flat, idx, axis=0), [BLOCK_M, BLOCK_N])


@triton.jit
def relative_runs_bounds(runs, start_m, start_n, N_Q, N_K, N_RUNS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The runs of the smallest and the largest distance of the tile at ``(start_m, start_n)``
    (``relative_runs_tile``'s ``runs`` layout). Any ``start_n`` is safe, also past the last key tile (the indices
    are clamped to the distances that exist). The kernels read a tile's own runs inside the key loop, whose software
    pipelining fetches them ahead."""
    run_of = runs + (N_RUNS + 1) + (N_Q - 1)
    first = tl.minimum(tl.maximum(start_n - start_m - (BLOCK_M - 1), -(N_Q - 1)), N_K - 1)
    last = tl.maximum(tl.minimum(start_n + BLOCK_N - 1 - start_m, N_K - 1), -(N_Q - 1))
    return tl.load(run_of + first), tl.load(run_of + last)


@triton.jit
def relative_runs_first(table_head, stride_table_run, first_run, start_m, N_Q, BLOCK_M: tl.constexpr):
    """``table[first_run, a]`` for the tile's query rows ``start_m + a`` (float32 ``[BLOCK_M]``; 0 for padding rows):
    the relative logit of every distance of the tile's first run (``relative_runs_tile``'s ``table_head``)."""
    rows = start_m + tl.arange(0, BLOCK_M)
    return tl.load(table_head + tl.cast(first_run, tl.int64) * stride_table_run + rows, mask=rows < N_Q, other=0.0)


# Runs per step of write_run_table (the kernels' prologue that writes a program's rows of the run table).
RUN_CHUNK = tl.constexpr(32)


@triton.jit
def write_run_table(
    q,
    run_keys_head,
    run_position_bias,
    table_head,
    stride_table_run,
    row_query,
    row_valid,
    n_runs,
    query_scale,
    HEAD_DIM_K: tl.constexpr,
    DK_PAD: tl.constexpr,
    RUN_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Write this program's queries' rows of the table of run logits, ``table[r, i] = scale (q_i . R[r]) + w . R[r]``
    (float32; ``table_head`` + ``r * stride_table_run + i``), from ``q`` (``[BLOCK_M, DK_PAD]`` in the input dtype,
    unscaled; rows ``row_query``, written where ``row_valid``), the head's run keys ``R`` (``run_keys_head``:
    ``[n_runs, HEAD_DIM_K]`` contiguous, q's dtype) and ``w`` (``run_position_bias``, float32 ``[DK_PAD]``, zero
    past the head dim), in steps of ``RUN_CHUNK`` runs: one product with the runs' keys each (16-bit products are
    exact in its float32 accumulator), plus the per-run offset. Then a barrier: the caller's threads read rows that
    other threads of the program wrote (``relative_runs_first``, ``relative_runs_tile``)."""
    offs_dk = tl.arange(0, DK_PAD)
    dk_ok = offs_dk < HEAD_DIM_K
    for run_start in range(0, n_runs, RUN_CHUNK):
        offs_run = run_start + tl.arange(0, RUN_CHUNK)
        run_ok = offs_run < n_runs
        keys = tl.load(
            run_keys_head + (offs_run * HEAD_DIM_K)[:, None] + offs_dk[None, :],
            mask=run_ok[:, None] & dk_ok[None, :],
            other=0.0,
        )
        offset = tl.sum(keys.to(tl.float32) * run_position_bias[None, :], 1)
        products = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        tl.store(
            table_head + (offs_run.to(tl.int64) * stride_table_run)[None, :] + row_query[:, None],
            products * query_scale + offset[None, :],
            mask=row_valid[:, None] & run_ok[None, :],
        )
    tl.debug_barrier()


@triton.jit
def relative_runs_tile(
    table_head,
    stride_table_run,
    runs,
    first_run,
    last_run,
    first_value,
    start_m,
    start_n,
    N_Q,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RUN_SPAN: tl.constexpr,
):
    """Relative-position logits ``[BLOCK_M, BLOCK_N]`` (float32) when the relative keys are constant over runs of
    distances, less the logit of the tile's first run per row (``first_value``, ``relative_runs_first``; the caller
    adds it back as the softmax's per-row shift, ``softmax_step(..., row_shift, SHIFTED)``): ``table[r, a] -
    table[first_run, a]`` for the run ``r`` holding ``d = (start_n + c) - (start_m + a)``. A tile within one run
    (most tiles far from the diagonal) is all zeros and costs no compare, select or load here.

    ``table_head``: pointer to this (batch, head)'s ``[N_RUNS, N_Q]`` float32 table (runs-major: a run's logits of
    consecutive queries are adjacent, so a tile's ``BLOCK_M`` values of one run are one coalesced load; run stride
    ``stride_table_run``). ``runs``: int32, the ``N_RUNS + 1`` run starts (distances, increasing, run ``r`` holding
    ``[runs[r], runs[r + 1])``, the last entry past every distance), then the run of each distance ``-(N_Q - 1) ..
    N_K - 1``. ``first_run`` / ``last_run``: the runs of the tile's smallest and largest distance
    (``relative_runs_bounds``). Each later run fills the distances from its start on with one compare and select
    per element. ``RUN_SPAN`` > 0: no tile spans more runs than that (``kvbound::attention_dense`` checks it
    against the layout; ``attention_dense_fwd`` refuses a pinned tile wider than the window it was counted for),
    and the runs after the first are unrolled, each behind a uniform branch: the key loop then holds no inner
    loop, which is what lets Triton pipeline its K/V loads. 0: an inner loop over any number of runs (the loads
    are not pipelined)."""
    relative = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if first_run < last_run:
        rows = start_m + tl.arange(0, BLOCK_M)
        distance = (start_n + tl.arange(0, BLOCK_N))[None, :] - rows[:, None]
        row_ptrs = table_head + rows
        row_ok = rows < N_Q
        # Runs in increasing order, each from its start on: a later run overwrites the distances past its start.
        if RUN_SPAN > 0:
            for step in tl.static_range(1, RUN_SPAN):
                if first_run + step <= last_run:
                    run = tl.cast(first_run + step, tl.int64)
                    value = tl.load(row_ptrs + run * stride_table_run, mask=row_ok, other=0.0) - first_value
                    relative = tl.where(distance >= tl.load(runs + run), value[:, None], relative)
        else:
            for run in range(first_run + 1, last_run + 1):
                offset = tl.cast(run, tl.int64) * stride_table_run
                value = tl.load(row_ptrs + offset, mask=row_ok, other=0.0) - first_value
                relative = tl.where(distance >= tl.load(runs + run), value[:, None], relative)
    return relative


@triton.jit
def key_loop_bounds(
    row_start, N_Q, N_K, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Key range of one program: tiles in ``[0, unmasked_end)`` need no mask, ``[unmasked_end, end)`` do
    (the ragged last tile, and with ``causal`` the tiles that cross the diagonal of any row)."""
    full_tiles_end = (N_K // BLOCK_N) * BLOCK_N
    if CAUSAL:
        first_query = row_start // GROUP
        last_query = tl.minimum((row_start + BLOCK_M - 1) // GROUP, N_Q - 1)
        end = tl.minimum(N_K, last_query + 1)
        unmasked_end = tl.minimum(((first_query + 1) // BLOCK_N) * BLOCK_N, full_tiles_end)
    else:
        end = N_K
        unmasked_end = full_tiles_end
    return unmasked_end, end


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code: in recent Triton versions that one is a constexpr function, whose
    wrapper costs a few microseconds per call on the host (launchers call these on every launch)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code (``ceil(a / b)`` for b > 0), without the constexpr function's wrapper."""
    return -(-a // b)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Whether the jit functions of this process run in the interpreter: Triton decides it when they are decorated,
# at import, so the launchers need not read the environment on every call.
_KERNELS_INTERPRETED = interpreting()


def _tma_allocator(size: int, alignment: int, stream):
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _has_tensor_descriptors(device) -> bool:
    """Hopper or newer (a device's capability is fixed: asked once per device)."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


_FLOAT32_PRECISION = {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}


def float32_dot_precision() -> str:
    """Triton's ``input_precision`` for products of float32 operands, following PyTorch's own setting for
    float32 matrix products (``torch.set_float32_matmul_precision``): "highest" (PyTorch's default) -> "ieee"
    (full float32), "high" -> "tf32x3" (three TF32 products, about float32 accuracy, on tensor cores), "medium"
    -> "tf32"."""
    return _FLOAT32_PRECISION.get(torch.get_float32_matmul_precision(), "ieee")


def tma_ready(*tensors) -> bool:
    """Whether kernels may read these [..., rows, cols] tensors through tensor descriptors (bulk tensor copies):
    Hopper or newer (or the interpreter), unit stride on the last dimension, every other stride and the
    base address 16-byte aligned. Installs Triton's scratch allocator that device-side descriptors need."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    if _KERNELS_INTERPRETED:
        return True
    if not _has_tensor_descriptors(tensors[0].device):
        return False
    triton.set_allocator(_tma_allocator)
    return True


def run_logits_table(q: torch.Tensor, runs: int, given: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 ``[B, H, runs, Nq]`` tensor into which the kernels write the table of run logits
    (``write_run_table``; ``q`` ``[B, H, Nq, Dk]``): a new one, or ``given`` (tests pass one to read it), checked."""
    shape = (q.shape[0], q.shape[1], runs, q.shape[2])
    if given is None:
        return torch.empty(shape, dtype=torch.float32, device=q.device)
    if given.shape != shape or given.dtype != torch.float32 or not given.is_contiguous():
        raise ValueError(
            f"run_table: expected a contiguous float32 tensor of shape {shape}, got {tuple(given.shape)} {given.dtype}"
        )
    return given


def output_order(q: torch.Tensor) -> tuple[int, ...]:
    """The memory order (outermost first) of an attention output ``[B, H, N, Dv]`` that follows ``q``'s: the order of
    ``q``'s dimensions by decreasing stride when its last dimension is dense (stride 1) and no stride is 0, else
    row-major. A query that is a head-split view of ``[B, N, H * D]`` (the ports' ``b n (h d) -> b h n d``) gives an
    output whose ``transpose(1, 2).reshape(B, N, H * Dv)`` is a view, not a copy (cuDNN and FlashAttention in
    ``scaled_dot_product_attention`` also follow the query's layout)."""
    strides = q.stride()
    if q.dim() != 4 or strides[-1] != 1 or 0 in strides:
        return (0, 1, 2, 3)
    # Dimensions of size 1 have no meaningful stride: they go outermost (batch 1 keeps the order of the others).
    order = tuple(sorted(range(4), key=lambda i: (q.shape[i] > 1, -strides[i], i)))
    return order if order[-1] == 3 else (0, 1, 2, 3)


def output_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` laid out in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def empty_output(q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    """An uninitialised ``[B, Hq, Nq, head_dim_v]`` output in ``q``'s dtype and memory order (``output_order``)."""
    b, h, n, _ = q.shape
    return torch.empty_permuted((b, h, n, head_dim_v), output_order(q), dtype=q.dtype, device=q.device)


def broadcast_strides(bias) -> tuple[int, int, int, int]:
    """Strides of a 4-d bias with 0 on its size-1 dimensions (they broadcast), or zeros for no bias."""
    if bias is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(bias.shape, bias.stride(), strict=True))


def launch_tuned(kernel, tuned: dict, grid, args: tuple, constexprs: dict, tune_key: tuple, config: dict | None):
    """Launch an autotuned kernel. ``config`` given: that configuration, no tuning. Otherwise the first call of
    ``tune_key`` goes through the autotuner and its winner is kept in ``tuned``; later calls launch the jit
    function with it directly (the autotuner would rebuild a dict of every argument and ``str()`` every
    tensor's dtype on each call). ``tune_key`` must hold the autotuner's key values and the dtypes that vary."""
    if config is not None:
        kernel.fn[grid](*args, **constexprs, **config)
        return
    best = tuned.get(tune_key)
    if best is None:
        kernel[grid](*args, **constexprs)
        tuned[tune_key] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[grid](*args, **constexprs, **best)


# Largest soft-cap in log2 units (``softcap * log2(e)``) for which a fixed softmax maximum keeps every
# probability a normal float16 number (see fixed_softmax_max).
FIXED_MAX_LIMIT = 14.0


def fixed_softmax_max(softcap: float | None) -> float | None:
    """The constant maximum ``M`` (log2 units) that replaces the running maximum, or None when not applicable.

    After a soft-cap ``c`` every logit ``x`` (log2 units) lies in ``[-c log2(e), c log2(e)]``, so with
    ``M = c log2(e) - 14`` every ``p = exp2(x - M)`` of an unmasked key lies in ``[2**(14 - 2 c log2(e)), 2**14]``.
    For ``c log2(e) <= 14`` (``c <= 9.7``; AlphaGenome's 5 gives ``[2**-0.4, 2**14]``) that is inside the normal
    range of float16 (``[2**-14, 65504]``), the narrowest operand type of the ``P @ V`` products, so no
    probability overflows or loses precision to subnormals, and softmax is invariant to the shift: the result
    is the same function, evaluated without the row maximum and without rescaling the accumulators."""
    if softcap is None or softcap * LOG2E > FIXED_MAX_LIMIT:
        return None
    return softcap * LOG2E - FIXED_MAX_LIMIT


def fold_scale_sign(q: torch.Tensor, scale: float, relative: bool) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` with a scale >= 0: ``softmax_step`` takes each row's maximum of the raw products before
    multiplying by the row multiplier, which is only right for a multiplier >= 0. A negative scale is therefore
    given as ``|scale| (-q) . k`` (the same logits; one copy of ``q``, only then). With relative positions the
    kernels scale ``q`` themselves and the multiplier carries no scale: nothing to fold."""
    if scale < 0 and not relative:
        return q.neg(), -scale
    return q, scale


def softcap_form(softcap: float | None, dtype: torch.dtype) -> int:
    """The kernels' ``SOFTCAP``: 0 without a soft-cap; ``SOFTCAP_EXP`` (tanh through one exp2, an absolute error of a
    few 2**-24 of the cap on every logit) where that stays under a quarter of ``dtype``'s rounding of a logit of 1
    (softmax weighs absolute logit errors), that is ``softcap <= 2**(21 - p)`` for ``p`` significand bits (bfloat16
    8192, float16 1024, float32 1/8); ``SOFTCAP_SERIES`` (an error of a few 2**-24 of each logit) above."""
    if softcap is None:
        return 0
    bits = {torch.bfloat16: 8, torch.float16: 11}.get(dtype, 24)
    return SOFTCAP_EXP if softcap <= 2.0 ** (21 - bits) else SOFTCAP_SERIES


def logit_multipliers(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """``(logit_mult, bias_mult, softcap_log2)``: multipliers from ``q . k`` and from ``bias`` to the kernels'
    logit units (log2 units without a soft-cap, ``logit / softcap`` before it with one)."""
    if softcap is None:
        return scale * LOG2E, LOG2E, 0.0
    return scale / softcap, 1.0 / softcap, softcap * LOG2E


# A bounded-maximum program (compressed or dense kernel) whose smallest row sum ends below this redoes its keys with
# the running maximum. P = exp2(x - bound) is formed in float32 and kept in float32 or bfloat16, whose normal range
# reaches 2**-126 with full relative precision; only terms below 2**-126 are lost (flushed to zero). With a row sum of
# at least 2**-90 the lost terms of Nk keys weigh less than Nk * 2**-126 / 2**-90 = Nk * 2**-36 of the row (2**-16 at
# a million keys), far below bfloat16's rounding of P; the products P v (P hi, P lo for the compressed kernel's pair)
# meet the same floor, so their loss is absolute, below Nk * 2**-36 in V's units. (2**-60 through 6e5937c, when
# programs retried on the benchmark's structured K/V at d = 128: benchmarks/bound_gap.py, kernels/README.md.)
BOUND_RETRY_SUM = tl.constexpr(2.0**-90)


def bounded_by_default(n_k: int, min_keys: int) -> bool:
    """Whether a launch that can take the bounded maximum takes it without being told: ``KVBOUND_BOUNDED_MAX`` on /
    off, or with ``auto`` from ``min_keys`` keys on (each kernel's ``BOUNDED_MIN_KEYS``)."""
    setting = bounded_setting()
    return setting == "on" or (setting == "auto" and n_k >= min_keys)


def bounded_setting() -> str:
    """``KVBOUND_BOUNDED_MAX``: ``auto`` (unset, empty or ``auto``: each kernel's default, see its launcher's
    ``bounded_max``), ``on`` (``1``, ``true``, ``on``, ``yes``: wherever it applies) or ``off`` (``0``, ``false``,
    ``off``, ``no``)."""
    return switch_setting("KVBOUND_BOUNDED_MAX")


def switch_setting(name: str) -> str:
    """The environment variable ``name`` as ``on`` (``1``, ``true``, ``on``, ``yes``), ``off`` (``0``, ``false``,
    ``off``, ``no``) or ``auto`` (unset, empty or ``auto``); anything else raises ValueError naming it."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "on", "yes"):
        return "on"
    if value in ("0", "false", "off", "no"):
        return "off"
    raise ValueError(f"{name}: expected one of 1, true, on, yes, 0, false, off, no, auto, got {value!r}")
