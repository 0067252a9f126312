"""Small instances of the ports for CPU tests (each test module adds what its own checks need)."""

from __future__ import annotations

import pytest
import torch


def small_enformer(depth: int = 1):
    """``(model, port)``: enformer-pytorch's ``Enformer`` at dim 96, 4 heads of key dim 16, three downsamples (the
    stem and two tower stages), ``depth`` transformer blocks, one output head of 8 tracks; seeded, in eval mode.
    Skips the test when the port is not installed."""
    port = pytest.importorskip("enformer_pytorch", reason="enformer_pytorch is not installed (kvbound[models])")
    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=96, depth=depth, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=8),
    ).eval()  # fmt: skip
    return model, port


def small_borzoi():
    """``(model, x)``: borzoi-pytorch's ``Borzoi`` at dim 64, one transformer block of 2 heads (key dim 8, value dim
    16), 64 bins returned, seeded and in eval mode, and a ``[1, 4, 4096]`` input. Skips the test when the port is
    not installed."""
    port = pytest.importorskip("borzoi_pytorch", reason="borzoi_pytorch is not installed (kvbound[models])")
    from borzoi_pytorch.config_borzoi import BorzoiConfig

    torch.manual_seed(0)
    model = port.Borzoi(
        BorzoiConfig(dim=64, depth=1, heads=2, attn_dim_key=8, attn_dim_value=16, bins_to_return=64)
    ).eval()
    return model, torch.randn(1, 4, 128 * 32, generator=torch.Generator().manual_seed(2))
