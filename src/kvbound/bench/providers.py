"""The attention implementations timed side by side, and the inputs they share.

Each provider turns a :class:`Case` (one shape's inputs) into a :class:`Prepared` call, or raises
:class:`Unsupported` with the reason. What each one computes (``semantics``):

``kvbound-compressed``  ``kvbound.attention`` on ``CompressedKV`` K and V (one row per compression config):
                        the shape's full function (bias, soft-cap, GQA), checked against the float64
                        reference on the *decompressed* K/V.
``kvbound-dense``       ``kvbound.attention`` on dense K/V: the full function.
``kvbound-dense-deferred``, ``kvbound-compressed-deferred`` (configs r8b4 and lowrank-r8)
                        the same calls inside one ``kvbound.deferred_checks()`` block around the check and the
                        timing loop (as ``kvbound.patch`` runs a model's forward): the NaN/Inf checks are read once
                        at the end instead of one host synchronisation per call.
``kvbound-compressed-split``, ``kvbound-compressed-one`` (config r8b4; only on shapes that list them, e.g.
                        ``benchmarks/shapes/share.toml``) the compressed call with ``KVBOUND_SPLIT_LOWRANK=1``
                        (always split: low-rank-only runs of key blocks in a second launch of the kernel compiled
                        without residual code, merged by log-sum-exp) and ``=0`` (one launch). The plain
                        ``kvbound-compressed`` row is the default (``KVBOUND_SPLIT_LOWRANK=auto`` whatever the
                        caller's environment), which splits from a share of low-rank-only blocks on.
``sdpa-cudnn``, ``sdpa-flash``, ``sdpa-efficient``
                        ``torch.nn.functional.scaled_dot_product_attention`` with one backend forced. On the
                        models' shapes they run plain attention without bias or soft-cap: the floor of what
                        any biased kernel can reach (``semantics`` says so).
``flex``                ``torch.compile(flex_attention)`` with a ``score_mod`` for the bias and soft-cap and
                        explicit ``kernel_options`` where the defaults do not compile.
``sdpa-bias``           (models' shapes) SDPA with the bias materialised as an ``[B, Hq, N, N]`` tensor, built
                        outside the timed region; SDPA cannot soft-cap, so with a soft-cap it computes the
                        function without it and is checked against that.
``eager``               (models' shapes) the ports' eager code: logits in the input dtype (bf16 autocast) or
                        float32 (AlphaGenome), bias, soft-cap, softmax in float32, probabilities @ V.

A provider whose library is missing is listed as ``unsupported`` with the import error, never dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbound.bench import data as bench_data
from kvbound.bench.formulas import DTYPE_BYTES, compressed_bytes_moved, dense_bytes_moved
from kvbound.bench.shapes import AttentionShape
from kvbound.config import DEFAULT_TAU

__all__ = [
    "Case",
    "CompressedConfigSpec",
    "DEFAULT_CONFIGS",
    "SWEEP_CONFIGS",
    "Prepared",
    "Provider",
    "Unsupported",
    "all_providers",
]


class Unsupported(Exception):
    """The provider cannot compute this shape; the message says why."""


# ------------------------------------------------------------------------------------------------- inputs
class Case:
    """One shape's inputs on one device: ``input_sets`` copies of q, k, v (rotated while timing when they fit
    in L2), the bias in compact and dense form, and the float64 reference on a subsample of query rows."""

    def __init__(self, shape: AttentionShape, device: torch.device, *, seed: int = 0, check_rows: int = 256,
                 input_sets: int = 1, block_size: int = 128, zero_tile_share: float | None = None) -> None:
        self.shape = shape
        self.device = device
        self.dtype = getattr(torch, shape.dtype)
        self.seed = seed
        self.block_size = block_size
        self.zero_tile_share = shape.zero_tile_share if zero_tile_share is None else zero_tile_share
        s = shape
        self.k_subspace = bench_data.kv_subspace(s.kv_heads, s.head_dim_qk, seed=seed * 100 + 1, device=device)
        self.v_subspace = bench_data.kv_subspace(s.kv_heads, s.head_dim_v, seed=seed * 100 + 2, device=device)
        self.q, self.k, self.v = [], [], []
        for i in range(input_sets):
            base = seed * 1000 + 10 * i
            self.q.append(bench_data.structured_queries(s.batch, s.q_heads, s.q_len, self.k_subspace,
                                                        dtype=self.dtype, seed=base + 3))
            self.k.append(self._kv(self.k_subspace, s.kv_len, base + 4))
            self.v.append(self._kv(self.v_subspace, s.kv_len, base + 5))
        self.softcap = s.softcap if s.softcap > 0 else None
        self.scale = s.scale
        if s.bias == "tile":
            self.bias_compact = bench_data.tile_pair_bias(s.batch, s.q_heads, s.q_len, s.kv_len, s.bias_tile,
                                                          dtype=self.dtype, seed=seed * 100 + 6, device=device)
        elif s.bias == "relpos":
            self.bias_compact = bench_data.relative_position_table(s.q_heads, s.q_len, s.kv_len, dtype=self.dtype,
                                                                   device=device)
        else:
            self.bias_compact = None
        self._bias_dense: torch.Tensor | None = None
        rows = min(check_rows, s.q_len)
        self.check_index = torch.linspace(0, s.q_len - 1, rows, device=device).round().long().unique()
        self._reference_cache: dict[tuple, torch.Tensor] = {}
        self._samples: dict[str, torch.Tensor] = {}
        self._bases: dict[tuple[str, int], object] = {}

    @property
    def input_sets(self) -> int:
        return len(self.q)

    def _kv(self, subspace: torch.Tensor, length: int, seed: int) -> torch.Tensor:
        return bench_data.structured_kv(self.shape.batch, length, subspace, zero_tile_share=self.zero_tile_share,
                                        block_size=self.block_size, dtype=self.dtype, seed=seed)

    def calibrated_basis(self, which: str, config):
        """``kvbound.calibrate`` on :meth:`calibration_samples`, once per (K or V, rank) for this case."""
        import kvbound

        key = (which, config.rank)
        if key not in self._bases:
            self._bases[key] = kvbound.calibrate(self.calibration_samples(which), config)
        return self._bases[key]

    def calibration_samples(self, which: str) -> torch.Tensor:
        """Another draw of K or V from the same layer (same subspace, other tokens): what a model load sees."""
        if which not in self._samples:
            subspace = self.k_subspace if which == "k" else self.v_subspace
            self._samples[which] = self._kv(subspace, self.shape.kv_len, self.seed * 1000 + 997 + (which == "v"))
        return self._samples[which]

    @property
    def bias_dense(self) -> torch.Tensor | None:
        """``[B or 1, Hq, Nq, Nk]`` in the input dtype, built once."""
        if self.bias_compact is None:
            return None
        if self._bias_dense is None:
            self._bias_dense = bench_data.dense_bias(self.shape.bias, self.bias_compact, self.shape.q_len,
                                                     self.shape.kv_len, self.shape.bias_tile)
        return self._bias_dense

    def _bias_rows(self, index: torch.Tensor) -> torch.Tensor | None:
        s = self.shape
        if self.bias_compact is None:
            return None
        if s.bias == "tile":
            rows = self.bias_compact[:, :, index // s.bias_tile]  # [B, Hq, R, Nk / tile]
            return rows.repeat_interleave(s.bias_tile, dim=-1)
        j = torch.arange(s.kv_len, device=self.device)[None, :]
        return self.bias_compact[:, index[:, None] - j + s.kv_len - 1].unsqueeze(0)

    def reference(self, k: torch.Tensor, v: torch.Tensor, *, bias: bool = True, softcap: bool = True,
                  cache_key: tuple | None = None) -> torch.Tensor:
        """float64 attention of query rows ``check_index`` of input set 0 over ``k``, ``v``:
        ``[B, Hq, R, Dv]``. ``bias``/``softcap`` False leave those parts out (for providers that cannot do
        them)."""
        if cache_key is not None and cache_key in self._reference_cache:
            return self._reference_cache[cache_key]
        chunks = []
        for part in self.check_index.split(64):
            q_rows = self.q[0][:, :, part]
            bias_rows = self._bias_rows(part) if bias else None
            cap = self.softcap if softcap else None
            chunks.append(_oracle(q_rows, part, k, v, scale=self.scale, causal=self.shape.causal, bias=bias_rows,
                                  softcap=cap))
        out = torch.cat(chunks, dim=2)
        if cache_key is not None:
            self._reference_cache[cache_key] = out
        return out

    def dense_reference(self, *, bias: bool = True, softcap: bool = True) -> torch.Tensor:
        return self.reference(self.k[0], self.v[0], bias=bias, softcap=softcap, cache_key=("dense", bias, softcap))


def _oracle(q_rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
            causal: bool, bias: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """float64 attention for the query rows at ``positions``.

    Non-causal rows go through ``kvbound.reference_attention``, the project's oracle. Causal rows need their
    absolute positions for the mask, which the oracle (top-left aligned on the rows it is given) cannot know
    for a subsample; they are computed here with the same float64 math (scale, bias, soft-cap, then mask)."""
    if not causal:
        try:
            from kvbound import reference_attention
        except ImportError:
            reference_attention = None
        if reference_attention is not None:
            return reference_attention(q_rows, k, v, scale=scale, bias=bias, softcap=softcap)
    group = q_rows.shape[1] // k.shape[1]
    q64 = q_rows.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=1)
    logits = (q64 @ k64.transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias.to(torch.float64)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if causal:
        keys = torch.arange(k.shape[2], device=k.device)
        logits = logits.masked_fill(keys[None, :] > positions[:, None], -math.inf)
    return torch.softmax(logits, dim=-1) @ v64


# ----------------------------------------------------------------------------------------------- prepared
@dataclass
class Prepared:
    """A provider ready to run one shape.

    ``call(i)`` runs one forward on input set ``i`` and returns ``[B, Hq, Nq, Dv]``. ``context`` is entered
    around the check and the timing loop (e.g. the forced SDPA backend), so its cost stays out of the time.
    ``reference()`` returns the float64 rows the output must match (``Case.check_index``)."""

    call: Callable[[int], torch.Tensor]
    reference: Callable[[], torch.Tensor]
    bytes_moved: int
    kv_bytes: int
    kv_dense_bytes: int
    semantics: str = "exact"
    note: str = ""
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    config: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    compressed: bool = False


@dataclass(frozen=True)
class CompressedConfigSpec:
    """A compression setting to benchmark. ``lowrank_only``: ``tau`` is raised (doubling from 8x the default)
    until every block of K and V is stored without residual. ``basis``: ``"calibrated"`` (a shared basis from
    ``kvbound.calibrate`` on another draw of the same layer) or ``"per-block"`` (exact truncated SVD)."""

    label: str
    rank: int
    bits: int
    block_size: int = 128
    tau: float = DEFAULT_TAU
    lowrank_only: bool = False
    basis: str = "calibrated"


DEFAULT_CONFIGS = (
    CompressedConfigSpec("r8b4", rank=8, bits=4),
    CompressedConfigSpec("quant-r0b4", rank=0, bits=4, basis="none"),
    CompressedConfigSpec("lowrank-r8", rank=8, bits=4, lowrank_only=True),
)
SWEEP_CONFIGS = (
    CompressedConfigSpec("r8b8", rank=8, bits=8),
    CompressedConfigSpec("r16b8", rank=16, bits=8),
    CompressedConfigSpec("r16b4", rank=16, bits=4),
    CompressedConfigSpec("r8b2", rank=8, bits=2),
    CompressedConfigSpec("r4b2", rank=4, bits=2),
    CompressedConfigSpec("r8b4-perblock", rank=8, bits=4, basis="per-block"),
)


def _element_bytes(shape: AttentionShape) -> int:
    return DTYPE_BYTES[shape.dtype]


def _dense_kv_bytes(shape: AttentionShape, kv_heads: int | None = None) -> int:
    heads = shape.kv_heads if kv_heads is None else kv_heads
    return shape.batch * heads * shape.kv_len * (shape.head_dim_qk + shape.head_dim_v) * _element_bytes(shape)


def _dense_moved(shape: AttentionShape, *, kv_heads: int | None = None, bias_bytes: int = 0) -> int:
    s = shape
    return dense_bytes_moved(s.batch, s.q_heads, s.kv_heads if kv_heads is None else kv_heads, s.q_len, s.kv_len,
                             s.head_dim_qk, s.head_dim_v, s.dtype, bias_bytes=bias_bytes)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------- providers
class Provider:
    """Base class. ``name`` is the CSV ``provider``; ``configs()`` lists the ``config`` values it runs."""

    name = ""

    def unavailable(self) -> str | None:
        """Why this provider cannot run at all here (import failure), or None."""
        return None

    def applies(self, shape: AttentionShape) -> bool:
        """Whether this provider has a row for ``shape`` (the models-only providers skip plain shapes)."""
        return True

    def configs(self, sweep: bool) -> list[CompressedConfigSpec | None]:
        return [None]

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        raise NotImplementedError


def _kvbound_attention():
    """``kvbound.attention`` (the function), or ImportError saying why it cannot be had."""
    import kvbound

    attention = getattr(kvbound, "attention", None)
    if attention is None or isinstance(attention, types.ModuleType):
        attention = getattr(importlib.import_module("kvbound.attention"), "attention", None)
    if not callable(attention):
        raise ImportError("kvbound.attention is not a function in this version of kvbound")
    return attention


def _kvbound_bias(case: Case) -> tuple[torch.Tensor | None, int, str]:
    """The bias as kvbound.attention reads it: AlphaGenome's tile bias in its compact form, others dense."""
    if case.shape.bias == "tile":
        return case.bias_compact, case.shape.bias_tile, f"bias read in compact {case.shape.bias_tile}x tile form"
    if case.bias_dense is not None:
        return case.bias_dense, 1, "bias read as a dense [B, Hq, Nq, Nk] tensor"
    return None, 1, ""


def _run_kvbound(attention, q, k, v, case: Case) -> torch.Tensor:
    bias, bias_tile, _ = _kvbound_bias(case)
    try:
        return attention(q, k, v, scale=case.scale, causal=case.shape.causal, bias=bias, bias_tile=bias_tile,
                         softcap=case.softcap)
    except NotImplementedError as err:
        raise Unsupported(f"kvbound.attention: {err}") from err


class _Kvbound(Provider):
    """kvbound.attention providers; ``deferred``: the ``-deferred`` variant, whose check and timing loop run inside
    one ``kvbound.deferred_checks()`` block; ``split`` (compressed only): True, the ``-split`` variant, run with
    ``KVBOUND_SPLIT_LOWRANK=1`` (low-rank runs in a second launch without residual code); False, the ``-one``
    variant, run with ``KVBOUND_SPLIT_LOWRANK=0`` (one launch); either on the shapes that list it only. None: the
    default."""

    compressed = False  # whether the calls read CompressedKV (the split launch applies)

    def __init__(self, deferred: bool = False, split: bool | None = None) -> None:
        self.deferred, self.split = deferred, split
        if deferred:
            self.name = f"{type(self).name}-deferred"
        if split is not None:
            self.name = f"{type(self).name}-{'split' if split else 'one'}"

    def applies(self, shape: AttentionShape) -> bool:
        return self.split is None or self.name in shape.providers

    @contextlib.contextmanager
    def context(self):
        with contextlib.ExitStack() as stack:
            if self.compressed:  # the default row measures the default, whatever the caller set
                setting = "auto" if self.split is None else "1" if self.split else "0"
                stack.enter_context(_environment("KVBOUND_SPLIT_LOWRANK", setting))
            if self.deferred:
                import kvbound

                stack.enter_context(kvbound.deferred_checks())
            yield


@contextlib.contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` inside the block, the previous state restored after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class KvboundDense(_Kvbound):
    name = "kvbound-dense"

    def unavailable(self) -> str | None:
        try:
            _kvbound_attention()
        except ImportError as err:
            return f"not importable: {err}"
        return None

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        attention = _kvbound_attention()
        bias, _, note = _kvbound_bias(case)
        bias_bytes = _tensor_bytes(bias)
        return Prepared(
            call=lambda i: _run_kvbound(attention, case.q[i], case.k[i], case.v[i], case),
            reference=lambda: case.dense_reference(),
            bytes_moved=_dense_moved(case.shape, bias_bytes=bias_bytes),
            kv_bytes=_dense_kv_bytes(case.shape),
            kv_dense_bytes=_dense_kv_bytes(case.shape),
            note=note,
            context=self.context,
        )


def _mode_shares(ckv) -> list[float]:
    counts = torch.bincount(ckv.mode.reshape(-1).long().cpu(), minlength=4).tolist()
    total = max(1, sum(counts))
    return [c / total for c in counts[:4]]


class KvboundCompressed(_Kvbound):
    name = "kvbound-compressed"
    compressed = True

    def unavailable(self) -> str | None:
        try:
            _kvbound_attention()
            import kvbound

            if not hasattr(kvbound, "compress_kv"):
                return "not importable: kvbound.compress_kv is not defined"
        except ImportError as err:
            return f"not importable: {err}"
        return None

    def configs(self, sweep: bool) -> list[CompressedConfigSpec | None]:
        if self.split is not None:
            return [c for c in DEFAULT_CONFIGS if c.label == "r8b4"]  # a config with a residual: something to split
        if self.deferred:
            return [c for c in DEFAULT_CONFIGS if c.label in ("r8b4", "lowrank-r8")]
        return list(DEFAULT_CONFIGS) + (list(SWEEP_CONFIGS) if sweep else [])

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        import kvbound

        assert config is not None
        attention = _kvbound_attention()
        s = case.shape
        for name, dim in (("k", s.head_dim_qk), ("v", s.head_dim_v)):
            if config.rank >= dim:
                raise Unsupported(f"rank {config.rank} needs a head dim above it; {name} has {dim}")
        if config.block_size != case.block_size:
            raise Unsupported(f"inputs were generated for block size {case.block_size}, config has {config.block_size}")

        def make_config(tau: float):
            return kvbound.CompressionConfig(block_size=config.block_size, rank=config.rank, bits=config.bits, tau=tau)

        cfg = make_config(config.tau)
        bases = {"k": None, "v": None}
        if config.basis == "calibrated" and config.rank > 0:
            bases = {w: case.calibrated_basis(w, cfg) for w in ("k", "v")}

        def compress(i: int, c):
            return (kvbound.compress_kv(case.k[i], c, bases["k"]), kvbound.compress_kv(case.v[i], c, bases["v"]))

        if not config.lowrank_only:
            ck, cv = compress(0, cfg)
        else:
            tau = 8 * config.tau
            while True:
                cfg = make_config(tau)
                ck, cv = compress(0, cfg)
                if _mode_shares(ck)[0] == 1.0 and _mode_shares(cv)[0] == 1.0:
                    break
                if tau >= 64.0:
                    raise Unsupported(f"no tau up to {tau:g} leaves every residual block empty")
                tau *= 2
        pairs = [(ck, cv)] + [compress(i, cfg) for i in range(1, case.input_sets)]
        k_ref, v_ref = ck.decompress(), cv.decompress()
        k_shares, v_shares = _mode_shares(ck), _mode_shares(cv)
        blocks_k, blocks_v = ck.mode.numel(), cv.mode.numel()
        bias, _, note = _kvbound_bias(case)
        bias_bytes = _tensor_bytes(bias)
        basis_label = config.basis if config.rank > 0 else "none"
        return Prepared(
            call=lambda i: _run_kvbound(attention, case.q[i], pairs[i][0], pairs[i][1], case),
            reference=lambda: case.reference(k_ref, v_ref),
            bytes_moved=compressed_bytes_moved(s.batch, s.q_heads, s.q_len, s.head_dim_qk, s.head_dim_v, s.dtype,
                                               ck.nbytes, cv.nbytes, bias_bytes=bias_bytes),
            kv_bytes=ck.nbytes + cv.nbytes,
            kv_dense_bytes=ck.dense_nbytes + cv.dense_nbytes,
            note=note,
            config={"config": config.label, "rank": config.rank, "bits": config.bits,
                    "block_size": config.block_size, "tau": cfg.tau, "basis": basis_label},
            extras={
                "compression_ratio": (ck.dense_nbytes + cv.dense_nbytes) / (ck.nbytes + cv.nbytes),
                "zero_residual_share": (k_shares[0] * blocks_k + v_shares[0] * blocks_v) / (blocks_k + blocks_v),
                **{f"k_share_{m}": x for m, x in zip(_MODE_NAMES, k_shares, strict=True)},
                **{f"v_share_{m}": x for m, x in zip(_MODE_NAMES, v_shares, strict=True)},
                "kv_max_abs_error": max(_max_abs_difference(case.k[0], k_ref), _max_abs_difference(case.v[0], v_ref)),
            },
            compressed=True,
            context=self.context,
        )


_MODE_NAMES = ("lowrank", "packed", "promoted", "raw")


def _max_abs_difference(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x.to(torch.float64) - x_hat.to(torch.float64)).abs().max())


def _sdpa_available() -> str | None:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except ImportError as err:
        return f"not importable: {err}"
    return None


def _call_recording_warnings(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run ``fn``; turn SDPA's 'no available kernel' into :class:`Unsupported` with the backends' reasons."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except RuntimeError as err:
            text = str(err)
            if "No available kernel" not in text and "No viable backend" not in text:
                raise
            reasons = [str(w.message).split(" (Triggered internally")[0] for w in caught]
            # Keep the forced backend's own reasons, not the notes that the other backends are switched off.
            reasons = [r for r in reasons if not r.endswith("kernel not used because:")
                       and "has been runtime disabled" not in r]
            raise Unsupported("; ".join(dict.fromkeys(reasons)) or text.split("\n")[0]) from err


class SdpaBackend(Provider):
    """SDPA with one backend forced; plain attention (no bias, no soft-cap) on every shape."""

    def __init__(self, name: str, backend_name: str) -> None:
        self.name = name
        self.backend_name = backend_name

    def unavailable(self) -> str | None:
        return _sdpa_available()

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, self.backend_name)
        s = case.shape
        fn = torch.nn.functional.scaled_dot_product_attention
        dropped = [part for part, present in (("bias", s.bias != "none"), ("soft-cap", s.softcap > 0)) if present]
        semantics = "exact" if not dropped else "floor: plain attention without " + " and ".join(dropped)
        k_sets, v_sets, note, kv_heads = case.k, case.v, "", s.kv_heads
        gqa = s.q_heads != s.kv_heads

        def run(i: int, use_gqa: bool) -> torch.Tensor:
            return fn(case.q[i], k_sets[i], v_sets[i], is_causal=s.causal, scale=case.scale, enable_gqa=use_gqa)

        with sdpa_kernel(backend):
            try:
                _call_recording_warnings(lambda: run(0, gqa))
            except Unsupported as first:
                if not gqa:
                    raise
                # Some backends take no GQA: expand K/V to every query head outside the timed region.
                k_sets = [k.repeat_interleave(s.group, dim=1) for k in case.k]
                v_sets = [v.repeat_interleave(s.group, dim=1) for v in case.v]
                gqa, kv_heads = False, s.q_heads
                note = f"K/V expanded to {s.q_heads} heads outside the timed region (with enable_gqa: {first})"
                _call_recording_warnings(lambda: run(0, False))
        use_gqa = gqa
        return Prepared(
            call=lambda i: run(i, use_gqa),
            reference=lambda: case.dense_reference(bias=False, softcap=False),
            bytes_moved=_dense_moved(s, kv_heads=kv_heads),
            kv_bytes=_dense_kv_bytes(s, kv_heads),
            kv_dense_bytes=_dense_kv_bytes(s),
            semantics=semantics,
            note=note,
            context=lambda: sdpa_kernel(backend),
        )


class SdpaBias(Provider):
    """SDPA (torch's own backend choice) with the bias materialised as a tensor."""

    name = "sdpa-bias"

    def unavailable(self) -> str | None:
        return _sdpa_available()

    def applies(self, shape: AttentionShape) -> bool:
        return shape.family == "model" and shape.bias != "none"

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        s = case.shape
        mask = case.bias_dense
        if s.causal:
            keep = torch.ones(s.q_len, s.kv_len, dtype=torch.bool, device=case.device).tril()
            mask = mask.masked_fill(~keep, -math.inf)
        fn = torch.nn.functional.scaled_dot_product_attention
        gqa = s.q_heads != s.kv_heads

        def run(i: int) -> torch.Tensor:
            return fn(case.q[i], case.k[i], case.v[i], attn_mask=mask, scale=case.scale, enable_gqa=gqa)

        _call_recording_warnings(lambda: run(0))
        return Prepared(
            call=run,
            reference=lambda: case.dense_reference(softcap=False),
            bytes_moved=_dense_moved(s, bias_bytes=_tensor_bytes(mask)),
            kv_bytes=_dense_kv_bytes(s),
            kv_dense_bytes=_dense_kv_bytes(s),
            semantics="exact" if s.softcap == 0 else "without soft-cap (SDPA cannot apply one)",
            note="bias materialised as [B, Hq, Nq, Nk] outside the timed region",
        )


class Eager(Provider):
    """The ports' eager attention: logits, bias, soft-cap, softmax in float32, probabilities @ V."""

    name = "eager"

    def applies(self, shape: AttentionShape) -> bool:
        return shape.family == "model"

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        s = case.shape
        logit_bytes = 4 if s.eager_fp32_logits else DTYPE_BYTES[s.dtype]
        need = s.batch * s.q_heads * s.q_len * s.kv_len * (logit_bytes + 4 + DTYPE_BYTES[s.dtype])
        if case.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            if need > 0.5 * free:
                raise Unsupported(f"needs {need / 2**30:.1f} GiB for the N x N logits, {free / 2**30:.1f} GiB free")
        bias = case.bias_dense
        causal_keep = None
        if s.causal:
            causal_keep = torch.ones(s.q_len, s.kv_len, dtype=torch.bool, device=case.device).tril()
        group = s.group

        def run(i: int) -> torch.Tensor:
            q, k, v = case.q[i], case.k[i], case.v[i]
            if group > 1:  # [B, Hkv, N, D] -> [B, Hkv, 1, N, D] broadcasts over the group of query heads
                q = q.unflatten(1, (s.kv_heads, group))
                k, v = k.unsqueeze(2), v.unsqueeze(2)
            if s.eager_fp32_logits:
                logits = (q.float() @ k.float().transpose(-1, -2)) * case.scale
            else:
                logits = (q @ k.transpose(-1, -2)) * case.scale
            if group > 1:
                logits = logits.flatten(1, 2)
            if bias is not None:
                logits = logits + bias
            if case.softcap is not None:
                logits = case.softcap * torch.tanh(logits / case.softcap)
            if causal_keep is not None:
                logits = logits.masked_fill(~causal_keep, -math.inf)
            weights = torch.softmax(logits.float(), dim=-1).to(v.dtype)
            if group > 1:
                return (weights.unflatten(1, (s.kv_heads, group)) @ v).flatten(1, 2)
            return weights @ v

        return Prepared(
            call=run,
            reference=lambda: case.dense_reference(),
            bytes_moved=_dense_moved(s, bias_bytes=_tensor_bytes(bias)),
            kv_bytes=_dense_kv_bytes(s),
            kv_dense_bytes=_dense_kv_bytes(s),
            note=("float32 logits" if s.eager_fp32_logits else f"{s.dtype} logits") + ", softmax in float32",
        )


# FlexAttention: kernel_options tried in order until one compiles. Defaults fail at dv = 192 on torch 2.11
# (shared memory above 227 KB), so wide heads start from explicit tiles.
_FLEX_WIDE_OPTIONS = (
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1},
)
_flex_compiled = None


def flex_kernel_options(head_dim_qk: int, head_dim_v: int, first: dict | None = None) -> list[dict | None]:
    """FlexAttention ``kernel_options`` to try in order on CUDA: ``first`` (a shape's own), the defaults where the
    heads are at most 128 wide, then the explicit tiles that compile for wider heads (``None`` = the defaults)."""
    candidates: list[dict | None] = []
    if first:
        candidates.append(dict(first))
    if max(head_dim_qk, head_dim_v) <= 128:
        candidates.append(None)
    candidates += [dict(o) for o in _FLEX_WIDE_OPTIONS if dict(o) not in candidates]
    return candidates


def raise_recompile_limits() -> None:
    """One compiled FlexAttention graph per shape, score_mod and kernel_options: dynamo's default limit (8) would
    silently fall back to eager past it."""
    import torch._dynamo

    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    for knob in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)


def _compiled_flex():
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        raise_recompile_limits()
        _flex_compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _flex_compiled


class Flex(Provider):
    name = "flex"

    def unavailable(self) -> str | None:
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as err:
            return f"not importable: {err}"
        return None

    def prepare(self, case: Case, config: CompressedConfigSpec | None) -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        s = case.shape
        compiled = case.device.type == "cuda"
        fn = _compiled_flex() if compiled else flex_attention
        score_mod = _flex_score_mod(case)
        block_mask = None
        if s.causal:
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, s.q_len,
                                           s.kv_len, device=case.device)
        gqa = s.q_heads != s.kv_heads
        candidates = flex_kernel_options(s.head_dim_qk, s.head_dim_v, s.flex_options)
        if not compiled:
            candidates = [None]  # kernel_options only matter to the compiled kernel
        failures = []
        for options in candidates:

            def run(i: int, options=options) -> torch.Tensor:
                return fn(case.q[i], case.k[i], case.v[i], score_mod=score_mod, block_mask=block_mask,
                          scale=case.scale, enable_gqa=gqa, kernel_options=options)

            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                    run(0)
                    if compiled:
                        torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001 - a failed compile is recorded and the next tile tried
                failures.append(f"{options}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                continue
            label = "default" if options is None else ",".join(f"{k}={v}" for k, v in options.items())
            return Prepared(
                call=run,
                reference=lambda: case.dense_reference(),
                bytes_moved=_dense_moved(s, bias_bytes=_tensor_bytes(case.bias_compact)),
                kv_bytes=_dense_kv_bytes(s),
                kv_dense_bytes=_dense_kv_bytes(s),
                config={"config": f"kernel_options={label}" if compiled else "eager (CPU)"},
                note="bias read in compact form through score_mod" if case.bias_compact is not None else "",
                context=_quiet_flex_warning,
            )
        raise Unsupported("no kernel_options compiled: " + " | ".join(failures))


@contextlib.contextmanager
def _quiet_flex_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


def _flex_score_mod(case: Case):
    s = case.shape
    cap = case.softcap
    table = case.bias_compact
    if s.bias == "tile":
        tile = s.bias_tile

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + table[b, h, q_idx // tile, kv_idx // tile]

    elif s.bias == "relpos":
        offset = s.kv_len - 1

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + offset]

    else:
        add_bias = None
    if add_bias is None and cap is None:
        return None
    if cap is None:
        return add_bias

    def score_mod(score, b, h, q_idx, kv_idx):
        if add_bias is not None:
            score = add_bias(score, b, h, q_idx, kv_idx)
        return cap * torch.tanh(score / cap)

    return score_mod


def all_providers() -> list[Provider]:
    """Every provider, in the order the summary table lists them."""
    return [
        KvboundCompressed(),
        KvboundDense(),
        KvboundCompressed(deferred=True),
        KvboundDense(deferred=True),
        KvboundCompressed(split=True),
        KvboundCompressed(split=False),
        SdpaBackend("sdpa-cudnn", "CUDNN_ATTENTION"),
        SdpaBackend("sdpa-flash", "FLASH_ATTENTION"),
        SdpaBackend("sdpa-efficient", "EFFICIENT_ATTENTION"),
        Flex(),
        SdpaBias(),
        Eager(),
    ]
