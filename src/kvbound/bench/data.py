"""Benchmark inputs with the structure of real K/V, and the attention biases of the genomic models.

K and V (``structured_kv``) are built as ``x = C @ P + R``:

* ``P`` ``[H, 8, D]``: a fixed orthonormal 8-dimensional subspace per head (the layer's projection; the same for
  the calibration samples and the measured input, as for one model). Singular values decay as ``0.7**i`` and
  are scaled so that every element has variance 1, the scale of LayerNorm-ed activations through a projection.
* ``C``: per-token coefficients, white noise smoothed over 9 neighbouring tokens (neighbouring genomic tokens
  are correlated).
* ``R``: the structured residual, drawn per block of ``block_size`` tokens. A chosen share of blocks
  (``zero_tile_share``) hold only noise of at most ``tau / 4``: together with bf16 rounding they stay within the
  bound of the low-rank part, so the codec stores them without residual (mode 0) and the fused kernel can skip
  their residual work. The other blocks also carry sparse features: ``D / 16`` channels with amplitudes of 2 to
  7 ``tau`` under a bump over the block's tokens (a motif seen by a few channels), which need codes.

The generator never returns zeros or pure noise, and the share of residual-free blocks is controlled, not
accidental; each benchmark row records the share the codec actually found (``zero_residual_share``).

Queries (``structured_queries``) lie mostly in K's subspace, so logits spread (std 2 to 3) as in trained
attention rather than giving the flat softmax of independent noise.
"""

from __future__ import annotations

import math

import torch

from kvbound.config import DEFAULT_TAU

__all__ = [
    "TRUE_RANK",
    "kv_subspace",
    "structured_kv",
    "structured_queries",
    "residual_free_case",
    "tile_pair_bias",
    "relative_position_table",
    "dense_bias",
]

TRUE_RANK = 8
_SMOOTHING = 9


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def kv_subspace(heads: int, head_dim: int, *, rank: int = TRUE_RANK, seed: int = 0,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """``[H, rank, D]`` float32 with orthonormal rows per head."""
    rank = min(rank, head_dim)
    g = _generator(seed, torch.device("cpu"))
    gaussian = torch.randn(heads, head_dim, rank, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(gaussian)
    return q.transpose(1, 2).to(torch.float32).to(device)


def _smooth_along_tokens(x: torch.Tensor) -> torch.Tensor:
    """Moving average over ``_SMOOTHING`` tokens of ``[..., N, R]``, rescaled to keep unit variance."""
    *lead, n, r = x.shape
    flat = x.reshape(-1, n, r).transpose(1, 2).reshape(-1, 1, n)
    kernel = torch.ones(1, 1, _SMOOTHING, device=x.device, dtype=x.dtype) / math.sqrt(_SMOOTHING)
    smooth = torch.nn.functional.conv1d(flat, kernel, padding=_SMOOTHING // 2)
    return smooth.reshape(-1, r, n).transpose(1, 2).reshape(*lead, n, r)


def structured_kv(
    batch: int,
    seq_len: int,
    subspace: torch.Tensor,
    *,
    zero_tile_share: float = 0.5,
    block_size: int = 128,
    tau: float = DEFAULT_TAU,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """``[B, H, N, D]`` K or V with low-rank structure and a block-structured residual (module docstring).

    Args:
        subspace: ``[H, r, D]`` from :func:`kv_subspace` (its device is used).
        zero_tile_share: share of blocks of each head whose residual stays below ``tau`` (rounded to whole blocks).
        block_size: the codec's block size the residual blocks align with.
        tau: the bound the residual amplitudes are expressed in.
    """
    if not 0.0 <= zero_tile_share <= 1.0:
        raise ValueError(f"zero_tile_share: expected a value in [0, 1], got {zero_tile_share!r}")
    heads, rank, dim = subspace.shape
    device = subspace.device
    g = _generator(seed, device)
    f32 = torch.float32

    spectrum = 0.7 ** torch.arange(rank, device=device, dtype=f32)
    spectrum = spectrum * math.sqrt(dim / float((spectrum**2).sum()))
    coeffs = _smooth_along_tokens(torch.randn(batch, heads, seq_len, rank, generator=g, device=device, dtype=f32))
    x = (coeffs * spectrum) @ subspace  # [B, H, N, D]

    blocks = -(-seq_len // block_size)
    padded = blocks * block_size
    noise = (torch.rand(batch, heads, padded, dim, generator=g, device=device, dtype=f32) - 0.5) * (tau / 2)
    active_count = round((1.0 - zero_tile_share) * blocks)
    order = torch.rand(batch, heads, blocks, generator=g, device=device).argsort(dim=-1)
    active = order < active_count  # exactly active_count blocks per head
    channels = max(1, dim // 16)
    picks = torch.rand(batch, heads, blocks, dim, generator=g, device=device).argsort(dim=-1) < channels
    amplitude = (2.0 + 5.0 * torch.rand(batch, heads, blocks, dim, generator=g, device=device, dtype=f32)) * tau
    sign = torch.where(torch.rand(batch, heads, blocks, dim, generator=g, device=device) < 0.5, -1.0, 1.0)
    features = amplitude * sign * picks * active[..., None]  # [B, H, NB, D]
    centre = torch.rand(batch, heads, blocks, 1, generator=g, device=device, dtype=f32) * block_size
    width = block_size / 4
    rows = torch.arange(block_size, device=device, dtype=f32)
    envelope = torch.exp(-(((rows - centre) / width) ** 2))  # [B, H, NB, block]
    envelope = envelope / envelope.amax(dim=-1, keepdim=True)
    residual = envelope[..., None] * features[..., None, :]  # [B, H, NB, block, D]
    residual = residual.reshape(batch, heads, padded, dim) + noise
    return (x + residual[:, :, :seq_len]).to(dtype)


def structured_queries(
    batch: int, q_heads: int, seq_len: int, k_subspace: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> torch.Tensor:
    """``[B, Hq, N, Dk]``: query head ``h`` lies mostly in the subspace of K/V head ``h // (Hq / Hkv)``."""
    kv_heads, rank, dim = k_subspace.shape
    device = k_subspace.device
    g = _generator(seed, device)
    group = q_heads // kv_heads
    basis = k_subspace.repeat_interleave(group, dim=0)  # [Hq, r, D]
    z = torch.randn(batch, q_heads, seq_len, rank, generator=g, device=device) * math.sqrt(dim / rank) * 0.8
    noise = 0.6 * torch.randn(batch, q_heads, seq_len, dim, generator=g, device=device)
    return (z @ basis + noise).to(dtype)


def residual_free_case(heads: int, seq_len: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                       device: torch.device | str = "cpu", block_size: int = 128, rank: int = 8):  # fmt: skip
    """``(q, ck, cv, tau)`` with every block of the compressed K and V low rank only, built as ``kvbound bench``'s
    ``lowrank-r8`` inputs are (this module's generator with every block residual-free, a shared basis calibrated on
    another draw; its own seeds), the tolerance raised from 8x the default until no block keeps a residual. Raises
    ValueError when none up to 64 does."""
    import kvbound  # the package imports this module's users, not this module

    k_sub = kv_subspace(heads, head_dim, seed=1, device=device)
    v_sub = kv_subspace(heads, head_dim, seed=2, device=device)

    def kv(sub, seed):
        return structured_kv(1, seq_len, sub, zero_tile_share=1.0, block_size=block_size, dtype=dtype, seed=seed)

    q = structured_queries(1, heads, seq_len, k_sub, dtype=dtype, seed=3)
    k, v = kv(k_sub, 4), kv(v_sub, 5)
    tau = 8 * DEFAULT_TAU
    while True:
        config = kvbound.CompressionConfig(block_size=block_size, rank=rank, bits=4, tau=tau)
        bases = [kvbound.calibrate(kv(sub, seed), config) for sub, seed in ((k_sub, 14), (v_sub, 15))]
        ck, cv = (kvbound.compress_kv(x, config, basis) for x, basis in zip((k, v), bases, strict=True))
        if all(bool((c.mode == 0).all()) for c in (ck, cv)):
            return q, ck, cv, tau
        if tau >= 64.0:
            raise ValueError(f"d={head_dim}, N={seq_len}: no tau up to {tau:g} leaves every block low rank only")
        tau *= 2


def tile_pair_bias(batch: int, q_heads: int, q_len: int, kv_len: int, tile: int, *,
                   dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, Hq, Nq / tile, Nk / tile]``: AlphaGenome's pair bias, one value per ``tile x tile`` token tile."""
    g = _generator(seed, torch.device(device))
    return torch.randn(batch, q_heads, q_len // tile, kv_len // tile, generator=g, device=device).to(dtype)


def relative_position_table(q_heads: int, q_len: int, kv_len: int, *, dtype: torch.dtype = torch.bfloat16,
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """``[Hq, Nq + Nk - 1]``: bias of offset ``i - j`` at index ``i - j + Nk - 1``. Each head mixes a
    logarithmic distance decay (its own slope) with a periodic term, the kind of function that relative
    positional features produce."""
    offsets = torch.arange(-(kv_len - 1), q_len, device=device, dtype=torch.float32)
    heads = torch.arange(q_heads, device=device, dtype=torch.float32)[:, None]
    slope = 2.0 ** (-(heads + 1) / 2)
    period = 10.0 * (heads + 1)
    table = -slope * torch.log1p(offsets.abs()) + 0.5 * torch.sin(2 * math.pi * offsets / period)
    return table.to(dtype)


def dense_bias(kind: str, compact: torch.Tensor, q_len: int, kv_len: int, tile: int = 16) -> torch.Tensor:
    """Materialise a compact bias as ``[B or 1, Hq, Nq, Nk]`` in its own dtype."""
    if kind == "tile":
        return compact.repeat_interleave(tile, dim=-2).repeat_interleave(tile, dim=-1).contiguous()
    if kind == "relpos":
        i = torch.arange(q_len, device=compact.device)[:, None]
        j = torch.arange(kv_len, device=compact.device)[None, :]
        return compact[:, i - j + kv_len - 1].unsqueeze(0).contiguous()
    raise ValueError(f"kind: expected 'tile' or 'relpos', got {kind!r}")
