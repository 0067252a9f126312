"""``kvbound.patch``: run a loaded Enformer, Borzoi or AlphaGenome port with memory-lean, optionally
compressed attention, per instance, undoably.

Each recognised module gets an instance attribute (``forward``; for AlphaGenome's ``TransformerTower``,
``_forward_block``) that shadows its class's method; the class is never touched, and ``handle.undo()``
deletes exactly those attributes (or restores what was there), so the module is left as it was found.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from kvbound import _checks
from kvbound._validate import check_finite_values
from kvbound.codec.basis import Basis, calibrate
from kvbound.codec.format import CompressedKV
from kvbound.compress import compress_kv
from kvbound.config import CompressionConfig
from kvbound.models._backend import BACKENDS, resolve_backend
from kvbound.models._operands import OperandCache
from kvbound.models._ports import (
    PORTS,
    UNSUPPORTED,
    Port,
    attention_pool_forward,
    conv_bias_forward,
    conv_block_forward,
    conv_block_parts,
    conv_residual_block,
    conv_residual_forward,
    feed_forward_forward,
    is_feed_forward,
    lookup_class,
    max_pool_forward,
    port_class,
    pre_norm_forward,
)
from kvbound.models._ports import (
    _check_inference as _check_module_inference,
)
from kvbound.models.relative import equal_row_runs

__all__ = ["patch", "PatchHandle", "PatchedModule", "calibrated_width"]

_MISSING = object()
# Every module currently patched, and by which handle (weak: an unreferenced model may be collected).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, PatchHandle] = weakref.WeakKeyDictionary()


def _training_matters(module: nn.Module) -> bool:
    """Whether ``module``'s own training flag can change what its forward does or leaves behind: it holds
    parameters or buffers (batch-norm statistics, for one), or it is one of torch's dropout layers."""
    return (
        any(p is not None for p in module._parameters.values())
        or any(b is not None for b in module._buffers.values())
        or isinstance(module, nn.modules.dropout._DropoutNd)
    )


def _count_modes(mode: torch.Tensor) -> torch.Tensor:
    """Blocks per storage mode (0 low rank, 1 packed, 2 promoted, 3 raw) as int64 ``[4]`` on ``mode``'s device, with
    no host read (``torch.bincount`` on CUDA reads its input's maximum)."""
    kinds = torch.arange(4, dtype=mode.dtype, device=mode.device)
    return (mode.reshape(-1, 1) == kinds).sum(0)


def _encoder(x: torch.Tensor, config: CompressionConfig, basis: Basis | None) -> str:
    """The Triton encoder on the GPU when it applies (a calibrated basis, rank >= 1), else the eager one."""
    return "triton" if x.is_cuda and basis is not None and config.rank > 0 else "eager"


# Kinds whose attention runs the relative-position kernels, which decode every coded block in their general loop
# (no uniform runs: kernels/attention_compressed.py, uniform_safe): a wider code only costs bytes there.
RELATIVE_KINDS = frozenset({"enformer", "borzoi"})
# A wider code width is taken only when it stores at most this many times the bytes of config.bits.
WIDEN_BYTES_LIMIT = 1.25


def _width_candidates(bits: int) -> list[int]:
    """``config.bits``, then the wider widths the kernel's uniform runs decode as bytes (4 and 8)."""
    return [bits, *(w for w in (4, 8) if w > bits)]


def calibrated_width(
    samples: Sequence[torch.Tensor], config: CompressionConfig, basis: Basis | None
) -> tuple[int, dict[int, tuple[int, float]]]:
    """The code width for K or V of one layer, from its calibration samples (``[B, H, N, D]`` each).

    Each candidate width ``w`` (``config.bits``, then 4 and 8 where wider) encodes the samples with
    ``bits = w``; a block is on the fused kernel's fast path when it is low rank only or packed at ``w`` with ``w``
    decoded as bytes (2, 4 or 8 bits, ``byte_planes``): blocks promoted to other widths, or kept exact, go through
    its general decode loop, several times slower per tile (kernels/README.md, "Byte decode in plane order").
    Among the widths that store at most ``WIDEN_BYTES_LIMIT`` times the bytes of ``config.bits``, the one with the
    largest share of fast blocks is returned; ties go to the narrower. The bound ``tau`` is the same at every
    width. The trials run the eager encoder (float64, on the samples' device), which stores the same modes and
    widths as the Triton encoder, so that no encoder kernel is compiled for a width that is not kept. Returns
    ``(width, {w: (stored bytes, fast share)})``."""
    from kvbound.kernels.attention_compressed import byte_planes

    found: dict[int, tuple[int, float]] = {}
    for width in _width_candidates(config.bits):
        trial = replace(config, bits=width)
        stored = fast = blocks = 0
        for x in samples:
            ckv = compress_kv(x, trial, basis, impl="eager")  # (no kernel compiled per trial width)
            mode = ckv.mode.reshape(-1)
            on_path = mode == 0
            if byte_planes(width, x.shape[-1]):
                on_path |= mode == 1
            stored += ckv.nbytes
            fast += int(on_path.sum())
            blocks += mode.numel()
        found[width] = (stored, fast / max(1, blocks))
    base = found[config.bits][0]
    allowed = [w for w in found if found[w][0] <= WIDEN_BYTES_LIMIT * base]
    best = max(found[w][1] for w in allowed)
    return min(w for w in allowed if found[w][1] == best), found


@dataclass(eq=False)
class PatchedModule:
    """One module a handle patched, and what its patched forward has done since."""

    name: str
    kind: str
    role: str
    module: nn.Module = field(repr=False)
    method: str = "forward"
    # For a helper: the patched attention module it serves (role "norm"), whose block it is in ("feed-forward") or
    # whose model it is in ("pool", "conv").
    target: nn.Module | None = field(default=None, repr=False)
    basis_k: Basis | None = None
    basis_v: Basis | None = None
    # The compression settings of this layer's K and V: the handle's config with the code width calibrated (patch's
    # ``widen_codes``); None where no width was calibrated (the handle's config is used).
    config_k: CompressionConfig | None = None
    config_v: CompressionConfig | None = None
    # "k" / "v" -> {width: (stored bytes, share of blocks on the kernel's fast path)} of the calibration samples at
    # each width tried (calibrated_width); empty when the width was not calibrated
    width_trials: dict[str, dict[int, tuple[int, float]]] = field(default_factory=dict, repr=False)
    calls: int = 0
    last_k_ratio: float | None = None
    last_v_ratio: float | None = None
    _encode_total: float = field(default=0.0, repr=False)
    # CUDA events around each forward's encoding, read (and folded into the total) when the time is asked for
    _encode_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list, repr=False)
    _original: object = field(default=_MISSING, repr=False)
    _installed: object = field(default=None, repr=False)
    _captured_k: list[torch.Tensor] = field(default_factory=list, repr=False)
    _captured_v: list[torch.Tensor] = field(default_factory=list, repr=False)
    # "k" / "v" -> (some block held a residual in some forward so far, low-rank-only share in the last one): what
    # the speculative encoder tells kvbound.attention in the next forward (PatchHandle._encode_speculative).
    _forecast: dict[str, tuple[bool, float | None, bool]] = field(default_factory=dict, repr=False)
    # "k" / "v" whose speculative encoding could not be kept (float16 range, certificate): encoded synchronously.
    _synchronous: set[str] = field(default_factory=set, repr=False)
    # (role, shape, dtype, coefficient dtype, code words, raw elements) -> the byte counts of a speculative encoding
    # but its used code words and raw values (PatchHandle._encode_speculative), for the latest shapes of each role
    _sizes: dict[tuple, tuple[int, int, int, int, int]] = field(default_factory=dict, repr=False)
    # "k" / "v" -> blocks per storage mode (int64 [4] on K/V's device) in the last forward encoded while the handle's
    # record_modes was on
    _mode_counts: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def mode_counts(self) -> dict[str, list[int]] | None:
        """Blocks of K and of V in each storage mode (``lowrank``, ``packed``, ``promoted``, ``raw``, as
        ``CompressedKV.mode_fractions``) in the last forward encoded while the handle's ``record_modes`` was on, as
        ``{"k": [...], "v": [...]}``; None when no such forward ran. Reading waits for that forward's device work."""
        if not self._mode_counts:
            return None
        return {role: counts.tolist() for role, counts in self._mode_counts.items()}

    def _learn(self, role: str, residual: bool, lowrank_share: float | None, general: bool | None) -> None:
        """What a forward found of this role's tensor: a residual (kept once seen), the low-rank-only share, and a
        block for the attention kernel's general loop (kept once seen; None, unknown, counts as seen)."""
        seen, _, seen_general = self._forecast.get(role, (False, None, False))
        self._forecast[role] = (seen or residual, lowrank_share, seen_general or general is None or general)

    def _add_encode_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        # fold the pairs already completed (no wait), so that a long inference loop keeps few events alive
        while self._encode_events and self._encode_events[0][1].query():
            done_start, done_end = self._encode_events.pop(0)
            self._encode_total += done_start.elapsed_time(done_end) / 1e3
        self._encode_events.append((start, end))

    @property
    def encode_seconds(self) -> float:
        """Time spent compressing this module's K and V. On CUDA it is the device time between events recorded
        around the encoder calls (host time would include waiting for the work queued before them), over the
        forwards run while the handle's ``time_encoding`` was on (off by default: the events cost about 20 us of
        host time per layer); reading it waits for those events. On the CPU, the encoders' own wall time, over all
        forwards. Forwards replayed from a CUDA graph (``kvbound.capture``) are not counted."""
        for start, end in self._encode_events:
            end.synchronize()
            self._encode_total += start.elapsed_time(end) / 1e3
        self._encode_events.clear()
        return self._encode_total


class _PatchedMethod:
    """The callable placed on a module instance: calls the port's lean forward with its record and handle."""

    __slots__ = ("_module", "_record", "_handle", "_impl", "__weakref__")

    def __init__(self, module: nn.Module, record: PatchedModule, handle: PatchHandle, impl: Callable) -> None:
        self._module = weakref.ref(module)
        self._record = record
        self._handle = handle
        self._impl = impl

    def __call__(self, *args, **kwargs):
        module = self._module()
        if module is None:
            raise RuntimeError(f"{self._record.name}: the patched module no longer exists")
        self._record.calls += 1
        return self._impl(module, self._record, self._handle, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<kvbound patched {self._record.kind} {self._record.method} of {self._record.name}>"

    # A copy would keep calling the original module; refuse instead of running the wrong weights.
    def __deepcopy__(self, memo):
        raise TypeError(
            f"{self._record.name}: a kvbound-patched module cannot be copied or pickled; call handle.undo() "
            "first (state_dict() is unaffected)"
        )

    def __reduce_ex__(self, protocol):
        self.__deepcopy__(None)


class PatchHandle:
    """What :func:`patch` did, and how to undo it.

    Attributes:
        modules: the patched attention modules (:class:`PatchedModule`: name, kind, bases, call counts,
            last compression ratios of K and V).
        helpers: modules patched only to serve patched attention: AlphaGenome's tower (role ``bias``: the pair
            bias at tile resolution), the ``nn.LayerNorm`` in front of each patched Enformer/Borzoi attention
            module (role ``norm``: it writes the attention's operand dtype in one kernel, ``pre_norm_forward``),
            and the feed-forward ``nn.Sequential`` of the same transformer block (role ``feed-forward``: that
            kernel, then the first ``Linear`` with its ReLU in one matmul, ``feed_forward_forward``), and the
            pools of a model whose Enformer or Borzoi attention is patched (role ``pool``: Enformer's
            ``AttentionPool``, ``attention_pool_forward``; Borzoi's ``nn.MaxPool1d``, ``max_pool_forward``), and the
            convolution blocks of such a model (role ``conv``: ``BatchNorm1d -> GELU -> Conv1d`` with the norm and
            the GELU in one kernel, ``conv_block_forward``), its ``nn.Conv1d`` s with a bias (role
            ``conv-bias``: the bias added in one pass, ``conv_bias_forward``), and Enformer's ``Residual`` around
            such a block (role ``conv-residual``: bias and residual added in one pass, ``conv_residual_forward``).
        skipped: ``(name, reason)`` for modules that look like a port's attention but were left alone.
        calibration_seconds: time spent in ``kvbound.calibrate`` and in choosing code widths
            (``widen_codes``) over all layers (0 without ``calibrate_on``).
        calibration_forward_seconds: time of the sample forward that captured K and V.
        widen_codes: whether calibration chose each layer's code widths (see :func:`patch`).
        speculative: encode K/V on the GPU without a host read per layer (default True; see :func:`patch`).
            Set it to False to read the encoder's results in every layer instead.
        speculative_retries: forwards that ran a second time because a speculative encoding could not be kept.
        retry_reasons: what flagged each of those forwards (``Retry.reasons``, the latest 16 forwards').
        synchronous_tensors: ``(layer, role)`` of the tensors encoded synchronously from now on after a retry
            whose cause would come back every time (``forget_forecasts`` lets them speculate again).
        one_pass_encode: run each speculative encode in one launch instead of five (``encode_triton_deferred``'s
            ``one_pass``: the same values, fewer launches, more device time for large tensors); None (default):
            ``KVBOUND_ONE_PASS_ENCODE`` when set to on or off, else one launch for tensors of at most 6 Mi
            elements (``encode_triton.one_pass_by_default``).
        time_encoding: record CUDA events around each layer's encoder calls, read by the patched modules'
            ``encode_seconds`` (default False: on the GPU ``encode_seconds`` counts only forwards run with it on).
        record_modes: count each layer's K and V blocks per storage mode in every forward (two small reductions
            per tensor, no host read; not in CUDA-graph captures), read by the patched modules' ``mode_counts()``
            (default False).
        operand_bytes: device memory held between forwards by the patched layers' kept weight casts and relative
            keys (``kvbound/models/_operands.py``; ``clear_operands()`` drops them, ``KVBOUND_OPERAND_CACHE=0``
            stops keeping them), and by the one-launch speculative encoder's stored tensors, one set for K and one
            for V at the latest shapes, which every layer's encode writes again (``encode_triton_deferred``'s
            ``workspace``: seven allocations fewer per encode; about 1.5x the bytes of one layer's K and V).
    """

    def __init__(
        self,
        config: CompressionConfig,
        compress: bool,
        backend: str,
        query_chunk: int | None,
        widen_codes: bool = True,
    ) -> None:
        self.config = config
        self.widen_codes = widen_codes
        self.compress = compress
        self.backend = backend
        self.query_chunk = query_chunk
        self.modules: list[PatchedModule] = []
        self.helpers: list[PatchedModule] = []
        self.skipped: list[tuple[str, str]] = []
        self.calibration_seconds = 0.0
        self.calibration_forward_seconds = 0.0
        self._capturing = False
        self._anchor_index: torch.Tensor | None = None
        # Speculative encoding (see patch's docstring): on by default; forwards run again after a retry.
        self.speculative = True
        self.speculative_retries = 0
        self.retry_reasons: list[list[str]] = []
        self.one_pass_encode: bool | None = None
        self.time_encoding = False
        self.record_modes = False
        # The one-launch speculative encoder's stored tensors, kept between layers and forwards (one set per role).
        self._encode_workspaces: dict[str, dict] = {"k": {}, "v": {}}
        self._attention_ids: set[int] = set()
        # The model's forward wrapped in kvbound.deferred_checks (set by patch when it patched anything).
        self._root: nn.Module | None = None
        self._root_original: object = _MISSING
        self._root_installed: object = None
        self._root_modules: list[nn.Module] = []
        # Positional features by (port function, length, sizes, dtype, device): see _positional_features.
        self._features: dict[tuple, torch.Tensor] = {}
        self._features_runs: dict[int, tuple[torch.Tensor, list[int] | None]] = {}
        self._features_run_rows: dict[int, tuple[torch.Tensor, list[int], torch.Tensor]] = {}
        # Casts of the patched layers' weights and their relative keys, kept while unchanged (_operands.py).
        self._operands = OperandCache()
        self.active = True

    # ------------------------------------------------------------------------------------- used by forwards
    def _patches_attention(self, module: nn.Module) -> bool:
        return self.active and id(module) in self._attention_ids

    def _positional_features(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Positional features that depend only on ``key`` (the port's function, the length, the feature sizes,
        dtype and device), computed once per handle and read by every patched layer of every forward at that
        length. The ports compute them again in each layer of each forward (Enformer: about 135 tensor ops). Made
        outside inference mode, so that a later forward with autograd can read them too; never written."""
        cached = self._features.get(key)
        if cached is None:
            with torch.inference_mode(False):
                cached = compute()
            self._features[key] = cached
        return cached

    def _relative_runs(self, features: torch.Tensor, limit: int = 64) -> list[int] | None:
        """The first rows of the runs of equal rows of ``features`` (``[2N - 1, F]``, a cached tensor of
        ``_positional_features``), found once per tensor (one host read), or None beyond ``limit`` runs or a quarter
        of the rows (smooth features, as Enformer's: one run per distance, nothing to gain)."""
        found = self._features_runs.get(id(features))
        if found is not None and found[0] is features:  # the entry holds the tensor: its id is not reused
            return found[1]
        starts = equal_row_runs(features)
        runs = starts if len(starts) <= min(limit, features.shape[0] // 4) else None
        self._features_runs[id(features)] = (features, runs)
        return runs

    def _run_features(self, features: torch.Tensor, runs: list[int]) -> torch.Tensor:
        """The first row of each run of ``features`` (``[R, F]``, ``runs`` from ``_relative_runs``), sliced once per
        features tensor: the relative keys of a layer are then computed for these rows only, one per run."""
        found = self._features_run_rows.get(id(features))
        if found is not None and found[0] is features and found[1] == runs:
            return found[2]
        with torch.inference_mode(False):
            rows = features[torch.tensor(runs, device=features.device)]
        self._features_run_rows[id(features)] = (features, list(runs), rows)
        return rows

    def _check_eager(self, record: PatchedModule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """On the eager backend (PyTorch operations, which pass NaN and Inf through), queue the finite checks of
        the layer's q, k and v in the forward's deferred-check block (checked at once outside one), as
        ``kvbound.attention`` does on its own backend; compressed K/V are checked by the encoder besides. On every
        backend, the block records this layer's name: the attention calls that follow name it in their errors."""
        scope = _checks.active()
        if scope is not None:
            scope.layer = record.name
        if self._capturing or resolve_backend(self.backend, q.device) != "eager":
            return
        tensors = [(f"{record.name} {name}", t) for name, t in (("q", q), ("k", k), ("v", v))]
        if scope is not None:
            scope.queue(record.name, tensors)
            return
        for name, t in tensors:
            check_finite_values(t, name)

    def _guard_gradients(
        self, record: PatchedModule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q`` as it is, except where this forward compresses K/V while autograd records it: then ``q`` through an
        identity whose backward raises, so that a gradient through the layer (to its input, weights or K/V) is
        refused instead of being computed without the compressed K/V's part of it."""
        if not (self.compress and not self._capturing and torch.is_grad_enabled()):
            return q
        if not (q.requires_grad or k.requires_grad or v.requires_grad):
            return q
        return _NoGradientThroughCompression.apply(q, record.name, k, v)

    def _prepare_kv(
        self, record: PatchedModule, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor | CompressedKV, torch.Tensor | CompressedKV]:
        """K and V ``[B, H, N, D]`` as the attention core should read them in this handle's mode."""
        if self._capturing:
            record._captured_k.append(k.detach())
            record._captured_v.append(v.detach())
            return k, v
        if not self.compress:
            return k, v
        events = None
        if self.time_encoding and k.is_cuda and not _checks._stream_capturing():  # (replays are not timed)
            stream = torch.cuda.current_stream(k.device)  # where the encoder's kernels go
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), stream)
            events[0].record(stream)
        scope = _checks.active()
        speculative = scope is not None and scope.speculative and self._anchor_index is None
        encoded = []
        for role, x, basis, config in (("k", k, record.basis_k, record.config_k), ("v", v, record.basis_v,
                                                                                  record.config_v)):
            config = self.config if config is None else config
            impl = _encoder(x, config, basis)
            if speculative and impl == "triton" and role not in record._synchronous:
                encoded.append(self._encode_speculative(record, role, x, basis, scope, config))
                continue
            try:
                ckv = compress_kv(x, config, basis, impl=impl)
            except ValueError as error:
                if not str(error).startswith("x: expected finite values"):
                    raise
                # the encoder's argument is this layer's K or V: name it as such
                raise ValueError(f"{record.name} {role}{str(error)[1:]}") from None
            residual = ckv._checked_residual()
            if residual is None:  # no record (inference tensors): both encoders store codes and raw at exact sizes
                residual = ckv.codes.numel() > 0 or ckv.raw.numel() > 0
            record._learn(role, residual, ckv._checked_lowrank_share(), ckv._checked_general())
            if self._anchor_index is None:  # (speculative encodings set theirs when the forward's read arrives)
                setattr(record, f"last_{role}_ratio", ckv.compression_ratio)
            encoded.append(ckv)
        ck, cv = encoded
        if self._anchor_index is not None:
            from kvbound.codec.anchored import encode_anchored

            if k.shape[0] != len(self._anchor_index):
                raise ValueError(
                    f"{record.name}: handle.variants() was given {len(self._anchor_index)} references for a batch "
                    f"of {k.shape[0]}"
                )
            index = self._anchor_index.to(k.device)
            ck = encode_anchored(k, ck, ck, index, source=k, check_fresh=False)  # both just encoded above
            cv = encode_anchored(v, cv, cv, index, source=v, check_fresh=False)
            record.last_k_ratio = ck.compression_ratio
            record.last_v_ratio = cv.compression_ratio
        if self.record_modes and not _checks._stream_capturing():
            record._mode_counts = {"k": _count_modes(ck.mode), "v": _count_modes(cv.mode)}
        if events is not None:
            events[1].record(events[2])
            record._add_encode_events(events[0], events[1])
        elif not k.is_cuda:
            record._encode_total += ck.encode_seconds + cv.encode_seconds
        return ck, cv

    def _encode_speculative(
        self, record: PatchedModule, role: str, x: torch.Tensor, basis: Basis, scope: _checks.DeferredChecks,
        config: CompressionConfig,
    ) -> CompressedKV:
        """``x`` through the Triton encoder without a host read (``encode_triton_deferred``), telling
        ``kvbound.attention`` what this layer's earlier forwards found: a residual somewhere (or nothing known yet,
        the first forward: the residual-capable kernel, always correct), the last low-rank-only share, and whether
        some block needs the attention kernel's general loop (else the kernel is compiled without it). A residual, or
        a general-loop block, where none was forecast is a retry flag (the forward runs again, synchronously, and the
        forecast learns it). So are coefficients beyond float16 and a block the float64 certificate rejects; as the same
        input would raise them again, this layer's tensor is then encoded synchronously in later forwards
        (``PatchedModule._synchronous``). The compression ratio and the forecast are updated from the sizes read
        when the forward ends."""
        from kvbound.codec.encode_triton import encode_triton_deferred
        from kvbound.kernels.attention_compressed import general_loop

        residual, share, general = record._forecast.get(role, (True, None, True))

        def unusable() -> None:  # the same input would raise it again: this tensor stops speculating
            record._synchronous.add(role)

        def sizes(code_words: int, raw_elements: int, lowrank_blocks: int, general_blocks: int) -> None:
            stored = fixed + code_words * word_bytes + raw_elements * raw_bytes
            setattr(record, f"last_{role}_ratio", dense / stored)
            found = code_words + raw_elements > 0
            record._learn(role, found, lowrank_blocks / blocks, general_loop(general_blocks, found, config.bits,
                                                                             x.shape[-1]))  # fmt: skip

        ckv = encode_triton_deferred(
            x, config, basis, scope, residual=residual, lowrank_share=share, general=general,
            name=f"{record.name} {role.upper()}", sizes=sizes, unusable=unusable, one_pass=self.one_pass_encode,
            workspace=self._encode_workspaces[role],
        )  # fmt: skip
        key = (role, ckv.shape, ckv.dtype, ckv.coeffs.dtype, ckv.codes.numel(), ckv.raw.numel())
        known = record._sizes.get(key)
        if known is None:
            word_bytes, raw_bytes = ckv.codes.element_size(), ckv.raw.element_size()
            # Bytes of everything but the two workspaces, whose used lengths arrive with the block's read.
            fixed = ckv.nbytes - ckv.codes.numel() * word_bytes - ckv.raw.numel() * raw_bytes
            known = (fixed, word_bytes, raw_bytes, ckv.dense_nbytes, max(1, ckv.mode.numel()))
            record._sizes = {key: known, **{k: v for k, v in record._sizes.items() if k[0] != role}}
        fixed, word_bytes, raw_bytes, dense, blocks = known
        return ckv

    def _check_inference(self) -> None:
        """Before each forward of the model: the patched attention modules' inference-only check (their dropouts in
        training mode), so that a refused forward runs no layer (batch norms before them would update their
        statistics)."""
        if self.active and self._root is not None:
            for record in self.modules:
                _check_module_inference(record.module, record.name)

    def _speculate(self) -> bool:
        """Whether this forward of the model may encode speculatively: compressing, switched on, and no module of
        the model that holds parameters or buffers, or is a dropout, in training mode (a forward that runs again
        must not update state or draw dropout twice; layers without state, such as einops' ``Rearrange``, whose
        copies come back in training mode, do not count). The modules are those the model held when it was patched
        (listing them again costs about 0.25 ms per forward at Enformer's size)."""
        return (
            self.compress
            and self.speculative
            and self.active
            and self._root is not None
            and not any(m.training for m in self._root_modules)
        )

    def _count_retry(self, retry: _checks.Retry) -> None:
        self.speculative_retries += 1
        self.retry_reasons = [*self.retry_reasons[-15:], list(retry.reasons)]

    @property
    def synchronous_tensors(self) -> list[tuple[str, str]]:
        return [(record.name, role) for record in self.modules for role in sorted(record._synchronous)]

    def forget_forecasts(self) -> None:
        """Forget what earlier forwards taught the speculative encoder: the per-layer residual forecasts, and the
        tensors that were switched to synchronous encoding after a retry (for example after an input with
        outliers, once the inputs are ordinary again). The next forward starts as the first one did."""
        for record in self.modules:
            record._forecast.clear()
            record._synchronous.clear()

    def clear_operands(self) -> None:
        """Drop the weights' casts, the relative keys and the speculative encoder's workspaces this handle keeps
        between forwards (``operand_bytes`` of device memory). They are made again at the next forward. Needed only
        after a weight was written in place through ``.data``, which PyTorch's version counter does not see; every
        other change of a weight (``load_state_dict``, in-place writes, ``model.to``) is seen and its operands are
        made again."""
        self._operands.clear()
        self._clear_workspaces()

    def _clear_workspaces(self) -> None:
        for workspace in self._encode_workspaces.values():
            workspace.clear()

    @property
    def operand_bytes(self) -> int:
        """Bytes of device memory held by the kept operands and the encoder's kept workspaces
        (``clear_operands``)."""
        kept = [t for workspace in self._encode_workspaces.values() for ts in workspace.values() for t in ts]
        return self._operands.bytes + sum(t.numel() * t.element_size() for t in kept)

    # ---------------------------------------------------------------------------------------------- public
    @contextlib.contextmanager
    def variants(self, references: Sequence[int] | torch.Tensor) -> Iterator[PatchHandle]:
        """Score variants against their references in one batch: inside this block each batch item's compressed
        K/V follow the item ``references[b]`` of the same batch (-1: a reference, encoded on its own), element by
        element (``kvbound.codec.anchored``), so that a variant and its reference decode identically wherever
        their K/V did not move and the predicted change carries no code-flip noise. Same bound, same ratio::

            with handle.variants([-1, 0, 0]):      # batch: reference, two variants of it
                out = model(batch)                 # Enformer: model(batch)["human"]
            effects = out[1:] - out[:1]

        Only with ``compress=True`` (exact K/V have nothing to anchor). Not re-entrant.
        """
        if not self.active:
            raise RuntimeError("handle.variants(): this handle was undone; patch the model again")
        if not self.compress:
            raise RuntimeError("handle.variants(): this handle keeps K/V exact (compress=False); nothing to anchor")
        given = references.tolist() if isinstance(references, torch.Tensor) or hasattr(references, "tolist") else (
            references  # (a NumPy array too)
        )
        if isinstance(given, (list, tuple)):
            given = [int(i) if hasattr(i, "__index__") and not isinstance(i, bool) else i for i in given]
        if (
            not isinstance(given, (list, tuple))
            or not given
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in given)
        ):
            raise ValueError(
                f"references: expected a non-empty 1-D sequence of ints (one per batch item), got {given!r}"
            )
        index = torch.tensor(given, dtype=torch.int64)
        batch = len(index)
        if bool(((index < -1) | (index >= batch)).any()):
            raise ValueError(f"references: expected values in [-1, {batch - 1}] (batch items), got {given}")
        if bool((index[index.clamp_min(0)] >= 0).logical_and(index >= 0).any()):
            raise ValueError(f"references: a reference must be its own (-1), got {index.tolist()}")
        if self._anchor_index is not None:
            raise RuntimeError("handle.variants(): already inside a variants() block")
        self._anchor_index = index
        try:
            yield self
        finally:
            self._anchor_index = None

    @property
    def calibrated(self) -> bool:
        return any(r.basis_k is not None for r in self.modules)

    def undo(self) -> None:
        """Restore every patched module exactly as it was found (idempotent)."""
        if not self.active:
            return
        problems = []
        # First the model's deferred-check wrapper: it may wrap a patched forward (a patched module as the model).
        root, self._root = self._root, None
        self._root_modules = []
        if root is not None:
            if root.__dict__.get("forward", _MISSING) is not self._root_installed:
                problems.append("the model's forward was replaced after kvbound.patch; left as it is")
            elif self._root_original is _MISSING:
                del root.__dict__["forward"]
            else:
                root.__dict__["forward"] = self._root_original
        for record in [*self.helpers, *self.modules]:
            module = record.module
            if _ACTIVE.get(module) is self:
                del _ACTIVE[module]
            current = module.__dict__.get(record.method, _MISSING)
            if current is not record._installed:
                problems.append(f"{record.name}.{record.method} was replaced after kvbound.patch; left as it is")
                continue
            if record._original is _MISSING:
                del module.__dict__[record.method]
            else:
                module.__dict__[record.method] = record._original
        self.active = False
        self._attention_ids.clear()
        self._features.clear()
        self._features_runs.clear()
        self._features_run_rows.clear()
        self._operands.clear()
        self._clear_workspaces()
        if problems:
            raise RuntimeError("kvbound.patch undo: " + "; ".join(problems))

    def summary(self) -> str:
        lines = [
            f"kvbound.patch: {len(self.modules)} attention module(s), {len(self.helpers)} helper(s), "
            f"compress={self.compress}, backend={self.backend}, active={self.active}"
        ]
        if self.compress:
            c = self.config
            lines.append(
                f"  config: rank {c.rank}, bits {c.bits}, block {c.block_size}, tau {c.tau:g}; calibration "
                f"{self.calibration_seconds:.3f} s (+ {self.calibration_forward_seconds:.3f} s sample forward)"
            )
        for r in self.modules:
            ratio = "" if r.last_k_ratio is None else f", K {r.last_k_ratio:.2f}x V {r.last_v_ratio:.2f}x"
            basis = ", calibrated basis" if r.basis_k is not None else ""
            if r.width_trials:
                basis += f", codes K {r.config_k.bits} / V {r.config_v.bits} bits (calibrated)"
            lines.append(f"  {r.name} [{r.kind}] calls={r.calls}{basis}{ratio}")
        for r in self.helpers:
            what = {
                "norm": "LayerNorm in the attention's operand dtype",
                "feed-forward": "feed-forward: fused LayerNorm, Linear with ReLU",
                "pool": "pool in one kernel",
                "conv": "BatchNorm and GELU in one kernel",
                "conv-bias": "Conv1d, its bias added in one pass",
                "conv-residual": "residual convolution block: its bias and the residual added in one pass",
            }.get(r.role, "tile-resolution bias")
            lines.append(f"  {r.name} [{r.kind} {r.method}: {what}]")
        for name, reason in self.skipped:
            lines.append(f"  skipped {name}: {reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"PatchHandle(modules={len(self.modules)}, helpers={len(self.helpers)}, skipped={len(self.skipped)}, "
            f"compress={self.compress}, calibration_seconds={self.calibration_seconds:.3f}, active={self.active})"
        )

    def __len__(self) -> int:
        return len(self.modules)

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.undo()
            return
        try:
            self.undo()
        except Exception as failed:  # noqa: BLE001 - the block's own exception is the one to see; this one is said
            warnings.warn(f"kvbound.patch: undo at the end of a block that raised {kind.__name__} failed too: "
                          f"{failed}", RuntimeWarning, stacklevel=2)  # fmt: skip


def _run_sample(model: nn.Module, sample) -> None:
    given = [("calibrate_on", sample)] if isinstance(sample, torch.Tensor) else (
        [(f"calibrate_on[{k!r}]", v) for k, v in sample.items()] if isinstance(sample, Mapping)
        else [(f"calibrate_on[{i}]", v) for i, v in enumerate(sample)] if isinstance(sample, (tuple, list)) else []
    )  # fmt: skip
    for name, t in given:  # named here: the layers would report NaN or Inf under their own argument names
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            check_finite_values(t, name)
    if isinstance(sample, torch.Tensor):
        model(sample)
    elif isinstance(sample, Mapping):
        model(**sample)
    elif isinstance(sample, (tuple, list)):
        model(*sample)
    elif callable(sample):
        sample(model)
    else:
        raise TypeError(
            "calibrate_on: expected a tensor, a tuple of positional arguments, a dict of keyword arguments or "
            f"a callable taking the model, got {type(sample).__name__}"
        )


def _selected(filter_fn: Callable, name: str, module: nn.Module) -> bool:
    """``filter_fn(name, module)``, which must return a bool (a truthy string or a tensor is refused, naming it)."""
    chosen = filter_fn(name, module)
    if not isinstance(chosen, bool):
        raise TypeError(f"filter_fn: expected a bool for {name}, got {type(chosen).__name__}")
    return chosen


def _install(module: nn.Module, record: PatchedModule, handle: PatchHandle, impl: Callable) -> None:
    record._original = module.__dict__.get(record.method, _MISSING)
    record._installed = _PatchedMethod(module, record, handle, impl)
    module.__dict__[record.method] = record._installed
    _ACTIVE[module] = handle


def _install_helper(handle: PatchHandle, module: nn.Module, impl: Callable, **fields) -> None:
    """Patch ``module`` as a helper of ``handle`` (a :class:`PatchedModule` of ``fields``, listed in
    ``handle.helpers``)."""
    record = PatchedModule(module=module, **fields)
    _install(module, record, handle, impl)
    handle.helpers.append(record)


# Ports whose attention module sits in ``Sequential(LayerNorm, Attention, ...)`` and multiplies the norm's output.
_PRE_NORM_KINDS = frozenset({"enformer", "borzoi"})


def _install_pre_norms(named: list[tuple[str, nn.Module]], handle: PatchHandle) -> None:
    """Patch the ``nn.LayerNorm`` right before each patched Enformer/Borzoi attention module in a ``Sequential``
    (``pre_norm_forward``), as a helper of the handle (role ``norm``)."""
    targets = {id(r.module): r for r in handle.modules if r.kind in _PRE_NORM_KINDS}
    for name, module in named:
        if not targets or not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (child_name, norm), (_, attention) in zip(children, children[1:], strict=False):
            target = targets.get(id(attention))
            if target is None or type(norm) is not nn.LayerNorm or norm in _ACTIVE or "forward" in vars(norm):
                continue
            path = f"{name}.{child_name}" if name else child_name
            _install_helper(handle, norm, pre_norm_forward, name=path, kind=target.kind, role="norm", target=attention)


def _install_feed_forwards(named: list[tuple[str, nn.Module]], handle: PatchHandle) -> None:
    """Patch the feed-forward ``nn.Sequential`` (``_ports.is_feed_forward``) of each Enformer/Borzoi transformer
    block whose attention module is patched (``feed_forward_forward``), as a helper of the handle (role
    ``feed-forward``, target: that attention module). The block is a ``Sequential`` whose child holding the patched
    attention is followed by the child holding the feed-forward."""
    targets = {id(r.module): r for r in handle.modules if r.kind in _PRE_NORM_KINDS}
    if not targets:
        return
    for name, block in named:
        if not isinstance(block, nn.Sequential):
            continue
        children = list(block.named_children())
        for (_, first), (child_name, second) in zip(children, children[1:], strict=False):
            # Both children of the block itself: the first holds one patched attention and no feed-forward, the
            # second a feed-forward and no patched attention (not two whole blocks of a tower).
            held = [targets[id(m)] for m in first.modules() if id(m) in targets]
            if len(held) != 1 or any(is_feed_forward(m) for m in first.modules()):
                continue
            if any(id(m) in targets for m in second.modules()):
                continue
            target = held[0]
            for sub_name, ffn in second.named_modules():
                if not is_feed_forward(ffn) or ffn in _ACTIVE or "forward" in vars(ffn):
                    continue
                path = ".".join(p for p in (name, child_name, sub_name) if p)
                _install_helper(handle, ffn, feed_forward_forward, name=path, kind=target.kind, role="feed-forward",
                                target=target.module)  # fmt: skip
                break


def _tower_helper(module: nn.Module, kinds: dict, pool_class: type | None) -> tuple[str, str, Callable] | None:
    """``(kind, role, forward)`` of the helper for ``module`` in a model whose attention of the port kinds ``kinds``
    is patched, or None: Enformer's ``AttentionPool`` and Borzoi's ``nn.MaxPool1d`` (``pool``), every ``nn.Conv1d``
    with a bias (``conv-bias``), Enformer's ``Residual`` around a convolution block (``conv-residual``), and the
    convolution blocks ``BatchNorm1d -> GELU -> Conv1d`` (``conv``)."""
    if "enformer" in kinds and pool_class is not None and type(module) is pool_class:
        return "enformer", "pool", attention_pool_forward
    if "borzoi" in kinds and type(module) is nn.MaxPool1d:
        return "borzoi", "pool", max_pool_forward
    if type(module) is nn.Conv1d and module.bias is not None:
        return next(iter(kinds)), "conv-bias", conv_bias_forward
    if "enformer" in kinds and conv_residual_block(module) is not None:
        return "enformer", "conv-residual", conv_residual_forward
    parts = conv_block_parts(module)
    kind = None if parts is None else ("enformer" if parts[2] == "sigmoid" else "borzoi")
    return (kind, "conv", conv_block_forward) if kind in kinds else None


def _install_tower(named: list[tuple[str, nn.Module]], handle: PatchHandle) -> None:
    """Patch the pooling and convolution layers of a model whose Enformer or Borzoi attention the handle patches
    (:func:`_tower_helper`), as helpers whose target is the first patched attention module of that port:
    Enformer's ``AttentionPool`` (``attention_pool_forward``), Borzoi's ``nn.MaxPool1d`` (``max_pool_forward``; fused
    only as ``MaxPool1d(2)``), each ``nn.Conv1d`` with a bias (``conv_bias_forward``), Enformer's ``Residual`` around
    a convolution block (``conv_residual_forward``), and the convolution blocks (``conv_block_forward``)."""
    targets: dict[str, nn.Module] = {}
    for record in handle.modules:
        if record.kind in _PRE_NORM_KINDS:
            targets.setdefault(record.kind, record.module)
    if not targets:
        return
    pool_class = lookup_class("enformer_pytorch.modeling_enformer", "AttentionPool")
    for name, module in named:
        if module in _ACTIVE or "forward" in vars(module):
            continue
        found = _tower_helper(module, targets, pool_class)
        if found is not None:
            kind, role, impl = found
            _install_helper(handle, module, impl, name=name or type(module).__name__, kind=kind, role=role,
                            target=targets[kind])  # fmt: skip


class _NoGradientThroughCompression(torch.autograd.Function):
    """The identity on q in a layer whose K/V are compressed under grad mode; its backward raises: compressed K/V
    hold rounded codes, so no gradient flows through them, and a gradient that skipped them would be wrong."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, name: str, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.name = name
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            f"{ctx.name}: expected no backward pass through a layer whose K/V are compressed (compressed K/V are "
            "rounded codes: no gradient flows through them); for gradients, patch with compress=False and "
            "backend='eager', or leave the model unpatched; for inference, run under torch.no_grad()"
        )


def patch(
    model: nn.Module,
    config: CompressionConfig | None = None,
    *,
    compress: bool = True,
    calibrate_on=None,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    backend: str = "auto",
    query_chunk: int | None = None,
    widen_codes: bool = True,
) -> PatchHandle:
    """Patch the Enformer, Borzoi and AlphaGenome attention modules of a loaded ``model`` in place.

    Args:
        model: any ``nn.Module``; every submodule whose class is exactly ``enformer_pytorch``'s or
            ``borzoi_pytorch``'s ``Attention`` or ``alphagenome_pytorch``'s ``MHABlock`` is patched (a port that is
            not installed contributes nothing). AlphaGenome's ``TransformerTower`` is patched too, so that its
            patched ``MHABlock`` s receive the pair bias at 16 x 16 tile resolution instead of ``[B, 8, S, S]``. The
            ``nn.LayerNorm`` right before each patched Enformer/Borzoi attention module is patched too: on CUDA
            under autocast it writes the attention's operand dtype in one kernel; so is the feed-forward of the
            same transformer block: its LayerNorm in that kernel and its first ``Linear`` with the ReLU in one
            matmul (``KVBOUND_FUSED_NORM=0``: their own forwards). In a model whose Enformer attention is patched,
            each ``AttentionPool`` runs its softmax pool in one kernel after the logits' matmul; in one whose Borzoi
            attention is patched, each ``nn.MaxPool1d(2)`` runs in one kernel (``KVBOUND_FUSED_POOL=0``: their own
            forwards); in both, each convolution block ``BatchNorm1d -> GELU -> Conv1d`` runs its inference norm
            and GELU in one kernel that writes the convolution's operand dtype, each ``nn.Conv1d`` adds its bias
            in one pass (a narrow input such as the stem's one-hot DNA convolved as one matmul), and Enformer's
            residual blocks add the bias and the residual in one pass (``KVBOUND_FUSED_CONV=0``: their own
            forwards). All are listed in ``handle.helpers`` and restored by ``undo``.
        config: compression settings (default ``CompressionConfig()``); ``rank`` must be below both head dims.
        compress: compress K and V with :func:`kvbound.compress_kv` on every forward. ``False`` keeps K and V
            exact and only makes attention memory-lean.
        calibrate_on: sample input for one forward of ``model`` (a tensor ``model(x)``, a tuple ``model(*x)``, a
            dict ``model(**x)``, or a callable ``f(model)``); its K and V fit one shared basis per layer and per
            K/V with :func:`kvbound.calibrate` (timed in ``handle.calibration_seconds``). Without it every
            block uses its own truncated SVD. Only with ``compress=True``.
        filter_fn: ``filter_fn(name, module) -> bool`` selects which recognised attention modules to patch.
        backend: ``"auto"`` (``kvbound.attention`` on CUDA when available, else eager chunks), ``"eager"`` or
            ``"kvbound"`` (raises when unavailable, never falls back).
        query_chunk: query rows per attention call where calls are chunked (the eager backend, and the relative-
            position layers on either backend); default: float32 logits of a chunk under 128 MiB.
        widen_codes: with ``calibrate_on``, on the kvbound backend on a GPU with tensor descriptors (sm_90 or
            newer), let calibration code a layer's K or V at a wider width than ``config.bits`` (4 or 8 bits,
            :func:`calibrated_width`) where its sample shows that the fused kernel then decodes more blocks on its
            fast path for at most 1.25x the stored bytes; not for the relative-position layers (Enformer, Borzoi),
            whose kernel has no such path, nor on older GPUs, where the kernel compiles none. The bound
            ``config.tau`` is the same. The widths chosen are each module's ``config_k`` / ``config_v``
            (``handle.summary()`` lists them). ``False``: ``config.bits`` everywhere.

    Returns:
        a :class:`PatchHandle`; ``handle.undo()`` (or leaving ``with patch(...)``) restores the model exactly.

    The patched forwards are for inference: Enformer/Borzoi modules in training mode with dropout raise.
    Each forward of ``model`` runs inside :func:`kvbound.deferred_checks`: the NaN/Inf checks of its dense attention
    calls are read once, when the forward returns (``model.forward`` is wrapped on the instance; ``undo`` restores
    it).

    Compressed forwards on the GPU (Triton encoder, calibrated basis) are speculative when no module of ``model``
    that holds parameters or buffers, or is a dropout layer, is in training mode: each layer's encoder reads nothing
    back (its NaN/Inf flag, the sizes it wrote and whether its result must be redone are read once, when the forward
    returns), so the host keeps queueing layers while the device works. Whether the blocks hold a residual (which
    kernel variant reads them) is forecast from the layer's earlier forwards. If an encoding cannot be kept
    (coefficients beyond float16, a block the float64 certificate rejects, a residual where none was forecast), the
    forward's result is dropped and the forward runs once more with the synchronous encoder, which handles those
    cases; ``handle.speculative_retries`` counts such forwards. Forward hooks of the model run again in such a
    second run. After a retry for float16 range or the certificate, that layer's K or V is encoded synchronously for
    the rest of the handle's life (``handle.forget_forecasts()`` starts over). The training-mode check looks at the
    modules the model held when it was patched. ``handle.speculative = False`` turns this off.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    config = CompressionConfig() if config is None else config
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"config: expected kvbound.CompressionConfig or None, got {type(config).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if query_chunk is not None and (
        isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1
    ):
        raise ValueError(f"query_chunk: expected None or an int >= 1, got {query_chunk!r}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn: expected a callable (name, module) -> bool, got {type(filter_fn).__name__}")
    if not isinstance(compress, bool):
        raise TypeError(f"compress: expected bool, got {type(compress).__name__}")
    if not isinstance(widen_codes, bool):
        raise TypeError(f"widen_codes: expected bool, got {type(widen_codes).__name__}")
    if calibrate_on is not None and not compress:
        raise ValueError("calibrate_on: given with compress=False; calibration only serves compression")

    handle = PatchHandle(config, compress, backend, query_chunk, widen_codes)
    classes = [(port, port_class(port)) for port in PORTS]
    classes = [(port, cls) for port, cls in classes if cls is not None]
    unsupported = []
    for module_name, class_name, reason in UNSUPPORTED:
        cls = lookup_class(module_name, class_name)
        if cls is not None:
            unsupported.append((cls, reason))

    named = list(model.named_modules())
    chosen: list[tuple[str, nn.Module, Port]] = []
    for name, module in named:
        name = name or type(module).__name__
        for cls, reason in unsupported:
            if type(module) is cls:
                handle.skipped.append((name, reason))
        for port, cls in classes:
            if not isinstance(module, cls) or port.role != "attention":
                continue
            if type(module) is not cls:
                handle.skipped.append((name, f"subclass {type(module).__qualname__} of {port.kind} {cls.__name__}"))
            elif not all(hasattr(module, attr) for attr in port.required):
                missing = [a for a in port.required if not hasattr(module, a)]
                handle.skipped.append((name, f"{port.kind} {cls.__name__} without {missing} (another version?)"))
            elif filter_fn is not None and not _selected(filter_fn, name, module):
                continue
            elif module in _ACTIVE:
                raise ValueError(f"model: module {name} is already patched by kvbound; undo that handle first")
            elif port.method in vars(module):
                handle.skipped.append((name, f"has an instance-level {port.method} (another patch or hook wrapper)"))
            else:
                if compress and port.head_dims is not None:
                    dk, dv = port.head_dims(module)
                    config.check_head_dim(dk, f"{name} K")
                    config.check_head_dim(dv, f"{name} V")
                chosen.append((name, module, port))

    if not chosen and not handle.skipped:  # (skipped modules get their own warning below)
        which = "that filter_fn selects" if filter_fn is not None else "of the Enformer, Borzoi or AlphaGenome ports"
        warnings.warn(f"kvbound.patch: no attention module {which} in this {type(model).__name__}: nothing was "
                      "patched and the model runs as it was", stacklevel=2)  # fmt: skip
    for name, module, port in chosen:
        record = PatchedModule(name=name, kind=port.kind, role=port.role, module=module, method=port.method)
        _install(module, record, handle, port.forward)
        handle.modules.append(record)
        handle._attention_ids.add(id(module))

    for name, module in named:
        name = name or type(module).__name__
        for port, cls in classes:
            if port.role != "bias" or type(module) is not cls:
                continue
            if not all(hasattr(module, attr) for attr in port.required):
                handle.skipped.append((name, f"{port.kind} {cls.__name__} of another layout"))
                continue
            feeds = any(id(m) in handle._attention_ids for m in module.modules())
            if feeds and module not in _ACTIVE and port.method not in vars(module):
                _install_helper(handle, module, port.forward, name=name, kind=port.kind, role=port.role,
                                method=port.method)  # fmt: skip
    _install_pre_norms(named, handle)
    _install_feed_forwards(named, handle)
    _install_tower(named, handle)

    if handle.modules:
        # One host read of the attention calls' NaN/Inf checks per forward of the model, not one per layer.
        handle._root = model
        handle._root_modules = [m for m in model.modules() if _training_matters(m)]
        handle._root_original = model.__dict__.get("forward", _MISSING)
        handle._root_installed = _checks.DeferredForward(model.forward, handle._speculate, handle._count_retry,
                                                         handle._check_inference)  # fmt: skip
        model.__dict__["forward"] = handle._root_installed
    if handle.skipped:
        listed = "; ".join(f"{name}: {reason}" for name, reason in handle.skipped)
        warnings.warn(f"kvbound.patch left these modules unpatched: {listed}", stacklevel=2)
    if calibrate_on is not None:
        _calibrate(model, handle, calibrate_on)
    return handle


def _widens(handle: PatchHandle, record: PatchedModule) -> bool:
    """Whether calibration picks this layer's code widths: ``widen_codes``, a layer whose kernel runs uniform runs
    (not the relative-position ones), on the kvbound backend for the sample's device, where that kernel compiles
    them: a GPU with tensor descriptors (sm_90 or newer; ``uniform_safe``) or Triton's interpreter."""
    from kvbound.kernels._common import _has_tensor_descriptors
    from kvbound.kernels.attention_compressed import uniform_safe

    if not handle.widen_codes or not record._captured_k:
        return False
    device = record._captured_k[0].device
    if resolve_backend(handle.backend, device) != "kvbound":
        return False
    return uniform_safe(_has_tensor_descriptors(device), None, relative=record.kind in RELATIVE_KINDS)


def _calibrate(model: nn.Module, handle: PatchHandle, sample) -> None:
    try:
        handle._capturing = True
        start = time.perf_counter()
        with torch.no_grad():
            _run_sample(model, sample)
        handle.calibration_forward_seconds = time.perf_counter() - start
        handle._capturing = False
        for record in [*handle.modules, *handle.helpers]:
            record.calls = 0
        unseen = []
        for record in handle.modules:
            if not record._captured_k:
                unseen.append(record.name)
                continue
            record.basis_k = calibrate(record._captured_k, handle.config)
            record.basis_v = calibrate(record._captured_v, handle.config)
            handle.calibration_seconds += record.basis_k.calibration_seconds + record.basis_v.calibration_seconds
            if _widens(handle, record):
                start = time.perf_counter()
                for role, samples, basis in (("k", record._captured_k, record.basis_k),
                                             ("v", record._captured_v, record.basis_v)):  # fmt: skip
                    width, record.width_trials[role] = calibrated_width(samples, handle.config, basis)
                    setattr(record, f"config_{role}", replace(handle.config, bits=width))
                handle.calibration_seconds += time.perf_counter() - start
        if unseen:
            warnings.warn(
                f"calibrate_on: the sample forward never reached {unseen}; those modules compress with per-block bases",
                stacklevel=3,
            )
    except BaseException:
        handle._capturing = False
        handle.undo()
        raise
    finally:
        for record in handle.modules:
            record._captured_k.clear()
            record._captured_v.clear()
