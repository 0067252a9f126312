"""``kvbound.capture``: a model's forward captured once in a CUDA graph and replayed per call, checks included.

At batch 1 a genomic model's forward is set by the host, not the device: Enformer's and Borzoi's layers each queue
dozens of small kernels, and the device waits for the Python that queues them. A CUDA graph queues the whole
forward in one call. ``torch.cuda.graph`` alone cannot capture a forward patched by :func:`kvbound.patch`: its
NaN/Inf checks are read on the host when the forward returns. :func:`capture` captures them on the device with the
forward and reads them after every replay, so a replay raises ``ValueError`` for NaN or Inf as the eager forward
does.

The graph runs what it captured: the inputs' shapes, dtypes and device, the non-tensor arguments, the autocast
state and the model's parameters (their memory: values loaded in place, as ``load_state_dict`` does, are seen;
parameters replaced by new tensors are not). A call that differs in any of these raises and names it, and so does
a call after the model was patched, unpatched or undone since the capture. It runs under ``torch.no_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils import _pytree

from kvbound import _checks

__all__ = ["capture", "CapturedForward"]


def capture(fn: Callable, *args, kwargs: dict | None = None, warmup: int = 2, clone_outputs: bool = True
            ) -> CapturedForward:  # fmt: skip
    """Capture ``fn(*args, **kwargs)`` (a model or any callable; patched by :func:`kvbound.patch` or not) in a CUDA
    graph, after ``warmup`` eager calls on a side stream (at least 1: Triton autotuning, cuBLAS workspaces and
    kvbound's per-length caches must be set up before the capture), and return the :class:`CapturedForward` that
    replays it.

    Tensor arguments (top level of ``args`` and ``kwargs``) are the graph's inputs: they are copied into buffers of
    the graph at each call (``args`` themselves are never written). Other arguments are fixed by the capture. Run it
    inside the ``torch.autocast`` context the forward should run in; autocast's weight cache is off while capturing
    (a cached cast made before the capture would be freed under the graph), so the graph casts the weights itself,
    except those of layers patched by :func:`kvbound.patch`, which keep their casts and relative keys between forwards:
    the graph reads those, and each call first makes again, in the same memory, any whose weight changed in place.

    ``clone_outputs``: return copies of the graph's output tensors (default). With False the call returns the
    graph's own output buffers, which the next call overwrites.

    Unpatched models and dense patches (``kvbound.patch(model, compress=False)``) capture, and so do compressed
    patches that encode speculatively (the default, in ``eval()``): the graph then runs the forecast kernel variant
    of each layer, as the warm-up forwards taught it, and a replay whose encoding raises a retry flag (a residual
    where none was forecast, coefficients beyond float16, a block the certificate rejects) is not returned: the
    model's eager forward runs instead (``fallbacks`` counts those calls). A compressed patch that would encode
    synchronously raises ``RuntimeError`` saying why, before anything is captured. Code that reads
    device values on the host inside the forward (``.item()``, ``.tolist()``, a synchronisation) cannot be captured
    either: that raises ``RuntimeError`` too, after a capture that CUDA abandoned (torch's random generator may then
    refuse further use in the process)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup: expected an int >= 1, got {warmup!r}")
    if not isinstance(clone_outputs, bool):
        raise TypeError(f"clone_outputs: expected a bool, got {type(clone_outputs).__name__}")
    if not callable(fn):
        raise TypeError(f"fn: expected a module or callable, got {type(fn).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs: expected a dict of keyword arguments, got {type(kwargs).__name__}")
    bad_keys = [k for k in kwargs or () if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"kwargs: expected str keys (argument names), got {bad_keys[0]!r} "
                        f"({type(bad_keys[0]).__name__})")
    kwargs = {} if kwargs is None else dict(kwargs)
    return CapturedForward(fn, args, kwargs, warmup=warmup, clone_outputs=clone_outputs)


class CapturedForward:
    """A forward captured by :func:`capture`; call it with arguments of the capture's shapes and dtypes.

    ``replays``: calls so far; ``fallbacks``: calls of them that ran the eager forward after a retry flag (compressed
    K/V). ``graph``: the ``torch.cuda.CUDAGraph``. ``pool_bytes``: the CUDA allocator's
    memory that grew while capturing (the graph's buffers, inputs and outputs)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, *, warmup: int, clone_outputs: bool) -> None:
        tensors = [(f"args[{i}]", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if not torch.cuda.is_available():
            raise RuntimeError("kvbound.capture: CUDA graphs need a CUDA device; none is available")
        if not tensors:
            raise ValueError("kvbound.capture: expected at least one tensor argument (the graph's input), got none")
        for name, t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"{name}: expected a tensor on a CUDA device, got one on {t.device}")
            if t.requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad (the graph runs no_grad)")
        devices = {t.device for _, t in tensors}
        if len(devices) > 1:
            shown = sorted(map(str, devices))
            raise ValueError(f"kvbound.capture: expected every tensor argument on one device, got {shown}")
        self.device = devices.pop()
        self.fn = fn
        self.clone_outputs = clone_outputs
        self.replays = 0
        self.fallbacks = 0
        self._names = [name for name, _ in tensors]
        self._specs = [(t.shape, t.dtype) for _, t in tensors]
        # The graph reads its inputs from these buffers; the caller's tensors are only read.
        self._static_args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        self._static_kwargs = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self._buffers = [a for a in self._static_args if isinstance(a, torch.Tensor)]
        self._buffers += [v for v in self._static_kwargs.values() if isinstance(v, torch.Tensor)]
        self._autocast = _autocast_state(self.device)
        module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
        self._module = module if isinstance(module, nn.Module) else None
        self._forward_attr = _forward_attr(self._module)
        self._handles = _patch_handles(self._module)
        reasons = [reason for h in self._handles if h.compress and (reason := _synchronous_reason(h))]
        if reasons:
            # Refused before capturing: a capture that fails part-way leaves the CUDA random generator of the
            # process in capture mode.
            raise RuntimeError(
                "kvbound.capture: the model is patched with compressed K/V (kvbound.patch(..., compress=True)) that "
                "it encodes synchronously, reading block modes on the host in each forward, which a CUDA graph "
                f"cannot replay: {reasons[0]}. Capture a compressed patch that encodes speculatively, or a dense "
                "patch (compress=False)"
            )
        self._weights = _weights(self._module)

        before = torch.cuda.memory_allocated(self.device)
        with torch.cuda.device(self.device), torch.no_grad(), _autocast_without_cache(self._autocast):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._call()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            self.graph = torch.cuda.CUDAGraph()
            try:
                with _checks.graph_staging() as staged:
                    with torch.cuda.graph(self.graph):
                        with _checks._block(speculative=False):
                            output = self._call()
            except Exception as err:
                raise RuntimeError(
                    f"kvbound.capture: the forward could not be captured in a CUDA graph ({type(err).__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}). Unpatched models and kvbound patches capture; "
                    "code that calls .item(), .tolist() or synchronises inside the forward does not"
                ) from err
        self._finishers = [f for f in staged if f is not _checks._nothing]
        self._output = output
        # kvbound's per-length caches that the graph reads (relative-position layouts, run starts): kept alive
        # with the graph, whatever the caches evict later.
        self._kept = _cached_device_tensors(self._handles)
        # The patched layers' kept weight casts and relative keys that the graph reads: made again in place before a
        # replay when a weight changed in place (load_state_dict), as the graph's own casts would have been.
        self._operands = [entry for h in self._handles for entry in h._operands.entries()]
        self._kept.append([entry.value for entry in self._operands])  # the memory the graph reads, whatever happens
        self.pool_bytes = torch.cuda.memory_allocated(self.device) - before

    def _call(self):
        return self.fn(*self._static_args, **self._static_kwargs)

    def __call__(self, *args, **kwargs):
        tensors = self._check_call(args, kwargs)
        for buffer, t in zip(self._buffers, tensors, strict=True):
            buffer.copy_(t)
        for entry in self._operands:
            entry.refresh()
        self.graph.replay()
        self.replays += 1
        out = _pytree.tree_map_only(torch.Tensor, torch.clone, self._output) if self.clone_outputs else self._output
        try:
            for finish in self._finishers:
                finish()
        except _checks.Retry:
            # A compressed layer's encoding cannot be used as the graph ran it (a residual where the capture's
            # forecast had none, coefficients beyond float16, a block the certificate rejects): the eager forward,
            # which encodes again as it needs, gives this call's output.
            self.fallbacks += 1
            with torch.no_grad():
                return self.fn(*args, **kwargs)
        return out

    def _check_call(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if len(args) != len(self._static_args):
            raise TypeError(f"kvbound.capture: expected {len(self._static_args)} positional arguments as captured, "
                            f"got {len(args)}")
        if set(kwargs) != set(self._static_kwargs):
            raise TypeError(f"kvbound.capture: expected keyword arguments {sorted(self._static_kwargs)} as captured, "
                            f"got {sorted(kwargs)}")
        given = [(f"args[{i}]", a, s) for i, (a, s) in enumerate(zip(args, self._static_args, strict=True))]
        given += [(f"kwargs[{k!r}]", kwargs[k], s) for k, s in self._static_kwargs.items()]
        tensors = []
        for name, value, static in given:
            if isinstance(static, torch.Tensor):
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{name}: expected a torch.Tensor as captured, got {type(value).__name__}")
                if value.shape != static.shape or value.dtype != static.dtype or value.device != static.device:
                    raise ValueError(
                        f"{name}: expected shape {list(static.shape)}, {str(static.dtype).removeprefix('torch.')} on "
                        f"{static.device} as captured, got {list(value.shape)}, "
                        f"{str(value.dtype).removeprefix('torch.')} on {value.device}"
                    )
                tensors.append(value)
            elif not _same(value, static):
                raise ValueError(f"{name}: expected {static!r} as captured (fixed in the graph), got {value!r}")
        if _autocast_state(self.device) != self._autocast:
            raise RuntimeError(
                f"kvbound.capture: expected the autocast state of the capture {_describe_autocast(self._autocast)}, "
                f"got {_describe_autocast(_autocast_state(self.device))}; capture again in this context"
            )
        if _forward_attr(self._module) is not self._forward_attr or not all(h.active for h in self._handles):
            raise RuntimeError(
                "kvbound.capture: the model was patched, unpatched or undone since the capture; the graph would run "
                "the forward it captured. Capture again"
            )
        names, weights, pointers = self._weights
        if [t.data_ptr() for t in weights] != pointers:
            name = next(n for n, t, p in zip(names, weights, pointers, strict=True) if t.data_ptr() != p)
            raise RuntimeError(
                f"kvbound.capture: {name} was moved or replaced since the capture (the graph reads its old memory); "
                "load weights in place (load_state_dict) or capture again"
            )
        return tensors

    def __repr__(self) -> str:
        inputs = ", ".join(f"{n}: {list(s)} {str(d).removeprefix('torch.')}" for n, (s, d) in zip(
            self._names, self._specs, strict=True))
        return f"<kvbound.CapturedForward of {getattr(self.fn, '__name__', type(self.fn).__name__)} ({inputs}), " \
               f"{len(self._finishers)} staged check read(s), {self.replays} replays, {self.fallbacks} eager>"


def _synchronous_reason(handle) -> str | None:
    """Why the compressed patch ``handle`` would encode some K/V synchronously (a host read per layer), or None."""
    if not handle.speculative:
        return "speculative encoding is off (handle.speculative = False)"
    if handle._anchor_index is not None:
        return "a handle.variants() block is open (anchored encoding reads on the host)"
    if not handle._speculate():
        return "a module of the model is in training mode, or the handle does not patch the captured model's forward"
    if handle.config.rank == 0 or any(r.basis_k is None or r.basis_v is None for r in handle.modules):
        return "a layer has no calibrated basis, so the eager encoder runs (pass calibrate_on to kvbound.patch)"
    switched = [f"{r.name} {role.upper()}" for r in handle.modules for role in sorted(r._synchronous)]
    if switched:
        return (f"{', '.join(switched)} encode synchronously since a retry (handle.forget_forecasts() lets them "
                "speculate again)")
    return None


def _same(a: object, b: object) -> bool:
    try:
        equal = a == b
        return bool(equal) if not isinstance(equal, torch.Tensor) else False
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the captured one
        return a is b


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype | None]:
    enabled = torch.is_autocast_enabled(device.type)
    return enabled, torch.get_autocast_dtype(device.type) if enabled else None


def _describe_autocast(state: tuple[bool, torch.dtype | None]) -> str:
    return f"(autocast {str(state[1]).removeprefix('torch.')})" if state[0] else "(no autocast)"


def _autocast_without_cache(state: tuple[bool, torch.dtype | None]):
    enabled, dtype = state
    if not enabled:
        return torch.autocast("cuda", enabled=False)
    return torch.autocast("cuda", dtype=dtype, cache_enabled=False)


def _forward_attr(module: nn.Module | None) -> object:
    return None if module is None else module.__dict__.get("forward")


def _patch_handles(module: nn.Module | None) -> list:
    if module is None:
        return []
    from kvbound.models.patch import _ACTIVE

    handles = []
    for m in module.modules():
        handle = _ACTIVE.get(m)
        if handle is not None and all(h is not handle for h in handles):
            handles.append(handle)
    return handles


def _weights(module: nn.Module | None) -> tuple[list[str], list[torch.Tensor], list[int]]:
    """The module's CUDA parameters and buffers (names, tensors, data pointers at the capture)."""
    named = [] if module is None else [*module.named_parameters(), *module.named_buffers()]
    named = [(name, t) for name, t in named if t.is_cuda]
    return [n for n, _ in named], [t for _, t in named], [t.data_ptr() for _, t in named]


def _cached_device_tensors(handles: list) -> list:
    from kvbound.attention import _RUN_LAYOUTS, _RUNS_ON_DEVICE

    kept: list = [list(_RUN_LAYOUTS.values()), list(_RUNS_ON_DEVICE.values())]
    for handle in handles:
        kept += [list(handle._features.values()), list(handle._features_runs.values()),
                 list(handle._features_run_rows.values())]
    return kept

