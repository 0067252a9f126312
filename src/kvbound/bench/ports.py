"""``kvbound bench --suite models``: whole forwards of the genomic ports, unpatched and under ``kvbound.patch``.

For each port at its full published size with random weights (enformer-pytorch 0.8.12 ``Enformer.from_hparams``
with the defaults: 196,608 bp -> 1536 tokens, 11 layers; borzoi-pytorch 0.5.1 ``Borzoi(BorzoiConfig())``:
524,288 bp -> 4096 tokens, 8 layers; alphagenome-pytorch 0.3.1 ``AlphaGenome()``: 1,048,576 bp -> 8192 tokens,
9 blocks, run with ``embeddings_only=True``), under ``torch.autocast(dtype=torch.bfloat16)`` and ``no_grad``,
at batch 1 and a larger batch, three variants run on the same one-hot DNA input:

``unpatched``         the port as published;
``patch-dense``       ``kvbound.patch(model, compress=False)``: memory-lean attention on exact K/V;
``patch-compressed``  ``kvbound.patch(model, config, compress=True, calibrate_on=...)``: K/V compressed on every
                      forward, with one basis per layer calibrated on a forward over another input.

Each row records the whole forward (``ms_p20/50/80``), the summed forwards of the attention modules, timed
by forward hooks in separate calls (``attention_ms_*``), the CUDA allocator's peak during one forward
(``peak_bytes``; ``baseline_bytes`` were allocated before it: weights, inputs, the reference output) and the
output's difference from the unpatched model's on the same input (``diff_max_abs``, ``diff_rel`` =
``||out - ref|| / ||ref||``; Enformer: the human head, Borzoi: its output, AlphaGenome: ``embeddings_128bp``).
Enformer zero-initialises its attention output projection (``to_out``); it is re-randomised, else attention
would add exactly nothing and every variant would match the unpatched output trivially.

``--cpu-smoke`` runs tiny configs through the same code (Enformer and Borzoi at a few dozen tokens, and
AlphaGenome's ``TransformerTower(64)``, the module the patch works on, since the full AlphaGenome has fixed
widths), with ``kvbound.patch``'s CPU backend; peak memory is recorded on CUDA only. A port that is not installed
gets an ``unsupported`` row saying so.

The GPU machine has no network and none of the ports: ``benchmarks/wheels.sh`` (run where pip can reach PyPI)
puts their wheels, and the few modules they import that the GPU image lacks, into ``.whl/``. Then, on one H200
with ``.whl/`` copied next to the sources::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit; export HF_HUB_OFFLINE=1; \\
    python3 -m kvbound.bench --suite models --only enformer borzoi --commit <sha> --out results/models_h200_a.csv

and the same with ``--only alphagenome --out results/models_h200_b.csv`` (two runs of under 10 minutes each;
``--batches 1`` keeps batch 1 only). On the CPU::

    python -m kvbound.bench --suite models --cpu-smoke --out /tmp/models.csv
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import importlib
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from kvbound.bench.encoder import config_label
from kvbound.bench.runner import quantiles, time_calls

__all__ = ["PortModel", "PORT_MODELS", "SMOKE_PORT_MODELS", "VARIANTS", "GRAPH_VARIANTS", "ModelOptions",
           "AttentionTimer", "model_rows", "model_variants", "port_models", "compressed_ratio", "largest_fitting",
           "largest_batch_rows", "watched_search"]

VARIANTS = ("unpatched", "patch-dense", "patch-compressed")
# With --graphs: the same forwards replayed from one CUDA graph each (kvbound.capture).
GRAPH_VARIANTS = ("unpatched-graph", "patch-dense-graph", "patch-compressed-graph")


@dataclass(frozen=True)
class Inputs:
    """Positional and keyword arguments of one forward."""

    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PortModel:
    """One port at one size.

    ``build()`` returns the model on the CPU, in eval mode, with its random weights set (seeded by the caller);
    ``make_input(batch, seed, device)`` the forward's arguments; ``output(result)`` the tensor compared between
    variants; ``attention_class()`` the class of its attention modules (timed by hooks, patched by kvbound);
    ``describe(module)`` ``(q_heads, kv_heads, dk, dv)`` of one of them."""

    name: str
    package: str
    distribution: str
    input_len: int
    tokens: int
    batches: tuple[int, ...]
    build: Callable[[], nn.Module]
    make_input: Callable[[int, int, torch.device], Inputs]
    output: Callable[[object], torch.Tensor]
    attention_class: Callable[[], type]
    describe: Callable[[nn.Module], tuple[int, int, int, int]]
    note: str = ""


def _one_hot_dna(batch: int, length: int, seed: int, device: torch.device, *, channels_first: bool = False
                 ) -> torch.Tensor:
    """``[B, L, 4]`` (or ``[B, 4, L]``) float32 one-hot of uniformly random bases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.one_hot(torch.randint(0, 4, (batch, length), generator=g), 4).float()
    return (x.transpose(1, 2).contiguous() if channels_first else x).to(device)


def _relative_describe(module: nn.Module) -> tuple[int, int, int, int]:
    heads = module.heads
    return heads, heads, module.to_k.out_features // heads, module.to_v.out_features // heads


def _alphagenome_describe(module: nn.Module) -> tuple[int, int, int, int]:
    dk, dv = module.norm_k.normalized_shape[0], module.norm_v.normalized_shape[0]
    return module.q_proj.out_features // dk, module.k_proj.out_features // dk, dk, dv


def _rerandomise_enformer_to_out(model: nn.Module) -> None:
    from enformer_pytorch.modeling_enformer import Attention

    for module in model.modules():
        if type(module) is Attention:
            module.to_out.reset_parameters()  # zero-initialised by the port


# ------------------------------------------------------------------------------------------------ Enformer
def _enformer(**hparams) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from enformer_pytorch import Enformer

        model = Enformer.from_hparams(**hparams)
        _rerandomise_enformer_to_out(model)
        return model.eval()

    return build


def _enformer_attention() -> type:
    from enformer_pytorch.modeling_enformer import Attention

    return Attention


# -------------------------------------------------------------------------------------------------- Borzoi
def _borzoi(**config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from borzoi_pytorch import Borzoi
        from borzoi_pytorch.config_borzoi import BorzoiConfig

        return Borzoi(BorzoiConfig(**config)).eval()

    return build


def _borzoi_attention() -> type:
    from borzoi_pytorch.pytorch_borzoi_transformer import Attention

    return Attention


# --------------------------------------------------------------------------------------------- AlphaGenome
def _alphagenome_full() -> nn.Module:
    from alphagenome_pytorch import AlphaGenome

    return AlphaGenome().eval()


def _alphagenome_tower(d_model: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from alphagenome_pytorch.model import TransformerTower

        return TransformerTower(d_model).eval()

    return build


def _alphagenome_attention() -> type:
    from alphagenome_pytorch.attention import MHABlock

    return MHABlock


def _first(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


PORT_MODELS: tuple[PortModel, ...] = (
    PortModel(
        name="enformer", package="enformer_pytorch", distribution="enformer-pytorch==0.8.12",
        input_len=196_608, tokens=1536, batches=(1, 8),
        build=_enformer(dim=1536, depth=11, heads=8, output_heads=dict(human=5313, mouse=1643), target_length=896),
        make_input=lambda b, seed, device: Inputs((_one_hot_dna(b, 196_608, seed, device),)),
        output=lambda result: result["human"], attention_class=_enformer_attention, describe=_relative_describe,
        note="Enformer.from_hparams (defaults), to_out re-randomised; output: human head",
    ),
    PortModel(
        name="borzoi", package="borzoi_pytorch", distribution="borzoi-pytorch==0.5.1",
        input_len=524_288, tokens=4096, batches=(1, 4),
        build=_borzoi(),
        make_input=lambda b, seed, device: Inputs((_one_hot_dna(b, 524_288, seed, device, channels_first=True),)),
        output=lambda result: result, attention_class=_borzoi_attention, describe=_relative_describe,
        note="Borzoi(BorzoiConfig()); output: human tracks",
    ),
    PortModel(
        name="alphagenome", package="alphagenome_pytorch", distribution="alphagenome-pytorch==0.3.1",
        input_len=1_048_576, tokens=8192, batches=(1, 2),
        build=_alphagenome_full,
        make_input=lambda b, seed, device: Inputs(
            (_one_hot_dna(b, 1_048_576, seed, device), torch.zeros(b, dtype=torch.long, device=device)),
            {"embeddings_only": True}),
        output=lambda result: result["embeddings_128bp"], attention_class=_alphagenome_attention,
        describe=_alphagenome_describe,
        note="AlphaGenome() (float32 parameters, default dtype policy), embeddings_only=True; output: "
             "embeddings_128bp",
    ),
)

SMOKE_PORT_MODELS: tuple[PortModel, ...] = (
    PortModel(
        name="enformer-tiny", package="enformer_pytorch", distribution="enformer-pytorch==0.8.12",
        input_len=8 * 48, tokens=48, batches=(1, 2),
        build=_enformer(dim=96, depth=2, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8,
                        target_length=-1, output_heads=dict(human=8)),
        make_input=lambda b, seed, device: Inputs((_one_hot_dna(b, 8 * 48, seed, device),)),
        output=lambda result: result["human"], attention_class=_enformer_attention, describe=_relative_describe,
        note="Enformer.from_hparams(dim=96, depth=2, heads=4, attn_dim_key=16, num_downsamples=3)",
    ),
    PortModel(
        name="borzoi-tiny", package="borzoi_pytorch", distribution="borzoi-pytorch==0.5.1",
        input_len=128 * 32, tokens=32, batches=(1, 2),
        build=_borzoi(dim=64, depth=2, heads=2, attn_dim_key=8, attn_dim_value=16, bins_to_return=64),
        make_input=lambda b, seed, device: Inputs((_one_hot_dna(b, 128 * 32, seed, device, channels_first=True),)),
        output=lambda result: result, attention_class=_borzoi_attention, describe=_relative_describe,
        note="Borzoi(BorzoiConfig(dim=64, depth=2, heads=2, attn_dim_key=8, attn_dim_value=16))",
    ),
    PortModel(
        name="alphagenome-tower-tiny", package="alphagenome_pytorch", distribution="alphagenome-pytorch==0.3.1",
        input_len=64, tokens=64, batches=(1, 2),
        build=_alphagenome_tower(64),
        make_input=lambda b, seed, device: Inputs(
            (torch.randn(b, 64, 64, generator=torch.Generator().manual_seed(seed)).to(device),)),
        output=_first, attention_class=_alphagenome_attention, describe=_alphagenome_describe,
        note="TransformerTower(64): 9 blocks of 8 x 128 / 1 x 128 / 1 x 192 heads on 64 tokens of width 64",
    ),
)


def port_models(cpu_smoke: bool) -> tuple[PortModel, ...]:
    return SMOKE_PORT_MODELS if cpu_smoke else PORT_MODELS


@dataclass
class ModelOptions:
    warmup: int = 2
    repeats: int = 5
    batches: tuple[int, ...] | None = None  # None: each model's own list
    backend: str = "auto"
    seed: int = 0
    alternatives: tuple[str, ...] = ()  # kvbound.bench.alternatives.ALTERNATIVES to time as well
    graphs: bool = False  # also GRAPH_VARIANTS (CUDA only)
    variants: tuple[str, ...] | None = None  # only these of the variants above (None: all of them)
    checkpoints: dict[str, str] | None = None  # model name -> trained weights (kvbound.models.load) instead of random
    widen_codes: bool = True  # kvbound.patch's widen_codes for the compressed variants


class AttentionTimer:
    """Forward hooks on ``modules`` that time each call (CUDA events, or ``perf_counter`` on the CPU);
    ``total_ms()`` sums the calls since ``reset()``. Use as a context manager: the hooks are removed on exit."""

    def __init__(self, modules: list[nn.Module], device: torch.device) -> None:
        self.device = device
        self.calls: list[tuple] = []
        self._open: dict[int, object] = {}
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._before))
            self._handles.append(module.register_forward_hook(self._after))

    def _stamp(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _before(self, module, args) -> None:
        self._open[id(module)] = self._stamp()

    def _after(self, module, args, output) -> None:
        self.calls.append((self._open.pop(id(module)), self._stamp()))

    def reset(self) -> None:
        self.calls.clear()
        self._open.clear()

    def total_ms(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(sum(start.elapsed_time(end) for start, end in self.calls))
        return sum(end - start for start, end in self.calls) * 1e3

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> AttentionTimer:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def compressed_ratio(records, describe: Callable[[nn.Module], tuple[int, int, int, int]]) -> float | None:
    """Dense K + V bytes over stored bytes, over all patched layers, from each layer's last K and V ratios."""
    dense = stored = 0.0
    for record in records:
        if record.last_k_ratio is None or record.last_v_ratio is None:
            continue
        _, kv_heads, dk, dv = describe(record.module)
        dense += kv_heads * (dk + dv)
        stored += kv_heads * (dk / record.last_k_ratio + dv / record.last_v_ratio)
    return dense / stored if stored else None


MODE_NAMES = ("lowrank", "packed", "promoted", "raw")


def mode_shares(records) -> dict[str, float]:
    """``k_share_lowrank`` .. ``v_share_raw``: the share of all patched layers' K (V) blocks in each storage mode
    (``CompressedKV.mode_fractions`` over the whole forward), from each layer's ``mode_counts()``; {} when no layer
    recorded them."""
    totals = {"k": [0] * len(MODE_NAMES), "v": [0] * len(MODE_NAMES)}
    for record in records:
        counts = record.mode_counts()
        for role, values in (counts or {}).items():
            totals[role] = [a + b for a, b in zip(totals[role], values, strict=True)]
    shares = {}
    for role, values in totals.items():
        blocks = sum(values)
        if blocks:
            shares.update({f"{role}_share_{name}": n / blocks for name, n in zip(MODE_NAMES, values, strict=True)})
    return shares


def _forward(spec: PortModel, model: Callable, inputs: Inputs, device: torch.device) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return spec.output(model(*inputs.args, **inputs.kwargs))


def _capture(spec: PortModel, model: nn.Module, inputs: Inputs, device: torch.device, options: ModelOptions):
    """``kvbound.capture`` of the model's forward on ``inputs``, under the suite's autocast."""
    import kvbound

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return kvbound.capture(model, *inputs.args, kwargs=inputs.kwargs, warmup=max(1, options.warmup))


def _difference(out: torch.Tensor, reference: torch.Tensor) -> dict:
    if out.shape != reference.shape:
        raise ValueError(f"output: expected shape {tuple(reference.shape)} as unpatched, got {tuple(out.shape)}")
    diff = out.to(torch.float64) - reference.to(torch.float64)
    norm = float(torch.linalg.vector_norm(reference.to(torch.float64)))
    return {"diff_max_abs": float(diff.abs().max()),
            "diff_rel": float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else math.inf}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _variant(name: str, model: nn.Module, config, calibrate: Callable[[nn.Module], None], backend: str,
             modules: list[nn.Module] | None = None, widen_codes: bool = True):  # fmt: skip
    """The model patched as ``name`` (undone on exit) and the handle (None when unpatched, and for the
    alternatives of ``kvbound.bench.alternatives``, which replace the attention core of ``modules``)."""
    import kvbound
    from kvbound.bench.alternatives import ALTERNATIVES, alternative_core

    name = name.removesuffix("-graph")
    if name == "unpatched":
        yield None
        return
    if name in ALTERNATIVES:
        device = next(model.parameters()).device
        with alternative_core(name, list(modules or ()), device, model):
            yield None
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped modules are reported from handle.skipped
        if name == "patch-dense":
            handle = kvbound.patch(model, compress=False, backend=backend)
        elif name == "patch-compressed":
            handle = kvbound.patch(model, config, compress=True, calibrate_on=calibrate, backend=backend,
                                   widen_codes=widen_codes)
        else:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {name!r}")
    try:
        yield handle
    finally:
        handle.undo()


def _error_reason(err: BaseException) -> str:
    """One line for a row's ``reason``. Out of memory keeps the allocator's figures (the request, what is free, what
    PyTorch holds allocated and what it holds reserved but unallocated: the last tells fragmentation from a forward
    that does not fit) and drops its advice."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        text = str(err).splitlines()[0] if str(err) else ""
        for advice in (" If reserved but unallocated", " See documentation"):
            text = text.split(advice)[0]
        return f"out of memory: {text[:600]}"
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {text}"


def _measure_variant(spec: PortModel, model: nn.Module, inputs: Inputs, reference: torch.Tensor | None,
                     modules: list[nn.Module], handle, device: torch.device, options: ModelOptions,
                     graph: bool = False) -> dict:
    """Check, time, time attention, then peak memory of one variant (the model already patched as it is).
    ``graph``: the forward is captured in a CUDA graph (``kvbound.capture``) and each call replays it; its peak is
    the allocator's peak while capturing and replaying once (the graph keeps its buffers), and its attention
    modules are not timed (hooks do not run in a replay)."""
    row: dict = {}
    if graph:
        if device.type == "cuda":
            _release(device)
            torch.cuda.reset_peak_memory_stats(device)
            row["baseline_bytes"] = torch.cuda.memory_allocated(device)
        model = _capture(spec, model, inputs, device, options)
        _forward(spec, model, inputs, device)
        torch.cuda.synchronize(device)
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        reads = len(model._finishers)
        row["note"] = f"one CUDA graph per forward (kvbound.capture, {reads} staged check read{'s' * (reads != 1)})"
    out = _forward(spec, model, inputs, device)
    if not bool(torch.isfinite(out).all()):
        row.update(status="check_failed", reason="output has NaN or Inf")
    if reference is not None:
        row.update(_difference(out, reference))
    del out
    times = time_calls(lambda: _forward(spec, model, inputs, device), device, warmup=options.warmup,
                       repeats=options.repeats)
    row.update(zip(("ms_p20", "ms_p50", "ms_p80"), quantiles(times), strict=True))
    if graph:
        if model.fallbacks:  # compressed K/V: replays whose retry flag was set ran the eager forward instead
            row["note"] += f"; {model.fallbacks} of {model.replays} calls ran the eager forward after a retry flag"
        return row
    if handle is not None and handle.compress:
        # The encoders' device time in forwards of their own (events around each layer's encodes, which the timed
        # forwards above do without: handle.time_encoding is off by default).
        # The same forwards count each layer's blocks per storage mode (handle.record_modes).
        encode_before = sum(r.encode_seconds for r in handle.modules)
        handle.time_encoding = handle.record_modes = True
        try:
            for _ in range(options.repeats):
                _forward(spec, model, inputs, device)
        finally:
            handle.time_encoding = handle.record_modes = False
        encoded = sum(r.encode_seconds for r in handle.modules) - encode_before
        row["compress_ms"] = encoded / options.repeats * 1e3
        row.update(mode_shares(handle.modules))
    attention = []
    with AttentionTimer(modules, device) as timer:
        for _ in range(options.repeats):
            timer.reset()
            _forward(spec, model, inputs, device)
            attention.append(timer.total_ms())
    row.update(zip(("attention_ms_p20", "attention_ms_p50", "attention_ms_p80"), quantiles(attention), strict=True))
    if device.type == "cuda":
        _release(device)
        torch.cuda.reset_peak_memory_stats(device)
        row["baseline_bytes"] = torch.cuda.memory_allocated(device)
        _forward(spec, model, inputs, device)
        torch.cuda.synchronize(device)
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return row


def _base_row(spec: PortModel, batch: int, describe: tuple[int, int, int, int] | None, layers: int,
              options: ModelOptions) -> dict:
    row = {"mode": "model", "suite": "models", "shape": spec.name, "family": "port", "batch": batch,
           "q_len": spec.tokens, "kv_len": spec.tokens, "input_len": spec.input_len, "dtype": "bfloat16",
           "causal": False, "layers": layers, "repeats": options.repeats, "note": ""}
    if describe is not None:
        row.update(zip(("q_heads", "kv_heads", "head_dim_qk", "head_dim_v"), describe, strict=True))
    return row


def model_rows(specs: tuple[PortModel, ...], device: torch.device, config, options: ModelOptions
               ) -> Iterator[dict]:
    """Rows for every (model, batch, variant); a port that cannot be imported gets ``unsupported`` rows."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for spec in specs:
        batches = options.batches or spec.batches
        try:
            importlib.import_module(spec.package)
        except ImportError as err:
            for batch in batches:
                for variant in model_variants(options):
                    yield {**_base_row(spec, batch, None, 0, options), "provider": variant, "status": "unsupported",
                           "reason": f"{spec.package} is not installed ({spec.distribution}; "
                                     f"benchmarks/wheels.sh): {err}"}
            continue
        checkpoint = (options.checkpoints or {}).get(spec.name)
        try:
            torch.manual_seed(options.seed)
            if checkpoint is None:
                model = spec.build().to(device)
            else:
                from kvbound.models import load
                from kvbound.models.checkpoints import PORT_CHECKPOINTS

                port = next(name for name, loader in PORT_CHECKPOINTS.items() if loader.package == spec.package)
                model = load(port, checkpoint, device=device)
                spec = dataclasses.replace(spec, note=f"trained weights: {checkpoint} (kvbound.models.load)")
        except Exception as err:  # noqa: BLE001 - recorded; the other ports still run
            for batch in batches:
                for variant in model_variants(options):
                    yield {**_base_row(spec, batch, None, 0, options), "provider": variant, "status": "error",
                           "reason": f"building the model: {_error_reason(err)}"}
            continue
        attention_class = spec.attention_class()
        modules = [m for m in model.modules() if type(m) is attention_class]
        describe = spec.describe(modules[0]) if modules else None
        yield from _model_batches(spec, model, modules, describe, batches, device, config, options)
        del model, modules
        _release(device)


def model_variants(options: ModelOptions) -> tuple[str, ...]:
    every = VARIANTS + (GRAPH_VARIANTS if options.graphs else ()) + tuple(options.alternatives)
    return every if options.variants is None else tuple(v for v in every if v in options.variants)


def _model_batches(spec, model, modules, describe, batches, device, config, options) -> Iterator[dict]:
    calibration_input = spec.make_input(1, options.seed + 2, device)

    def calibrate(m: nn.Module) -> None:
        _forward(spec, m, calibration_input, device)

    from kvbound.bench.alternatives import RELATIVE_ALTERNATIVES, supported_alternatives

    supported = supported_alternatives(modules)
    if device.type == "cuda":
        # One small forward first, as the batch search's climb from batch 1 has: what the first forward of a process
        # allocates and keeps (library workspaces) then comes from small blocks of the allocator, not from the
        # middle of a large batch's freed activations, where it can strand them. (The suite's first forward at
        # Enformer's batch 64 ran out of memory asking for 36 GiB with 29.9 GiB free, at a batch the search had
        # run; an out-of-memory reason now keeps the reserved-but-unallocated figure that tells this apart.)
        _forward(spec, model, calibration_input, device)
        _release(device)
    for batch in batches:
        inputs = spec.make_input(batch, options.seed + 1, device)
        reference = unpatched_failure = None
        for variant in model_variants(options):
            row = {**_base_row(spec, batch, describe, len(modules), options), "provider": variant,
                   "status": "ok", "reason": "", "note": spec.note if variant == "unpatched" else ""}
            if variant in GRAPH_VARIANTS and device.type != "cuda":
                yield {**row, "status": "unsupported", "reason": "CUDA graphs need a CUDA device"}
                continue
            if variant in options.alternatives and variant not in supported:
                ports = "relative-position ports (Enformer, Borzoi)" if variant in RELATIVE_ALTERNATIVES else (
                    "AlphaGenome port")
                yield {**row, "status": "unsupported", "reason": f"{variant} is built for the {ports} only"}
                continue
            if variant.removesuffix("-graph") == "patch-compressed":
                row.update(config=config_label(config), rank=config.rank, bits=config.bits,
                           block_size=config.block_size, tau=config.tau, basis="calibrated")
            try:
                with _variant(variant, model, config, calibrate, options.backend, modules,
                              options.widen_codes) as handle:
                    if handle is not None:
                        row["layers"] = len(handle.modules)
                        if handle.skipped:
                            row["note"] = ("left unpatched: " + "; ".join(
                                f"{n}: {r}" for n, r in handle.skipped))[:500]
                        if handle.compress:
                            row["calibration_ms"] = handle.calibration_seconds * 1e3
                            # The calibration forward ran at batch 1: its freed blocks go back to the device before
                            # this batch's forwards, which would otherwise be carved out of them (an H100 ran out of
                            # memory at AlphaGenome's batch 2 with 22.8 GiB reserved but unallocated).
                            _release(device)
                    if variant == "unpatched":
                        try:
                            reference = _forward(spec, model, inputs, device)
                        except Exception as err:  # noqa: BLE001 - the lean variants may still fit; they run
                            unpatched_failure = _error_reason(err)
                            raise
                        row["ref_max_abs"] = float(reference.abs().max())
                    elif reference is None:
                        why = ("not run (--variants)" if unpatched_failure is None
                               else f"failed ({unpatched_failure})")
                        row["note"] = "; ".join(x for x in (f"no output difference: the unpatched forward {why}",
                                                            row["note"]) if x)[:500]
                    measured = _measure_variant(spec, model, inputs, reference if variant != "unpatched" else None,
                                                modules, handle, device, options, variant in GRAPH_VARIANTS)
                    if measured.get("note"):
                        measured["note"] = "; ".join(x for x in (measured["note"], row["note"]) if x)[:500]
                    row.update(measured)
                    if handle is not None and handle.compress:
                        row["compression_ratio"] = compressed_ratio(handle.modules, spec.describe)
                        encoding = (f"speculative encoding ({_one_pass_label(handle)}), "
                                    f"{handle.speculative_retries} forward(s) run again{_retry_label(handle)}"
                                    if handle.speculative and device.type == "cuda" else "synchronous encoding")
                        note = (row["note"], width_label(handle), general_loop_label(handle), encoding)
                        row["note"] = "; ".join(x for x in note if x)[:500]
            except Exception as err:  # noqa: BLE001 - one variant's failure is recorded, the next still runs
                row.update(status="error", reason=_error_reason(err))
            yield row
            _release(device)
        del inputs, reference


def width_label(handle) -> str:
    """The code widths the compressed layers use, for a row's note: ``"code widths K 8 (9 layers), V 8 (9 layers):
    calibrated from 4"``; ``"code widths 4 (not calibrated: why)"`` where calibration chose none."""
    from kvbound.models.patch import RELATIVE_KINDS

    chosen = [r for r in handle.modules if r.width_trials]
    if not chosen:
        why = ("widen_codes off" if not handle.widen_codes
               else "no attention module patched" if not handle.modules
               else "relative positions" if all(r.kind in RELATIVE_KINDS for r in handle.modules)
               else "no calibrate_on, or a backend or GPU without the kernel's uniform loop")
        return f"code widths {handle.config.bits} (not calibrated: {why})"
    parts = []
    for role in ("k", "v"):
        widths = collections.Counter(getattr(r, f"config_{role}").bits for r in chosen)
        listed = ", ".join(f"{w} ({n} layer{'s' * (n != 1)})" for w, n in sorted(widths.items()))
        parts.append(f"{role.upper()} {listed}")
    rest = len(handle.modules) - len(chosen)
    others = f"; {rest} other layer{'s' * (rest != 1)} at {handle.config.bits}" if rest else ""
    return f"code widths {', '.join(parts)}: calibrated from {handle.config.bits}{others}"


def general_loop_label(handle) -> str:
    """For a row's note: in how many layers outside relative positions (whose kernel always keeps it) the last
    forward found no block for the compressed kernel's general loop in K or V, where some block has a residual, as
    the layers' forecasts learnt it (``"no block for the kernel's general loop in 9 of 9 layers"``: those layers ran
    the kernel compiled without that loop); '' where no such layer has run."""
    from kvbound.models.patch import RELATIVE_KINDS

    layers = [r for r in handle.modules if r.kind not in RELATIVE_KINDS and getattr(r, "_forecast", None)]
    if not layers:
        return ""

    def without(record) -> bool:
        found = [record._forecast.get(role, (True, None, True)) for role in ("k", "v")]
        return any(residual for residual, _, _ in found) and not any(res and gen for res, _, gen in found)

    count = sum(without(r) for r in layers)
    return f"no block for the kernel's general loop in {count} of {len(layers)} layer{'s' * (len(layers) != 1)}"


def _retry_label(handle) -> str:
    """Why forwards ran again and which tensors stopped speculating, for a row's note ('' when none did)."""
    parts = []
    if handle.retry_reasons:
        parts.append("first flag: " + "; ".join(handle.retry_reasons[0])[:160])
    if handle.synchronous_tensors:
        parts.append("encoded synchronously since: " + ", ".join(f"{n} {r.upper()}"
                                                                  for n, r in handle.synchronous_tensors)[:160])
    return f" ({'; '.join(parts)})" if parts else ""


def _one_pass_label(handle) -> str:
    """How the handle's speculative encodes are launched, for a row's note."""
    from kvbound.codec.encode_triton import ONE_PASS_AUTO_ELEMENTS
    from kvbound.kernels._common import switch_setting

    choice = handle.one_pass_encode
    if choice is None:
        setting = switch_setting("KVBOUND_ONE_PASS_ENCODE")
        if setting == "auto":
            return f"one launch up to {ONE_PASS_AUTO_ELEMENTS} elements, five above"
        choice = setting == "on"
    return "one launch" if choice else "five launches"


def largest_fitting(fits: Callable[[int], bool], limit: int, *, largest: int = 0,
                    failing: int | None = None) -> tuple[int, int | None, int]:  # fmt: skip
    """The largest ``n`` in ``1 .. limit`` with ``fits(n)``, for a ``fits`` that holds up to some size and fails
    above it: ``n`` doubled from 1 until ``fits`` fails (or passes ``limit``, which is then tried itself), then
    bisected between the last size that fit and the first that did not. Returns ``(largest or 0, smallest size
    seen failing or None, calls of fits)``. A search resumed with what is known already (``largest`` fits,
    ``failing`` does not) doubles on from ``largest``, or bisects between them when ``failing`` is given."""
    if limit < 1:
        raise ValueError(f"limit: expected >= 1, got {limit}")
    if largest < 0 or (failing is not None and not largest < failing <= limit + 1):
        raise ValueError(f"largest, failing: expected 0 <= largest < failing <= limit + 1, got {largest}, {failing}")
    calls, n = 0, max(1, 2 * largest)
    while failing is None and n <= limit:
        calls += 1
        if not fits(n):
            failing = n
            break
        largest, n = n, n * 2
    if failing is None and largest < limit:
        calls += 1
        if fits(limit):
            largest = limit
        else:
            failing = limit
    while failing is not None and failing - largest > 1:
        middle = (largest + failing) // 2
        calls += 1
        if fits(middle):
            largest = middle
        else:
            failing = middle
    return largest, failing, calls


PROBING = "probing"
_PROBE_LINE = re.compile(
    r"^(?P<model>\S+) (?P<variant>\S+) batch (?P<batch>\d+): (?P<what>probing|fits|out of memory)"
    r"(?:, peak (?P<peak>[0-9.]+) GiB)?$"
)
ROW_PREFIX = "largest-batch-row "


def watched_search(cmd: list[str], probe_timeout_s: float | None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Run one search (``cmd``: a process that prints ``largest_batch_rows``'s progress lines, then its row as
    ``ROW_PREFIX`` + JSON) and return that row, with what its progress lines showed: ``seen_largest`` (the largest
    batch that fitted), ``seen_out_of_memory`` (the smallest that ran out of memory, or None) and ``seen_peaks``
    (batch -> peak GiB). A probe that gives no answer within ``probe_timeout_s`` seconds of its start (a forward
    that runs far longer than its neighbours: out-of-memory is an answer, a kernel that does not return is not)
    ends the process group, and the row says ``status=timeout`` with ``failed_batch`` the batch in flight. A
    process that exits without a row gives ``status=error`` with the end of what it printed. The process group is
    killed on any way out of this function (an exception, a signal turned into ``SystemExit``)."""
    import json
    import queue
    import signal
    import subprocess
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            bufsize=1, start_new_session=True)  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip("\n"))
        finally:
            lines.put(None)

    def kill() -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    threading.Thread(target=pump, daemon=True).start()
    seen = {"largest": 0, "out_of_memory": None, "peaks": {}}
    in_flight, deadline, tail, row = None, None, [], None
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if row is not None:  # the row is in: give the process a moment to exit, no longer
                wait = 60.0
            try:
                line = lines.get(timeout=wait)
            except queue.Empty:
                kill()
                if row is not None:
                    break
                row = {"status": "timeout", "failed_batch": in_flight,
                       "reason": f"batch {in_flight}: no answer within {probe_timeout_s:g} s (process killed)"}
                break
            if line is None:
                break
            if line.startswith(ROW_PREFIX):
                row, in_flight, deadline = json.loads(line[len(ROW_PREFIX):]), None, None
                continue
            tail = (tail + [line])[-5:]
            probe = _PROBE_LINE.match(line)
            if probe is not None:
                batch = int(probe["batch"])
                if probe["what"] == PROBING:
                    in_flight = batch
                    deadline = None if probe_timeout_s is None else time.monotonic() + probe_timeout_s
                else:
                    in_flight, deadline = None, None
                    if probe["what"] == "fits":
                        seen["largest"] = max(seen["largest"], batch)
                        if probe["peak"] is not None:
                            seen["peaks"][batch] = float(probe["peak"])
                    elif seen["out_of_memory"] is None or batch < seen["out_of_memory"]:
                        seen["out_of_memory"] = batch
            if progress is not None and (probe is None or probe["what"] != PROBING):
                progress(line)
    finally:
        kill()
    if row is None:
        row = {"status": "error", "failed_batch": in_flight,
               "reason": f"search process exited with status {proc.returncode} and no row: "
                         + " | ".join(tail)[-300:]}  # fmt: skip
    row.setdefault("largest_batch", seen["largest"])
    return {**row, **{f"seen_{k}": v for k, v in seen.items()}}


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` says that device memory ran out (the allocator's error, or a library's allocation failure
    reported as a ``RuntimeError``)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


class _SearchFailed(Exception):
    """A probe failed for another reason than memory: the search stops there."""


def largest_batch_rows(specs: tuple[PortModel, ...], device: torch.device, config, *, limit: int,
                       variants: tuple[str, ...] = VARIANTS, backend: str = "auto", seed: int = 0,
                       progress: Callable[[str], None] | None = None, known_largest: int = 0,
                       known_failing: int | None = None) -> Iterator[dict]:
    """For each model and variant, the largest batch whose forward (bf16 autocast, ``no_grad``, inputs of the models
    suite) runs without running out of device memory (``largest_fitting`` up to ``limit``), and the peak memory of
    that forward. A forward that fails otherwise ends that variant's search: an error row with the largest batch
    found so far, the batch that failed (``failed_batch``) and why. ``known_largest`` / ``known_failing``: resume a
    search (``largest_fitting``'s ``largest`` / ``failing``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for spec in specs:
        torch.manual_seed(seed)
        model = spec.build().to(device)
        calibration_input = spec.make_input(1, seed + 2, device)

        def calibrate(m: nn.Module, calibration_input=calibration_input, spec=spec) -> None:
            _forward(spec, m, calibration_input, device)

        for variant in variants:
            peaks: dict[int, int] = {}
            row = {"model": spec.name, "variant": variant, "input_len": spec.input_len, "limit": limit}
            started = time.perf_counter()

            def fits(batch: int, spec=spec, model=model, peaks=peaks, variant=variant, row=row) -> bool:
                inputs = out = None
                if progress is not None:
                    progress(f"{spec.name} {variant} batch {batch}: {PROBING}")
                try:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    inputs = spec.make_input(batch, seed + 1, device)
                    out = _forward(spec, model, inputs, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                        peaks[batch] = torch.cuda.max_memory_allocated(device)
                    ok = True
                    row["largest_batch"] = max(row.get("largest_batch", 0), batch)
                except Exception as err:  # noqa: BLE001 - memory: does not fit; anything else: stop, recorded
                    if not _out_of_memory(err):
                        row.update(failed_batch=batch, reason=_error_reason(err))
                        raise _SearchFailed from err
                    ok = False
                finally:
                    del inputs, out
                    _release(device)
                if progress is not None:
                    peak = f", peak {peaks[batch] / 2**30:.2f} GiB" if ok and batch in peaks else ""
                    progress(f"{spec.name} {variant} batch {batch}: {'fits' if ok else 'out of memory'}{peak}")
                return ok

            try:
                with _variant(variant, model, config, calibrate, backend):
                    _release(device)  # (after calibration; each probe releases what it used)
                    largest, failing, calls = largest_fitting(fits, limit, largest=known_largest,
                                                              failing=known_failing)  # fmt: skip
                row.update(status="ok", largest_batch=largest, first_out_of_memory=failing, probes=calls)
            except _SearchFailed:
                row["status"] = "error"
            except Exception as err:  # noqa: BLE001 - patching or calibration failed; the other variants still run
                row.update(status="error", reason=_error_reason(err))
            largest = row.get("largest_batch")
            row["peak_gib"] = peaks[largest] / 2**30 if largest in peaks else None
            row["seconds"] = time.perf_counter() - started
            yield row
        del model
        _release(device)
