"""``kvbound bench --suite ring``: context-parallel attention (``kvbound.distributed``) on 1 and 2 GPUs.

One process per GPU (NCCL; gloo on CPU processes with ``--cpu-smoke``). Every process draws the same whole
sequence (``kvbound.bench.data``: structured K/V with ``--zero-tile-share`` residual-free blocks, default 0.5 as
in the attention suite; queries in K's subspace), keeps its contiguous shard and, per sequence length N, times
one attention layer (non-causal, B = 1, bf16) three ways:

``ring-compressed``  ``context_parallel_attention(compress=True, impl="triton")`` (the eager encoder on the
                     CPU): K/V shards compressed once (timed inside the layer) and passed around the ring;
``ring-dense``       the same ring passing dense K/V (``compress=False``);
``allgather-dense``  ``allgather_attention``: all-gather the dense shards, then local attention.

``ms_*`` are quantiles over calls of the slowest rank's time (all ranks start together after a barrier);
``bytes_sent`` is what one rank sent (``RingStats.bytes_sent``, the largest over ranks), ``dense_bytes_sent``
the dense K + V it would send (``(W - 1) x`` its shard). Before timing, each provider's output on an evenly
spaced subsample of query rows (``--check-rows`` over the whole sequence) is compared with the float64
``kvbound.reference_attention`` over the K/V it computes on: for the compressed ring the shards compressed as the
ring compresses them, decompressed and concatenated (``err_max``, ``err_rel``), and also the original K/V
(``err_vs_dense_rel``: what compression costs the output). The basis of each K/V comes from
``kvbound.calibrate`` on another draw of the same layer (8192 tokens at most).

On a machine with two H200s (NCCL's NVLink multicast kept off)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; \\
    PYTHONPATH=$PWD/src python3 -m kvbound.bench --suite ring --commit <sha> --out results/ring_h200x2.csv

(defaults: ``--lengths 65536 131072 262144 524288 --world-sizes 1 2``; a world size above the GPUs present gets
``unsupported`` rows). On the CPU::

    python -m kvbound.bench --suite ring --cpu-smoke --out /tmp/ring.csv
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from kvbound.bench.formulas import attention_flops, ring_dense_bytes_per_rank, tflops

__all__ = ["RingOptions", "RING_PROVIDERS", "ring_rows", "check_row_index", "DEFAULT_LENGTHS", "SMOKE_LENGTHS"]

RING_PROVIDERS = ("ring-compressed", "ring-dense", "allgather-dense")
DEFAULT_LENGTHS = (65_536, 131_072, 262_144, 524_288)
SMOKE_LENGTHS = (256,)
_CALIBRATION_TOKENS = 8192
# NVLink multicast can take the host's GPUs out of service; keep it off in every process started here.
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_MODE_NAMES = ("lowrank", "packed", "promoted", "raw")


@dataclass
class RingOptions:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    world_sizes: tuple[int, ...] = (1, 2)
    heads: int = 8
    head_dim: int = 64
    dtype: str = "bfloat16"
    warmup: int = 1
    repeats: int = 5
    check_rows: int = 64
    zero_tile_share: float = 0.5
    seed: int = 0
    rank: int = 8
    bits: int = 4
    block_size: int = 128
    tau: float | None = None
    timeout_s: float = 300.0
    providers: tuple[str, ...] = field(default_factory=lambda: RING_PROVIDERS)


def check_row_index(seq_len: int, rows: int, start: int, stop: int) -> torch.Tensor:
    """Local indices (within ``[start, stop)``) of ``rows`` evenly spaced query rows of the whole sequence."""
    picks = torch.linspace(0, seq_len - 1, min(rows, seq_len)).round().long().unique()
    mine = picks[(picks >= start) & (picks < stop)]
    return mine - start


def _config(options: RingOptions):
    from kvbound.config import DEFAULT_TAU, CompressionConfig

    return CompressionConfig(block_size=options.block_size, rank=options.rank, bits=options.bits,
                             tau=DEFAULT_TAU if options.tau is None else options.tau)


def _inputs(n: int, options: RingOptions, device: torch.device) -> dict[str, torch.Tensor]:
    from kvbound.bench import data as bench_data

    dtype = getattr(torch, options.dtype)
    s = options.seed
    k_subspace = bench_data.kv_subspace(options.heads, options.head_dim, seed=s * 100 + 1, device=device)
    v_subspace = bench_data.kv_subspace(options.heads, options.head_dim, seed=s * 100 + 2, device=device)

    def kv(subspace, seed, length):
        return bench_data.structured_kv(1, length, subspace, zero_tile_share=options.zero_tile_share,
                                        block_size=options.block_size, dtype=dtype, seed=seed)

    calibration = min(n, _CALIBRATION_TOKENS)
    return {
        "q": bench_data.structured_queries(1, options.heads, n, k_subspace, dtype=dtype, seed=s * 1000 + 3),
        "k": kv(k_subspace, s * 1000 + 4, n),
        "v": kv(v_subspace, s * 1000 + 5, n),
        "k_sample": kv(k_subspace, s * 1000 + 997, calibration),
        "v_sample": kv(v_subspace, s * 1000 + 998, calibration),
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _errors(out_rows: torch.Tensor, reference: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(max abs, relative L2) over every rank's checked rows."""
    import torch.distributed as dist

    diff = out_rows.to(torch.float64) - reference
    stats = torch.tensor([float(diff.abs().max()) if diff.numel() else 0.0,
                          float((diff**2).sum()), float((reference**2).sum())], dtype=torch.float64, device=device)
    maximum, sums = stats[:1].clone(), stats[1:].clone()
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return float(maximum), float(sums[0].sqrt() / sums[1].sqrt().clamp_min(1e-300))


def _gather_sequence(x: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=2)


def _slowest(times: list[float]) -> list[float]:
    """Per call, the largest time over ranks."""
    import torch.distributed as dist

    everyone: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return [max(column) for column in zip(*everyone, strict=True)]


def _largest(value: float) -> float:
    import torch.distributed as dist

    everyone: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return max(everyone)


def _summed(values: list[float]) -> list[float]:
    """Element-wise sums over ranks."""
    import torch.distributed as dist

    everyone: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [float(x) for x in values])
    return [sum(column) for column in zip(*everyone, strict=True)]


def _time(fn, device: torch.device, warmup: int, repeats: int) -> list[float]:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _layer_rows(n: int, world: int, rank: int, device: torch.device, options: RingOptions) -> list[dict]:
    import kvbound
    from kvbound.bench.runner import quantiles
    from kvbound.distributed import allgather_attention, context_parallel_attention

    config = _config(options)
    encoder = "triton" if device.type == "cuda" else "eager"
    data = _inputs(n, options, device)
    start, stop = rank * n // world, (rank + 1) * n // world
    q, k, v = (data[name][:, :, start:stop].contiguous() for name in ("q", "k", "v"))
    basis_k = kvbound.calibrate(data["k_sample"], config)
    basis_v = kvbound.calibrate(data["v_sample"], config)
    rows_here = check_row_index(n, options.check_rows, start, stop).to(device)
    checked = int(check_row_index(n, options.check_rows, 0, n).numel())
    shard_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    # What the compressed ring computes on: every shard compressed as the ring compresses it.
    ck = kvbound.compress_kv(k, config, basis_k, impl=encoder)
    cv = kvbound.compress_kv(v, config, basis_v, impl=encoder)
    k_hat, v_hat = _gather_sequence(ck.decompress(), world), _gather_sequence(cv.decompress(), world)
    dense_reference = kvbound.reference_attention(q[:, :, rows_here], data["k"], data["v"])
    # Storage and block modes over the whole sequence (every rank's shard).
    counts = _summed([ck.nbytes + cv.nbytes, ck.dense_nbytes + cv.dense_nbytes, ck.mode.numel(), cv.mode.numel(),
                      *(ck.mode_fractions()[m] * ck.mode.numel() for m in _MODE_NAMES),
                      *(cv.mode_fractions()[m] * cv.mode.numel() for m in _MODE_NAMES)])
    stored, dense_stored, k_blocks, v_blocks = counts[:4]
    k_counts, v_counts = counts[4:8], counts[8:]
    shares = {f"k_share_{m}": c / k_blocks for m, c in zip(_MODE_NAMES, k_counts, strict=True)}
    shares.update({f"v_share_{m}": c / v_blocks for m, c in zip(_MODE_NAMES, v_counts, strict=True)})
    calls = {
        "ring-compressed": partial(context_parallel_attention, q, k, v, config=config, basis_k=basis_k,
                                   basis_v=basis_v, impl=encoder, return_stats=True),
        "ring-dense": partial(context_parallel_attention, q, k, v, compress=False, return_stats=True),
        "allgather-dense": lambda: (allgather_attention(q, k, v), None),
    }
    flops = attention_flops(1, options.heads, n, n, options.head_dim, options.head_dim, False)
    dense_sent = ring_dense_bytes_per_rank(world, shard_bytes)
    out_rows = []
    for provider in options.providers:
        row = {"mode": "ring", "suite": "ring", "provider": provider, "shape": f"ring-n{n}-d{options.head_dim}",
               "family": "ring", "batch": 1, "q_heads": options.heads, "kv_heads": options.heads, "q_len": n,
               "kv_len": n, "head_dim_qk": options.head_dim, "head_dim_v": options.head_dim, "causal": False,
               "dtype": options.dtype, "bias": "none", "world_size": world, "flops": flops, "repeats": options.repeats,
               "check_rows": checked, "dense_bytes_sent": dense_sent, "kv_dense_bytes": world * shard_bytes,
               "status": "ok", "reason": ""}
        if provider == "ring-compressed":
            row.update(config=f"r{config.rank}b{config.bits}", rank=config.rank, bits=config.bits,
                       block_size=config.block_size, tau=config.tau, basis="calibrated",
                       compression_ratio=dense_stored / stored, kv_bytes=int(stored),
                       zero_residual_share=(k_counts[0] + v_counts[0]) / (k_blocks + v_blocks),
                       note=f"{encoder} encoder inside the timed layer", **shares)
        try:
            fn = calls[provider]
            out, stats = fn()
            if provider == "ring-compressed":
                reference = kvbound.reference_attention(q[:, :, rows_here], k_hat, v_hat)
                row["err_vs_dense_rel"] = _errors(out[:, :, rows_here], dense_reference, device)[1]
            else:
                reference = dense_reference
            row["err_max"], row["err_rel"] = _errors(out[:, :, rows_here], reference, device)
            finite = bool(torch.isfinite(out).all())
            if not _largest(0.0 if finite else 1.0) == 0.0:
                row.update(status="check_failed", reason="output has NaN or Inf on some rank")
            elif not row["err_rel"] <= 3e-2:
                row.update(status="check_failed", reason=f"relative error {row['err_rel']:.3g} > tolerance 0.03")
            row["bytes_sent"] = int(_largest(stats.bytes_sent if stats is not None else dense_sent))
            del out
            compress_ms = []

            def timed(fn=fn, compress_ms=compress_ms):
                _, stats = fn()
                if stats is not None and stats.compress_seconds:
                    compress_ms.append(stats.compress_seconds * 1e3)

            times = _slowest(_time(timed, device, options.warmup, options.repeats))
            p20, p50, p80 = quantiles(times)
            row.update(ms_p20=p20, ms_p50=p50, ms_p80=p80, tflops=tflops(flops, p50))
            if compress_ms:
                row["compress_ms"] = _largest(quantiles(compress_ms)[1])
        except torch.cuda.OutOfMemoryError as err:
            row.update(status="error", reason=f"out of memory: {str(err).splitlines()[0][:200]}")
        except Exception as err:  # noqa: BLE001 - recorded; the next provider still runs
            text = str(err).splitlines()[0][:300] if str(err) else ""
            row.update(status="error", reason=f"{type(err).__name__}: {text}")
        out_rows.append(row)
    return out_rows


def _worker(rank: int, world: int, backend: str, init: str, out_path: str, options: dict) -> None:
    import torch.distributed as dist

    os.environ.update(_NO_MULTICAST)
    opts = RingOptions(**options)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per process, as one GPU per process: no oversubscribed thread pools
    # A rank that fails mid-collective leaves the others waiting: the timeout ends them instead of hanging.
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=opts.timeout_s))
    try:
        rows = []
        for n in opts.lengths:
            rows.extend(_layer_rows(n, world, rank, device, opts))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:  # written after every length, so a crash keeps what was measured
                Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _unavailable_rows(world: int, options: RingOptions, reason: str, status: str = "unsupported") -> list[dict]:
    return [{"mode": "ring", "suite": "ring", "provider": provider, "shape": f"ring-n{n}-d{options.head_dim}",
             "family": "ring", "batch": 1, "q_heads": options.heads, "kv_heads": options.heads, "q_len": n,
             "kv_len": n, "head_dim_qk": options.head_dim, "head_dim_v": options.head_dim, "dtype": options.dtype,
             "world_size": world, "status": status, "reason": reason}
            for n in options.lengths for provider in options.providers]


def ring_rows(device: torch.device, options: RingOptions):
    """Rows for every (world size, N, provider), world sizes in order (a generator: one world size at a time)."""
    import torch.multiprocessing as mp

    os.environ.update(_NO_MULTICAST)
    for world in options.world_sizes:
        bad = [n for n in options.lengths if n % world]
        if bad:
            yield from _unavailable_rows(world, options, f"N = {bad} not divisible by {world} processes")
            continue
        if device.type == "cuda" and world > torch.cuda.device_count():
            yield from _unavailable_rows(world, options, f"needs {world} GPUs; {torch.cuda.device_count()} present")
            continue
        backend = "nccl" if device.type == "cuda" else "gloo"
        with tempfile.TemporaryDirectory(prefix="kvbound-ring-") as tmp:
            out_path = os.path.join(tmp, "rows.json")
            init = f"file://{os.path.join(tmp, 'init')}"
            try:
                mp.spawn(_worker, args=(world, backend, init, out_path, asdict(options)), nprocs=world, join=True)
                failure = None
            except Exception as err:  # noqa: BLE001 - a crashed process group is recorded, not raised
                failure = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err) else ''}"
            rows = json.loads(Path(out_path).read_text()) if os.path.exists(out_path) else []
        yield from rows
        if failure is not None:
            done = {(r["q_len"], r["provider"]) for r in rows}
            yield from (r for r in _unavailable_rows(world, options, f"process group failed: {failure}", "error")
                        if (r["q_len"], r["provider"]) not in done)
