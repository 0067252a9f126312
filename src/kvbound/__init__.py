"""kvbound: compressed K/V with a certified element-wise error bound, and fused attention over it."""

from kvbound._checks import deferred_checks
from kvbound.attention import attention
from kvbound.codec import Basis, CompressedKV, calibrate, load
from kvbound.compress import compress_kv
from kvbound.config import CompressionConfig
from kvbound.graphs import CapturedForward, capture
from kvbound.models import patch
from kvbound.reference import reference_attention

__version__ = "0.1.0"

__all__ = [
    "Basis",
    "attention",
    "CapturedForward",
    "capture",
    "CompressedKV",
    "CompressionConfig",
    "calibrate",
    "compress_kv",
    "deferred_checks",
    "load",
    "patch",
    "reference_attention",
]
