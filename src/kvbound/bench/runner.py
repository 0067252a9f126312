"""Run providers over shapes: prepare, check against the float64 reference, then time (or profile once).

Timing uses ``triton.testing.do_bench`` (quantiles 0.2/0.5/0.8 of CUDA-event times; it runs the call for
``warmup_ms`` first and clears L2 before every timed call). When one input set (q, k, v, o) fits in L2 the
call also rotates over several input sets, so back-to-back calls never find their inputs cached. On the CPU
(``--cpu-smoke``) the same loop times with ``time.perf_counter``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvbound.bench.formulas import DTYPE_BYTES, attention_flops, tflops
from kvbound.bench.providers import Case, CompressedConfigSpec, Prepared, Provider, Unsupported
from kvbound.bench.shapes import AttentionShape

__all__ = ["RunOptions", "Task", "plan_tasks", "run_task", "skipped_row", "measure", "time_calls", "quantiles",
           "input_sets_for", "shape_fields", "calibration_rows", "MODEL_LAYERS", "NVTX_PREFIX"]

QUANTILES = (0.2, 0.5, 0.8)
NVTX_PREFIX = "kvbound_bench:"
_TOLERANCE = {"bfloat16": 3e-2, "float16": 3e-2, "float32": 1e-3}


@dataclass
class RunOptions:
    mode: str = "time"  # "time" or "ncu"
    sweep: bool = False
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    check_rows: int = 256
    seed: int = 0
    zero_tile_share: float | None = None
    tolerance: float | None = None


@dataclass
class Task:
    shape: AttentionShape
    provider: Provider
    config: CompressedConfigSpec | None
    unavailable: str | None

    @property
    def label(self) -> str:
        return self.provider.name + (f"[{self.config.label}]" if self.config else "")


def plan_tasks(shapes: list[AttentionShape], providers: list[Provider], sweep: bool) -> list[Task]:
    """Every (shape, provider, config) to run, in order. Providers that cannot be imported are left out (the
    caller reports them); a provider that imports but cannot run a shape gets an ``unsupported`` row."""
    tasks = []
    for shape in shapes:
        for provider in providers:
            if shape.providers and provider.name not in shape.providers:
                continue
            if not provider.applies(shape):
                continue
            for config in provider.configs(sweep):
                tasks.append(Task(shape, provider, config, None))
    return tasks


def input_sets_for(shape: AttentionShape, device: torch.device) -> int:
    """How many input sets to rotate: enough to exceed L2 when one set fits in it (at most 4)."""
    s = shape
    one_set = (s.batch * s.q_heads * s.q_len * (s.head_dim_qk + s.head_dim_v)
               + s.batch * s.kv_heads * s.kv_len * (s.head_dim_qk + s.head_dim_v)) * DTYPE_BYTES[s.dtype]
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    else:
        l2 = 2 * one_set  # exercise rotation on the CPU path too
    if one_set >= l2:
        return 1
    return min(4, l2 // one_set + 1)


def shape_fields(shape: AttentionShape) -> dict:
    return {
        "shape": shape.name, "family": shape.family, "batch": shape.batch, "q_heads": shape.q_heads,
        "kv_heads": shape.kv_heads, "q_len": shape.q_len, "kv_len": shape.kv_len,
        "head_dim_qk": shape.head_dim_qk, "head_dim_v": shape.head_dim_v, "causal": shape.causal,
        "dtype": shape.dtype, "bias": shape.bias, "softcap": shape.softcap,
    }


def measure(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float) -> list[float]:
    """p20, p50, p80 of ``fn``'s time in milliseconds."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return [float(x) for x in do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))]
    # The caller's correctness check was the warm-up call; the interpreter is slow, so two timed calls at least.
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 2 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return [_quantile(times, q) for q in QUANTILES]


def time_calls(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    For calls too long for ``do_bench``'s fixed time budget (a whole model forward, a distributed layer): on CUDA
    each call is bracketed by events and the device synchronised after it; on the CPU, ``time.perf_counter``."""
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats!r}")
    for _ in range(warmup):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def quantiles(values: list[float]) -> list[float]:
    """p20, p50, p80 of ``values`` (linear interpolation, numpy's default)."""
    if not values:
        raise ValueError("values: expected at least one time")
    return [_quantile(values, q) for q in QUANTILES]


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _errors(out: torch.Tensor, case: Case, reference: torch.Tensor) -> tuple[float, float, bool]:
    """(max abs error, relative L2 error, all finite) of the checked rows of ``out``."""
    rows = out[:, :, case.check_index].to(torch.float64)
    finite = bool(torch.isfinite(rows).all())
    diff = rows - reference
    err_max = float(diff.abs().max())
    err_rel = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(reference).clamp_min(1e-300))
    return err_max, err_rel, finite


def _base_row(task: Task, options: RunOptions, measurement_id: str) -> dict:
    shape = task.shape
    row = {"mode": options.mode, "measurement_id": measurement_id, "provider": task.provider.name,
           **shape_fields(shape),
           "flops": attention_flops(shape.batch, shape.q_heads, shape.q_len, shape.kv_len, shape.head_dim_qk,
                                    shape.head_dim_v, shape.causal)}
    if task.config is not None:
        c = task.config
        row.update(config=c.label, rank=c.rank, bits=c.bits, block_size=c.block_size, tau=c.tau, basis=c.basis)
    return row


def skipped_row(task: Task, options: RunOptions, measurement_id: str, reason: str) -> dict:
    """An ``error`` row for a task that was not run (``reason`` says why)."""
    return {**_base_row(task, options, measurement_id), "status": "error", "reason": reason}


def run_task(task: Task, case: Case, options: RunOptions, measurement_id: str) -> dict:
    """One CSV row (without the provenance columns) for ``task`` on ``case``."""
    shape = task.shape
    row = {**_base_row(task, options, measurement_id), "check_rows": int(case.check_index.numel()),
           "input_sets": case.input_sets}
    if task.unavailable:
        return {**row, "status": "unsupported", "reason": task.unavailable}
    device = case.device
    prepared: Prepared | None = None
    try:
        prepared = task.provider.prepare(case, task.config)
        row.update(prepared.config)
        row.update(prepared.extras)
        row.update(bytes_moved=prepared.bytes_moved, kv_bytes=prepared.kv_bytes,
                   kv_dense_bytes=prepared.kv_dense_bytes, semantics=prepared.semantics, note=prepared.note)
        with prepared.context():
            out = prepared.call(0)
            _synchronize(device)
            err_max, err_rel, finite = _errors(out, case, prepared.reference())
            if prepared.compressed:
                row["err_vs_dense_rel"] = _errors(out, case, case.dense_reference())[1]
            del out
            tolerance = options.tolerance or _TOLERANCE[shape.dtype]
            row.update(err_max=err_max, err_rel=err_rel)
            status, reason = "ok", ""
            if not finite:
                status, reason = "check_failed", "output has NaN or Inf in the checked rows"
            elif not err_rel <= tolerance:
                status, reason = "check_failed", f"relative error {err_rel:.3g} > tolerance {tolerance:g}"
            if options.mode == "time":
                p20, p50, p80 = measure(_rotating(prepared.call, case.input_sets), device, options.warmup_ms,
                                        options.rep_ms)
                row.update(ms_p20=p20, ms_p50=p50, ms_p80=p80, tflops=tflops(row["flops"], p50))
            elif options.mode == "ncu":
                _profiled_call(prepared, device, measurement_id)
        row.update(status=status, reason=reason)
    except Unsupported as err:
        row.update(status="unsupported", reason=str(err))
    except torch.cuda.OutOfMemoryError as err:
        row.update(status="error", reason=f"out of memory: {str(err).splitlines()[0][:200]}")
    except Exception as err:  # noqa: BLE001 - one provider's failure must not stop the run; it is recorded
        row.update(status="error", reason=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
    finally:
        del prepared
    return row


def _rotating(call: Callable[[int], torch.Tensor], sets: int) -> Callable[[], torch.Tensor]:
    counter = itertools.count()
    return lambda: call(next(counter) % sets)


def _profiled_call(prepared: Prepared, device: torch.device, measurement_id: str) -> None:
    """One call inside an NVTX range that ``ncu --nvtx-include`` selects (warm-up and checks stay outside)."""
    prepared.call(0)  # second warm call: lazy initialisation (handles, autotuning) happens before the range
    _synchronize(device)
    torch.cuda.nvtx.range_push(NVTX_PREFIX + measurement_id)
    prepared.call(0)
    _synchronize(device)
    torch.cuda.nvtx.range_pop()


# --------------------------------------------------------------------------------------------- calibration
# (model, layers, K/V heads, tokens, dk, dv): one sample sequence per layer, K and V calibrated separately.
MODEL_LAYERS = (
    ("enformer", 11, 8, 1536, 64, 192),
    ("borzoi", 8, 8, 4096, 64, 192),
    ("alphagenome", 9, 1, 8192, 128, 192),
)
SMOKE_LAYERS = (("smoke-model", 2, 2, 256, 32, 48),)


def calibration_rows(device: torch.device, dtype: torch.dtype, models=MODEL_LAYERS, *, seed: int = 0
                     ) -> Iterator[dict]:
    """Time ``kvbound.calibrate`` on model-sized samples: per model, every layer's K and V (default config).

    ``ms_p50`` is the whole model load (sum over layers); ``ms_p20``/``ms_p80`` are left empty (one load)."""
    import kvbound
    from kvbound.bench import data as bench_data

    config = kvbound.CompressionConfig()
    warm = bench_data.structured_kv(1, 256, bench_data.kv_subspace(1, 64, device=device), dtype=dtype)
    kvbound.calibrate(warm, config)  # first-call costs (kernels, handles) are not a model load's
    for name, layers, heads, tokens, dk, dv in models:
        samples = []
        for layer in range(layers):
            for which, dim in (("k", dk), ("v", dv)):
                subspace = bench_data.kv_subspace(heads, dim, seed=seed + 17 * layer + (which == "v"), device=device)
                samples.append(bench_data.structured_kv(1, tokens, subspace, dtype=dtype, seed=seed + layer))
        _synchronize(device)
        start = time.perf_counter()
        for x in samples:
            kvbound.calibrate(x, config)
        _synchronize(device)
        total_ms = (time.perf_counter() - start) * 1e3
        yield {
            "mode": "calibrate", "provider": "kvbound.calibrate", "config": "r8", "shape": name, "family": "model",
            "batch": 1, "q_heads": heads, "kv_heads": heads, "q_len": tokens, "kv_len": tokens, "head_dim_qk": dk,
            "head_dim_v": dv, "dtype": str(dtype).removeprefix("torch."), "rank": config.rank, "bits": config.bits,
            "block_size": config.block_size, "tau": config.tau, "status": "ok", "ms_p50": total_ms,
            "note": f"{layers} layers x (K, V), one {tokens}-token sample each", "semantics": "",
            "reason": "",
        }
        del samples
