"""The compressed K/V format, its eager codec and the calibrated bases."""

from kvbound.codec.basis import Basis, calibrate
from kvbound.codec.format import CompressedKV, load

__all__ = ["Basis", "CompressedKV", "calibrate", "load"]
