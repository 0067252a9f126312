"""Variant scoring reads the model at the TSS bin, with the alternative base placed where the variant is.

A linear stand-in model with a known answer replaces the trained network: its expression output at output bin
``j`` is ``sum_p exp(-|p - c_j| / L) * [base at p is G] / (2 L)`` with ``c_j`` the centre of the input bin that output
bin ``j`` stands for (after the central crop). The predicted change of a variant is then exactly
``exp(-|position - centre of the TSS bin| / L) * ([alt is G] - [ref is G]) / (2 L)``: a window, crop, bin or sign
mismatch between the scorer and the model moves it by a factor ``exp(+-128 / L)`` or flips it.
"""

import types

import numpy as np
import pytest
import torch

from kvbound.eval import cli
from kvbound.eval.metrics import auroc
from kvbound.eval.models import BIN_SIZE, ModelConfig
from kvbound.eval.variants import VariantConfig, generate_variants
from kvbound.eval.windows import load_benchmark, split_intervals

DECAY_BP = 1_000.0
NORM = 2 * DECAY_BP


class _LinearGuanineModel(torch.nn.Module):
    def __init__(self, config: ModelConfig, expression_track: int):
        super().__init__()
        self.config = config
        self.expression_track = expression_track
        crop = (config.window_bins - config.target_bins) // 2
        centres = (crop + torch.arange(config.target_bins, dtype=torch.float64)) * BIN_SIZE + BIN_SIZE / 2
        positions = torch.arange(config.window_bp, dtype=torch.float64)
        # divided by a constant that keeps outputs near 1: the scorer differences them in float32
        self.register_buffer("weight", torch.exp(-(positions[None] - centres[:, None]).abs() / DECAY_BP) / NORM)

    def forward(self, one_hot: torch.Tensor) -> torch.Tensor:
        guanine = one_hot[:, 2].to(torch.float64)  # [B, L]
        out = torch.zeros(one_hot.shape[0], self.config.target_bins, self.config.n_tracks, dtype=torch.float64)
        out[:, :, self.expression_track] = guanine @ self.weight.T
        return out


@pytest.fixture(scope="module")
def fixture_benchmark(tmp_path_factory):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_benchmark(fixture=tmp_path_factory.mktemp("fixture"))
    finally:
        torch.set_num_threads(previous)


def test_variant_effects_are_read_at_the_tss_bin_of_the_variant_window(fixture_benchmark):
    benchmark = fixture_benchmark
    tracks = benchmark.config.track_names
    config = ModelConfig.toy("enformer", len(tracks))
    model = _LinearGuanineModel(config, tracks.index("expression"))
    reach = (config.window_bins // 2 - 1) * BIN_SIZE
    test = split_intervals(benchmark.config, benchmark.data.length, "test")
    variants = generate_variants(
        benchmark.simulator, benchmark.simulation, VariantConfig.fixture(), reach_bp=reach, split_bounds=test
    )
    guanine = [v for v in variants if "G" in (v.ref, v.alt)]
    assert len(variants) >= 30 and len(guanine) >= 5
    args = types.SimpleNamespace(batch_size=5, variant_dtype="float32")
    run = cli._run(model, benchmark, np.zeros(0, dtype=np.int64), variants, args, torch.device("cpu"), False)
    tss_centre = np.array([(v.tss // BIN_SIZE) * BIN_SIZE + BIN_SIZE / 2 for v in variants])
    position = np.array([v.position for v in variants])
    change = np.array([(v.alt == "G") - (v.ref == "G") for v in variants], dtype=np.float64)
    expected = np.exp(-np.abs(position - tss_centre) / DECAY_BP) / NORM * change
    print("largest |expected|", np.abs(expected).max(), "largest error", np.abs(run["effects"] - expected).max())
    np.testing.assert_allclose(run["effects"], expected, rtol=1e-3, atol=1e-7)


def test_oracle_scores_rank_every_positive_first(fixture_benchmark):
    """The simulator's own change, the quantity the labels come from, scored as the benchmark scores a model."""
    benchmark = fixture_benchmark
    test = split_intervals(benchmark.config, benchmark.data.length, "test")
    variants = generate_variants(
        benchmark.simulator, benchmark.simulation, VariantConfig.fixture(), reach_bp=4_000, split_bounds=test
    )
    labels = np.array([v.label for v in variants])
    oracle = []
    for v in variants:
        ref, alt = benchmark.simulator.snv_expression(
            benchmark.simulation, v.position, v.alt_code, np.array([v.tss // BIN_SIZE])
        )
        oracle.append(alt[0] - ref[0])
    oracle = np.array(oracle)
    np.testing.assert_allclose(oracle, [v.true_effect for v in variants], atol=1e-12)
    assert labels.sum() >= 5 and auroc(labels, np.abs(oracle)) == 1.0


def test_float32_scoring_turns_tf32_off_and_restores_it():
    _float32_exact = cli._float32_exact
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with _float32_exact(enabled=True):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with _float32_exact(enabled=False):  # bf16 scoring: left as it is
            assert torch.backends.cudnn.allow_tf32
        try:
            with _float32_exact(enabled=True):
                raise KeyError("inside")
        except KeyError:
            pass
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
