"""Attention over one query chunk: ``kvbound.attention`` when asked for (or available on CUDA), else eager.

Both lean paths (relative positions, tile bias) reduce every query chunk to
``softmax(softcap(scale * q k^T + bias)) v`` with a ``[B, Hq, Bq, Nk]`` bias, which is exactly what
``kvbound.attention`` takes (the tile bias also in its compact form, ``bias_tile``, over all queries at once).
Relative positions go to ``kvbound.attention`` whole (``attend_relative``), over dense or compressed K/V: the
kernels form each tile's relative term on chip, so no query chunking and no bias tensor at all.
The eager form below is the same formula in the caller's dtype with float32 logits, chunk by chunk; it is what
runs on the CPU and whenever ``kvbound.attention`` is not importable.
"""

from __future__ import annotations

import torch

from kvbound.codec.format import CompressedKV

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "attend_chunk",
    "attend_relative",
    "fuses_relative",
    "materialize_kv",
    "default_query_chunk",
]

BACKENDS = ("auto", "eager", "kvbound")

# Elements of float32 logits (bias + logits of one query chunk) kept alive at once: 2**25 = 128 MiB each.
_CHUNK_ELEMENTS = 1 << 25


def _kvbound_attention():
    """The fused ``kvbound.attention`` function, or None when this installation has none."""
    try:
        from kvbound.attention import attention
    except ImportError:
        return None
    return attention if callable(attention) else None


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``kvbound`` on CUDA when ``kvbound.attention`` exists, else ``eager``. An explicit
    ``kvbound`` that cannot be served raises; it never falls back."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "eager":
        return "eager"
    available = _kvbound_attention() is not None
    if backend == "kvbound":
        if not available:
            raise RuntimeError("backend='kvbound': kvbound.attention is not available in this installation")
        return "kvbound"
    return "kvbound" if available and device.type == "cuda" else "eager"


def default_query_chunk(batch: int, q_heads: int, n_k: int, multiple: int = 16) -> int:
    """Rows per query chunk so that one chunk's float32 logits stay under ``_CHUNK_ELEMENTS``."""
    rows = _CHUNK_ELEMENTS // max(1, batch * q_heads * 2 * n_k)
    return max(multiple, rows // multiple * multiple)


def materialize_kv(x: torch.Tensor | CompressedKV, backend: str) -> torch.Tensor | CompressedKV:
    """What the backend reads: the eager path decodes a compressed tensor once per forward (float32,
    ``[B, H, N, D]``: O(N) memory); ``kvbound.attention`` reads the compressed form itself."""
    if backend == "eager" and isinstance(x, CompressedKV):
        return x.decompress()
    return x


def attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    *,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    backend: str,
    bias_tile: int = 1,
) -> torch.Tensor:
    """``softmax(softcap(scale * q k^T + bias)) v`` for one query chunk.

    Args:
        q: ``[B, Hq, Bq, Dk]``.
        k: ``[B, Hkv, Nk, Dk]``, v: ``[B, Hkv, Nk, Dv]`` (tensors, or ``CompressedKV`` for ``kvbound``);
            query head ``h`` reads K/V head ``h // (Hq // Hkv)``.
        bias: ``[B, Hq, Bq, Nk]`` (or broadcastable) float32, or None. With ``bias_tile = T > 1`` (``kvbound``
            only) the compact tile bias ``[B, Hq, ceil(Bq / T), ceil(Nk / T)]`` of ``kvbound.attention``.
        scale, softcap: as in ``kvbound.reference_attention``.
        backend: ``eager`` or ``kvbound`` (already resolved).

    Returns:
        ``[B, Hq, Bq, Dv]``: in q's dtype for ``kvbound``; for ``eager`` in the dtype of ``weights @ v``
        (q's dtype for dense inputs, float32 for decoded ones).
    """
    if backend == "kvbound":
        attention = _kvbound_attention()
        return attention(q, k, v, scale=scale, bias=bias, bias_tile=bias_tile, softcap=softcap)
    if bias_tile != 1:
        raise ValueError(f"bias_tile: the eager backend takes an expanded bias (bias_tile=1), got {bias_tile}")
    b, hq, bq, dk = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if k.dtype != q.dtype:
        q = q.to(k.dtype)
    # [B, Hkv, group * Bq, Dk]: every query head of a K/V head shares one product with that head's keys.
    qg = q.reshape(b, hkv, group * bq, dk)
    logits = (qg @ k.transpose(-1, -2)).float().reshape(b, hq, bq, -1) * scale
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    weights = torch.softmax(logits, dim=-1).to(v.dtype)
    return (weights.reshape(b, hkv, group * bq, -1) @ v).reshape(b, hq, bq, -1)


def fuses_relative(k: torch.Tensor | CompressedKV, v: torch.Tensor | CompressedKV) -> bool:
    """Whether ``kvbound.attention`` takes relative positions for these K/V in one fused call: both dense
    tensors or both ``CompressedKV`` (the dense and the compressed kernels each have a relative tile)."""
    return isinstance(k, CompressedKV) == isinstance(v, CompressedKV)


def attend_relative(
    q: torch.Tensor,
    k: torch.Tensor | CompressedKV,
    v: torch.Tensor | CompressedKV,
    relative_keys: torch.Tensor,
    content_bias: torch.Tensor,
    position_bias: torch.Tensor,
    *,
    scale: float,
    relative_runs: list[int] | None = None,
) -> torch.Tensor:
    """Transformer-XL relative-position attention over all queries in one ``kvbound.attention`` call.
    ``relative_runs``: first rows of runs of equal rows of ``relative_keys`` (``kvbound.attention``).


    Args:
        q: ``[B, H, N, Dk]`` before scaling; k: ``[B, H, N, Dk]``; v: ``[B, H, N, Dv]`` (dense in q's dtype, or
            both ``CompressedKV``: then the logits use the decoded keys, read in place by the compressed kernel).
        relative_keys: ``[H, 2N - 1, Dk]``, or one row per run with ``relative_runs`` (cast to q's dtype, the
            kernel's operand type).
        content_bias, position_bias: ``u``, ``v`` broadcastable to ``[1, H, 1, Dk]``.

    Returns:
        ``[B, H, N, Dv]`` in q's dtype.
    """
    attention = _kvbound_attention()
    return attention(
        q,
        k,
        v,
        scale=scale,
        relative_keys=relative_keys.to(q.dtype),
        relative_content_bias=content_bias,
        relative_position_bias=position_bias,
        relative_runs=relative_runs,
    )
