"""``kvbound bench --suite relative``: one Enformer / Borzoi attention layer's core against what a user could build.

Transformer-XL relative attention (both ports) adds a term that depends on the query to every logit::

    logits[i, j] = (scale q_i + u) . k_j  +  (scale q_i + w) . R[N - 1 + j - i]

so no stock fused kernel computes it: a user either runs the ports' eager math or materialises the position term
first and hands it to a fused kernel. Each row times one layer's attention core (B, 8 heads, dk 64, dv 192, bf16,
Enformer's 1536 and Borzoi's 4096 tokens), every preparation a provider needs included in its time:

``port-eager``                  the ports' math under autocast: ``[B, H, N, 2N - 1]`` position logits, the
                                port's relative shift (Enformer: pad and reshape; Borzoi: a strided view),
                                ``[B, H, N, N]`` logits, softmax, ``@ v``;
``sdpa-built-bias``             the position term built as a ``[B, H, N, N]`` bf16 bias (one einsum and one
                                copy of its shifted view), then
                                ``F.scaled_dot_product_attention(scale q + u, k, v, attn_mask=bias)``;
``flex-built-table``            the ``[B, H, N, 2N - 1]`` position table built, then FlexAttention
                                (``torch.compile``d on CUDA) adding ``table[b, h, i, N - 1 + j - i]`` in
                                ``score_mod``;
``kvbound-relative``            ``kvbound.attention(..., relative_keys=R, ...)``: one fused call, each tile's
                                position term formed on chip from the ``BM + BN - 1`` rows of ``R`` it needs;
``kvbound-relative-runs``       (Borzoi only) the same call with ``relative_runs``: Borzoi's relative keys are
                                constant over runs of distances (its features are step functions of ``|d|``), so
                                the kernel reads one value per query and run instead of ``R``;
``kvbound-relative-deferred``,   the same two calls with their NaN/Inf checks deferred: the check and the timing
``kvbound-relative-runs-deferred`` loop inside one ``kvbound.deferred_checks()`` block, as a patched model runs
                                its layers (one host read per forward); the rows above check at each call, which
                                waits for the device once per call;
``kvbound-relative-compressed`` encoding this forward's K and V with the default config (bases calibrated on
                                another draw), then the same fused call on the compressed form: a compressed
                                forward's work per layer; ``compress_ms`` is the encoding alone.

``peak_bytes`` is the CUDA allocator's peak during one call above what was allocated before it. Before timing,
the first and last batch items of each output are compared with the float64 reference
(``kvbound.models.reference.relative_position_attention_reference``; on the decompressed K/V for the compressed
provider): ``err_max``, ``err_rel``; ``check_failed`` beyond ``err_rel`` 3e-2. K/V are structured as in the attention
suite (``kvbound.bench.data``, half of the blocks residual-free), queries in K's subspace, ``u``, ``w`` Gaussian at
the scale of the ports' projections; ``R`` Gaussian for Enformer, and for Borzoi its positional features (32 step
functions of ``|d|``) times a Gaussian projection, as its ``to_rel_k`` makes them.

    python -m kvbound.bench --suite relative --out benchmarks/results/relative_h200.csv
    python -m kvbound.bench --suite relative --cpu-smoke --out /tmp/relative.csv    # tiny sizes, CPU
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvbound.bench import data as bench_data
from kvbound.bench.formulas import attention_flops, tflops
from kvbound.models.relative import equal_row_runs, shifted_view

__all__ = ["RELATIVE_PROVIDERS", "RelativeOptions", "RelativeSpec", "relative_rows", "relative_specs"]

RELATIVE_PROVIDERS = (
    "port-eager",
    "sdpa-built-bias",
    "flex-built-table",
    "kvbound-relative",
    "kvbound-relative-runs",
    "kvbound-relative-deferred",
    "kvbound-relative-runs-deferred",
    "kvbound-relative-compressed",
)
_TOLERANCE = 3e-2


@dataclass(frozen=True)
class RelativeSpec:
    name: str
    tokens: int
    batches: tuple[int, ...]
    heads: int = 8
    dk: int = 64
    dv: int = 192
    shift: str = "pad"  # the port's relative shift: Enformer pads and reshapes, Borzoi takes a strided view


def relative_specs(smoke: bool) -> tuple[RelativeSpec, ...]:
    if smoke:
        return (
            RelativeSpec("enformer-layer", 48, (1, 2), heads=2, dk=16, dv=24),
            RelativeSpec("borzoi-layer", 40, (1,), heads=2, dk=16, dv=24, shift="strided"),
        )
    return (
        RelativeSpec("enformer-layer", 1536, (1, 8)),
        RelativeSpec("borzoi-layer", 4096, (1, 4), shift="strided"),
    )


@dataclass
class RelativeOptions:
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    seed: int = 0
    zero_tile_share: float = 0.5
    batches: tuple[int, ...] | None = None


def _inputs(spec: RelativeSpec, batch: int, device: torch.device, dtype: torch.dtype, config, seed: int,
            share: float) -> dict:
    n, h = spec.tokens, spec.heads
    k_sub = bench_data.kv_subspace(h, spec.dk, seed=seed * 100 + 1, device=device)
    v_sub = bench_data.kv_subspace(h, spec.dv, seed=seed * 100 + 2, device=device)

    def kv(sub, s):
        return bench_data.structured_kv(batch, n, sub, zero_tile_share=share, block_size=config.block_size,
                                        dtype=dtype, seed=s)

    g = torch.Generator(device="cpu").manual_seed(seed * 100 + 7)
    relative_keys, runs = torch.randn(h, 2 * n - 1, spec.dk, generator=g) * 0.5, None
    if spec.shift == "strided":  # Borzoi: features that are step functions of |d|, projected
        from kvbound.models.reference import borzoi_positional_features_reference

        features = borzoi_positional_features_reference(n, 32).float()
        projection = torch.randn(32, h * spec.dk, generator=g) * (0.5 / features.pow(2).sum(-1).mean().sqrt())
        relative_keys = (features @ projection).reshape(2 * n - 1, h, spec.dk).transpose(0, 1).contiguous()
        runs = equal_row_runs(features)
    return {
        "runs": runs,
        "q": bench_data.structured_queries(batch, h, n, k_sub, dtype=dtype, seed=seed * 100 + 3),
        "k": kv(k_sub, seed * 100 + 4),
        "v": kv(v_sub, seed * 100 + 5),
        "k_sample": kv(k_sub, seed * 100 + 14),
        "v_sample": kv(v_sub, seed * 100 + 15),
        "relative_keys": relative_keys.to(device=device, dtype=dtype),
        "u": (torch.randn(h, spec.dk, generator=g) * 0.1).to(device=device, dtype=dtype),
        "w": (torch.randn(h, spec.dk, generator=g) * 0.1).to(device=device, dtype=dtype),
        "scale": spec.dk**-0.5,
        "shift": spec.shift,
    }


def _port_eager(x: dict) -> torch.Tensor:
    """The ports' math: bf16 einsums (as under autocast), the port's relative shift, float32 softmax."""
    q, k, v, rel = x["q"], x["k"], x["v"], x["relative_keys"]
    b, h, n, _ = q.shape
    qs = q * x["scale"]
    content = torch.einsum("bhid,bhjd->bhij", qs + x["u"][None, :, None], k)
    table = torch.einsum("bhid,hmd->bhim", qs + x["w"][None, :, None], rel)  # [B, H, N, 2N - 1]
    if x["shift"] == "pad":  # enformer-pytorch's relative_shift: pad, reshape, slice (copies)
        padded = torch.nn.functional.pad(table, (1, 0))
        shifted = padded.reshape(b, h, 2 * n, n)[:, :, 1:].reshape(b, h, n, 2 * n - 1)[..., :n]
    else:  # borzoi-pytorch's fast_relative_shift: a strided view
        shifted = shifted_view(table, n)
    weights = (content + shifted).float().softmax(dim=-1).to(v.dtype)
    return weights @ v


def _position_bias(x: dict) -> torch.Tensor:
    """The position term as a contiguous ``[B, H, N, N]`` bias in the input dtype (one einsum, one gather copy)."""
    query = x["q"] * x["scale"] + x["w"][None, :, None]
    n = query.shape[2]
    return shifted_view(torch.einsum("bhid,hmd->bhim", query, x["relative_keys"]), n).contiguous()


def _sdpa_built_bias(x: dict) -> torch.Tensor:
    bias = _position_bias(x)
    query = x["q"] * x["scale"] + x["u"][None, :, None]
    return torch.nn.functional.scaled_dot_product_attention(query, x["k"], x["v"], attn_mask=bias, scale=1.0)


# The most elements of the position table one FlexAttention call reads: compiled FlexAttention faulted with an illegal
# memory access on a [31, 8, 4096, 8191] table (8.3e9 elements, Borzoi's batch 31), where tables below 2**31 elements
# ran (Enformer's batch 48: 1.8e9); the batch then runs in chunks whose tables stay below 2**31 elements.
FLEX_TABLE_ELEMENTS = 2**31 - 1


def _flex_built_table(flex: Callable, kernel_options: dict | None = None) -> Callable[[dict], torch.Tensor]:
    def run(x: dict) -> torch.Tensor:
        q = x["q"]
        b, h, n = q.shape[:3]
        per_batch = h * n * x["relative_keys"].shape[1]
        chunk = max(1, FLEX_TABLE_ELEMENTS // per_batch)
        if b > chunk:
            return torch.cat([run({**x, "q": x["q"][i : i + chunk], "k": x["k"][i : i + chunk],
                                   "v": x["v"][i : i + chunk]}) for i in range(0, b, chunk)])  # fmt: skip
        table = torch.einsum("bhid,hmd->bhim", q * x["scale"] + x["w"][None, :, None], x["relative_keys"])

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[b, h, q_idx, n - 1 + kv_idx - q_idx]

        query = q * x["scale"] + x["u"][None, :, None]
        return flex(query, x["k"], x["v"], score_mod=score_mod, scale=1.0, kernel_options=kernel_options)

    return run


def _flex_that_compiles(flex: Callable, x: dict, device: torch.device,
                        build: Callable[..., Callable[[dict], torch.Tensor]] | None = None) -> tuple[Callable, str]:
    """The first ``kernel_options`` (``providers.flex_kernel_options``) whose compiled kernel runs on ``x``: the
    defaults run out of shared memory at dv = 192. On the CPU FlexAttention runs eagerly and takes the defaults.
    ``build(flex, kernel_options)`` makes the core (default: FlexAttention over a built position table)."""
    from kvbound.bench.providers import flex_kernel_options

    build = build or _flex_built_table
    if device.type != "cuda":
        return build(flex), ""
    failures = []
    for options in flex_kernel_options(x["k"].shape[-1], x["v"].shape[-1]):
        fn = build(flex, options)
        try:
            fn(x)
            torch.cuda.synchronize(device)
        except Exception as error:  # noqa: BLE001 - a failed compile is recorded and the next tile tried
            failures.append(f"{options}: {_reason(error)[:160]}")
            continue
        label = "default" if options is None else ",".join(f"{k}={v}" for k, v in options.items())
        return fn, f"kernel_options={label}"
    raise RuntimeError("no kernel_options compiled: " + " | ".join(failures))


def _kvbound_relative(k_name: str, v_name: str, runs: bool = False) -> Callable[[dict], torch.Tensor]:
    def run(x: dict) -> torch.Tensor:
        from kvbound.models.relative import relative_position_attention

        return relative_position_attention(x["q"], x[k_name], x[v_name], x["relative_keys"], x["u"][None, :, None],
                                           x["w"][None, :, None], scale=x["scale"], backend="kvbound",
                                           relative_runs=x["runs"] if runs else None)

    return run


def _flex_function(device: torch.device):
    """FlexAttention compiled on CUDA (dynamo's recompile limits raised, so that no shape or ``kernel_options``
    candidate silently falls back to eager), eager on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        from kvbound.bench.providers import raise_recompile_limits

        raise_recompile_limits()
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def _reference(x: dict, k, v, item: int) -> torch.Tensor:
    """float64 attention of batch item ``item`` (``[1, H, N, Dv]``)."""
    from kvbound.models.reference import relative_position_attention_reference

    one = slice(item, item + 1)
    return relative_position_attention_reference(x["q"][one], k[one], v[one], x["relative_keys"], x["u"], x["w"],
                                                 scale=x["scale"])


def _peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline, baseline


def _measured(fn: Callable[[dict], torch.Tensor], x: dict, references: dict[int, torch.Tensor],
              device: torch.device, options: RelativeOptions, flops: int) -> dict:
    """Check the batch items in ``references`` (first and last) against float64, then time ``fn(x)`` and take its
    peak memory."""
    from kvbound.bench.runner import measure

    with warnings.catch_warnings():
        if device.type == "cpu":  # FlexAttention runs eagerly there, on purpose
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = fn(x)
        finite = bool(torch.isfinite(out).all())
        worst_rel, worst_abs = 0.0, 0.0
        for item, expected in references.items():
            diff = out[item].double() - expected[0]
            worst_rel = max(worst_rel, float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(expected)))
            worst_abs = max(worst_abs, float(diff.abs().max()))
        del out
        times = measure(lambda: fn(x), device, options.warmup_ms, options.rep_ms)
        peak, baseline = _peak_bytes(lambda: fn(x), device)
    if not finite:
        status, reason = "check_failed", "output has NaN or Inf"
    elif worst_rel > _TOLERANCE:
        status, reason = "check_failed", f"err_rel {worst_rel:.3g} > {_TOLERANCE:g} against float64"
    else:
        status, reason = "ok", ""
    return {
        "status": status, "reason": reason, "err_max": worst_abs, "err_rel": worst_rel,
        "ms_p20": times[0], "ms_p50": times[1], "ms_p80": times[2],
        "tflops": tflops(flops, times[1]), "peak_bytes": peak, "baseline_bytes": baseline,
    }


def _compress_and_attend(config, bases: dict, impl: str) -> Callable[[dict], torch.Tensor]:
    """What a compressed forward does per layer: encode this forward's K and V, then the fused call."""
    def run(x: dict) -> torch.Tensor:
        import kvbound

        x["ck"] = kvbound.compress_kv(x["k"], config, bases["k"], impl=impl)
        x["cv"] = kvbound.compress_kv(x["v"], config, bases["v"], impl=impl)
        return _kvbound_relative("ck", "cv")(x)

    return run


def relative_rows(device: torch.device, config, options: RelativeOptions, smoke: bool) -> Iterator[dict]:
    """One row per (layer, batch, provider); see the module docstring."""
    import kvbound

    dtype = torch.float16 if smoke else torch.bfloat16  # the CPU interpreter's dot is unreliable on bfloat16
    impl = "triton" if device.type == "cuda" else "eager"
    flex = None
    for spec in relative_specs(smoke):
        for batch in options.batches or spec.batches:
            n = spec.tokens
            base = {
                "mode": "time", "suite": "relative", "shape": f"{spec.name}-b{batch}", "family": "relative",
                "batch": batch, "q_heads": spec.heads, "kv_heads": spec.heads, "q_len": n, "kv_len": n,
                "head_dim_qk": spec.dk, "head_dim_v": spec.dv, "causal": False, "dtype": str(dtype).split(".")[-1],
                "bias": "relpos", "softcap": 0.0,
                "flops": attention_flops(batch, spec.heads, n, n, spec.dk, spec.dv, False),
            }
            items = sorted({0, batch - 1})
            try:
                x = _inputs(spec, batch, device, dtype, config, options.seed, options.zero_tile_share)
                exact = {item: _reference(x, x["k"], x["v"], item) for item in items}
            except Exception as error:  # no inputs: every provider of this shape gets the reason
                for provider in RELATIVE_PROVIDERS:
                    yield {**base, "provider": provider, "status": "error", "reason": _reason(error)}
                continue
            for provider in RELATIVE_PROVIDERS:
                row = {**base, "provider": provider, "config": "", "semantics": "exact"}
                try:
                    references = exact
                    if provider == "port-eager":
                        fn = _port_eager
                    elif provider == "sdpa-built-bias":
                        fn = _sdpa_built_bias
                    elif provider == "flex-built-table":
                        if flex is None:
                            flex = _flex_function(device)
                        fn, flex_config = _flex_that_compiles(flex, x, device)
                        row.update(config=flex_config)
                    elif provider in ("kvbound-relative", "kvbound-relative-deferred"):
                        fn = _kvbound_relative("k", "v")
                    elif provider in ("kvbound-relative-runs", "kvbound-relative-runs-deferred"):
                        if x["runs"] is None:
                            raise NotImplementedError("these relative keys differ at every distance (no runs)")
                        fn = _kvbound_relative("k", "v", runs=True)
                        row.update(note=f"{len(x['runs'])} runs of equal relative keys")
                    else:
                        from kvbound.bench.runner import measure

                        bases = {w: kvbound.calibrate(x[f"{w}_sample"], config) for w in ("k", "v")}
                        fn = _compress_and_attend(config, bases, impl)
                        fn(x)  # the encodings the reference reads (the encoder is deterministic), and a warm-up

                        def encode(x=x, bases=bases):
                            kvbound.compress_kv(x["k"], config, bases["k"], impl=impl)
                            kvbound.compress_kv(x["v"], config, bases["v"], impl=impl)

                        encode_ms = measure(encode, device, options.warmup_ms, options.rep_ms)[1]
                        ck, cv = x["ck"], x["cv"]
                        ratio = (ck.dense_nbytes + cv.dense_nbytes) / (ck.nbytes + cv.nbytes)
                        row.update(config=f"r{config.rank}b{config.bits}", rank=config.rank, bits=config.bits,
                                   block_size=config.block_size, tau=config.tau, basis="calibrated",
                                   compression_ratio=ratio, compress_ms=encode_ms,
                                   note="time includes encoding K and V (compress ms: encoding alone)")
                        references = {item: _reference(x, ck.decompress(), cv.decompress(), item) for item in items}
                    with kvbound.deferred_checks() if provider.endswith("-deferred") else contextlib.nullcontext():
                        row.update(_measured(fn, x, references, device, options, base["flops"]))
                except Exception as error:  # a provider that cannot run here gets its row, with why
                    row.update(status="unsupported" if isinstance(error, NotImplementedError) else "error",
                               reason=_reason(error))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                yield row
            del x, exact


def _reason(error: BaseException) -> str:
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return f"{type(error).__name__}: {text}"
