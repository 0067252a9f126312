"""Context-parallel attention over ``torch.distributed``: K/V shards travel a ring in compressed form.

Each rank holds a contiguous shard of the sequence (rank 0 the first). K and V shards are compressed once
(``kvbound.compress_kv``), packed into one byte buffer, and passed around the ring with point-to-point sends that
overlap the fused kernel working on the shard in hand. Partial outputs are merged exactly with their log-sum-exp,
so the result equals single-device attention over the same (decompressed) K/V up to float rounding.

What crosses the link is ``CompressedKV.nbytes`` per shard instead of the dense ``K`` and ``V``; ``RingStats``
reports both. With NCCL on GPUs and gloo on CPUs.

Transformer-XL relative positions (Enformer, Borzoi) take one global table ``relative_keys`` ``[H, 2N - 1, Dk]`` over
the whole sequence; each (query shard, key shard) call reads the view of it that covers that pair's distances.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvbound._validate import check_tensor
from kvbound.codec.basis import Basis
from kvbound.codec.format import CompressedKV
from kvbound.compress import compress_kv
from kvbound.config import CompressionConfig

__all__ = ["RingStats", "context_parallel_attention", "allgather_attention"]

_ALIGN = 16
_FIELDS = ("coeffs", "basis", "mode", "scale", "bits", "offset", "codes", "raw")

# bias(q_start, q_len, k_start, k_len) -> tensor broadcastable to [B, Hq, q_len, k_len], in global positions.
BiasFn = Callable[[int, int, int, int], torch.Tensor]


@dataclass
class RingStats:
    """What one rank sent around the ring."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    steps: int = 0
    compress_seconds: float = 0.0

    @property
    def reduction(self) -> float:
        return self.dense_bytes / max(1, self.bytes_sent)


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int, torch.dtype, tuple]]]:
    """Concatenate tensors into one uint8 buffer with 16-byte aligned segments; return (buffer, layout)."""
    layout, pieces, at = [], [], 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % _ALIGN
        layout.append((at, raw.numel(), t.dtype, tuple(t.shape)))
        pieces.append(raw)
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
        at += raw.numel() + pad
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8), layout


def _unpack(buffer: torch.Tensor, layout) -> list[torch.Tensor]:
    return [buffer[at : at + n].view(dtype).reshape(shape) for at, n, dtype, shape in layout]


def _ckv_tensors(ckv: CompressedKV) -> list[torch.Tensor]:
    return [getattr(ckv, name) for name in _FIELDS]


def _ckv_from(template: dict, tensors: list[torch.Tensor]) -> CompressedKV:
    return CompressedKV(**template, **dict(zip(_FIELDS, tensors, strict=True)))


def _relative_rows(
    relative_keys: torch.Tensor | None, total: int, q_start: int, q_len: int, k_start: int, k_len: int
) -> torch.Tensor | None:
    """The rows of the global table ``[H, 2 total - 1, Dk]`` that a block of ``q_len`` queries at global ``q_start``
    against ``k_len`` keys at ``k_start`` reads: distances ``k_start - q_start - (q_len - 1)`` .. ``k_start - q_start +
    k_len - 1``, i.e. ``kvbound.attention``'s local table ``[H, q_len + k_len - 1, Dk]``. A view (the kernels read
    the table through its strides)."""
    if relative_keys is None:
        return None
    first = total - 1 + k_start - q_start - (q_len - 1)
    return relative_keys[:, first : first + q_len + k_len - 1]


def _check_relative(
    relative_keys: object,
    content_bias: object,
    position_bias: object,
    q: torch.Tensor,
    kv_heads: int,
    total: int,
) -> None:
    """The global table's shape (``[Hq, 2 total - 1, Dk]``) before any communication, so that every rank raises the
    same error at the same point; ``kvbound.attention`` checks the rest (the biases' shapes, devices)."""
    if relative_keys is None:
        for name, t in (("relative_content_bias", content_bias), ("relative_position_bias", position_bias)):
            if t is not None:
                raise ValueError(f"{name}: given without relative_keys (it only applies to relative positions)")
        return
    check_tensor(relative_keys, "relative_keys", ndim=3, dtypes=(q.dtype,))
    heads, head_dim = q.shape[1], q.shape[3]
    if heads != kv_heads:
        raise ValueError(
            f"relative_keys: relative positions need one query head per K/V head, got Hq={heads}, Hkv={kv_heads}"
        )
    expected = (heads, 2 * total - 1, head_dim)
    if tuple(relative_keys.shape) != expected:
        raise ValueError(
            f"relative_keys: expected the global table [Hq, 2N - 1, Dk] = {list(expected)} (N = {total}, the whole "
            f"sequence), got {list(relative_keys.shape)}"
        )
    if relative_keys.device != q.device:
        raise ValueError(f"relative_keys: expected device {q.device} (q's), got {relative_keys.device}")


def _merge(out, lse, part_out, part_lse):
    """Exact merge of two softmax partial results given their natural-log sum-exp."""
    if out is None:
        return part_out.float(), part_lse
    new_lse = torch.logaddexp(lse, part_lse)
    out = out * torch.exp(lse - new_lse)[..., None] + part_out.float() * torch.exp(part_lse - new_lse)[..., None]
    return out, new_lse


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    config: CompressionConfig | None = None,
    basis_k: Basis | None = None,
    basis_v: Basis | None = None,
    compress: bool = True,
    impl: str = "eager",
    scale: float | None = None,
    causal: bool = False,
    softcap: float | None = None,
    bias: BiasFn | None = None,
    bias_tile: int = 1,
    relative_keys: torch.Tensor | None = None,
    relative_content_bias: torch.Tensor | None = None,
    relative_position_bias: torch.Tensor | None = None,
    return_stats: bool = False,
):
    """Attention of this rank's queries over the whole sequence, sharded contiguously across ``group``.

    Args:
        q: ``[B, Hq, n_r, Dk]``, k: ``[B, Hkv, n_r, Dk]``, v: ``[B, Hkv, n_r, Dv]``: this rank's shard (rank ``i``
            holds the ``i``-th contiguous piece; pieces may differ in length). RoPE, if any, is applied before.
        group: the process group (default: the world).
        config, basis_k, basis_v: compression settings and calibrated bases.
        impl: the encoder, as in :func:`kvbound.compress_kv` (``"triton"`` needs the bases).
        compress: send compressed K/V (default) or dense K/V around the same ring.
        scale, causal, softcap: as in :func:`kvbound.attention`; ``causal`` uses global positions.
        bias: optional ``bias(q_start, q_len, k_start, k_len)`` giving the additive bias for a block of global
            positions. With ``bias_tile=T > 1`` it returns the compact form, ``[B, Hq, ceil(q_len/T),
            ceil(k_len/T)]`` (e.g. a slice of AlphaGenome's 16x16-tile pair bias); shard starts must then be
            multiples of ``T``.
        relative_keys: Transformer-XL relative positions with global distances: ``[Hq, 2N - 1, Dk]`` of q's dtype
            over the whole sequence (``N`` the sum of the shard lengths, the same tensor on every rank); row ``m``
            is the key of distance ``m - (N - 1)`` (key position minus query position), as
            :func:`kvbound.attention`'s table for ``Nq = Nk = N``. The block of this rank's queries (global start
            ``qo``, length ``nq``) against a key shard (start ``ko``, length ``nk``) reads the view of rows
            ``N - 1 + ko - qo - (nq - 1)`` .. ``N - 1 + ko - qo + nk - 1``. ``Hq == Hkv`` only; dense or compressed
            K/V; composes with ``causal``, ``bias`` and ``softcap``.
        relative_content_bias, relative_position_bias: ``u`` and ``w``, as in :func:`kvbound.attention`.
        return_stats: also return :class:`RingStats`.

    Returns:
        ``[B, Hq, n_r, Dv]`` in q's dtype (and the stats when asked).
    """
    from kvbound.attention import attention

    check_tensor(q, "q", ndim=4)
    check_tensor(k, "k", ndim=4)
    check_tensor(v, "v", ndim=4)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    lengths = [None] * world
    dist.all_gather_object(lengths, (q.shape[2], k.shape[2]), group=group)
    if any(qn != kn for qn, kn in lengths):
        raise ValueError(f"q, k: expected each rank's q and k shards to have equal length, got {lengths}")
    starts = [0]
    for qn, _ in lengths[:-1]:
        starts.append(starts[-1] + qn)
    if bias is not None and bias_tile > 1 and any(s % bias_tile for s in starts):
        raise ValueError(f"bias_tile: shard starts {starts} must be multiples of bias_tile={bias_tile}")
    total = starts[-1] + lengths[-1][0]
    _check_relative(relative_keys, relative_content_bias, relative_position_bias, q, k.shape[1], total)

    stats = RingStats()
    stats.dense_bytes = (k.numel() * k.element_size() + v.numel() * v.element_size()) * (world - 1)
    if compress:
        config = CompressionConfig() if config is None else config
        t0 = time.perf_counter()
        ck = compress_kv(k, config, basis_k, impl=impl)
        cv = compress_kv(v, config, basis_v, impl=impl)
        if k.is_cuda:
            torch.cuda.synchronize(k.device)
        stats.compress_seconds = time.perf_counter() - t0
        buffer, layout = _pack(_ckv_tensors(ck) + _ckv_tensors(cv))
        templates = [
            {"shape": c.shape, "dtype": c.dtype, "config": c.config, "shared_basis": c.shared_basis} for c in (ck, cv)
        ]
        meta = (layout, templates, buffer.numel())
    else:
        buffer, layout = _pack([k, v])
        meta = (layout, None, buffer.numel())
    metas = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    send_to, recv_from = ranks[(rank + 1) % world], ranks[(rank - 1) % world]

    out = lse = None
    current = buffer
    for step in range(world):
        src = (rank - step) % world
        pending = []
        if step < world - 1:
            size = metas[(rank - step - 1) % world][2]
            incoming = torch.empty(size, dtype=torch.uint8, device=buffer.device)
            ops = [dist.P2POp(dist.isend, current, send_to, group), dist.P2POp(dist.irecv, incoming, recv_from, group)]
            pending = dist.batch_isend_irecv(ops)
            stats.bytes_sent += current.numel()
        skip = causal and src > rank
        if not skip:
            src_layout, src_templates, _ = metas[src]
            pieces = _unpack(current, src_layout)
            if src_templates is None:
                k_s, v_s = pieces
            else:
                half = len(_FIELDS)
                k_s, v_s = _ckv_from(src_templates[0], pieces[:half]), _ckv_from(src_templates[1], pieces[half:])
            k_len = lengths[src][1]
            block_bias = bias(starts[rank], q.shape[2], starts[src], k_len) if bias is not None else None
            part, part_lse = attention(
                q, k_s, v_s, scale=scale, causal=causal and src == rank, bias=block_bias,
                bias_tile=1 if block_bias is None else bias_tile,
                softcap=softcap, return_lse=True,
                relative_keys=_relative_rows(relative_keys, total, starts[rank], q.shape[2], starts[src], k_len),
                relative_content_bias=relative_content_bias, relative_position_bias=relative_position_bias,
            )
            out, lse = _merge(out, lse, part, part_lse)
        for work in pending:
            work.wait()
        if step < world - 1:
            current = incoming
            stats.steps += 1
    assert out is not None  # the diagonal shard is never skipped
    result = out.to(q.dtype)
    return (result, stats) if return_stats else result


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    relative_keys: torch.Tensor | None = None,
    relative_content_bias: torch.Tensor | None = None,
    relative_position_bias: torch.Tensor | None = None,
):
    """The dense baseline: all-gather K/V shards (equal lengths), then local attention over the whole sequence.

    ``relative_keys`` (the global table ``[Hq, 2N - 1, Dk]``, ``N = world * n_r``), ``relative_content_bias`` and
    ``relative_position_bias`` as in :func:`context_parallel_attention`."""
    from kvbound.attention import attention

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    check_tensor(q, "q", ndim=4, check_finite=False)
    check_tensor(k, "k", ndim=4, check_finite=False)
    shard = q.shape[2]
    total = world * shard
    # Every rank learns every shard's lengths before anything is gathered, so that all raise together (a rank that
    # raised alone would leave the others waiting in the all-gather).
    lengths: list = [None] * world
    dist.all_gather_object(lengths, (q.shape[2], k.shape[2]), group=group)
    if any(pair != (shard, shard) for pair in lengths):
        raise ValueError(f"q, k: expected shards of one equal length on every rank, got (q, k) lengths {lengths}")
    _check_relative(relative_keys, relative_content_bias, relative_position_bias, q, k.shape[1], total)
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    return attention(
        q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), scale=scale, softcap=softcap,
        relative_keys=_relative_rows(relative_keys, total, rank * shard, shard, 0, total),
        relative_content_bias=relative_content_bias, relative_position_bias=relative_position_bias,
    )

