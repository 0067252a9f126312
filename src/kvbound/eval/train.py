"""Train a compact model on the simulated tracks.

    python -m kvbound.eval.train --model enformer|alphagenome [--no-attention] [--size full|toy]
        [--steps N] [--time-budget-s S] [--batch-size B] [--fixture DIR | --cache DIR] [--device cuda] [--seed S]

Writes ``eval/weights/<name>.safetensors`` (the weights of the best validation step, stored in bfloat16, the
dtype the models run in on the GPU; model config, track names, normalisation, data fingerprint, seed, steps
reached and seconds in the header) and ``eval/results/train_<name>.csv`` (one row per logged step) plus
``train_<name>.json`` (the run's summary).

``--time-budget-s`` bounds the wall clock of the whole run (data loading included; ``--deadline-unix`` sets
an absolute end instead, e.g. one deadline shared by several runs): training stops cleanly before it,
keeping room for the last validation pass and the save, and the summary records the steps reached and
``stopped_by`` ("steps" or "time_budget"). The learning-rate schedule follows whichever of step count and
elapsed time is further along, so a budgeted run still anneals to its final rate.
Seeded: the same arguments on the same device give the same run (with a time budget, the same run up to
the step at which it stops).
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
from kvbound.eval.models import ModelConfig, TrackModel, build_model, count_parameters, load_model, save_model
from kvbound.eval.windows import (
    Benchmark,
    TrackNormalizer,
    load_benchmark,
    make_batch,
    split_intervals,
    window_starts,
    windows_with_tss,
)

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


def track_weights(specs: list[str] | None, track_names, device) -> torch.Tensor:
    """Per-track loss weights from ``NAME=WEIGHT`` items (1 for tracks not named), normalised to mean 1 so that
    the learning rate means the same with and without them."""
    weights = {name: 1.0 for name in track_names}
    for spec in specs or []:
        name, sep, value = spec.partition("=")
        if not sep or name not in weights:
            raise ValueError(f"--track-weight: expected NAME=WEIGHT with NAME one of {list(track_names)}, got {spec!r}")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"--track-weight: expected a finite weight >= 0 for {name}, got {value!r}")
        weights[name] = weight
    out = torch.tensor([weights[name] for name in track_names], dtype=torch.float32, device=device)
    if not out.sum() > 0:
        raise ValueError(f"--track-weight: expected at least one track with a weight > 0, got {specs}")
    return out * (len(out) / out.sum())


def train(args: argparse.Namespace) -> dict:
    clock_started = time.perf_counter()
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
    if args.init is not None:
        # Continue from earlier weights of the same configuration (a new optimizer and schedule).
        started_from, _ = load_model(str(args.init), device=device)
        if started_from.config != config:
            raise ValueError(
                f"--init: expected weights of the model being trained ({config.as_dict()}), got "
                f"{started_from.config.as_dict()} in {args.init}"
            )
        model.load_state_dict(started_from.state_dict())
    weights = track_weights(args.track_weight, track_names, device)
    train_starts = window_starts(simulation, train_intervals, config.window_bins)
    # --tss-share: that share of every batch from windows whose output bins hold a TSS (expression is learned there).
    tss_bins = np.array([gene.tss // benchmark.config.bin_size for gene in benchmark.data.genes], dtype=np.int64)
    tss_starts = train_starts[windows_with_tss(train_starts, tss_bins, config.window_bins, config.target_bins)]
    tss_count = int(round(args.tss_share * args.batch_size))
    if tss_count and len(tss_starts) == 0:
        raise ValueError(f"--tss-share {args.tss_share}: no training window holds a TSS in its output bins")
    valid_starts = window_starts(simulation, valid_intervals, config.window_bins, stride_bins=config.target_bins)
    if len(train_starts) == 0 or len(valid_starts) == 0:
        raise ValueError(
            f"no training or validation window of {config.window_bins} bins fits the splits of {benchmark.data.source}"
        )
    valid_starts = valid_starts[:: max(1, len(valid_starts) // args.eval_windows)][: args.eval_windows]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    budget = args.time_budget_s
    if args.deadline_unix is not None:  # an absolute deadline (e.g. shared by several runs of one script)
        left = args.deadline_unix - time.time() + (time.perf_counter() - clock_started)
        budget = left if budget is None else min(budget, left)
    loop_started = time.perf_counter()
    setup_seconds = loop_started - clock_started

    def time_progress() -> float:
        """Share of the time left after setup that has been used (0 without a budget)."""
        if budget is None:
            return 0.0
        return (time.perf_counter() - loop_started) / max(1e-3, budget - setup_seconds)

    def learning_rate(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = max((step - args.warmup) / max(1, args.steps - args.warmup), time_progress())
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
        "time_budget_s": budget,
        "trained": True,
        "track_weights": weights.tolist(),
        "init": None if args.init is None else str(args.init),
    }
    best = {"valid_pearson_mean": -math.inf}
    best_state: dict[str, torch.Tensor] | None = None
    started = time.perf_counter()
    eval_seconds = 0.0  # the longest validation pass so far: room kept at the end of a budget
    stopped_by = "steps"
    steps_done = logged_step = 0
    from rich.progress import Progress

    def log_row(step: int, loss: float) -> list:
        return [step, loss, scheduler.get_last_lr()[0], round(time.perf_counter() - started, 3), "", ""]

    def validate(row: list) -> None:
        nonlocal best, best_state, eval_seconds
        tic = time.perf_counter()
        model.eval()
        scores = evaluate_pearson(model, benchmark, normalized, valid_starts, device=device, autocast=autocast)
        row[4], row[5] = float(np.nanmean(scores)), float(scores[expression])
        if not row[4] > best["valid_pearson_mean"] and best_state is not None:
            eval_seconds = max(eval_seconds, time.perf_counter() - tic)
            return
        best = {"step": row[0], "valid_pearson_mean": row[4], "valid_pearson_expression": row[5]}
        best_state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        # saved at once too, so that an interrupted run still leaves its best weights
        save_model(model, str(weights_path), {**metadata, "best_step": row[0]}, dtype=torch.bfloat16)
        eval_seconds = max(eval_seconds, time.perf_counter() - tic)

    with open(log_path, "w", newline="") as handle, Progress(transient=True) as bar:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss", "lr", "seconds", "valid_pearson_mean", "valid_pearson_expression"])
        task = bar.add_task(f"training {name}", total=args.steps)
        running = 0.0
        for step in range(args.steps):
            model.train()
            if tss_count:
                starts = np.concatenate(
                    [rng.choice(tss_starts, size=tss_count), rng.choice(train_starts, size=args.batch_size - tss_count)]
                )
            else:
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
            loss = ((prediction.float() - targets) ** 2 * weights).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running = running + loss.detach()  # read back at log steps only: no host sync per step
            bar.update(task, advance=1)
            steps_done = step + 1
            if budget is not None and stopped_by == "steps":
                step_seconds = (time.perf_counter() - started) / steps_done
                # room for one more step, the closing validation pass and the save
                if time.perf_counter() - clock_started + step_seconds + 1.5 * eval_seconds + 2.0 > budget:
                    stopped_by = "time_budget"
            last = step == args.steps - 1 or stopped_by == "time_budget"
            if steps_done % args.log_every == 0 or steps_done % args.eval_every == 0 or last:
                mean_loss = float(running) / (steps_done - logged_step)
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(
                        f"loss: expected finite values, got a mean of {mean_loss} "
                        f"over steps {logged_step + 1}..{steps_done}"
                    )
                row = log_row(steps_done, mean_loss)
                running, logged_step = 0.0, steps_done
                if steps_done % args.eval_every == 0 or last:
                    validate(row)
                writer.writerow(row)
                handle.flush()
            if last:
                break
    if best_state is None:
        raise RuntimeError(
            f"train {name}: the time budget of {budget} s ended before the first training step "
            f"(setup took {setup_seconds:.1f} s)"
        )
    seconds = round(time.perf_counter() - started, 2)
    final = {
        **metadata,
        "best_step": best["step"],
        "steps_reached": steps_done,
        "stopped_by": stopped_by,
        "train_seconds": seconds,
        "setup_seconds": round(setup_seconds, 2),
    }
    model.load_state_dict(best_state)
    save_model(model, str(weights_path), final, dtype=torch.bfloat16)
    summary = {
        "name": name,
        "weights": str(weights_path),
        "log": str(log_path),
        "parameters": count_parameters(model),
        "model_config": config.as_dict(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "seconds": seconds,
        "setup_seconds": round(setup_seconds, 2),
        "total_seconds": round(time.perf_counter() - clock_started, 2),
        "steps_reached": steps_done,
        "stopped_by": stopped_by,
        "time_budget_s": budget,
        "train_windows": int(len(train_starts)),
        "valid_windows": int(len(valid_starts)),
        "best": best,
        "optimizer": {
            "name": "AdamW",
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "warmup_steps": args.warmup,
            "schedule": "cosine to 5% over whichever of steps and time budget is further along",
            "grad_clip_norm": 1.0,
            "bf16_autocast": autocast,
            "rc_augment": args.rc_augment,
            "loss": "mean squared error over bins and tracks, each track weighted (track_weights)",
            "track_weights": dict(zip(track_names, weights.tolist(), strict=True)),
            "init": None if args.init is None else str(args.init),
            "tss_share": args.tss_share,
            "tss_windows": int(len(tss_starts)),
        },
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
    parser.add_argument("--steps", type=int, default=3000, help="the most steps (with a budget: a cap)")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run in seconds (data loading included); stops cleanly before it",
    )
    parser.add_argument(
        "--deadline-unix",
        type=float,
        default=None,
        help="stop cleanly before this wall-clock time (seconds since the epoch); combines with --time-budget-s",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-bf16", action="store_true", help="train in float32 on CUDA too")
    parser.add_argument("--rc-augment", action="store_true", help="random reverse complements")
    parser.add_argument(
        "--track-weight",
        action="append",
        default=None,
        metavar="NAME=WEIGHT",
        help="loss weight of one track (repeatable; others 1; normalised to mean 1), e.g. enhancer=4",
    )
    parser.add_argument("--init", type=Path, default=None, help="start from these weights (same model configuration)")
    parser.add_argument(
        "--tss-share",
        type=float,
        default=0.0,
        help="share of each batch drawn from windows whose output bins hold a TSS (0: uniform windows)",
    )
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
    if not 0.0 <= args.tss_share <= 1.0:
        raise SystemExit(f"--tss-share: expected a share between 0 and 1, got {args.tss_share}")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        raise SystemExit(f"--time-budget-s: expected a positive number of seconds, got {args.time_budget_s}")
    summary = train(args)
    keys = ("name", "weights", "parameters", "seconds", "total_seconds", "steps_reached", "stopped_by", "best")
    print(json.dumps({key: summary[key] for key in keys}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
