"""``kvbound bench --suite encoder``: the codec's encoders against a plain device copy, and ``kvbound.calibrate``.

For every shape of the shape files (default ``benchmarks/shapes/seed.toml`` and ``models.toml``; ``smoke.toml``
with ``--cpu-smoke``) one layer's K ``[B, Hkv, Nk, Dk]`` and V ``[B, Hkv, Nk, Dv]`` are drawn as in the attention
suite (``kvbound.bench.data.structured_kv``, same seeds as its first input set), and timed as:

``encoder-triton``           ``kvbound.compress_kv(x, config, basis, impl="triton")`` for K then V, with the
                             float64 certificate on the stored numbers (``verify=True``, the default);
``encoder-triton-noverify``  the same with ``verify=False`` (the in-kernel conservative check only);
``encoder-eager``            ``kvbound.compress_kv(x, config, basis)``, the float64 reference encoder;
``device-copy``              ``k.clone(), v.clone()``: the floor of any pass over the same bytes.

Before timing, each encoder's output is decompressed and checked element by element: ``max_err_over_tau`` =
``max |x - decompress(x)| / tau`` over K and V must be <= 1 and every value finite, else the row is
``check_failed`` (still timed). ``gbps`` is the K + V input bytes over the median time. The basis comes from
``kvbound.calibrate`` on another draw of the same layer (what a model load sees), and that calibration is
timed too: one ``calibrate`` row per shape (mode ``calibrate``, suite ``encoder``) for one K and one V sample
of the shape's size.

    python -m kvbound.bench --suite encoder --out benchmarks/results/encoder_h200_<date>_<commit>.csv
    python -m kvbound.bench --suite encoder --cpu-smoke --out /tmp/encoder.csv

On one H200 from a source checkout (nothing to install beyond the GPU image's torch and Triton)::

    PYTHONPATH=$PWD/src python3 -m kvbound.bench --suite encoder --commit <sha> --out results/encoder_h200.csv

Times come from ``kvbound.bench.runner.measure`` (``triton.testing.do_bench`` quantiles on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvbound.bench import data as bench_data
from kvbound.bench.formulas import gbps
from kvbound.bench.runner import measure, shape_fields
from kvbound.bench.shapes import AttentionShape

__all__ = ["ENCODERS", "EncoderOptions", "config_label", "encoder_rows", "encoder_inputs"]

ENCODERS = ("encoder-triton", "encoder-triton-noverify", "encoder-eager", "device-copy")
_MODE_NAMES = ("lowrank", "packed", "promoted", "raw")


@dataclass
class EncoderOptions:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0
    zero_tile_share: float | None = None
    encoders: tuple[str, ...] = ENCODERS
    calibration: bool = True


def config_label(config) -> str:
    """``r8b4``; the block size and tau are appended when they differ from the defaults."""
    from kvbound.config import DEFAULT_TAU

    label = f"r{config.rank}b{config.bits}"
    if config.block_size != 128:
        label += f"-block{config.block_size}"
    if config.tau != DEFAULT_TAU:
        label += f"-tau{config.tau:g}"
    return label


def encoder_inputs(shape: AttentionShape, device: torch.device, *, seed: int = 0, block_size: int = 128,
                   zero_tile_share: float | None = None) -> dict[str, torch.Tensor]:
    """One layer's ``k``, ``v`` and calibration samples ``k_sample``, ``v_sample`` (another draw of the same
    layer), with the attention suite's seeds (``kvbound.bench.providers.Case``, input set 0)."""
    s = shape
    dtype = getattr(torch, s.dtype)
    share = s.zero_tile_share if zero_tile_share is None else zero_tile_share
    k_subspace = bench_data.kv_subspace(s.kv_heads, s.head_dim_qk, seed=seed * 100 + 1, device=device)
    v_subspace = bench_data.kv_subspace(s.kv_heads, s.head_dim_v, seed=seed * 100 + 2, device=device)

    def draw(subspace: torch.Tensor, draw_seed: int) -> torch.Tensor:
        return bench_data.structured_kv(s.batch, s.kv_len, subspace, zero_tile_share=share, block_size=block_size,
                                        dtype=dtype, seed=draw_seed)

    return {"k": draw(k_subspace, seed * 1000 + 4), "v": draw(v_subspace, seed * 1000 + 5),
            "k_sample": draw(k_subspace, seed * 1000 + 997), "v_sample": draw(v_subspace, seed * 1000 + 998)}


def _encoder_call(name: str, k: torch.Tensor, v: torch.Tensor, config, basis_k, basis_v) -> Callable[[], tuple]:
    import kvbound

    if name == "encoder-triton":
        return lambda: (kvbound.compress_kv(k, config, basis_k, impl="triton"),
                        kvbound.compress_kv(v, config, basis_v, impl="triton"))
    if name == "encoder-triton-noverify":
        return lambda: (kvbound.compress_kv(k, config, basis_k, impl="triton", verify=False),
                        kvbound.compress_kv(v, config, basis_v, impl="triton", verify=False))
    if name == "encoder-eager":
        return lambda: (kvbound.compress_kv(k, config, basis_k, impl="eager"),
                        kvbound.compress_kv(v, config, basis_v, impl="eager"))
    if name == "device-copy":
        return lambda: (k.clone(), v.clone())
    raise ValueError(f"encoder: expected one of {ENCODERS}, got {name!r}")


def _max_abs_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.to(torch.float64) - y.to(torch.float64)).abs().max())


def _check(name: str, result: tuple, k: torch.Tensor, v: torch.Tensor, tau: float) -> tuple[dict, str, str]:
    """Fields describing ``result`` (compressed or copied K and V) and the check's (status, reason)."""
    if name == "device-copy":
        same = torch.equal(result[0], k) and torch.equal(result[1], v)
        return {"kv_max_abs_error": 0.0 if same else math.inf, "max_err_over_tau": 0.0 if same else math.inf}, (
            "ok" if same else "check_failed"), ("" if same else "the copy differs from its source")
    ck, cv = result
    k_hat, v_hat = ck.decompress(), cv.decompress()
    finite = bool(torch.isfinite(k_hat).all()) and bool(torch.isfinite(v_hat).all())
    error = max(_max_abs_difference(k, k_hat), _max_abs_difference(v, v_hat)) if finite else math.inf
    k_shares = [ck.mode_fractions()[m] for m in _MODE_NAMES]
    v_shares = [cv.mode_fractions()[m] for m in _MODE_NAMES]
    blocks_k, blocks_v = ck.mode.numel(), cv.mode.numel()
    fields = {
        "kv_bytes": ck.nbytes + cv.nbytes,
        "compression_ratio": (ck.dense_nbytes + cv.dense_nbytes) / (ck.nbytes + cv.nbytes),
        "zero_residual_share": (k_shares[0] * blocks_k + v_shares[0] * blocks_v) / (blocks_k + blocks_v),
        **{f"k_share_{m}": x for m, x in zip(_MODE_NAMES, k_shares, strict=True)},
        **{f"v_share_{m}": x for m, x in zip(_MODE_NAMES, v_shares, strict=True)},
        "kv_max_abs_error": error,
        "max_err_over_tau": error / tau,
    }
    if not finite:
        return fields, "check_failed", "decompressed K or V has NaN or Inf"
    if not error <= tau:
        return fields, "check_failed", f"max |x - decompress(x)| = {error:.4g} > tau = {tau:g}"
    return fields, "ok", ""


def _tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def encoder_rows(shapes: list[AttentionShape], device: torch.device, config, options: EncoderOptions
                 ) -> Iterator[dict]:
    """One ``calibrate`` row and one ``encode`` row per encoder for each shape (without provenance columns)."""
    for shape in shapes:
        yield from _shape_rows(shape, device, config, options)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _error_reason(err: BaseException) -> str:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return f"out of memory: {str(err).splitlines()[0][:200]}"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def _shape_rows(shape: AttentionShape, device: torch.device, config, options: EncoderOptions) -> Iterator[dict]:
    import kvbound

    inputs = encoder_inputs(shape, device, seed=options.seed, block_size=config.block_size,
                            zero_tile_share=options.zero_tile_share)
    k, v = inputs["k"], inputs["v"]
    dense = _tensor_bytes(k, v)
    common = {**shape_fields(shape), "suite": "encoder", "rank": config.rank, "bits": config.bits,
              "block_size": config.block_size, "tau": config.tau}

    def calibrate_both():
        return kvbound.calibrate(inputs["k_sample"], config), kvbound.calibrate(inputs["v_sample"], config)

    try:
        basis_k, basis_v = calibrate_both()
    except Exception as err:  # noqa: BLE001 - without a basis no encoder can run; every row says why
        for name in options.encoders:
            yield {**common, "mode": "encode", "provider": name, "status": "error",
                   "reason": f"kvbound.calibrate failed: {_error_reason(err)}"}
        return
    if options.calibration:
        p20, p50, p80 = measure(calibrate_both, device, options.warmup_ms, options.rep_ms)
        yield {**common, "mode": "calibrate", "provider": "kvbound.calibrate", "config": f"r{config.rank}",
               "basis": "calibrated", "status": "ok", "reason": "", "ms_p20": p20, "ms_p50": p50, "ms_p80": p80,
               "kv_dense_bytes": _tensor_bytes(inputs["k_sample"], inputs["v_sample"]),
               "note": f"one K and one V sample of {shape.kv_len} tokens x {shape.kv_heads} heads"}
    for name in options.encoders:
        row = {**common, "mode": "encode", "provider": name, "kv_dense_bytes": dense}
        if name == "device-copy":
            row.update(bytes_moved=2 * dense, note="k.clone(), v.clone(): reads and writes K + V once")
        else:
            row.update(config=config_label(config), basis="calibrated",
                       note="verify=False: in-kernel check only" if name.endswith("noverify") else "")
        try:
            call = _encoder_call(name, k, v, config, basis_k, basis_v)
            fields, status, reason = _check(name, call(), k, v, config.tau)
            row.update(fields)
            if name != "device-copy":
                row["bytes_moved"] = dense + fields["kv_bytes"]
            p20, p50, p80 = measure(call, device, options.warmup_ms, options.rep_ms)
            row.update(status=status, reason=reason, ms_p20=p20, ms_p50=p50, ms_p80=p80, gbps=gbps(dense, p50))
        except Exception as err:  # noqa: BLE001 - one encoder's failure is recorded, the others still run
            row.update(status="error", reason=_error_reason(err))
        yield row
