"""Counted work and bytes: the formulas every benchmark row and table uses, written out once.

FLOP of one attention forward (``attention_flops``)::

    2 * B * Hq * Nq * Nk * (Dk + Dv)          halved when causal

``Q K^T`` costs ``Dk`` multiply-adds per (query, key) pair and ``P V`` costs ``Dv``; a multiply-add is 2 FLOP.
The softmax's exponentials and the reconstruction of compressed tiles are not counted, so TFLOP/s of every
provider divides the same number.

Bytes a provider must move at the least (``dense_bytes_moved`` / ``compressed_bytes_moved``)::

    dense:       Q + K + V read once + O written once     (each in its own dtype, K/V at Hkv heads)
    compressed:  Q + K.nbytes + V.nbytes read once + O written once

plus the bias tensor the provider reads, if any, in the form it reads it (``bias_bytes``). ``nbytes`` is
``CompressedKV.nbytes``: factors, packed residual codes, scales, offsets, modes, exact blocks and metadata.

Reconstruction overhead (``reconstruction_flops``): what a fused kernel that rebuilds each K/V tile in
registers/shared memory does beyond dense attention. Per K/V tile of ``n`` rows and head dim ``D``:

    low-rank part   C @ P                  2 * n * r * D
    residual        codes * scale + add    2 * n * D        (tiles stored with codes: modes 1 and 2)
    exact tiles     a cast                 0

Unpacking a code (shift, mask, subtract) is 3 integer operations per element, counted separately. A kernel
that rebuilds every K/V tile once per query tile of ``block_m`` rows and ``heads_per_program`` query heads
does ``reconstruction / (2 * block_m * heads_per_program * n * (Dk + Dv))`` more work than dense attention;
for residual-free tiles that is ``r / (block_m * heads_per_program)`` (rank 8, 128 rows: 6.25%).

A kernel that instead works in rank space with a shared basis (logits ``(Q P^T) C^T``, values accumulated as
``(P_attn C_v) P_v``; FACTS.md's second loop) replaces ``Dk`` and ``Dv`` by ``r`` in the per-pair cost and adds
two projections per query tile: ``rank_space_flops`` counts it for residual-free tiles.

Encoder throughput (``--suite encoder``, ``gbps``): the bytes of the dense K and V given to the encoder over its
median time, ``(K + V bytes) / time``, the same for the encoders and for a plain device copy of K and V (which
also writes as many bytes as it reads, so its traffic is twice that).

Ring traffic per rank (``--suite ring``, ``ring_dense_bytes_per_rank``): a ring of ``W`` ranks passes every
shard on ``W - 1`` times, so each rank sends ``(W - 1) * shard`` bytes, with ``shard`` the dense K + V bytes of
one rank (``dense_bytes_sent``) or the packed ``CompressedKV`` buffers it forwards (``bytes_sent``, measured).
An all-gather moves the same ``(W - 1) * shard`` dense bytes per rank.
"""

from __future__ import annotations

__all__ = [
    "DTYPE_BYTES",
    "attention_flops",
    "dense_bytes_moved",
    "compressed_bytes_moved",
    "reconstruction_flops",
    "reconstruction_overhead",
    "rank_space_flops",
    "tflops",
    "gbps",
    "ring_dense_bytes_per_rank",
]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")


def attention_flops(batch: int, q_heads: int, q_len: int, kv_len: int, dk: int, dv: int, causal: bool) -> int:
    """``2 * B * Hq * Nq * Nk * (Dk + Dv)``, halved for causal (see the module docstring)."""
    _positive(batch=batch, q_heads=q_heads, q_len=q_len, kv_len=kv_len, dk=dk, dv=dv)
    flops = 2 * batch * q_heads * q_len * kv_len * (dk + dv)
    return flops // 2 if causal else flops


def tflops(flops: int, milliseconds: float) -> float:
    """FLOP over time, in 10**12 FLOP per second."""
    if not milliseconds > 0:
        raise ValueError(f"milliseconds: expected a time > 0, got {milliseconds!r}")
    return flops / (milliseconds * 1e-3) / 1e12


def gbps(nbytes: int, milliseconds: float) -> float:
    """Bytes over time, in 10**9 bytes per second."""
    _positive(nbytes=nbytes)
    if not milliseconds > 0:
        raise ValueError(f"milliseconds: expected a time > 0, got {milliseconds!r}")
    return nbytes / (milliseconds * 1e-3) / 1e9


def ring_dense_bytes_per_rank(world_size: int, shard_bytes: int) -> int:
    """Dense K + V bytes each rank sends in a ring (or an all-gather) of ``world_size`` ranks: every shard of
    ``shard_bytes`` travels ``world_size - 1`` hops."""
    _positive(world_size=world_size, shard_bytes=shard_bytes)
    if world_size == 0:
        raise ValueError("world_size: expected >= 1, got 0")
    return (world_size - 1) * shard_bytes


def dense_bytes_moved(
    batch: int,
    q_heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    dk: int,
    dv: int,
    dtype: str,
    *,
    bias_bytes: int = 0,
) -> int:
    """``Q + K + V`` read once and ``O`` written once, in ``dtype``, plus ``bias_bytes``.

    ``kv_heads`` is the number of K/V heads the provider actually reads (a provider that expands GQA K/V to
    every query head reads ``q_heads`` of them)."""
    _positive(batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, dk=dk, dv=dv,
              bias_bytes=bias_bytes)
    size = DTYPE_BYTES[dtype]
    q = batch * q_heads * q_len * dk
    k = batch * kv_heads * kv_len * dk
    v = batch * kv_heads * kv_len * dv
    o = batch * q_heads * q_len * dv
    return (q + k + v + o) * size + bias_bytes


def compressed_bytes_moved(
    batch: int,
    q_heads: int,
    q_len: int,
    dk: int,
    dv: int,
    dtype: str,
    k_nbytes: int,
    v_nbytes: int,
    *,
    bias_bytes: int = 0,
) -> int:
    """``Q`` read once, ``O`` written once (in ``dtype``), ``K.nbytes + V.nbytes`` read once, plus ``bias_bytes``."""
    _positive(batch=batch, q_heads=q_heads, q_len=q_len, dk=dk, dv=dv, k_nbytes=k_nbytes, v_nbytes=v_nbytes,
              bias_bytes=bias_bytes)
    size = DTYPE_BYTES[dtype]
    return (batch * q_heads * q_len * (dk + dv)) * size + k_nbytes + v_nbytes + bias_bytes


def reconstruction_flops(rows: int, rank: int, head_dim: int, with_residual: bool) -> int:
    """FLOP to rebuild one tile of ``rows`` x ``head_dim``: ``2 * rows * rank * head_dim`` for ``C @ P`` plus
    ``2 * rows * head_dim`` for ``codes * scale + low_rank`` when the tile stores codes."""
    _positive(rows=rows, rank=rank, head_dim=head_dim)
    return 2 * rows * rank * head_dim + (2 * rows * head_dim if with_residual else 0)


def reconstruction_overhead(
    rank: int,
    dk: int,
    dv: int,
    *,
    block_m: int = 128,
    heads_per_program: int = 1,
    k_coded_share: float = 0.0,
    v_coded_share: float = 0.0,
) -> float:
    """Reconstruction FLOP over attention FLOP for a kernel that rebuilds each K/V tile once per query tile.

    Per (query tile, K/V tile of ``n`` rows) pair, with ``k_coded_share`` / ``v_coded_share`` the share of K / V
    tiles stored with residual codes (modes 1 and 2)::

        rebuild   = 2 n (r (Dk + Dv) + Dk * k_coded_share + Dv * v_coded_share)
        attention = 2 * block_m * heads_per_program * n * (Dk + Dv)

    ``n`` cancels. Exact (mode 3) tiles cost nothing to rebuild and count as not coded.
    """
    _positive(rank=rank, dk=dk, dv=dv, block_m=block_m, heads_per_program=heads_per_program)
    if block_m == 0 or heads_per_program == 0:
        raise ValueError("block_m, heads_per_program: expected >= 1")
    for name, share in (("k_coded_share", k_coded_share), ("v_coded_share", v_coded_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name}: expected a value in [0, 1], got {share!r}")
    rebuild = rank * (dk + dv) + dk * k_coded_share + dv * v_coded_share
    return rebuild / (block_m * heads_per_program * (dk + dv))


def rank_space_flops(
    batch: int, q_heads: int, q_len: int, kv_len: int, dk: int, dv: int, rank: int, causal: bool, *,
    block_m: int = 128,
) -> int:
    """FLOP of rank-space attention over residual-free tiles with a shared basis.

    Per query tile of ``block_m`` rows: ``Q P_k^T`` (``2 * block_m * Dk * r``) and the output projection
    ``acc @ P_v`` (``2 * block_m * r * Dv``); per (query, key) pair: ``2 * r`` for the logit and ``2 * r`` for the
    value accumulation. Compare with ``attention_flops`` (``2 * (Dk + Dv)`` per pair)."""
    _positive(batch=batch, q_heads=q_heads, q_len=q_len, kv_len=kv_len, dk=dk, dv=dv, rank=rank, block_m=block_m)
    pairs = batch * q_heads * q_len * kv_len
    if causal:
        pairs //= 2
    query_tiles = batch * q_heads * -(-q_len // block_m)
    return 4 * rank * pairs + query_tiles * 2 * block_m * rank * (dk + dv)
