"""Output fidelity of the public ports under ``kvbound.patch``: compressed against exact K/V on real DNA.

    python -m kvbound.eval.fidelity [--cache DIR | --fixture DIR] [--ports enformer,borzoi,alphagenome]
        [--cpu-smoke] [--out eval/results/fidelity.csv] [--device cuda]

For each port at its full published size (built as in :mod:`kvbound.bench.ports`: enformer-pytorch with
``to_out`` re-randomised, since the port zero-initialises it and attention would add nothing; borzoi-pytorch;
alphagenome-pytorch with ``embeddings_only=True``) with seeded random weights, one real chrX window of the
port's input length (test split) at batch 1 runs under bf16 autocast three ways:

``unpatched``         the port as published (the reference);
``patch-dense``       ``kvbound.patch(model, compress=False)``: exact K/V, kvbound's attention (the floor);
``patch-compressed``  ``kvbound.patch(model, CompressionConfig(), compress=True, calibrate_on=...)``: the default
                      config, one basis per layer calibrated on another real window (train split).

Each row gives the output's SQNR in dB (``10 log10(||ref||^2 / ||out - ref||^2)``), max and relative error,
against the unpatched output and (for the compressed run) against the dense patched one, which isolates what
compression adds. With random weights this is weak evidence: it shows the compressed path runs the real
architectures at full size and how much it perturbs their outputs, not what it does to trained predictions.

``--cpu-smoke`` runs the tiny configurations of :mod:`kvbound.bench.ports` instead (CPU, seconds; rank 4, since
their smallest head dimension is 8).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

__all__ = ["main", "sqnr_db"]

REPOSITORY = Path(__file__).resolve().parents[3]


def sqnr_db(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """SQNR (dB), max abs and relative error of ``out`` against ``reference`` (float64)."""
    if out.shape != reference.shape:
        raise ValueError(f"out: expected shape {tuple(reference.shape)} as the reference, got {tuple(out.shape)}")
    ref = reference.double()
    diff = out.double() - ref
    if not bool(torch.isfinite(diff).all()):
        return {"sqnr_db": float("nan"), "max_abs_error": float("nan"), "rel_error": float("nan"), "finite": False}
    signal, noise = float((ref**2).sum()), float((diff**2).sum())
    return {
        "sqnr_db": 10 * math.log10(signal / noise) if noise > 0 else math.inf,
        "max_abs_error": float(diff.abs().max()),
        "rel_error": math.sqrt(noise / signal) if signal > 0 else math.inf,
        "finite": True,
    }


def _real_window(codes: np.ndarray, length: int, start: int) -> np.ndarray:
    """The first window of ``length`` bases at or after ``start`` with no N (base codes 0..3)."""
    position = start
    while position + length <= codes.size:
        window = codes[position : position + length]
        bad = np.flatnonzero(window == 4)
        if bad.size == 0:
            return window
        position += int(bad[-1]) + 1
    raise ValueError(f"no N-free window of {length} bp at or after {start} in a sequence of {codes.size} bp")


def _inputs(spec, window: np.ndarray, device: torch.device):
    """The port's forward arguments for one real window (batch 1)."""
    from kvbound.bench.ports import Inputs

    one_hot = torch.nn.functional.one_hot(torch.from_numpy(window.astype(np.int64)), 4).float()[None].to(device)
    if spec.name.startswith("enformer"):
        return Inputs((one_hot,))
    if spec.name.startswith("borzoi"):
        return Inputs((one_hot.transpose(1, 2).contiguous(),))
    if spec.name == "alphagenome":
        return Inputs((one_hot, torch.zeros(1, dtype=torch.long, device=device)), {"embeddings_only": True})
    return None  # a tower that takes embeddings, not DNA


def _forward(spec, model, inputs, device) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return spec.output(model(*inputs.args, **inputs.kwargs)).float()


def fidelity_rows(
    ports: list[str] | None,
    codes: np.ndarray,
    data_source: str,
    test_start: int,
    train_start: int,
    device: torch.device,
    *,
    cpu_smoke: bool,
    seed: int = 0,
) -> list[dict]:
    import kvbound
    from kvbound.bench.ports import port_models, width_label

    rows = []
    for spec in port_models(cpu_smoke):
        if ports and spec.name.split("-")[0] not in ports:
            continue
        base = {
            "port": spec.name,
            "distribution": spec.distribution,
            "input_bp": spec.input_len,
            "tokens": spec.tokens,
            "batch": 1,
            "weights": "random (seeded); weak evidence",
            "note": spec.note,
        }
        try:
            __import__(spec.package)
        except ImportError as error:
            rows.append({**base, "variant": "unsupported", "reason": f"{spec.package} not installed: {error}"})
            continue
        torch.manual_seed(seed)
        with device:  # parameters initialised where they will run (AlphaGenome's are slow to fill on a CPU)
            model = spec.build()
        model = model.to(device)
        evaluated = _inputs(spec, _real_window(codes, spec.input_len, test_start), device)
        calibration = _inputs(spec, _real_window(codes, spec.input_len, train_start), device)
        source = f"{data_source}, {spec.input_len} bp from {test_start}"
        if evaluated is None:
            evaluated, calibration = spec.make_input(1, seed, device), spec.make_input(1, seed + 1, device)
            source = "random embeddings (the tower takes no DNA)"
        tic = time.perf_counter()
        reference = _forward(spec, model, evaluated, device)
        print(f"{spec.name}: unpatched forward ({time.perf_counter() - tic:.1f} s)", flush=True)
        outputs = {}
        config = kvbound.CompressionConfig(rank=4) if cpu_smoke else kvbound.CompressionConfig()
        for variant in ("patch-dense", "patch-compressed"):
            tic = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if variant == "patch-dense":
                    handle = kvbound.patch(model, compress=False)
                else:
                    handle = kvbound.patch(
                        model,
                        config,
                        compress=True,
                        calibrate_on=lambda m, inputs=calibration: m(*inputs.args, **inputs.kwargs),
                    )
            try:
                outputs[variant] = _forward(spec, model, evaluated, device)
                ratios = [r for m in handle.modules for r in (m.last_k_ratio, m.last_v_ratio) if r is not None]
                widths = width_label(handle) if handle.compress else ""
            finally:
                handle.undo()
            row = {
                **base,
                "variant": variant,
                "input": source,
                "patched_modules": len(handle.modules),
                "rank": config.rank if variant == "patch-compressed" else 0,
                "bits": config.bits if variant == "patch-compressed" else 0,
                "code_widths": widths,  # the widths the layers used (kvbound.patch's widen_codes)
                "tau": config.tau if variant == "patch-compressed" else float("nan"),
                "kv_ratio_mean": float(np.mean(ratios)) if ratios else 1.0,
                "seconds": round(time.perf_counter() - tic, 3),
            }
            row.update({f"vs_unpatched_{k}": v for k, v in sqnr_db(outputs[variant], reference).items()})
            if variant == "patch-compressed":
                row.update({f"vs_dense_{k}": v for k, v in sqnr_db(outputs[variant], outputs["patch-dense"]).items()})
            rows.append(row)
            print(
                f"{spec.name}: {variant} ({row['seconds']:.1f} s): SQNR vs unpatched "
                f"{row['vs_unpatched_sqnr_db']:.1f} dB",
                flush=True,
            )
        del model, outputs, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvbound.eval.fidelity", description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="real-data cache (default $KVBOUND_CACHE)")
    parser.add_argument("--fixture", type=Path, default=None, help="the synthetic fixture instead (tests)")
    parser.add_argument("--ports", default="enformer,borzoi,alphagenome")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny configurations (CPU)")
    parser.add_argument("--out", type=Path, default=REPOSITORY / "eval" / "results" / "fidelity.csv")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvbound.eval.data import default_cache_dir, load_data, write_fixture
    from kvbound.eval.simulate import SimulatorConfig

    if args.fixture is not None:
        if not (args.fixture / "manifest.json").exists():
            write_fixture(args.fixture)
        data, config = load_data(args.fixture), SimulatorConfig.fixture()
    else:
        data, config = load_data(args.cache or default_cache_dir()), SimulatorConfig()
    test_start = next(start for name, start, _ in config.splits if name == "test")
    device = torch.device(args.device)
    ports = [p.strip() for p in args.ports.split(",") if p.strip()]
    rows = fidelity_rows(
        ports, data.codes, data.source, test_start, 0, device, cpu_smoke=args.cpu_smoke, seed=args.seed
    )
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    device_name = str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    for row in rows:
        row.update(device=device_name, torch=torch.__version__, date=stamp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    for row in rows:
        print(row["port"], row["variant"], {k: row[k] for k in row if k.endswith("sqnr_db")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
