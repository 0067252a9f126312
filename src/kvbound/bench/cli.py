"""``kvbound bench`` / ``python -m kvbound.bench``: every measurement the project reports, one CSV row each.

Suites (``--suite``, default ``attention``):

``attention``  every attention provider side by side on the shapes in ``benchmarks/shapes/``
               (``kvbound.bench.runner``);
``encoder``    the Triton and eager encoders against a device copy, and ``kvbound.calibrate`` per sample
               (``kvbound.bench.encoder``);
``models``     whole forwards of Enformer, Borzoi and AlphaGenome, unpatched and under ``kvbound.patch``
               (``kvbound.bench.ports``; the GPU needs the ports' wheels: ``benchmarks/wheels.sh``);
``relative``   one Enformer / Borzoi attention core (relative positions) against the ports' math, SDPA and
               FlexAttention with the position term built for them (``kvbound.bench.relative``);
``ring``       context-parallel attention on 1 and 2 GPUs (``kvbound.bench.ring``).

    python -m kvbound.bench --out benchmarks/results/h200.csv            # seed + model shapes, default configs
    python -m kvbound.bench --sweep --out ...                            # + the (rank, bits) sweep
    python -m kvbound.bench --ncu --out benchmarks/results/h200-ncu.csv  # DRAM / L2 bytes under Nsight Compute
    python -m kvbound.bench --suite encoder --out benchmarks/results/encoder_h200.csv
    python -m kvbound.bench --suite models --out benchmarks/results/models_h200.csv    # or: kvbound bench --models
    python -m kvbound.bench --suite ring --out benchmarks/results/ring_h200x2.csv
    python -m kvbound.bench [--suite S] --cpu-smoke --out /tmp/smoke.csv  # tiny sizes on the CPU

Without a CUDA GPU it exits with status 2 unless ``--cpu-smoke`` is given (which re-runs itself with
``TRITON_INTERPRET=1`` so that Triton kernels run in the interpreter). ``python -m kvbound.bench.report`` turns
the CSVs under ``benchmarks/results/`` into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

__all__ = ["main", "build_parser", "SUITES"]

SUITES = ("attention", "encoder", "models", "relative", "ring")


def _at_least(low, kind=int):
    """An argparse type: ``kind(text)`` of at least ``low`` (else argparse's clear error, exit 2)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"expected a value >= {low}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbound bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=SUITES, default="attention",
                   help="what to measure (default attention; see above)")
    p.add_argument("--models", dest="suite", action="store_const", const="models",
                   help="the same as --suite models")
    p.add_argument("--shapes", nargs="+", type=Path, default=None,
                   help="shape files (default: benchmarks/shapes/seed.toml and models.toml; smoke.toml with "
                        "--cpu-smoke)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="run only these shapes (names or shell patterns, e.g. 'seed-*')")
    p.add_argument("--providers", nargs="+", default=None, metavar="NAME",
                   help="run only these providers (see --list)")
    p.add_argument("--configs", nargs="+", default=None, metavar="LABEL",
                   help="run only these kvbound-compressed configs (e.g. r8b4 quant-r0b4 lowrank-r8)")
    p.add_argument("--sweep", action="store_true",
                   help="also run the (rank, bits) sweep (8,8) (16,8) (16,4) (8,2) (4,2) and the per-block basis")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV to write (default: benchmarks/results/bench-<date>.csv); rows are appended as "
                        "they are measured, so an interrupted run keeps its rows. An existing file is refused "
                        "unless --overwrite is given")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--ncu", action="store_true",
                   help="re-run under Nsight Compute and record DRAM and L2 bytes per provider (no timing)")
    p.add_argument("--ncu-path", default="ncu", help="Nsight Compute command line (default: ncu on PATH)")
    p.add_argument("--ncu-kernel", default=None, metavar="REGEX",
                   help="with --ncu: also filter profiled kernels by name (inside the NVTX ranges)")
    p.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--crashed", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU through the same code path (Triton interpreter)")
    p.add_argument("--warmup-ms", type=_at_least(0.0, float), default=None,
                   help="do_bench warm-up (default 25; 2 on CPU)")
    p.add_argument("--rep-ms", type=_at_least(0.0, float), default=None,
                   help="do_bench repetition time (default 100; 20 on CPU)")
    p.add_argument("--check-rows", type=_at_least(1), default=256,
                   help="query rows compared with the float64 reference (evenly spaced, first and last included)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative L2 error above which a row is check_failed (default 3e-2 for 16-bit inputs)")
    p.add_argument("--zero-tile-share", type=float, default=None,
                   help="override the shape files' share of residual-free K/V blocks")
    p.add_argument("--no-calibration", action="store_true", help="skip timing kvbound.calibrate per model load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--list", action="store_true", help="list providers and whether they can run here, then exit")
    g = p.add_argument_group("encoder, models and ring suites")
    g.add_argument("--rank", type=int, default=None,
                   help="compression rank (default 8; 4 for the models suite with --cpu-smoke)")
    g.add_argument("--bits", type=int, default=None, help="residual bits (default 4)")
    g.add_argument("--block-size", type=int, default=None, help="block size (default 128; 16 with --cpu-smoke)")
    g.add_argument("--tau", type=float, default=None, help="error bound (default 2**-5)")
    g.add_argument("--encoders", nargs="+", default=None, metavar="NAME",
                   help="encoder suite: encoders to run (encoder-triton encoder-triton-noverify encoder-eager "
                        "device-copy)")
    g.add_argument("--batches", nargs="+", type=_at_least(1), default=None,
                   help="models suite: batch sizes (default per model: 1 and a larger one)")
    g.add_argument("--patch-backend", choices=("auto", "eager", "kvbound"), default="auto",
                   help="models suite: kvbound.patch backend (default auto: kvbound.attention on CUDA)")
    g.add_argument("--fixed-widths", action="store_true",
                   help="models suite: code every compressed layer at --bits (kvbound.patch(widen_codes=False)) "
                        "instead of letting calibration widen AlphaGenome's codes")
    g.add_argument("--alternatives", action="store_true",
                   help="models suite: also time the ports with their attention core replaced by what a user could "
                        "assemble: Enformer and Borzoi by SDPA with a built position bias and by FlexAttention over a "
                        "built table, AlphaGenome by FlexAttention reading its compact pair bias "
                        "(kvbound/bench/alternatives.py)")
    g.add_argument("--checkpoint", nargs="+", default=None, metavar="MODEL=PATH",
                   help="models suite: trained weights instead of random ones, per model (enformer=DIR_OR_REPO_ID, "
                        "borzoi=DIR_OR_REPO_ID, alphagenome=WEIGHTS_FILE; kvbound.models.load, offline with "
                        "HF_HUB_OFFLINE=1)")
    g.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help="models suite: time only these variants (of unpatched patch-dense patch-compressed, the "
                        "-graph ones with --graphs and the alternatives with --alternatives)")
    g.add_argument("--graphs", action="store_true",
                   help="models suite: also time the unpatched, the dense-patched and the compressed-patched forward "
                        "replayed from one CUDA graph each (kvbound.capture; CUDA only)")
    g.add_argument("--warmup", type=_at_least(0), default=None,
                   help="models and ring suites: untimed calls (default 2 / 1)")
    g.add_argument("--repeats", type=_at_least(1), default=None,
                   help="models and ring suites: timed calls (default 5; 2 on CPU)")
    g.add_argument("--lengths", nargs="+", type=_at_least(1), default=None,
                   help="ring suite: whole sequence lengths (default 65536 131072 262144 524288; 256 on CPU)")
    g.add_argument("--world-sizes", nargs="+", type=_at_least(1), default=None,
                   help="ring suite: processes (one per GPU; default 1 2)")
    g.add_argument("--heads", type=_at_least(1), default=None, help="ring suite: heads (default 8; 2 on CPU)")
    g.add_argument("--head-dim", type=_at_least(1), default=None, help="ring suite: head dim (default 64; 32 on CPU)")
    return p


def _reexec_with_interpreter(argv: list[str]) -> int:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.call([sys.executable, "-m", "kvbound.bench", *argv], env=env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_compression_args(parser, args)
    _check_paths(parser, args)
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when kvbound is imported: start afresh.
        return _reexec_with_interpreter(argv)

    import torch

    from kvbound.bench.providers import all_providers

    providers = all_providers()
    if args.list:
        for p in providers:
            print(f"{p.name:20s} {p.unavailable() or 'available'}")
        return 0
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("kvbound bench: no CUDA GPU found. The benchmark times GPU kernels; run it on a machine with one, "
              "or pass --cpu-smoke to run tiny shapes on the CPU through the same code path.", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    if args.suite != "attention":
        return _run_suite(args, argv, device)
    if args.ncu and not args.ncu_child:
        from kvbound.bench.ncu import run_under_ncu

        return run_under_ncu(argv, args)
    return _run(args, argv, providers, device)


def _suite_config(args):
    from kvbound.config import DEFAULT_TAU, CompressionConfig

    smoke = args.cpu_smoke
    # The tiny Borzoi has 8-dimensional keys, and the rank must stay below the head dim.
    smoke_rank = 4 if args.suite == "models" else 8
    return CompressionConfig(
        block_size=args.block_size if args.block_size is not None else (16 if smoke else 128),
        rank=args.rank if args.rank is not None else (smoke_rank if smoke else 8),
        bits=args.bits if args.bits is not None else 4,
        tau=args.tau if args.tau is not None else DEFAULT_TAU)


def _check_paths(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (exit 2) for an --out that is a directory, lies in no existing directory, or exists (unless
    --overwrite, or a resumed or child run that appends to it), and for --shapes files that do not exist."""
    out = args.out
    if out is not None:
        if out.is_dir():
            parser.error(f"--out: expected a CSV file to write, got the directory {out}")
        if not out.parent.is_dir():
            parser.error(f"--out: expected a file in an existing directory, got {out} ({out.parent} does not exist)")
        if out.exists() and not (args.overwrite or args.resume or args.ncu_child):
            parser.error(f"--out: {out} exists; pass --overwrite to replace it, or choose another path")
    for path in args.shapes or ():
        if not path.is_file():
            parser.error(f"--shapes: expected a shape file, got {path}, which does not exist")


def _check_compression_args(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (exit 2) for ``--rank``, ``--bits``, ``--block-size`` or ``--tau`` values that
    ``CompressionConfig`` refuses, and for a rank that is not below every head dim the chosen suite compresses
    (checked once, here, rather than in each row)."""
    import re

    try:
        config = _suite_config(args)
    except (TypeError, ValueError) as err:
        found = re.match(r"CompressionConfig\.(\w+): (.*)", str(err), re.DOTALL)
        parser.error(f"--{found[1].replace('_', '-')}: {found[2]}" if found else str(err))
    dims = _suite_head_dims(parser, args)
    if dims:
        where, dim = min(dims, key=lambda item: item[1])
        if config.rank >= dim:
            parser.error(f"--rank: expected a rank below every head dim the {args.suite} suite compresses (the "
                         f"smallest is {dim}, {where}), got {config.rank}")


def _suite_head_dims(parser: argparse.ArgumentParser, args) -> list[tuple[str, int]]:
    """``(where, head dim)`` of every K and V the chosen suite compresses, where known without building a model
    (the models suite's ports are not built here: a rank too large for them gives error rows)."""
    smoke = args.cpu_smoke
    if args.suite == "encoder":
        from kvbound.bench.shapes import default_shape_files, load_shapes

        try:
            shapes = load_shapes(args.shapes or default_shape_files(smoke))
        except (OSError, ValueError) as err:
            parser.error(f"--shapes: {err}")
        if args.only:
            shapes = [s for s in shapes if any(fnmatch(s.name, pattern) for pattern in args.only)]
        return [(f"{name} of shape {s.name}", dim) for s in shapes
                for name, dim in (("K", s.head_dim_qk), ("V", s.head_dim_v))]
    if args.suite == "relative":
        from kvbound.bench.relative import relative_specs

        return [(f"{name} of {spec.name}", dim) for spec in relative_specs(smoke)
                for name, dim in (("K", spec.dk), ("V", spec.dv))]
    if args.suite == "ring":
        return [("K and V of --head-dim", args.head_dim or (32 if smoke else 64))]
    return []


def _suite_rows(args, device, console):
    """The chosen suite's rows (a generator), or an int exit status when the arguments select nothing."""
    config = _suite_config(args)
    if args.suite == "encoder":
        from kvbound.bench.encoder import ENCODERS, EncoderOptions, encoder_rows
        from kvbound.bench.shapes import default_shape_files, load_shapes

        shapes = load_shapes(args.shapes or default_shape_files(args.cpu_smoke))
        if args.only:
            shapes = [s for s in shapes if any(fnmatch(s.name, pattern) for pattern in args.only)]
        unknown = sorted(set(args.encoders or ()) - set(ENCODERS))
        if not shapes or unknown:
            console.print(f"kvbound bench --suite encoder: nothing to run (shapes {args.only}, unknown encoders "
                          f"{unknown}; encoders: {list(ENCODERS)})")
            return 2
        options = EncoderOptions(
            warmup_ms=args.warmup_ms if args.warmup_ms is not None else (2.0 if device.type == "cpu" else 25.0),
            rep_ms=args.rep_ms if args.rep_ms is not None else (20.0 if device.type == "cpu" else 100.0),
            seed=args.seed, zero_tile_share=args.zero_tile_share, encoders=tuple(args.encoders or ENCODERS),
            calibration=not args.no_calibration)
        return encoder_rows(shapes, device, config, options)
    if args.suite == "models":
        from kvbound.bench.alternatives import ALTERNATIVES
        from kvbound.bench.ports import ModelOptions, model_rows, model_variants, port_models

        specs = port_models(args.cpu_smoke)
        if args.only:
            specs = tuple(s for s in specs if any(fnmatch(s.name, pattern) for pattern in args.only))
        if not specs:
            console.print(f"kvbound bench --suite models: --only {args.only} matches no model of "
                          f"{[s.name for s in port_models(args.cpu_smoke)]}")
            return 2
        checkpoints = {}
        for item in args.checkpoint or ():
            name, sep, path = item.partition("=")
            if not sep or not path or name not in {s.name for s in specs}:
                console.print(f"kvbound bench --suite models: --checkpoint {item!r}: expected MODEL=PATH with MODEL "
                              f"one of {[s.name for s in specs]}")
                return 2
            checkpoints[name] = path
        options = ModelOptions(
            warmup=args.warmup if args.warmup is not None else 2,
            repeats=args.repeats if args.repeats is not None else (2 if device.type == "cpu" else 5),
            batches=tuple(args.batches) if args.batches else None, backend=args.patch_backend, seed=args.seed,
            alternatives=ALTERNATIVES if args.alternatives else (), graphs=args.graphs,
            variants=tuple(args.variants) if args.variants else None, checkpoints=checkpoints or None,
            widen_codes=not args.fixed_widths)
        offered = set(model_variants(options))
        unknown = [v for v in args.variants or () if v not in offered]
        if unknown:
            console.print(f"kvbound bench --suite models: --variants {unknown} are not offered with these flags "
                          f"(offered: {sorted(offered)})")
            return 2
        return model_rows(specs, device, config, options)
    if args.suite == "relative":
        from kvbound.bench.relative import RelativeOptions, relative_rows

        options = RelativeOptions(
            warmup_ms=args.warmup_ms if args.warmup_ms is not None else (2.0 if device.type == "cpu" else 25.0),
            rep_ms=args.rep_ms if args.rep_ms is not None else (20.0 if device.type == "cpu" else 100.0),
            seed=args.seed, zero_tile_share=args.zero_tile_share if args.zero_tile_share is not None else 0.5,
            batches=tuple(args.batches) if args.batches else None)
        return relative_rows(device, config, options, args.cpu_smoke)
    from kvbound.bench.ring import DEFAULT_LENGTHS, SMOKE_LENGTHS, RingOptions, ring_rows

    smoke = args.cpu_smoke
    options = RingOptions(
        lengths=tuple(args.lengths or (SMOKE_LENGTHS if smoke else DEFAULT_LENGTHS)),
        world_sizes=tuple(args.world_sizes or (1, 2)), heads=args.heads or (2 if smoke else 8),
        head_dim=args.head_dim or (32 if smoke else 64), dtype="float16" if smoke else "bfloat16",
        warmup=args.warmup if args.warmup is not None else 1,
        repeats=args.repeats if args.repeats is not None else (2 if smoke else 5),
        check_rows=16 if smoke else 64,
        zero_tile_share=args.zero_tile_share if args.zero_tile_share is not None else 0.5, seed=args.seed,
        rank=config.rank, bits=config.bits, block_size=config.block_size, tau=config.tau)
    return ring_rows(device, options)


def _run_suite(args, argv: list[str], device) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvbound.bench import records, tables

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    rows = _suite_rows(args, device, console)
    if isinstance(rows, int):
        return rows
    out = args.out or Path("benchmarks/results") / time.strftime(f"{args.suite}-%Y%m%d-%H%M%S.csv")
    if out.exists():
        out.unlink()
    env = records.environment(argv, commit=args.commit)
    console.print(f"kvbound bench --suite {args.suite}: {env['gpu']}, torch {env['torch']}, triton {env['triton']} "
                  f"-> {out}")
    started = time.perf_counter()
    for row in rows:
        records.append_row(out, {**row, **env})
        timing = f"{row['ms_p50']:.4g} ms" if row.get("ms_p50") is not None else (row.get("reason") or "")[:100]
        extra = f" (x{row['world_size']})" if row.get("world_size") else (
            f" B={row['batch']}" if args.suite == "models" else "")
        console.print(f"[{time.perf_counter() - started:7.1f} s] {row['shape']}{extra} {row['provider']}: "
                      f"{row['status']} {timing}", highlight=False)
    written = records.read_rows(out) if out.exists() else []
    table_of = {"encoder": tables.encoder_table, "models": tables.models_table, "ring": tables.ring_table,
                "relative": tables.relative_table}
    headers, body = table_of[args.suite](written)
    table = Table(title=f"kvbound bench --suite {args.suite}")
    for h in headers:
        table.add_column(h)
    for line in body:
        table.add_row(*line)
    console.print(table)
    console.print(f"{len(written)} rows written to {out} in {time.perf_counter() - started:.0f} s")
    return 1 if any(r["status"] == "check_failed" for r in written) else 0


def _run(args, argv: list[str], providers, device) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbound.bench import records
    from kvbound.bench.providers import Case
    from kvbound.bench.runner import (
        MODEL_LAYERS,
        SMOKE_LAYERS,
        RunOptions,
        calibration_rows,
        input_sets_for,
        plan_tasks,
        run_task,
        skipped_row,
    )
    from kvbound.bench.shapes import default_shape_files, load_shapes
    from kvbound.bench.summary import print_summary

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
    shapes = load_shapes(args.shapes or default_shape_files(args.cpu_smoke))
    if args.only:
        unknown = [pattern for pattern in args.only if not any(fnmatch(s.name, pattern) for s in shapes)]
        if unknown:
            console.print(f"kvbound bench: --only: no shape matches {unknown}; shapes: {[s.name for s in shapes]}")
            return 2
        shapes = [s for s in shapes if any(fnmatch(s.name, pattern) for pattern in args.only)]
    if args.providers:
        unknown = set(args.providers) - {p.name for p in providers}
        if unknown:
            console.print(f"kvbound bench: --providers: unknown {sorted(unknown)}; see --list")
            return 2
        providers = [p for p in providers if p.name in args.providers]
    missing = {p.name: p.unavailable() for p in providers}
    for name, reason in missing.items():
        if reason:
            console.print(f"[yellow]{name} left out: {reason}[/yellow]")
    tasks = plan_tasks(shapes, [p for p in providers if not missing[p.name]], args.sweep)
    if args.configs:
        tasks = [t for t in tasks if t.config is None or t.config.label in args.configs]
    mode = "ncu" if args.ncu_child else "time"
    options = RunOptions(
        mode=mode, sweep=args.sweep, check_rows=args.check_rows, seed=args.seed,
        warmup_ms=args.warmup_ms if args.warmup_ms is not None else (2.0 if device.type == "cpu" else 25.0),
        rep_ms=args.rep_ms if args.rep_ms is not None else (20.0 if device.type == "cpu" else 100.0),
        zero_tile_share=args.zero_tile_share, tolerance=args.tolerance,
    )
    out = args.out or Path("benchmarks/results") / time.strftime("bench-%Y%m%d-%H%M%S.csv")
    if out.exists() and not args.resume:
        out.unlink()
    env = {**records.environment(_without(_without(argv, "--resume"), "--crashed"), commit=args.commit),
           "suite": "attention"}
    console.print(f"kvbound bench: {len(tasks)} measurements on {len(shapes)} shapes, {env['gpu']}, "
                  f"torch {env['torch']}, triton {env['triton']} -> {out}")
    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("starting", total=len(tasks))
        index = 0
        for shape in shapes:
            shape_tasks = [t for t in tasks if t.shape is shape]
            if index + len(shape_tasks) <= args.resume:
                index += len(shape_tasks)
                progress.advance(bar, len(shape_tasks))
                continue
            if not shape_tasks:
                continue
            progress.update(bar, description=f"{shape.name}: generating inputs")
            case = Case(shape, device, seed=args.seed, check_rows=args.check_rows,
                        input_sets=input_sets_for(shape, device), zero_tile_share=args.zero_tile_share)
            for task in shape_tasks:
                if index < args.resume:
                    index += 1
                    progress.advance(bar)
                    continue
                progress.update(bar, description=f"{shape.name}: {task.label}")
                if args.crashed.count(task.provider.name) >= _CRASHES_BEFORE_SKIP:
                    row = {**skipped_row(task, options, f"m{index:04d}",
                                         f"not run: {task.provider.name} lost the CUDA context in "
                                         f"{args.crashed.count(task.provider.name)} earlier measurements"), **env}
                else:
                    row = {**run_task(task, case, options, f"m{index:04d}"), **env}
                index += 1
                records.append_row(out, row)
                progress.advance(bar)
                timing = f"{row['ms_p50']:.4g} ms" if row.get("ms_p50") is not None else (row.get("reason") or "")[:80]
                progress.console.print(f"[{time.perf_counter() - started:7.1f} s] {shape.name} {task.label}: "
                                       f"{row['status']} {timing}", highlight=False)
                if row["status"] == "error" and device.type == "cuda" and not _cuda_context_alive():
                    # A kernel fault (e.g. an illegal address) poisons this process's CUDA context: every later
                    # call would fail. Start afresh after this measurement, appending to the same CSV.
                    progress.stop()
                    console.print(f"[red]CUDA context lost in {task.label} on {shape.name}; restarting the "
                                  f"process at measurement {index}[/red]")
                    _restart(argv, index, out, task.provider.name)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if mode == "time" and not args.no_calibration and not args.only:
            progress.update(bar, description="kvbound.calibrate per model load")
            try:
                dtype = torch.float16 if args.cpu_smoke else torch.bfloat16
                for row in calibration_rows(device, dtype, SMOKE_LAYERS if args.cpu_smoke else MODEL_LAYERS):
                    records.append_row(out, {**row, **env})
            except ImportError as err:
                console.print(f"calibration not timed: {err}")
    rows = records.read_rows(out) if out.exists() else []
    print_summary(rows, console)
    console.print(f"{len(rows)} rows written to {out} in {time.perf_counter() - started:.0f} s")
    failed = [r for r in rows if r["status"] == "check_failed"]
    return 1 if failed else 0


def _without(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def _cuda_context_alive() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return float((torch.ones(1, device="cuda") + 1).item()) == 2.0
    except Exception:  # noqa: BLE001 - any failure here means the context is unusable
        return False


_CRASHES_BEFORE_SKIP = 2


def _restart(argv: list[str], next_index: int, out: Path, crashed: str) -> None:
    args = [*_without(_without(argv, "--resume"), "--out"), "--resume", str(next_index), "--out", str(out),
            "--crashed", crashed]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "kvbound.bench", *args])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
