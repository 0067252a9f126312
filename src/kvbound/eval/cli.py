"""``kvbound eval``: biological quality with exact and compressed K/V.

    kvbound eval [--fixture DIR | --cache DIR] [--weights-dir eval/weights] [--out eval/results]
                 [--models enformer,alphagenome] [--windows 32] [--max-variants 2000] [--device cuda]
                 [--time-budget-s S] [--scaling 1,2,4] [--layer-windows 4] [--test-chromosomes X [22]]

For each model (trained weights from ``--weights-dir`` when they exist and match the data; otherwise
randomly initialised, and every output says so), on held-out windows of the test split:

* exact inference: per-track Pearson of the central bins, and variant-effect AUROC (score ``|predicted
  change of expression at the TSS bin|``, labels from the simulator), overall and per distance stratum;
* the same with K and V of every attention layer replaced through a hook by
  ``kvbound.compress_kv(...).decompress()`` for: the default config; the ablations "low-rank only" (rank 8,
  residual dropped, no bound) and "quantisation only" (rank 0); variant scoring with anchored encoding
  (``paired``: keeping codes, following changes from bf16 K/V and from the float32 K/V; ``paired_tau``: following
  changes from float32 K/V at tau 2^-6 and 2^-7); the (rank, bits) sweep (8,8), (16,8), (16,4), (8,4), (8,2),
  (4,2); and a tau sweep 2^-7 .. 2^-2; plus "bf16 K/V" (rounding only, the common floor);
* the no-attention ablation models (``<kind>_noattn``) when their weights exist;
* per attention layer (default config, ``--layer-windows`` windows): the largest effective query 1-norm, the
  Hoelder bound ``||q||_1 * tau`` on the logit change from compressed K and the measured largest change
  (:class:`kvbound.eval.kv_hooks.LogitProbe`);
* context length: exact against the default config with the trained weights at ``--scaling`` multiples of
  the training window (``--scaling-windows`` windows, ``--scaling-variants`` variants).

``--test-chromosomes X 22``: also evaluate on chr22, a second test set held out entirely from training (fetched
with ``python -m kvbound.eval.data fetch --chromosomes X 22``; simulated by the chrX-calibrated simulator; windows
for Pearson may hold up to ``--held-out-max-n`` N, whose bins are left out of the Pearson). Every setting's row in
``quality.csv`` then also has, per extra chromosome C, ``auroc_all_chrC``, ``auroc_drop_chrC``, ``pearson_mean_chrC``,
``pearson_expression_chrC``, ``variants_chrC``, ``positives_chrC``, ``windows_chrC``, and over all test chromosomes
``auroc_all_pooled``, ``auroc_drop_pooled`` with its 90 % interval ``auroc_drop_pooled_low`` / ``_high``,
``variants_pooled``, ``positives_pooled`` (``auroc_all`` and the other AUROC, Pearson and variant columns stay
chrX's); the extra variants and their predicted changes go to ``variants_chrC.csv`` and ``effects_chrC.csv``. The
default is chrX only. Layers and scaling stay on chrX; the codec's columns (compression ratio, maximum errors, bound
violations) and ``seconds`` cover every chromosome evaluated.

``--time-budget-s``: the work runs in order of importance (exact, default, paired, floor, paired_tau, ablations,
layers, the two sweeps, scaling) and whatever would not fit the budget, judged from the times measured so far, is
skipped and listed under ``skipped`` in ``eval_run.json``.

Writes ``quality.csv`` (one row per model and setting), ``quality_by_stratum.csv``, ``effects.csv`` (the
predicted change of every variant under every setting), ``layers.csv``, ``scaling.csv``, ``variants.csv``,
``eval_run.json`` and ``pareto.png`` (compression ratio against quality
loss) into ``--out``; ``python -m kvbound.eval.report`` turns them into EVAL.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvbound.eval import kv_hooks
from kvbound.eval.metrics import auroc, auroc_drop_interval, pearson, pearson_per_track
from kvbound.eval.models import ModelConfig, TrackModel, build_model, load_model
from kvbound.eval.variants import Variant, VariantConfig, load_or_generate, write_variants
from kvbound.eval.windows import (
    Benchmark,
    TrackNormalizer,
    load_benchmark,
    load_test_chromosome,
    make_batch,
    split_intervals,
    window_starts,
)

__all__ = ["Setting", "default_settings", "main"]

REPOSITORY = Path(__file__).resolve().parents[3]
SWEEP_RANK_BITS = ((8, 8), (16, 8), (16, 4), (8, 4), (8, 2), (4, 2))
SWEEP_TAU_EXPONENTS = (-7, -6, -5, -4, -3, -2)


@dataclass(frozen=True)
class Setting:
    """One way of feeding K/V to attention."""

    group: str  # exact | floor | default | paired | paired_tau | ablation | sweep_rank_bits | sweep_tau
    name: str
    method: str  # exact | bf16 | codec | lowrank_only
    rank: int = 0
    bits: int = 0
    tau: float = float("nan")
    block_size: int = 128
    # codec only: each variant's window is encoded against its reference window's blocks (kvbound.codec.anchored):
    # "codes" keeps the reference's codes where they certify the variant; "changes" moves them by the rounded
    # change of the K/V (the reference's values known, as in kvbound.patch's handle.variants()); "" independent
    anchored: str = ""
    # codec only: the dtype K/V are encoded from: "" the forward's K/V rounded to bfloat16 first (kv_hooks), or
    # "float32" as the forward computed them (what kvbound.patch encodes in a float32 forward)
    storage: str = ""

    @property
    def key(self) -> tuple:
        """Settings with equal keys compute the same thing (e.g. "r8 b4" and "tau 2^-5" are the default)."""
        return (self.method, self.rank, self.bits, self.tau, self.block_size, self.anchored, self.storage)


def default_settings(block_size: int = 128) -> list[Setting]:
    from kvbound.config import DEFAULT_TAU, CompressionConfig

    default = CompressionConfig(block_size=block_size)
    out = [
        Setting("exact", "exact", "exact"),
        Setting("floor", "bf16 K/V", "bf16"),
        Setting(
            "default",
            f"default r{default.rank} b{default.bits}",
            "codec",
            default.rank,
            default.bits,
            default.tau,
            block_size,
        ),
    ]
    # Variant scoring with anchored encoding (name suffix, anchoring, dtype encoded from), at the default tau, then
    # following changes from float32 K/V at smaller tau: what a variant-effect study would choose when the
    # default's errors matter, at the ratio shown
    paired = (
        (", anchored", "codes", ""),
        (", anchored to changes", "changes", ""),
        (", anchored to changes, float32 K/V", "changes", "float32"),
    )
    out += [
        Setting("paired", f"default r{default.rank} b{default.bits}{suffix}", "codec", default.rank, default.bits,
                default.tau, block_size, anchored=anchored, storage=storage)
        for suffix, anchored, storage in paired
    ]
    out += [
        Setting("paired_tau", f"r{default.rank} b{default.bits} tau 2^{e}, anchored to changes, float32 K/V", "codec",
                default.rank, default.bits, 2.0**e, block_size, anchored="changes", storage="float32")
        for e in (-6, -7)
    ]
    out += [
        Setting(
            "ablation", f"low-rank only r{default.rank}", "lowrank_only", default.rank, 0, float("nan"), block_size
        ),
        Setting("ablation", f"quantisation only b{default.bits}", "codec", 0, default.bits, default.tau, block_size),
    ]
    out += [
        Setting("sweep_rank_bits", f"r{r} b{b}", "codec", r, b, DEFAULT_TAU, block_size) for r, b in SWEEP_RANK_BITS
    ]
    out += [
        Setting("sweep_tau", f"tau 2^{e}", "codec", default.rank, default.bits, 2.0**e, block_size)
        for e in SWEEP_TAU_EXPONENTS
    ]
    return out


@dataclass
class LoadedModel:
    name: str
    model: TrackModel
    weights: str  # "trained: <path>" or "random (untrained)"
    normalizer: TrackNormalizer


def _find_models(args, benchmark: Benchmark, kinds: list[str], device) -> list[LoadedModel]:
    n_tracks = len(benchmark.config.track_names)
    train = split_intervals(benchmark.config, benchmark.data.length, "train")
    fitted = TrackNormalizer.fit(benchmark.simulation, train)
    out = []
    for kind in kinds:
        for suffix in ("", "_noattn"):
            candidates = [f"{kind}{suffix}", f"{kind}{suffix}_toy"]
            if benchmark.is_fixture:
                candidates.reverse()
            loaded = None
            for name in candidates:
                path = Path(args.weights_dir) / f"{name}.safetensors"
                if not path.exists():
                    continue
                model, metadata = load_model(str(path), device)
                if metadata.get("simulator_fingerprint") != benchmark.simulator.fingerprint():
                    print(f"kvbound eval: {path} was trained on other simulated data; not used")
                    continue
                normalizer = TrackNormalizer(
                    np.array(metadata["normalizer_mean"], np.float32), np.array(metadata["normalizer_std"], np.float32)
                )
                loaded = LoadedModel(name, model, f"trained: {path.name}", normalizer)
                break
            if loaded is None and suffix == "":
                if benchmark.is_fixture:
                    config = ModelConfig.toy(kind, n_tracks)
                else:
                    config = ModelConfig(kind=kind, n_tracks=n_tracks)
                model = build_model(config, seed=args.seed).to(device).eval()
                loaded = LoadedModel(kind, model, "random (untrained)", fitted)
            if loaded is not None:
                out.append(loaded)
    return out


def _variants(args, benchmark: Benchmark, window_bins: int) -> list[Variant]:
    size = benchmark.config.bin_size
    reach = (window_bins // 2 - 1) * size
    config = VariantConfig.fixture() if benchmark.is_fixture else VariantConfig()
    cache = Path(args.fixture) if benchmark.is_fixture else Path(args.cache or _default_cache())
    variants = load_or_generate(
        benchmark.simulator,
        benchmark.simulation,
        config,
        reach_bp=reach,
        split_bounds=benchmark.intervals("test"),
        cache_dir=cache,
        progress=True,
    )
    if args.max_variants and len(variants) > args.max_variants:
        # every k-th gene, all of its variants (positives stay with their matched negatives)
        genes = list(dict.fromkeys(v.gene for v in variants))
        kept = set(genes[:: math.ceil(len(variants) / args.max_variants)])
        variants = [v for v in variants if v.gene in kept]
    return variants


def _default_cache() -> Path:
    from kvbound.eval.data import default_cache_dir

    return default_cache_dir()


def _hook_for(setting: Setting, bases: dict, impl: str):
    from kvbound.config import CompressionConfig

    if setting.method == "exact":
        return None
    if setting.method == "bf16":
        return kv_hooks.RoundingHook()
    if setting.method == "lowrank_only":
        return kv_hooks.LowRankOnlyHook(setting.rank, setting.block_size, bases.get(setting.rank))
    config = CompressionConfig(block_size=setting.block_size, rank=setting.rank, bits=setting.bits, tau=setting.tau)
    return kv_hooks.CompressedKVHook(
        config, bases.get(setting.rank), strict=False, impl=impl, anchored=setting.anchored,
        storage=getattr(torch, setting.storage) if setting.storage else None,
    )


@contextmanager
def _float32_exact(enabled: bool) -> Iterator[None]:
    """TF32 off for cuDNN convolutions and CUDA matmuls inside the block (restored after); a no-op when disabled."""
    if not enabled:
        yield
        return
    matmul, convolution = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, convolution


@torch.no_grad()
def _run(model: TrackModel, benchmark: Benchmark, starts, variants, args, device, autocast, hook=None) -> dict:
    """Predictions on the windows and predicted variant effects under whatever hook is installed (``hook``: that
    hook, when it encodes variants against their references and needs to know which rows those are)."""
    anchored = hook is not None and bool(getattr(hook, "anchored", ""))
    config = model.config
    size = benchmark.config.bin_size
    predictions = []
    for offset in range(0, len(starts), args.batch_size):
        inputs, _ = make_batch(
            benchmark.data.codes,
            None,
            starts[offset : offset + args.batch_size],
            config.window_bins,
            config.target_bins,
            size,
            device=device,
        )
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            predictions.append(model(inputs).float().cpu().numpy())
    expression = benchmark.config.track_names.index("expression")
    half = config.window_bins // 2
    out_index = half - (config.window_bins - config.target_bins) // 2

    # Variant effects are differences of two predictions of one bin; in bf16 (8 significant bits) a single SNV's
    # change mostly rounds away and ties the scores, so they are computed in float32 unless asked otherwise.
    variant_autocast = autocast and args.variant_dtype == "bfloat16"

    def centre_expression(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=variant_autocast):
            return model(batch).float()[:, out_index, expression]

    # Each batch holds the reference windows of its variants' TSSs next to the variants' windows, so that both sides
    # of every difference go through the same kernels; in float32, TF32 is off while scoring (cuDNN convolutions
    # default to TF32, whose rounding is the size of a single SNV's predicted change).
    effects = []
    with _float32_exact(enabled=not variant_autocast):
        for offset in range(0, len(variants), args.batch_size):
            chunk = variants[offset : offset + args.batch_size]
            chunk_tss = sorted({v.tss for v in chunk})
            firsts = np.array([tss // size - half for tss in chunk_tss] + [v.tss // size - half for v in chunk])
            inputs, _ = make_batch(
                benchmark.data.codes, None, firsts, config.window_bins, config.target_bins, size, device=device
            )
            for row, variant in enumerate(chunk, start=len(chunk_tss)):
                column = variant.position - firsts[row] * size
                if not 0 <= column < config.window_bp:
                    raise ValueError(
                        f"variant {variant.gene}:{variant.position}: outside the {config.window_bp} bp window centred "
                        f"on its TSS {variant.tss}"
                    )
                inputs[row, :, column] = 0.0
                inputs[row, variant.alt_code, column] = 1.0
            if anchored:  # each variant row follows its TSS's reference row; the references stand alone
                hook.anchor_index = [-1] * len(chunk_tss) + [chunk_tss.index(v.tss) for v in chunk]
            try:
                values = centre_expression(inputs).cpu().numpy()
            finally:
                if anchored:
                    hook.anchor_index = None
            reference = dict(zip(chunk_tss, values[: len(chunk_tss)], strict=True))
            effects.append(values[len(chunk_tss) :] - np.array([reference[v.tss] for v in chunk]))
    return {
        "predictions": np.concatenate(predictions)
        if predictions
        else np.zeros((0, config.target_bins, config.n_tracks)),
        "effects": np.concatenate(effects) if effects else np.zeros(0),
    }


def _metrics(run: dict, targets: np.ndarray, tss_index: np.ndarray, variants: list[Variant], strata) -> dict:
    n_tracks = targets.shape[-1]
    prediction = run["predictions"].reshape(-1, n_tracks)
    per_track = pearson_per_track(prediction, targets.reshape(-1, n_tracks))
    labels = np.array([v.label for v in variants])
    scores = np.abs(run["effects"])
    out = {
        "pearson_mean": float(np.nanmean(per_track)),
        "pearson_expression": float(per_track[-1]),
        "pearson_expression_tss": pearson(prediction[tss_index, -1], targets.reshape(-1, n_tracks)[tss_index, -1])
        if tss_index.size >= 3
        else float("nan"),
        "auroc_all": auroc(labels, scores) if len(variants) else float("nan"),
        "per_track": per_track,
        "effects": np.asarray(run["effects"], dtype=np.float64),
    }
    stratum = np.array([v.stratum for v in variants])
    for name in strata:
        mask = stratum == name
        out[f"auroc_{name}"] = auroc(labels[mask], scores[mask]) if mask.any() else float("nan")
    positive = labels == 1
    kind = np.array([v.kind for v in variants])
    for negative_kind in ("random", "motif"):  # positives against one kind of negative at a time
        mask = positive | (kind == negative_kind)
        out[f"auroc_vs_{negative_kind}"] = auroc(labels[mask], scores[mask]) if mask.any() else float("nan")
    true_effect = np.array([v.true_effect for v in variants])
    out["effect_pearson_positives"] = (
        pearson(run["effects"][positive], true_effect[positive]) if positive.sum() >= 3 else float("nan")
    )
    # Positive control: the median |predicted change| of positives and of negatives (normalised expression units);
    # a model that learned the enhancers puts the first far above the second.
    for name, mask in (("positives", positive), ("negatives", ~positive)):
        out[f"effect_median_{name}"] = float(np.median(scores[mask])) if mask.any() else float("nan")
    return out


def _git_commit() -> str:
    """``KVBOUND_COMMIT`` when set (machines that get a copy of the sources without their git history), else git's."""
    if os.environ.get("KVBOUND_COMMIT"):
        return os.environ["KVBOUND_COMMIT"]
    try:
        result = subprocess.run(
            ["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=5,
        )
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbound eval", description=__doc__.split("\n")[0])
    parser.add_argument("--fixture", type=Path, default=None, help="use (and if needed write) the synthetic fixture")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="real-data cache (default $KVBOUND_CACHE or "
        "~/.cache/kvbound; fill it with `python -m kvbound.eval.data fetch`)",
    )
    parser.add_argument("--weights-dir", default=str(REPOSITORY / "eval" / "weights"))
    parser.add_argument("--out", type=Path, default=REPOSITORY / "eval" / "results")
    parser.add_argument("--models", default="enformer,alphagenome")
    parser.add_argument("--windows", type=int, default=32, help="held-out windows for Pearson")
    parser.add_argument("--max-variants", type=int, default=2000)
    parser.add_argument(
        "--variant-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="precision of the forwards that score variants (default float32: bf16 rounding ties small effects)",
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--settings",
        default="all",
        help="all, or a comma list of groups (exact,floor,default,paired,paired_tau,ablation,sweep_rank_bits,"
        "sweep_tau)",
    )
    parser.add_argument(
        "--basis",
        choices=("calibrated", "per-block"),
        default="calibrated",
        help="low-rank basis: calibrated per layer and head on training windows, or per-block SVD",
    )
    parser.add_argument("--calibration-windows", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument(
        "--codec-impl",
        default="auto",
        help="encoder: eager, triton, or auto (triton on CUDA with a calibrated basis and rank >= 1, else eager)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock budget: work runs in order of importance (exact, default, floor, ablations, layers, "
        "sweeps, scaling) and what would not fit is skipped and listed in eval_run.json",
    )
    parser.add_argument("--layer-windows", type=int, default=4, help="windows for the per-layer logit table")
    parser.add_argument(
        "--scaling",
        type=lambda text: tuple(int(x) for x in text.split(",") if x),
        default=(1, 2, 4),
        help="window multiples of the training window for the context-length table (empty: none)",
    )
    parser.add_argument("--scaling-windows", type=int, default=8)
    parser.add_argument(
        "--test-chromosomes",
        nargs="+",
        default=["X"],
        metavar="CHROM",
        help="X (default: the test split of the training chromosome) and optionally 22, held out entirely (fetch it "
        "with `python -m kvbound.eval.data fetch --chromosomes X 22`); adds per-chromosome and pooled columns",
    )
    parser.add_argument(
        "--held-out-max-n",
        type=float,
        default=0.1,
        help="largest share of N in a Pearson window on a held-out chromosome (chr22 is aligned in fragments; its "
        "N bins are left out of the Pearson)",
    )
    parser.add_argument("--scaling-variants", type=int, default=120)
    return parser


@dataclass
class _TestSet:
    """A held-out chromosome's windows, targets (N-free target bins only) and variants, for one model."""

    chrom: str
    benchmark: Benchmark
    starts: np.ndarray
    targets: np.ndarray  # [1, clean bins, T]
    clean: np.ndarray  # flat indices of the N-free target bins among starts x target_bins
    tss_index: np.ndarray  # into the clean bins
    variants: list[Variant]
    strata: list[str]


@dataclass
class _ModelContext:
    """Everything one model's settings share: windows, targets, variants, calibration inputs, bases."""

    loaded: LoadedModel
    starts: np.ndarray
    targets: np.ndarray
    tss_index: np.ndarray
    variants: list[Variant]
    strata: list[str]
    calibration_inputs: list[torch.Tensor]
    bases_by_rank: dict
    done: dict
    exact: dict | None = None
    exact_seconds: float = float("nan")
    codec_seconds: float = float("nan")
    extra: list[_TestSet] = field(default_factory=list)


def _prepare(loaded: LoadedModel, benchmark: Benchmark, args, device) -> _ModelContext:
    config = loaded.model.config
    size = benchmark.config.bin_size
    test = split_intervals(benchmark.config, benchmark.data.length, "test")
    train = split_intervals(benchmark.config, benchmark.data.length, "train")
    starts = window_starts(benchmark.simulation, test, config.window_bins, stride_bins=config.target_bins)
    if len(starts) > args.windows:
        starts = starts[np.linspace(0, len(starts) - 1, args.windows).astype(np.int64)]
    normalized = loaded.normalizer.normalize(benchmark.simulation.tracks)
    crop = (config.window_bins - config.target_bins) // 2
    targets = np.stack([normalized[:, s + crop : s + crop + config.target_bins].T for s in starts])
    flat_bins = (starts[:, None] + crop + np.arange(config.target_bins)[None]).reshape(-1)
    tss_bins = np.unique([g.tss // size for g in benchmark.data.genes])
    tss_index = np.flatnonzero(np.isin(flat_bins, tss_bins))
    variants = _variants(args, benchmark, config.window_bins)
    # strata as generated: the last one is cut at the reach of this model's window (e.g. "50-98kb")
    strata = list(dict.fromkeys(v.stratum for v in sorted(variants, key=lambda v: v.distance)))
    calibration_starts = window_starts(benchmark.simulation, train, config.window_bins, stride_bins=config.window_bins)
    pick = np.linspace(0, len(calibration_starts) - 1, min(args.calibration_windows, len(calibration_starts)))
    calibration_inputs = [
        make_batch(
            benchmark.data.codes,
            None,
            calibration_starts[[i]],
            config.window_bins,
            config.target_bins,
            size,
            device=device,
        )[0]
        for i in pick.astype(np.int64)
    ]
    context = _ModelContext(loaded, starts, targets, tss_index, variants, strata, calibration_inputs, {}, {})
    context.extra = [_prepare_test_set(loaded, test_set, args) for test_set in getattr(args, "test_sets", [])]
    return context


def _prepare_test_set(loaded: LoadedModel, benchmark: Benchmark, args) -> _TestSet:
    """Windows (at most ``--held-out-max-n`` N), N-free target bins and variants of a held-out chromosome."""
    config = loaded.model.config
    size = benchmark.config.bin_size
    starts = window_starts(
        benchmark.simulation,
        benchmark.intervals("test"),
        config.window_bins,
        stride_bins=config.target_bins,
        max_n_fraction=args.held_out_max_n,
    )
    if len(starts) > args.windows:
        starts = starts[np.linspace(0, len(starts) - 1, args.windows).astype(np.int64)]
    crop = (config.window_bins - config.target_bins) // 2
    flat_bins = (starts[:, None] + crop + np.arange(config.target_bins)[None]).reshape(-1).astype(np.int64)
    clean = np.flatnonzero(benchmark.simulation.n_fraction[flat_bins] == 0)
    normalized = loaded.normalizer.normalize(benchmark.simulation.tracks)
    targets = normalized[:, flat_bins[clean]].T[None]
    tss_bins = np.unique([g.tss // size for g in benchmark.data.genes])
    tss_index = np.flatnonzero(np.isin(flat_bins[clean], tss_bins))
    variants = _variants(args, benchmark, config.window_bins)
    strata = list(dict.fromkeys(v.stratum for v in sorted(variants, key=lambda v: v.distance)))
    return _TestSet(benchmark.data.chrom, benchmark, starts, targets, clean, tss_index, variants, strata)


def _test_set_metrics(run: dict, test_set: _TestSet) -> dict:
    """:func:`_metrics` on a held-out chromosome: Pearson over its N-free target bins only."""
    n_tracks = test_set.targets.shape[-1]
    predictions = run["predictions"].reshape(-1, n_tracks)[test_set.clean][None]
    if predictions.shape[1] < 3:  # too few bins for a correlation: variants only
        blank = np.zeros((1, 3, n_tracks))  # constant: every Pearson comes out NaN
        metrics = _metrics({"predictions": blank, "effects": run["effects"]}, blank, np.zeros(0, np.int64),
                           test_set.variants, test_set.strata)
        metrics.update(pearson_mean=float("nan"), pearson_expression=float("nan"))
        return metrics
    return _metrics({"predictions": predictions, "effects": run["effects"]}, test_set.targets, test_set.tss_index,
                    test_set.variants, test_set.strata)


def _pooled_columns(context: _ModelContext, metrics: dict) -> dict:
    """Per extra chromosome and pooled (chrX test split + every extra chromosome) columns of a quality row."""
    if not context.extra:
        return {}
    exact = context.exact
    out = {
        "test_chromosomes": ",".join(["X", *(t.chrom for t in context.extra)]),
        "auroc_all_chrX": metrics["auroc_all"],
    }
    for test_set in context.extra:
        name = f"chr{test_set.chrom}"
        own, reference = metrics["chromosomes"][test_set.chrom], exact["chromosomes"][test_set.chrom]
        out.update(
            {
                f"auroc_all_{name}": own["auroc_all"],
                f"auroc_drop_{name}": reference["auroc_all"] - own["auroc_all"],
                f"pearson_mean_{name}": own["pearson_mean"],
                f"pearson_expression_{name}": own["pearson_expression"],
                f"variants_{name}": len(test_set.variants),
                f"positives_{name}": sum(v.label for v in test_set.variants),
                f"windows_{name}": len(test_set.starts),
            }
        )
    variants = context.variants + [v for t in context.extra for v in t.variants]
    labels = np.array([v.label for v in variants])

    def pooled_effects(values: dict) -> np.ndarray:
        parts = [values["effects"]] + [values["chromosomes"][t.chrom]["effects"] for t in context.extra]
        return np.abs(np.concatenate(parts))

    pooled, pooled_exact = pooled_effects(metrics), pooled_effects(exact)
    has_both = len(labels) and 0 < labels.sum() < len(labels)
    auroc_pooled = auroc(labels, pooled) if has_both else float("nan")
    auroc_exact = auroc(labels, pooled_exact) if has_both else float("nan")
    low, high = auroc_drop_interval(labels, pooled_exact, pooled) if has_both else (float("nan"), float("nan"))
    out.update(
        {
            "auroc_all_pooled": auroc_pooled,
            "auroc_drop_pooled": auroc_exact - auroc_pooled,
            "auroc_drop_pooled_low": low,
            "auroc_drop_pooled_high": high,
            "variants_pooled": len(variants),
            "positives_pooled": int(labels.sum()),
        }
    )
    return out


def _effect_rows(model: str, setting: str, variants: list[Variant], effects) -> list[dict]:
    """One effects.csv row per variant: its predicted change under ``setting``."""
    return [
        {
            "model": model,
            "setting": setting,
            "gene": variant.gene,
            "position": variant.position,
            "alt": variant.alt,
            "label": variant.label,
            "effect": float(value),
        }
        for variant, value in zip(variants, effects, strict=True)
    ]


def _bases(context: _ModelContext, rank: int, block_size: int, args) -> dict:
    from kvbound.config import CompressionConfig

    if args.basis != "calibrated" or rank == 0:
        return {}
    if rank not in context.bases_by_rank:
        calibration = CompressionConfig(block_size=block_size, rank=rank)
        context.bases_by_rank[rank] = kv_hooks.calibrate_bases(
            context.loaded.model, context.calibration_inputs, calibration
        )
    return context.bases_by_rank[rank]


def _drop_interval(variants: list[Variant], exact: dict, metrics: dict) -> dict:
    """``auroc_drop_low`` / ``auroc_drop_high``: the 90 % paired bootstrap interval of the AUROC drop (exact minus
    this setting) over the same variants (``metrics.auroc_drop_interval``)."""
    if not variants or "effects" not in exact or "effects" not in metrics:
        return {"auroc_drop_low": float("nan"), "auroc_drop_high": float("nan")}
    labels = np.array([v.label for v in variants])
    low, high = auroc_drop_interval(labels, np.abs(exact["effects"]), np.abs(metrics["effects"]))
    return {"auroc_drop_low": low, "auroc_drop_high": high}


def _setting_rows(context: _ModelContext, setting: Setting, benchmark, args, device, autocast) -> tuple[dict, list]:
    """Run one setting on one model; the quality row and its per-stratum rows."""
    loaded, model = context.loaded, context.loaded.model
    variants, strata = context.variants, context.strata
    key = setting.key
    if key in context.done:  # e.g. "r8 b4" and "tau 2^-5" are the default config again
        metrics, stats, seconds = context.done[key]
    else:
        bases = {setting.rank: _bases(context, setting.rank, setting.block_size, args)}
        hook = _hook_for(setting, bases, args.codec_impl)
        tic = time.perf_counter()
        extra_runs = {}
        if hook is None:
            run = _run(model, benchmark, context.starts, variants, args, device, autocast)
            for test_set in context.extra:
                extra_runs[test_set.chrom] = _run(
                    model, test_set.benchmark, test_set.starts, test_set.variants, args, device, autocast
                )
        else:
            with kv_hooks.install(model, hook):
                run = _run(model, benchmark, context.starts, variants, args, device, autocast, hook)
                for test_set in context.extra:
                    extra_runs[test_set.chrom] = _run(
                        model, test_set.benchmark, test_set.starts, test_set.variants, args, device, autocast, hook
                    )
        seconds = time.perf_counter() - tic
        metrics = _metrics(run, context.targets, context.tss_index, variants, strata)
        metrics["chromosomes"] = {t.chrom: _test_set_metrics(extra_runs[t.chrom], t) for t in context.extra}
        stats = hook.stats if hook is not None else None
        context.done[key] = (metrics, stats, seconds)
        if setting.method == "codec":
            context.codec_seconds = max(seconds, 0.0 if math.isnan(context.codec_seconds) else context.codec_seconds)
    if setting.method == "exact":
        context.exact, context.exact_seconds = metrics, seconds
    exact = context.exact
    row = {
        "model": loaded.name,
        "weights": loaded.weights,
        "data": benchmark.data.source,
        "group": setting.group,
        "setting": setting.name,
        "method": setting.method,
        "rank": setting.rank,
        "bits": setting.bits,
        "tau": setting.tau,
        "block_size": setting.block_size,
        "anchored": setting.anchored,
        "kv_storage": (setting.storage or "bfloat16") if setting.method == "codec" else "",
        "basis": args.basis if setting.rank > 0 else "",
        "ratio": stats.ratio() if stats else 1.0,
        "ratio_k": stats.ratio("k") if stats else 1.0,
        "ratio_v": stats.ratio("v") if stats else 1.0,
        "max_abs_error_k": stats.max_abs_error["k"] if stats else 0.0,
        "max_abs_error_v": stats.max_abs_error["v"] if stats else 0.0,
        "bound_violations": stats.bound_violations if stats else 0,
        **{
            f"blocks_{mode}": (stats.mode_shares()[mode] if stats else float("nan"))
            for mode in ("lowrank", "packed", "promoted", "raw")
        },
        "encoder_fallback": getattr(stats, "encoder_fallback", "") if stats else "",
        "pearson_mean": metrics["pearson_mean"],
        "pearson_expression": metrics["pearson_expression"],
        "pearson_expression_tss": metrics["pearson_expression_tss"],
        "pearson_mean_drop_pct": 100 * (exact["pearson_mean"] - metrics["pearson_mean"]) / abs(exact["pearson_mean"]),
        "pearson_expression_drop_pct": 100
        * (exact["pearson_expression"] - metrics["pearson_expression"])
        / abs(exact["pearson_expression"]),
        "auroc_all": metrics["auroc_all"],
        "auroc_drop": exact["auroc_all"] - metrics["auroc_all"],
        **_drop_interval(variants, exact, metrics),
        **{f"auroc_{name}": metrics[f"auroc_{name}"] for name in strata},
        "auroc_vs_random": metrics["auroc_vs_random"],
        "auroc_vs_motif": metrics["auroc_vs_motif"],
        "effect_pearson_positives": metrics["effect_pearson_positives"],
        "effect_median_positives": metrics["effect_median_positives"],
        "effect_median_negatives": metrics["effect_median_negatives"],
        "windows": len(context.starts),
        "variants": len(variants),
        "seconds": round(seconds, 3),
        **_pooled_columns(context, metrics),
    }
    labels = np.array([v.label for v in variants])
    stratum = np.array([v.stratum for v in variants])
    stratum_rows = []
    for name in ["all", *strata]:
        mask = np.ones(len(variants), bool) if name == "all" else stratum == name
        value = metrics["auroc_all"] if name == "all" else metrics[f"auroc_{name}"]
        reference = exact["auroc_all"] if name == "all" else exact[f"auroc_{name}"]
        stratum_rows.append(
            {
                "model": loaded.name,
                "weights": loaded.weights,
                "setting": setting.name,
                "stratum": name,
                "positives": int(labels[mask].sum()),
                "negatives": int((1 - labels[mask]).sum()),
                "auroc": value,
                "auroc_drop": reference - value,
            }
        )
    return row, stratum_rows


def _default_config(block_size: int):
    from kvbound.config import CompressionConfig

    return CompressionConfig(block_size=block_size)


def _layer_rows(context: _ModelContext, benchmark, args, device, autocast) -> list[dict]:
    """Item (b): per attention layer, max ||q||_1, the Hoelder bound ||q||_1 * tau on the logit change from
    compressed K, and the measured maximum logit change (default config, held-out windows)."""
    model, config = context.loaded.model, context.loaded.model.config
    default = _default_config(args.block_size)
    hook = kv_hooks.CompressedKVHook(
        default, _bases(context, default.rank, default.block_size, args), strict=False, impl=args.codec_impl
    )
    probe = kv_hooks.LogitProbe(hook, config.kind)
    starts = context.starts[: args.layer_windows]
    size = benchmark.config.bin_size
    with kv_hooks.install(model, probe.kv_hook, probe.attention_fn(model)):
        for start in starts:
            inputs, _ = make_batch(
                benchmark.data.codes,
                None,
                np.array([start]),
                config.window_bins,
                config.target_bins,
                size,
                device=device,
            )
            with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                model(inputs)
    rows = []
    for layer, record in sorted(probe.records.items()):
        rows.append(
            {
                "model": context.loaded.name,
                "weights": context.loaded.weights,
                "layer": layer,
                "rank": default.rank,
                "bits": default.bits,
                "tau": default.tau,
                "softmax_scale": record["softmax_scale"],
                "max_q_l1": record["max_q_l1"],
                "max_abs_error_k": record["max_abs_error_k"],
                "max_abs_error_v": record["max_abs_error_v"],
                "logit_bound_tau": record["max_q_l1"] * default.tau,
                "logit_bound_measured_k": record["max_q_l1"] * record["max_abs_error_k"],
                "max_logit_error": record["max_logit_error"],
                "max_logit_error_consumed": record["max_logit_error_consumed"],
                "model_kv_dtype": str(torch.bfloat16 if autocast else next(model.parameters()).dtype)[6:],
                "bound_used_pct": 100 * record["max_logit_error"] / (record["max_q_l1"] * default.tau),
                "bound_violations": record["bound_violations"],
                "logit_violations": record["logit_violations"],
                "windows": len(starts),
            }
        )
    return rows


def _scaling_rows(context: _ModelContext, benchmark, args, device, autocast, budget_left) -> tuple[list, list]:
    """Item (a): exact vs the default config as the input window grows (the trained weights at 1x, 2x, 4x
    the training window; predictions on all but the same edge margin)."""
    from dataclasses import replace

    loaded = context.loaded
    base = loaded.model.config
    margin = base.window_bins - base.target_bins
    default = _default_config(args.block_size)
    test = split_intervals(benchmark.config, benchmark.data.length, "test")
    size = benchmark.config.bin_size
    rows, skipped = [], []
    subset = context.variants
    if args.scaling_variants and len(subset) > args.scaling_variants:
        genes = list(dict.fromkeys(v.gene for v in subset))
        kept = set(genes[:: math.ceil(len(subset) / args.scaling_variants)])
        subset = [v for v in subset if v.gene in kept]
    train = split_intervals(benchmark.config, benchmark.data.length, "train")
    for factor in args.scaling:
        window = base.window_bins * factor
        config = replace(base, window_bins=window, target_bins=window - margin)
        starts = window_starts(benchmark.simulation, test, window, stride_bins=config.target_bins)
        first_bins = {v.tss: v.tss // size - window // 2 for v in subset}  # of the TSS-centred window
        last_bin = benchmark.data.length // size - window
        variants = [v for v in subset if 0 <= first_bins[v.tss] <= last_bin]  # inside the sequence
        if len(starts) == 0:
            skipped.append(f"{loaded.name} scaling x{factor}: no {window}-bin window fits the test split")
            continue
        estimate = 2.5 * context.exact_seconds * factor**1.5 * len(variants) / max(1, len(context.variants))
        if budget_left() < estimate:
            skipped.append(f"{loaded.name} scaling x{factor}: time budget (needs about {estimate:.0f} s)")
            continue
        starts = starts[np.linspace(0, len(starts) - 1, min(args.scaling_windows, len(starts))).astype(np.int64)]
        model = build_model(config).to(device).eval()
        model.load_state_dict(loaded.model.state_dict())
        normalized = loaded.normalizer.normalize(benchmark.simulation.tracks)
        crop = margin // 2
        targets = np.stack([normalized[:, s + crop : s + crop + config.target_bins].T for s in starts])
        tss_bins = np.unique([g.tss // size for g in benchmark.data.genes])
        flat_bins = (starts[:, None] + crop + np.arange(config.target_bins)[None]).reshape(-1)
        tss_index = np.flatnonzero(np.isin(flat_bins, tss_bins))
        bases = {}
        calibration_starts = window_starts(benchmark.simulation, train, window, stride_bins=window)
        if args.basis == "calibrated" and len(calibration_starts):  # a training window, as at 1x
            middle = calibration_starts[[len(calibration_starts) // 2]]
            calibration = [
                make_batch(benchmark.data.codes, None, middle, window, config.target_bins, size, device=device)[0]
            ]
            bases = kv_hooks.calibrate_bases(model, calibration, default)
        results = {}
        for name in ("exact", "default"):
            hook = (
                None
                if name == "exact"
                else kv_hooks.CompressedKVHook(default, bases, strict=False, impl=args.codec_impl)
            )
            tic = time.perf_counter()
            if hook is None:
                run = _run(model, benchmark, starts, variants, args, device, autocast)
            else:
                with kv_hooks.install(model, hook):
                    run = _run(model, benchmark, starts, variants, args, device, autocast)
            results[name] = (
                run,
                _metrics(run, targets, tss_index, variants, context.strata),
                hook,
                time.perf_counter() - tic,
            )
        (run_e, exact, _, _), (run_c, compressed, hook, seconds) = results["exact"], results["default"]
        rows.append(
            {
                "model": loaded.name,
                "weights": loaded.weights,
                "scale": factor,
                "window_bins": window,
                "window_bp": window * size,
                "target_bins": config.target_bins,
                "tau": default.tau,
                "ratio": hook.stats.ratio(),
                "bound_violations": hook.stats.bound_violations,
                "pearson_mean_exact": exact["pearson_mean"],
                "pearson_mean_default": compressed["pearson_mean"],
                "pearson_mean_drop_pct": 100
                * (exact["pearson_mean"] - compressed["pearson_mean"])
                / abs(exact["pearson_mean"]),
                "pearson_expression_drop_pct": 100
                * (exact["pearson_expression"] - compressed["pearson_expression"])
                / abs(exact["pearson_expression"]),
                "auroc_exact": exact["auroc_all"],
                "auroc_default": compressed["auroc_all"],
                "auroc_drop": exact["auroc_all"] - compressed["auroc_all"],
                "max_abs_prediction_change": float(np.abs(run_c["predictions"] - run_e["predictions"]).max()),
                "windows": len(starts),
                "variants": len(variants),
                "seconds": round(seconds, 3),
            }
        )
        del model
    return rows, skipped


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (exit 2) for values the run would only refuse after loading its data and models."""
    for name in ("windows", "max_variants", "batch_size", "calibration_windows", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a value >= 1, got {getattr(args, name)}")
    if args.layer_windows < 0:
        parser.error(f"--layer-windows: expected a value >= 0, got {args.layer_windows}")
    wanted = [c.removeprefix("chr") for c in args.test_chromosomes]
    if not wanted or wanted[0] != "X" or len(set(wanted)) != len(wanted):
        parser.error("--test-chromosomes: expected X first (the training chromosome's test split) and no repeats, "
                     f"e.g. `X 22`; got {' '.join(args.test_chromosomes)}")  # fmt: skip
    kinds = [kind.strip() for kind in args.models.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in ("enformer", "alphagenome")]
    if not kinds or unknown:
        parser.error(f"--models: expected a comma list of enformer and alphagenome, got {args.models!r}")
    if args.codec_impl not in ("auto", "eager", "triton"):
        parser.error(f"--codec-impl: expected eager, triton or auto, got {args.codec_impl!r}")
    if args.settings != "all":
        known = {s.group for s in default_settings(args.block_size)}
        unknown = sorted({g.strip() for g in args.settings.split(",")} - known)
        if unknown:
            parser.error(f"--settings: expected all or a comma list of {', '.join(sorted(known))}, got {unknown}")
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device: expected a torch device such as cpu or cuda, got {args.device!r} ({err})")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: expected an available device, got {args.device!r}: torch.cuda.is_available() is "
                     "False")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    from rich.console import Console

    from kvbound.eval.data import DataNotFoundError

    started = time.perf_counter()
    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    device = torch.device(args.device)
    autocast = device.type == "cuda"
    try:
        benchmark = load_benchmark(args.cache, fixture=args.fixture, progress=True)
    except DataNotFoundError as err:
        console.print(f"kvbound eval: {err}")
        return 1
    args.test_sets = _test_sets(args, benchmark)
    kinds = [kind.strip() for kind in args.models.split(",") if kind.strip()]
    models = _find_models(args, benchmark, kinds, device)
    for loaded in models:
        if loaded.weights.startswith("random"):
            console.print(
                f"[bold yellow]WARNING[/]: no trained weights for {loaded.name} in {args.weights_dir}: "
                "its weights are RANDOM; quality numbers measure only how compression perturbs an "
                "untrained model"
            )
    settings = default_settings(args.block_size)
    if args.settings != "all":
        groups = {group.strip() for group in args.settings.split(",")}
        settings = [s for s in settings if s.group in groups or s.method == "exact"]
    budget = args.time_budget_s

    def budget_left() -> float:
        return math.inf if budget is None else budget - (time.perf_counter() - started)

    args.out.mkdir(parents=True, exist_ok=True)
    contexts = [_prepare(loaded, benchmark, args, device) for loaded in models]
    if contexts:
        write_variants(contexts[0].variants, args.out / "variants.csv")
        for test_set in contexts[0].extra:
            write_variants(test_set.variants, args.out / f"variants_chr{test_set.chrom}.csv")
    extra_effect_rows: dict[str, list[dict]] = {t.data.chrom: [] for t in args.test_sets}
    # Work in order of importance, so that a time budget cuts the sweeps, not the headline numbers.
    stages: list[tuple[str, list]] = [("exact", [s for s in settings if s.method == "exact"])]
    for group in (
        "default", "paired", "floor", "paired_tau", "ablation", "layers", "sweep_rank_bits", "sweep_tau", "scaling"
    ):
        stages.append((group, [s for s in settings if s.group == group]))
    rows_by_model: dict[str, list] = {c.loaded.name: [] for c in contexts}
    stratum_by_model: dict[str, list] = {c.loaded.name: [] for c in contexts}
    effect_rows: list[dict] = []  # the predicted change of every variant under every setting
    layer_rows, scaling_rows, skipped = [], [], []
    for group, chosen in stages:
        for context in contexts:
            config = context.loaded.model.config
            if group != "exact" and not config.attention:
                continue
            name = context.loaded.name
            if group == "layers":
                if args.layer_windows > 0 and "default" in {s.group for s in settings}:
                    if budget_left() < 2 * context.codec_seconds:
                        skipped.append(f"{name} layers: time budget")
                        continue
                    layer_rows += _layer_rows(context, benchmark, args, device, autocast)
                continue
            if group == "scaling":
                if args.scaling and "default" in {s.group for s in settings}:
                    new_rows, new_skipped = _scaling_rows(context, benchmark, args, device, autocast, budget_left)
                    scaling_rows += new_rows
                    skipped += new_skipped
                continue
            for setting in chosen:
                head_dims = (config.key_dim, config.value_dim)
                if setting.method in ("codec", "lowrank_only") and setting.rank >= min(head_dims):
                    console.print(f"{name}: skipping {setting.name} (rank >= head dim {min(head_dims)})")
                    continue
                key = setting.key
                if setting.method != "exact" and key not in context.done:
                    cost = context.codec_seconds if not math.isnan(context.codec_seconds) else 3 * context.exact_seconds
                    if budget_left() < 1.2 * cost:
                        skipped.append(f"{name} {setting.name}: time budget")
                        continue
                row, stratum_rows = _setting_rows(context, setting, benchmark, args, device, autocast)
                rows_by_model[name].append(row)
                effects = context.done[key][0]["effects"]
                effect_rows += _effect_rows(name, setting.name, context.variants, effects)
                for test_set in context.extra:
                    extra_effects = context.done[key][0]["chromosomes"][test_set.chrom]["effects"]
                    extra_effect_rows[test_set.chrom] += _effect_rows(name, setting.name, test_set.variants,
                                                                      extra_effects)  # fmt: skip
                stratum_by_model[name] += stratum_rows
                console.print(
                    f"{name}: {setting.name}: ratio {row['ratio']:.2f}, dPearson {row['pearson_mean_drop_pct']:+.3f}%, "
                    f"dAUROC {row['auroc_drop']:+.4f} ({row['seconds']:.1f} s; {budget_left():.0f} s left)"
                )
    rows = [row for context in contexts for row in rows_by_model[context.loaded.name]]
    stratum_rows = [row for context in contexts for row in stratum_by_model[context.loaded.name]]
    _write_csv(args.out / "quality.csv", rows)
    _write_csv(args.out / "quality_by_stratum.csv", stratum_rows)
    _write_csv(args.out / "effects.csv", effect_rows)
    for chrom, chrom_rows in extra_effect_rows.items():
        _write_csv(args.out / f"effects_chr{chrom}.csv", chrom_rows)
    _write_csv(args.out / "layers.csv", layer_rows)
    _write_csv(args.out / "scaling.csv", scaling_rows)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "data": benchmark.data.source,
        "simulator_fingerprint": benchmark.simulator.fingerprint(),
        "basis": args.basis,
        "codec_impl": args.codec_impl,
        "variant_dtype": args.variant_dtype,
        "seconds": round(time.perf_counter() - started, 2),
        "time_budget_s": budget,
        "skipped": skipped,
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "models": {
            c.loaded.name: {
                "weights": c.loaded.weights,
                "model_config": c.loaded.model.config.as_dict(),
                "windows": len(c.starts),
                "variants": len(c.variants),
                "tss_bins_in_windows": int(c.tss_index.size),
                **{
                    f"chr{t.chrom}": {"windows": len(t.starts), "clean_target_bins": int(t.clean.size),
                                      "variants": len(t.variants), "positives": sum(v.label for v in t.variants)}
                    for t in c.extra
                },
            }
            for c in contexts
        },
        "test_chromosomes": ["X", *(t.data.chrom for t in args.test_sets)],
        "held_out": {t.data.chrom: t.data.source for t in args.test_sets},
    }
    (args.out / "eval_run.json").write_text(json.dumps(meta, indent=2) + "\n")
    _pareto_plot(rows, args.out / "pareto.png")
    _print_summary(console, rows)
    for line in skipped:
        console.print(f"[yellow]skipped[/]: {line}")
    return 0


def _test_sets(args, benchmark: Benchmark) -> list[Benchmark]:
    """The held-out chromosomes asked for by ``--test-chromosomes`` (X, the training chromosome, first: checked by
    ``_check_args``)."""
    extra = [c.removeprefix("chr") for c in args.test_chromosomes][1:]
    if not extra:
        return []
    cache = Path(args.fixture) if args.fixture is not None else Path(args.cache or _default_cache())
    return [load_test_chromosome(benchmark, chrom, cache, progress=True) for chrom in extra]


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    fieldnames = list(dict.fromkeys(key for row in rows for key in row))  # models may have other strata
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fieldnames)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def _pareto_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(row["model"] for row in rows if row["method"] != "exact"))
    figure, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = {"floor": "x", "default": "*", "ablation": "s", "sweep_rank_bits": "o", "sweep_tau": "^"}
    for model_index, model in enumerate(models):
        chosen = [r for r in rows if r["model"] == model and r["method"] != "exact"]
        for axis, key in ((axes[0], "auroc_drop"), (axes[1], "pearson_mean_drop_pct")):
            for row in chosen:
                if not math.isfinite(row[key]):
                    continue
                axis.scatter(
                    row["ratio"], row[key], color=f"C{model_index}", marker=markers.get(row["group"], "o"), s=60
                )
                axis.annotate(
                    row["setting"], (row["ratio"], row[key]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    for axis, label in ((axes[0], "variant AUROC drop (exact - compressed)"), (axes[1], "mean track Pearson drop (%)")):
        axis.set_xlabel("K/V compression ratio vs bf16")
        axis.set_ylabel(label)
        axis.axhline(0.0, color="grey", linewidth=0.8)
    weights = {row["model"]: row["weights"].split(":")[0] for row in rows}
    handles = [
        Line2D([], [], color=f"C{i}", marker="o", linestyle="", label=f"{m} ({weights[m]})")
        for i, m in enumerate(models)
    ]
    handles += [
        Line2D([], [], color="black", marker=marker, linestyle="", label=group) for group, marker in markers.items()
    ]
    axes[0].legend(handles=handles, fontsize=7)
    untrained = any(r["weights"].startswith("random") for r in rows)
    figure.suptitle(
        "kvbound eval: compression ratio vs quality loss"
        + ("  [RANDOM WEIGHTS: not a quality result]" if untrained else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _print_summary(console, rows: list[dict]) -> None:
    from rich.table import Table

    for model in dict.fromkeys(row["model"] for row in rows):
        chosen = [row for row in rows if row["model"] == model]
        table = Table(title=f"{model}: {chosen[0]['weights']}")
        for column in ("setting", "ratio", "bound", "Pearson", "dPearson %", "AUROC", "dAUROC"):
            table.add_column(column, no_wrap=True)
        for row in chosen:
            bound = "ok" if row["bound_violations"] == 0 else f"{row['bound_violations']} violations"
            table.add_row(
                row["setting"],
                f"{row['ratio']:.2f}",
                bound if row["method"] == "codec" else "-",
                f"{row['pearson_mean']:.4f}",
                f"{row['pearson_mean_drop_pct']:+.3f}",
                f"{row['auroc_all']:.4f}",
                f"{row['auroc_drop']:+.4f}",
            )
        console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
