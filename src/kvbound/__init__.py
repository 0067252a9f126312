"""kvbound: compressed K/V with a certified element-wise error bound, and fused attention over it."""

from kvbound.codec import Basis, CompressedKV, calibrate, load
from kvbound.compress import compress_kv
from kvbound.config import CompressionConfig
from kvbound.reference import reference_attention

__version__ = "0.1.0"

__all__ = [
    "Basis",
    "CompressedKV",
    "CompressionConfig",
    "calibrate",
    "compress_kv",
    "load",
    "reference_attention",
]
