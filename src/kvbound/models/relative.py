"""Transformer-XL relative-position attention (Enformer, Borzoi) without an N x N tensor per head at once.

The ports form ``(scale q + v) @ relative_keys^T`` as ``[B, H, N, 2N - 1]`` and shift it to ``[B, H, N, N]``.
Query rows ``i0 .. i1 - 1`` only ever read the ``Bq + N - 1`` relative rows ``m = N - i1 .. 2N - 2 - i0``
(``Bq = i1 - i0``), so each query chunk builds its own ``[B, H, Bq, Bq + N - 1]`` window product, shifts it
with a strided view, and hands ``scale q + u`` with that bias to one attention call::

    logits[i, j] = (scale q_i + u) . k_j  +  (scale q_i + v) . relative_keys[N - 1 + j - i]

The content term is a plain ``q' k^T`` with ``q' = scale q + u`` and scale 1, so K and V may be compressed.

On the ``kvbound`` backend there is no chunking, for dense and compressed K/V alike: one
``kvbound.attention(..., relative_keys=...)`` call per layer, whose kernel forms each tile's relative term on chip
from the ``BM + BN - 1`` relative keys the tile needs (``kvbound.kernels._common.relative_logits_tile``).
"""

from __future__ import annotations

import torch

from kvbound.attention import expand_run_keys
from kvbound.codec.format import CompressedKV
from kvbound.models._backend import (
    attend_chunk,
    attend_relative,
    default_query_chunk,
    fuses_relative,
    materialize_kv,
    resolve_backend,
)

__all__ = ["equal_row_runs", "relative_position_attention", "relative_window", "shifted_view"]


def equal_row_runs(rows: torch.Tensor) -> list[int]:
    """The first index of each run of equal rows of ``rows`` (``[M, F]``; one host read): the ``relative_runs`` of
    relative keys projected from these rows (Borzoi's positional features give at most 33 runs)."""
    changes = (rows[1:] != rows[:-1]).any(dim=-1).nonzero().flatten() + 1
    return [0, *changes.tolist()]


def relative_window(query: torch.Tensor, relative_keys: torch.Tensor, start: int, stop: int, n_k: int) -> torch.Tensor:
    """Relative logits of query rows ``start .. stop - 1`` against all ``n_k`` keys.

    Args:
        query: ``[B, H, stop - start, Dk]``: ``scale q + v`` of those rows.
        relative_keys: ``[H, 2 n_k - 1, Dk]`` (row ``m`` = distance ``m - (n_k - 1)``).

    Returns:
        ``[B, H, stop - start, n_k]`` float32 with ``out[a, j] = query[a] . relative_keys[n_k - 1 + j - start - a]``.
    """
    window = relative_keys[:, n_k - stop : 2 * n_k - 1 - start]  # [H, rows + n_k - 1, Dk]
    return shifted_view(torch.einsum("bhad,hwd->bhaw", query, window).float(), n_k)


def shifted_view(table: torch.Tensor, n_k: int) -> torch.Tensor:
    """The relative shift as a view: ``[B, H, R, R + n_k - 1] -> [B, H, R, n_k]`` with
    ``out[a, j] = table[a, R - 1 + j - a]`` (row ``a`` starts ``a`` columns further left: a row stride of
    ``width - 1``). ``table`` is made contiguous first."""
    table = table.contiguous()
    b, h, rows, width = table.shape
    return table.as_strided(
        (b, h, rows, n_k),
        (h * rows * width, rows * width, width - 1, 1),
        table.storage_offset() + rows - 1,
    )


def relative_position_attention(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    relative_keys: torch.Tensor,
    content_bias: torch.Tensor,
    position_bias: torch.Tensor,
    *,
    scale: float,
    query_chunk: int | None = None,
    backend: str = "auto",
    relative_runs: list[int] | None = None,
) -> torch.Tensor:
    """Enformer/Borzoi attention core, chunked over queries.

    Args:
        q: ``[B, H, N, Dk]`` queries before scaling.
        k: ``[B, H, N, Dk]``, v: ``[B, H, N, Dv]``: tensors or ``CompressedKV`` (then attention runs on the
            decoded values, which are within the codec's bound of the originals).
        relative_keys: ``[H, 2N - 1, Dk]``; row ``m`` holds distance ``m - (N - 1)``.
        content_bias, position_bias: ``u`` and ``v`` of Transformer-XL, broadcastable to ``[1, H, 1, Dk]``.
        scale: applied to ``q`` before the biases (``Dk ** -0.5`` in the ports).
        query_chunk: rows per chunk (default: float32 logits of one chunk stay under 128 MiB). Not used on the
            ``kvbound`` backend: that is one fused call over all queries (dense or compressed K/V).
        backend: ``auto``, ``eager`` or ``kvbound`` (see ``kvbound.models._backend``).
        relative_runs: first rows of runs of equal rows of ``relative_keys``, for the fused call on dense or
            compressed K/V (``kvbound.attention``'s ``relative_runs``). With it, ``relative_keys`` may hold one row
            per run, ``[H, len(relative_runs), Dk]``, which the chunked path expands.

    Returns:
        ``[B, H, N, Dv]`` in q's dtype (float32 when K/V are decoded by the eager path).

    Peak extra memory is ``O(B H Bq N)`` for one chunk, never ``B H N N``; ``O(B H N Dk)`` for the fused call. Formula:
    :func:`kvbound.models.reference.relative_position_attention_reference`.
    """
    b, h, n, dk = q.shape
    if tuple(k.shape) != (b, h, n, dk):
        raise ValueError(f"k: expected shape {(b, h, n, dk)} (from q), got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (b, h, n):
        raise ValueError(f"v: expected shape [{b}, {h}, {n}, Dv] (from q), got {tuple(v.shape)}")
    per_run = None if relative_runs is None else (h, len(relative_runs), dk)
    if tuple(relative_keys.shape) not in ((h, 2 * n - 1, dk), per_run):
        also = "" if per_run is None else f" or, one row per run, {per_run}"
        raise ValueError(f"relative_keys: expected shape {(h, 2 * n - 1, dk)}{also}, got {tuple(relative_keys.shape)}")
    backend = resolve_backend(backend, q.device)
    chunk = query_chunk or default_query_chunk(b, h, n)
    if chunk < 1:
        raise ValueError(f"query_chunk: expected >= 1, got {chunk}")
    if backend == "kvbound" and fuses_relative(k, v):
        return attend_relative(
            q, k, v, relative_keys, content_bias, position_bias, scale=scale, relative_runs=relative_runs
        )
    if relative_keys.shape[1] != 2 * n - 1:
        relative_keys = expand_run_keys(relative_keys, relative_runs, 2 * n - 1)
    k = materialize_kv(k, backend)
    v = materialize_kv(v, backend)
    q_scaled = q * scale
    u = content_bias.reshape(1, h, 1, dk)
    pos = position_bias.reshape(1, h, 1, dk)
    outputs = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = q_scaled[:, :, start:stop]
        bias = relative_window(rows + pos, relative_keys, start, stop, n)
        outputs.append(attend_chunk(rows + u, k, v, bias=bias, scale=1.0, softcap=None, backend=backend))
    return torch.cat(outputs, dim=2)
