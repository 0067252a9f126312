"""Compression settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CompressionConfig", "DEFAULT_TAU", "MAX_BLOCK_SIZE", "SUPPORTED_BITS"]

SUPPORTED_BITS = (2, 3, 4, 8)

# Largest block size. The kernels and the Triton encoder take the block size as a compile-time power of two and set
# no limit of their own; the eager encoder pads every block to ``block_size`` rows in float64, so a block far beyond
# N costs memory and time for nothing (2**20 on 32 tokens: 1.8 GiB), and the per-block metadata (mode, width, step,
# offset: 14 bytes) is already negligible next to 2**16 rows of codes.
MAX_BLOCK_SIZE = 2**16

# Default absolute bound. Attention inputs in these models come out of a LayerNorm-ed residual stream
# through a projection, so K and V entries are O(1) (std 0.6 for the demo's conv + projection layer; 0.3-3 is
# typical of LayerNorm-ed projections). bf16 already rounds such values by up to 2^-8 relative (0.004-0.016
# absolute at |x| = 1-4). 2^-5 = 0.03125 is a few bf16 ulps at unit scale: large enough that smooth K/V blocks
# are covered by the low-rank part alone (their residual tiles are skipped by the kernel), small enough that the
# logit perturbation |q . (k - k_hat)| * scale <= ||q||_1 * tau / sqrt(d) stays well under one unit for
# unit-variance q. It is a power of two so that the quantisation step 2 * tau is exact in every float format.
DEFAULT_TAU = 2.0**-5


@dataclass(frozen=True)
class CompressionConfig:
    """How K or V is compressed.

    Args:
        block_size: tokens per block along the sequence; a power of two from 16 to ``MAX_BLOCK_SIZE`` (2**16).
        rank: rank of the low-rank part (0 = residual quantisation only); must be < head dim.
        bits: bits per residual code, one of 2, 3, 4, 8. Blocks whose residual does not fit are
            promoted to wider codes (4, 5, 6 or 8 bits), and to exact storage when even that fails (see
            ``CompressedKV``).
        tau: the certified absolute bound: every reconstructed element is within ``tau`` of the input.
    """

    block_size: int = 128
    rank: int = 8
    bits: int = 4
    tau: float = DEFAULT_TAU

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"CompressionConfig.block_size: expected int, got {type(self.block_size).__name__}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"CompressionConfig.block_size: expected a power of two >= 16, got {self.block_size}"
            )
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(
                f"CompressionConfig.block_size: expected at most {MAX_BLOCK_SIZE} (2**16: every block is padded to "
                f"block_size rows when encoded, and larger blocks save no storage), got {self.block_size}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"CompressionConfig.rank: expected int, got {type(self.rank).__name__}")
        if self.rank < 0:
            raise ValueError(f"CompressionConfig.rank: expected >= 0, got {self.rank}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"CompressionConfig.bits: expected int, got {type(self.bits).__name__}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"CompressionConfig.bits: expected one of {SUPPORTED_BITS}, got {self.bits!r}")
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)):
            raise TypeError(f"CompressionConfig.tau: expected float, got {type(self.tau).__name__}")
        if not math.isfinite(self.tau) or self.tau <= 0:
            raise ValueError(f"CompressionConfig.tau: expected a finite value > 0, got {self.tau!r}")
        object.__setattr__(self, "tau", float(self.tau))

    def check_head_dim(self, head_dim: int, name: str = "x") -> None:
        """Raise if this config cannot compress a head dimension of ``head_dim``."""
        if self.rank >= head_dim:
            raise ValueError(
                f"{name}: CompressionConfig.rank must be < head dim; got rank {self.rank} for head dim {head_dim}"
            )

    def as_dict(self) -> dict:
        return {"block_size": self.block_size, "rank": self.rank, "bits": self.bits, "tau": self.tau}
