"""``compress_kv``: the public entry point of the codec."""

from __future__ import annotations

import torch

from kvbound.codec.basis import Basis
from kvbound.codec.eager import encode
from kvbound.codec.format import CompressedKV
from kvbound.config import CompressionConfig

__all__ = ["compress_kv"]


def compress_kv(
    x: torch.Tensor,
    config: CompressionConfig | None = None,
    basis: Basis | None = None,
    *,
    impl: str = "eager",
    verify: bool = True,
    anchor: CompressedKV | None = None,
    anchor_index: torch.Tensor | None = None,
    anchor_source: torch.Tensor | None = None,
) -> CompressedKV:
    """Compress K or V with a certified element-wise bound.

    Args:
        x: ``[B, H, N, D]`` float16, bfloat16 or float32, finite, any N >= 1, any strides. Never modified.
        config: block size, rank, bits and the bound ``tau`` (default ``CompressionConfig()``).
        basis: a shared per-head projection from :func:`kvbound.calibrate`; without one each block uses its
            exact truncated SVD (rank 0: residual quantisation only).
        impl: ``"eager"`` (float64 encoder, any basis or none) or ``"triton"`` (fused GPU encoder; needs a
            calibrated basis and rank >= 1; its output is certified by the same float64 check).
        verify: ``impl="triton"`` only: run the float64 certificate on the stored numbers (default). ``False``
            relies on the encoder's conservative in-kernel check alone (see ``encode_triton``) and saves a pass.
        anchor: the compressed form of a reference (for example the reference sequence's K/V when ``x`` is a
            variant's): each block of ``x`` follows the anchor's block, keeping its codes wherever they still
            certify ``x`` within tau, so that paired forwards differ only where the inputs really moved
            (``kvbound.codec.anchored``). Same config, basis, dtype, heads, N and D as ``x``.
        anchor_index: int64 ``[B]``: the anchor's batch item for each item of ``x`` (-1: encode that item on its
            own). Default: item for item when the batches match, item 0 when the anchor has one.
        anchor_source: optional, the tensor the anchor was encoded from: each block then follows the change, its
            low-rank coefficients moved by the change projected on the basis and its codes by the rounded
            remainder, so that small changes inside the basis are carried too (``encode_anchored``).

    Returns:
        a :class:`CompressedKV` whose ``decompress()`` is within ``config.tau`` of ``x`` element-wise.
    """
    config = CompressionConfig() if config is None else config
    if impl == "eager":
        fresh = encode(x, config, basis)
    elif impl == "triton":
        from kvbound.codec.encode_triton import encode_triton

        fresh = encode_triton(x, config, basis, verify=verify)
    else:
        raise ValueError(f"impl: expected 'eager' or 'triton', got {impl!r}")
    if anchor is None:
        given = [name for name, value in (("anchor_index", anchor_index), ("anchor_source", anchor_source))
                 if value is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: given without an anchor (pass anchor=, the reference's encoding)")
        return fresh
    from kvbound.codec.anchored import encode_anchored

    return encode_anchored(x, fresh, anchor, anchor_index, anchor_source, check_fresh=False,  # fresh: just certified
                           source_name="anchor_source")  # fmt: skip
