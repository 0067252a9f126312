"""AlphaGenome attention with its pair bias kept at tile resolution.

AlphaGenome's bias is constant over 16 x 16 blocks of (query, key) positions: the port expands
``[B, 8, S/16, S/16]`` to ``[B, 8, S, S]`` (a 2.1 GB float32 tensor per layer at S = 8192) before adding it to
float32 logits of the same size. Here the compact bias travels as a :class:`TileBias`::

    logits[h, i, j] = c * tanh((scale q_hi . k_j + tile_bias[h, i // T, j // T]) / c)

The fused backend (``kvbound.attention``) reads the compact ``[B, 8, S/16, S/16]`` tensor itself
(``bias_tile=16``) in one call over the whole sequence; nothing is expanded. The eager backend expands only the
rows of one query chunk, ``[B, 8, Bq, S]``, per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbound.codec.format import CompressedKV
from kvbound.models._backend import attend_chunk, default_query_chunk, materialize_kv, resolve_backend

__all__ = ["TileBias", "tile_bias_attention", "expand_tile_rows"]


@dataclass(frozen=True)
class TileBias:
    """A pair bias constant over ``tile_size x tile_size`` blocks.

    ``values`` is ``[B, H, ceil(Nq / T), ceil(Nk / T)]``; element ``(i, j)`` of the full bias is
    ``values[..., i // T, j // T]``. ``expand()`` materialises the full ``[B, H, Nq, Nk]`` form (what the port
    passes around); the lean path never calls it.
    """

    values: torch.Tensor
    tile_size: int
    n_q: int
    n_k: int

    def __post_init__(self) -> None:
        if self.values.dim() != 4:
            raise ValueError(f"TileBias.values: expected 4 dimensions, got shape {tuple(self.values.shape)}")
        t = self.tile_size
        expected = (-(-self.n_q // t), -(-self.n_k // t))
        if tuple(self.values.shape[2:]) != expected:
            raise ValueError(
                f"TileBias.values: expected [B, H, {expected[0]}, {expected[1]}] for Nq={self.n_q}, "
                f"Nk={self.n_k}, tile {t}; got {tuple(self.values.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.values.shape[0], self.values.shape[1], self.n_q, self.n_k)

    def expand(self) -> torch.Tensor:
        return expand_tile_rows(self, 0, self.n_q)


def expand_tile_rows(bias: TileBias, start: int, stop: int) -> torch.Tensor:
    """Rows ``start .. stop - 1`` of the full bias: ``[B, H, stop - start, Nk]`` in the dtype of ``values``."""
    t = bias.tile_size
    rows = bias.values[:, :, start // t : -(-stop // t)]
    rows = rows.repeat_interleave(t, dim=2)[:, :, start - (start // t) * t :][:, :, : stop - start]
    return rows.repeat_interleave(t, dim=3)[..., : bias.n_k]


def tile_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    bias: TileBias | torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None,
    query_chunk: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Soft-capped attention with a tile (or full) bias, chunked over queries, GQA/MQA aware.

    Args:
        q: ``[B, Hq, N, Dk]`` (AlphaGenome: 8 heads, after LayerNorm and RoPE).
        k: ``[B, Hkv, N, Dk]``, v: ``[B, Hkv, N, Dv]`` (AlphaGenome: one shared head), tensors or
            ``CompressedKV``; ``Hq`` a multiple of ``Hkv``.
        bias: a :class:`TileBias` of shape ``[B, Hq, N, N]``, or a full tensor broadcastable to it (the eager
            backend slices its rows per chunk), or None.
        scale: logit scale (AlphaGenome: ``1 / sqrt(128)``); softcap: ``c`` (AlphaGenome: 5.0) or None.
        query_chunk: rows per chunk for the eager backend (a multiple of the tile size is cheapest); default
            from a memory budget. The fused backend needs no chunks (its memory is O(N)) and makes one call
            over all queries, reading a ``TileBias`` in its compact form; only a tile size that is not a power
            of two (which the kernels cannot index) is expanded chunk by chunk there too.
        backend: ``auto``, ``eager`` or ``kvbound``.

    Returns:
        ``[B, Hq, N, Dv]`` (dtype as :func:`kvbound.models._backend.attend_chunk`). Formula:
        :func:`kvbound.models.reference.tile_bias_attention_reference`.
    """
    b, hq, n, dk = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != dk:
        raise ValueError(f"k: expected shape [{b}, Hkv, {n}, {dk}] (from q), got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (b, hkv, n):
        raise ValueError(f"v: expected shape [{b}, {hkv}, {n}, Dv] (from k), got {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"q: expected a head count that is a multiple of k's {hkv}, got {hq}")
    if isinstance(bias, TileBias) and (bias.n_q, bias.n_k) != (n, n):
        raise ValueError(f"bias: expected a TileBias over {n} x {n} positions, got {bias.n_q} x {bias.n_k}")
    backend = resolve_backend(backend, q.device)
    multiple = bias.tile_size if isinstance(bias, TileBias) else 16
    chunk = query_chunk or default_query_chunk(b, hq, n, multiple)
    if chunk < 1:
        raise ValueError(f"query_chunk: expected >= 1, got {chunk}")
    k = materialize_kv(k, backend)
    v = materialize_kv(v, backend)
    full = None
    if isinstance(bias, torch.Tensor):
        try:
            full = bias.expand(b, hq, n, n)
        except RuntimeError as err:
            raise ValueError(
                f"bias: expected a TileBias or a tensor broadcastable to {(b, hq, n, n)}, got {tuple(bias.shape)}"
            ) from err
    if backend == "kvbound":
        if isinstance(bias, TileBias) and _power_of_two(bias.tile_size):
            return attend_chunk(
                q, k, v, bias=bias.values, bias_tile=bias.tile_size, scale=scale, softcap=softcap, backend=backend
            )
        if not isinstance(bias, TileBias):
            # A full (or broadcast) bias goes as it is: the kernels read its broadcast dimensions with stride 0.
            return attend_chunk(q, k, v, bias=bias, scale=scale, softcap=softcap, backend=backend)
    outputs = []
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        if isinstance(bias, TileBias):
            rows = expand_tile_rows(bias, start, stop).float()
        elif full is not None:
            rows = full[:, :, start:stop].float()
        else:
            rows = None
        outputs.append(
            attend_chunk(q[:, :, start:stop], k, v, bias=rows, scale=scale, softcap=softcap, backend=backend)
        )
    return torch.cat(outputs, dim=2)


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0
