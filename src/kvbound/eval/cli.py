"""``kvbound eval``: biological quality with exact and compressed K/V.

    kvbound eval [--fixture DIR | --cache DIR] [--weights-dir eval/weights] [--out eval/results]
                 [--models enformer,alphagenome] [--windows 32] [--max-variants 300] [--device cuda]

For each model (trained weights from ``--weights-dir`` when they exist and match the data; otherwise
randomly initialised, and every output says so), on held-out windows of the test split:

* exact inference: per-track Pearson of the central bins, and variant-effect AUROC (score ``|predicted
  change of expression at the TSS bin|``, labels from the simulator), overall and per distance stratum;
* the same with K and V of every attention layer replaced through a hook by
  ``kvbound.compress_kv(...).decompress()`` for: the default config; the ablations "low-rank only" (rank 8,
  residual dropped, no bound) and "quantisation only" (rank 0); the (rank, bits) sweep (16,8), (16,4),
  (8,4), (8,2), (4,2); and a tau sweep 2^-7 .. 2^-2; plus "bf16 K/V" (rounding only, the common floor);
* the no-attention ablation models (``<kind>_noattn``) when their weights exist.

Writes ``quality.csv`` (one row per model and setting), ``quality_by_stratum.csv``, ``variants.csv``,
``eval_run.json`` and ``pareto.png`` (compression ratio against quality loss) into ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvbound.eval import kv_hooks
from kvbound.eval.metrics import auroc, pearson, pearson_per_track
from kvbound.eval.models import ModelConfig, TrackModel, build_model, load_model
from kvbound.eval.variants import Variant, VariantConfig, load_or_generate, write_variants
from kvbound.eval.windows import Benchmark, TrackNormalizer, load_benchmark, make_batch, split_intervals, window_starts

__all__ = ["Setting", "default_settings", "main"]

REPOSITORY = Path(__file__).resolve().parents[3]
SWEEP_RANK_BITS = ((16, 8), (16, 4), (8, 4), (8, 2), (4, 2))
SWEEP_TAU_EXPONENTS = (-7, -6, -5, -4, -3, -2)


@dataclass(frozen=True)
class Setting:
    """One way of feeding K/V to attention."""

    group: str  # exact | floor | default | ablation | sweep_rank_bits | sweep_tau
    name: str
    method: str  # exact | bf16 | codec | lowrank_only
    rank: int = 0
    bits: int = 0
    tau: float = float("nan")
    block_size: int = 128


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
        split_bounds=split_intervals(benchmark.config, benchmark.data.length, "test"),
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
    return kv_hooks.CompressedKVHook(config, bases.get(setting.rank), strict=False, impl=impl)


@torch.no_grad()
def _run(model: TrackModel, benchmark: Benchmark, starts, variants, args, device, autocast) -> dict:
    """Predictions on the windows and predicted variant effects under whatever hook is installed."""
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

    def centre_expression(batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            return model(batch).float()[:, out_index, expression]

    # the reference window of a TSS is shared by all of its variants: predict it once
    reference: dict[int, float] = {}
    tss_list = sorted({v.tss for v in variants})
    for offset in range(0, len(tss_list), args.batch_size):
        chunk_tss = tss_list[offset : offset + args.batch_size]
        starts_t = np.array([tss // size - half for tss in chunk_tss])
        inputs, _ = make_batch(
            benchmark.data.codes, None, starts_t, config.window_bins, config.target_bins, size, device=device
        )
        reference.update(zip(chunk_tss, centre_expression(inputs).cpu().tolist(), strict=True))
    effects = []
    for offset in range(0, len(variants), args.batch_size):
        chunk = variants[offset : offset + args.batch_size]
        starts_v = np.array([v.tss // size - half for v in chunk])
        alternative, _ = make_batch(
            benchmark.data.codes, None, starts_v, config.window_bins, config.target_bins, size, device=device
        )
        for row, variant in enumerate(chunk):
            column = variant.position - starts_v[row] * size
            if not 0 <= column < config.window_bp:
                raise ValueError(
                    f"variant {variant.gene}:{variant.position}: outside the {config.window_bp} bp window centred "
                    f"on its TSS {variant.tss}"
                )
            alternative[row, :, column] = 0.0
            alternative[row, variant.alt_code, column] = 1.0
        alt = centre_expression(alternative).cpu().numpy()
        effects.append(alt - np.array([reference[v.tss] for v in chunk]))
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
    return out


def _git_commit() -> str:
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
    parser.add_argument("--max-variants", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--settings",
        default="all",
        help="all, or a comma list of groups (exact,floor,default,ablation,sweep_rank_bits,sweep_tau)",
    )
    parser.add_argument(
        "--basis",
        choices=("calibrated", "per-block"),
        default="calibrated",
        help="low-rank basis: calibrated per layer and head on training windows, or per-block SVD",
    )
    parser.add_argument("--calibration-windows", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--codec-impl", default="eager", help="encoder passed to kvbound.compress_kv(impl=...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
    device = torch.device(args.device)
    autocast = device.type == "cuda"
    benchmark = load_benchmark(args.cache, fixture=args.fixture, progress=True)
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

    size = benchmark.config.bin_size
    test = split_intervals(benchmark.config, benchmark.data.length, "test")
    train = split_intervals(benchmark.config, benchmark.data.length, "train")
    args.out.mkdir(parents=True, exist_ok=True)
    rows, stratum_rows, runs_meta = [], [], {}
    started = time.perf_counter()
    for loaded in models:
        model, config = loaded.model, loaded.model.config
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
        if loaded.name == models[0].name:
            write_variants(variants, args.out / "variants.csv")
        calibration_starts = window_starts(
            benchmark.simulation, train, config.window_bins, stride_bins=config.window_bins
        )
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
        model_settings = settings if config.attention else [s for s in settings if s.method == "exact"]
        head_dims = (config.key_dim, config.value_dim)
        exact = None
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"{loaded.name}", total=len(model_settings))
            bases_by_rank: dict[int, dict] = {}
            done: dict[tuple, tuple] = {}
            for setting in model_settings:
                if setting.method in ("codec", "lowrank_only") and setting.rank >= min(head_dims):
                    console.print(f"{loaded.name}: skipping {setting.name} (rank >= head dim {min(head_dims)})")
                    bar.advance(task)
                    continue
                if args.basis == "calibrated" and setting.rank > 0 and setting.rank not in bases_by_rank:
                    from kvbound.config import CompressionConfig

                    calibration = CompressionConfig(block_size=setting.block_size, rank=setting.rank)
                    bases_by_rank[setting.rank] = kv_hooks.calibrate_bases(model, calibration_inputs, calibration)
                key = (setting.method, setting.rank, setting.bits, setting.tau, setting.block_size)
                if key in done:  # e.g. "r8 b4" and "tau 2^-5" are the default config again
                    metrics, stats, seconds = done[key]
                else:
                    hook = _hook_for(setting, bases_by_rank, args.codec_impl)
                    tic = time.perf_counter()
                    if hook is None:
                        run = _run(model, benchmark, starts, variants, args, device, autocast)
                    else:
                        with kv_hooks.install(model, hook):
                            run = _run(model, benchmark, starts, variants, args, device, autocast)
                    seconds = time.perf_counter() - tic
                    metrics = _metrics(run, targets, tss_index, variants, strata)
                    stats = hook.stats if hook is not None else None
                    done[key] = (metrics, stats, seconds)
                if setting.method == "exact":
                    exact = metrics
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
                    "pearson_mean": metrics["pearson_mean"],
                    "pearson_expression": metrics["pearson_expression"],
                    "pearson_expression_tss": metrics["pearson_expression_tss"],
                    "pearson_mean_drop_pct": 100
                    * (exact["pearson_mean"] - metrics["pearson_mean"])
                    / abs(exact["pearson_mean"]),
                    "pearson_expression_drop_pct": 100
                    * (exact["pearson_expression"] - metrics["pearson_expression"])
                    / abs(exact["pearson_expression"]),
                    "auroc_all": metrics["auroc_all"],
                    "auroc_drop": exact["auroc_all"] - metrics["auroc_all"],
                    **{f"auroc_{name}": metrics[f"auroc_{name}"] for name in strata},
                    "auroc_vs_random": metrics["auroc_vs_random"],
                    "auroc_vs_motif": metrics["auroc_vs_motif"],
                    "effect_pearson_positives": metrics["effect_pearson_positives"],
                    "windows": len(starts),
                    "variants": len(variants),
                    "seconds": round(seconds, 3),
                }
                rows.append(row)
                labels = np.array([v.label for v in variants])
                stratum = np.array([v.stratum for v in variants])
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
                bar.advance(task)
        runs_meta[loaded.name] = {
            "weights": loaded.weights,
            "model_config": config.as_dict(),
            "windows": len(starts),
            "variants": len(variants),
            "tss_bins_in_windows": int(tss_index.size),
        }
    _write_csv(args.out / "quality.csv", rows)
    _write_csv(args.out / "quality_by_stratum.csv", stratum_rows)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "data": benchmark.data.source,
        "simulator_fingerprint": benchmark.simulator.fingerprint(),
        "basis": args.basis,
        "seconds": round(time.perf_counter() - started, 2),
        "models": runs_meta,
    }
    (args.out / "eval_run.json").write_text(json.dumps(meta, indent=2) + "\n")
    _pareto_plot(rows, args.out / "pareto.png")
    _print_summary(console, rows)
    return 0


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
