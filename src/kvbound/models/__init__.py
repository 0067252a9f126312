"""Enformer, Borzoi and AlphaGenome ports: float64 references of their attention, memory-lean forwards, and
``patch`` to run a loaded model with them (K/V optionally compressed), and ``load`` to read their trained weights
offline. See README.md in this folder."""

from kvbound.models.bounds import attention_output_bound, linear_output_bound
from kvbound.models.checkpoints import hub_offline, load
from kvbound.models.patch import PatchedModule, PatchHandle, patch
from kvbound.models.relative import relative_position_attention
from kvbound.models.tile_bias import TileBias, tile_bias_attention

__all__ = [
    "PatchHandle",
    "PatchedModule",
    "TileBias",
    "attention_output_bound",
    "hub_offline",
    "linear_output_bound",
    "load",
    "patch",
    "relative_position_attention",
    "tile_bias_attention",
]
