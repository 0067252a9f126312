"""Windows, splits and normalisation shared by training and evaluation.

A window is ``window_bins`` consecutive 128 bp bins; the model sees all of them and predicts the central
``target_bins``. Windows lie entirely inside one split (``SimulatorConfig.splits``; the rest is "train") and
contain at most ``max_n_fraction`` N bases. Targets are the simulated tracks standardised per track with the
mean and standard deviation of the N-free training bins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvbound.eval.data import CODE_N, EvalData, default_cache_dir, load_chromosome, load_data, write_fixture
from kvbound.eval.simulate import Simulation, Simulator, SimulatorConfig, cached_simulator, load_or_run

__all__ = [
    "Benchmark",
    "TrackNormalizer",
    "load_benchmark",
    "load_test_chromosome",
    "make_batch",
    "one_hot",
    "split_intervals",
    "window_starts",
]


@dataclass
class Benchmark:
    """The data, the calibrated simulator and its simulated tracks."""

    data: EvalData
    simulator: Simulator
    simulation: Simulation
    is_fixture: bool
    held_out: bool = False  # a whole chromosome held out from training (load_test_chromosome): all of it is "test"

    @property
    def config(self) -> SimulatorConfig:
        return self.simulator.config

    def intervals(self, split: str) -> list[tuple[int, int]]:
        """``[start, end)`` bp intervals of ``split``: :func:`split_intervals`, or on a held-out chromosome the
        whole chromosome for "test" and nothing for "train" / "valid"."""
        if not self.held_out:
            return split_intervals(self.config, self.data.length, split)
        if split not in ("train", "valid", "test"):
            raise ValueError(f"split: expected one of train, valid, test; got {split!r}")
        return [(0, self.data.length)] if split == "test" else []


def load_benchmark(
    cache_dir: str | Path | None = None, *, fixture: str | Path | None = None, progress: bool = False
) -> Benchmark:
    """Real data from the cache, or the synthetic fixture written (once) into ``fixture``."""
    if fixture is not None:
        cache = Path(fixture)
        if not (cache / "manifest.json").exists():
            write_fixture(cache)
        data, config = load_data(cache), SimulatorConfig.fixture()
    else:
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        data, config = load_data(cache), SimulatorConfig()
    simulator = cached_simulator(data, config, cache)
    return Benchmark(data, simulator, load_or_run(simulator, cache, progress=progress), fixture is not None)


def load_test_chromosome(
    benchmark: Benchmark,
    chrom: str,
    cache_dir: str | Path | None = None,
    *,
    data: EvalData | None = None,
    progress: bool = False,
) -> Benchmark:
    """A second, independent test set: chromosome ``chrom`` of the cache (e.g. ``22``, see
    ``python -m kvbound.eval.data fetch --chromosomes X 22``), simulated by ``benchmark``'s calibrated simulator
    (:meth:`Simulator.on`) and held out entirely (:attr:`Benchmark.held_out`). ``chrom`` equal to the benchmark's
    own chromosome returns ``benchmark``. ``data``: use this sequence instead of reading the cache (tests).

    The scan is cached under ``<cache>/sim/`` like the first chromosome's (``cache_dir`` None: not cached).
    """
    if chrom.removeprefix("chr") == benchmark.data.chrom.removeprefix("chr") and data is None:
        return benchmark
    if data is None:
        data = load_chromosome(cache_dir, chrom, first=benchmark.data)
    simulator = benchmark.simulator.on(data)
    simulation = load_or_run(simulator, cache_dir, progress=progress)
    return Benchmark(data, simulator, simulation, benchmark.is_fixture, held_out=True)


def split_intervals(config: SimulatorConfig, length: int, split: str) -> list[tuple[int, int]]:
    """``[start, end)`` bp intervals of ``split`` ("train" is what ``config.splits`` leaves)."""
    if split != "train":
        out = [(start, min(end, length)) for name, start, end in config.splits if name == split]
        if not out:
            raise ValueError(
                f"split: expected one of train, {', '.join(n for n, _, _ in config.splits)}; got {split!r}"
            )
        return out
    edges = sorted((start, end) for _, start, end in config.splits)
    out, cursor = [], 0
    for start, end in edges:
        if start > cursor:
            out.append((cursor, min(start, length)))
        cursor = max(cursor, end)
    if cursor < length:
        out.append((cursor, length))
    return [(s, e) for s, e in out if e > s]


def window_starts(
    simulation: Simulation,
    intervals: list[tuple[int, int]],
    window_bins: int,
    *,
    stride_bins: int = 1,
    max_n_fraction: float = 0.01,
) -> np.ndarray:
    """First bins of the windows that lie inside one interval and hold at most ``max_n_fraction`` N."""
    size = simulation.config.bin_size
    prefix = np.concatenate([[0.0], np.cumsum(simulation.n_fraction)])
    starts = []
    for start, end in intervals:
        first = -(-start // size)
        last = end // size - window_bins  # inclusive
        if last < first:
            continue
        candidates = np.arange(first, last + 1, stride_bins)
        n_share = (prefix[candidates + window_bins] - prefix[candidates]) / window_bins
        starts.append(candidates[n_share <= max_n_fraction])
    return np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)


def windows_with_tss(starts: np.ndarray, tss_bins: np.ndarray, window_bins: int, target_bins: int) -> np.ndarray:
    """Mask of the windows (first bins ``starts``) whose central ``target_bins`` output bins hold a TSS bin."""
    crop = (window_bins - target_bins) // 2
    tss_bins = np.sort(np.asarray(tss_bins, dtype=np.int64))
    first = np.searchsorted(tss_bins, np.asarray(starts) + crop, side="left")
    last = np.searchsorted(tss_bins, np.asarray(starts) + crop + target_bins, side="left")
    return last > first


@dataclass(frozen=True)
class TrackNormalizer:
    """Per-track standardisation fitted on N-free training bins."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, simulation: Simulation, intervals: list[tuple[int, int]]) -> TrackNormalizer:
        size = simulation.config.bin_size
        mask = np.zeros(simulation.n_bins, dtype=bool)
        for start, end in intervals:
            mask[start // size : end // size] = True
        mask &= simulation.n_fraction == 0
        values = simulation.tracks[:, mask].astype(np.float64)
        std = values.std(axis=1)
        return cls(values.mean(axis=1).astype(np.float32), np.maximum(std, 1e-6).astype(np.float32))

    def normalize(self, tracks: np.ndarray) -> np.ndarray:
        """``[T, bins]`` -> standardised float32."""
        return ((tracks - self.mean[:, None]) / self.std[:, None]).astype(np.float32)


def one_hot(codes: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` base codes (0..4) -> ``[B, 4, L]`` float32 one-hot; N is all zeros."""
    encoded = F.one_hot(codes.long().clamp(max=3), 4).to(torch.float32)
    encoded[codes == CODE_N] = 0.0
    return encoded.transpose(1, 2)


def reverse_complement(codes: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` codes -> reverse complement (N stays N)."""
    flipped = codes.flip(-1)
    return torch.where(flipped == CODE_N, flipped, 3 - flipped)


def make_batch(
    codes: np.ndarray,
    normalized_tracks: np.ndarray | None,
    start_bins: np.ndarray,
    window_bins: int,
    target_bins: int,
    bin_size: int,
    *,
    reverse: np.ndarray | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One-hot inputs ``[B, 4, window_bins * bin_size]`` and targets ``[B, target_bins, T]``.

    ``reverse[i]``: take the reverse complement of window ``i`` (targets reversed along bins; every track of
    the simulator is strand-symmetric).
    """
    length = window_bins * bin_size
    batch = np.stack([codes[s * bin_size : s * bin_size + length] for s in start_bins])
    sequence = torch.from_numpy(batch).to(device)
    crop = (window_bins - target_bins) // 2
    targets = None
    if normalized_tracks is not None:
        targets = np.stack([normalized_tracks[:, s + crop : s + crop + target_bins].T for s in start_bins])
        targets = torch.from_numpy(targets).to(device)
    if reverse is not None and reverse.any():
        flip = torch.from_numpy(np.asarray(reverse, dtype=bool)).to(device)
        sequence = torch.where(flip[:, None], reverse_complement(sequence), sequence)
        if targets is not None:
            targets = torch.where(flip[:, None, None], targets.flip(1), targets)
    return one_hot(sequence), targets
