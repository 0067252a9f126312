"""Train a compact model on the simulated tracks.

    python -m kvbound.eval.train --model enformer|alphagenome [--no-attention] [--size full|toy]
        [--steps N] [--batch-size B] [--fixture DIR | --cache DIR] [--device cuda] [--seed S]

Writes ``eval/weights/<name>.safetensors`` (weights + model config, track names, normalisation and the data
fingerprint in the header) and ``eval/results/train_<name>.csv`` (one row per logged step) plus
``train_<name>.json`` (the run's summary). Seeded: the same arguments on the same device give the same run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from kvbound.eval.metrics import pearson_per_track
from kvbound.eval.models import ModelConfig, TrackModel, build_model, count_parameters, save_model
from kvbound.eval.windows import Benchmark, TrackNormalizer, load_benchmark, make_batch, split_intervals, window_starts

__all__ = ["main", "predict_windows", "train"]

REPOSITORY = Path(__file__).resolve().parents[3]


def default_name(kind: str, attention: bool, toy: bool) -> str:
    return f"{kind}{'' if attention else '_noattn'}{'_toy' if toy else ''}"


@torch.no_grad()
def predict_windows(
    model: TrackModel,
    benchmark: Benchmark,
    starts: np.ndarray,
    *,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    autocast: bool = False,
) -> np.ndarray:
    """Standardised predictions ``[windows, target_bins, tracks]`` (float32) for windows at ``starts``."""
    config = model.config
    outputs = []
    for offset in range(0, len(starts), batch_size):
        inputs, _ = make_batch(
            benchmark.data.codes,
            None,
            starts[offset : offset + batch_size],
            config.window_bins,
            config.target_bins,
            benchmark.config.bin_size,
            device=device,
        )
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            outputs.append(model(inputs).float().cpu().numpy())
    return np.concatenate(outputs) if outputs else np.zeros((0, config.target_bins, config.n_tracks), np.float32)


def evaluate_pearson(model, benchmark, normalized, starts, *, device, autocast) -> np.ndarray:
    config = model.config
    prediction = predict_windows(model, benchmark, starts, device=device, autocast=autocast)
    crop = (config.window_bins - config.target_bins) // 2
    target = np.stack([normalized[:, s + crop : s + crop + config.target_bins].T for s in starts])
    return pearson_per_track(prediction.reshape(-1, config.n_tracks), target.reshape(-1, config.n_tracks))


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    autocast = device.type == "cuda" and not args.no_bf16
    benchmark = load_benchmark(args.cache, fixture=args.fixture, progress=True)
    simulation = benchmark.simulation
    track_names = benchmark.config.track_names
    train_intervals = split_intervals(benchmark.config, benchmark.data.length, "train")
    valid_intervals = split_intervals(benchmark.config, benchmark.data.length, "valid")
    normalizer = TrackNormalizer.fit(simulation, train_intervals)
    normalized = normalizer.normalize(simulation.tracks)

    toy = args.size == "toy"
    sizes = {"window_bins": args.window_bins, "target_bins": args.target_bins}
    sizes = {key: value for key, value in sizes.items() if value is not None}
    if toy:
        config = ModelConfig.toy(args.model, len(track_names), attention=not args.no_attention, **sizes)
    else:
        config = ModelConfig(kind=args.model, n_tracks=len(track_names), attention=not args.no_attention, **sizes)
    model = build_model(config, seed=args.seed).to(device)
    train_starts = window_starts(simulation, train_intervals, config.window_bins)
    valid_starts = window_starts(simulation, valid_intervals, config.window_bins, stride_bins=config.target_bins)
    if len(train_starts) == 0 or len(valid_starts) == 0:
        raise ValueError(
            f"no training or validation window of {config.window_bins} bins fits the splits of {benchmark.data.source}"
        )
    valid_starts = valid_starts[:: max(1, len(valid_starts) // args.eval_windows)][: args.eval_windows]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def learning_rate(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate)
    name = args.name or default_name(args.model, not args.no_attention, toy)
    weights_dir, log_dir = Path(args.weights_dir), Path(args.log_dir)
    weights_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"train_{name}.csv"
    weights_path = weights_dir / f"{name}.safetensors"
    expression = track_names.index("expression")
    metadata = {
        "track_names": list(track_names),
        "normalizer_mean": normalizer.mean.tolist(),
        "normalizer_std": normalizer.std.tolist(),
        "data_source": benchmark.data.source,
        "simulator_fingerprint": benchmark.simulator.fingerprint(),
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "trained": True,
    }
    best = {"valid_pearson_mean": -math.inf}
    started = time.perf_counter()
    from rich.progress import Progress

    with open(log_path, "w", newline="") as handle, Progress(transient=True) as bar:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss", "lr", "seconds", "valid_pearson_mean", "valid_pearson_expression"])
        task = bar.add_task(f"training {name}", total=args.steps)
        running = 0.0
        for step in range(args.steps):
            model.train()
            starts = rng.choice(train_starts, size=args.batch_size)
            reverse = rng.random(args.batch_size) < 0.5 if args.rc_augment else None
            inputs, targets = make_batch(
                benchmark.data.codes,
                normalized,
                starts,
                config.window_bins,
                config.target_bins,
                benchmark.config.bin_size,
                reverse=reverse,
                device=device,
            )
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                prediction = model(inputs)
            loss = torch.nn.functional.mse_loss(prediction.float(), targets)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss: expected a finite value, got {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            bar.update(task, advance=1)
            last = step == args.steps - 1
            if (step + 1) % args.log_every == 0 or last:
                row = [
                    step + 1,
                    running / ((step % args.log_every) + 1),
                    scheduler.get_last_lr()[0],
                    round(time.perf_counter() - started, 3),
                    "",
                    "",
                ]
                running = 0.0
                if (step + 1) % args.eval_every == 0 or last:
                    model.eval()
                    scores = evaluate_pearson(
                        model, benchmark, normalized, valid_starts, device=device, autocast=autocast
                    )
                    row[4], row[5] = float(np.nanmean(scores)), float(scores[expression])
                    if row[4] > best["valid_pearson_mean"]:
                        best = {"step": step + 1, "valid_pearson_mean": row[4], "valid_pearson_expression": row[5]}
                        save_model(model, str(weights_path), {**metadata, "best_step": step + 1})
                writer.writerow(row)
                handle.flush()
    summary = {
        "name": name,
        "weights": str(weights_path),
        "log": str(log_path),
        "parameters": count_parameters(model),
        "model_config": config.as_dict(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "seconds": round(time.perf_counter() - started, 2),
        "train_windows": int(len(train_starts)),
        "valid_windows": int(len(valid_starts)),
        "best": best,
        **{key: metadata[key] for key in ("data_source", "simulator_fingerprint", "seed", "steps", "batch_size")},
    }
    (log_dir / f"train_{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvbound.eval.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("enformer", "alphagenome"), required=True)
    parser.add_argument("--no-attention", action="store_true", help="ablation: attention layers are identity")
    parser.add_argument("--size", choices=("full", "toy"), default="full", help="toy: a CPU-sized model")
    parser.add_argument("--window-bins", type=int, default=None, help="input bins (x128 bp); default 1536 (toy 64)")
    parser.add_argument("--target-bins", type=int, default=None, help="central output bins; default 896 (toy 32)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 on CUDA too")
    parser.add_argument("--rc-augment", action="store_true", help="random reverse complements")
    parser.add_argument(
        "--cache", type=Path, default=None, help="data cache (default $KVBOUND_CACHE or ~/.cache/kvbound)"
    )
    parser.add_argument(
        "--fixture", type=Path, default=None, help="use (and if needed write) the synthetic fixture here"
    )
    parser.add_argument("--weights-dir", default=str(REPOSITORY / "eval" / "weights"))
    parser.add_argument("--log-dir", default=str(REPOSITORY / "eval" / "results"))
    parser.add_argument("--name", default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-windows", type=int, default=32)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.warmup >= args.steps:
        args.warmup = max(1, args.steps // 10)
    summary = train(args)
    print(json.dumps({key: summary[key] for key in ("name", "weights", "parameters", "seconds", "best")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
