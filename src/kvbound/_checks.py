"""Deferred NaN/Inf checks: one host synchronisation per block of attention calls instead of one per call.

Every ``kvbound.attention`` call checks its floating-point inputs for NaN and Inf. Reading that check back to the
host synchronises with the device; in a model forward with one attention call per layer, each synchronisation
drains the device queue and leaves it idle while the host queues the next layer. Inside
:func:`deferred_checks`, calls whose kernel does not depend on the data (dense K/V) queue their checks on the
device and return at once; the block's exit reads all of them in one synchronisation and raises ``ValueError``
naming the first call and tensor that held NaN or Inf. Compressed K/V still read their checks at the call: which
kernel variant runs depends on whether the blocks carry a residual.

The check per tensor is its largest magnitude (``vector_norm(ord=inf)`` as float64, one pass, no temporary; the
tensors of one call in one multi-tensor call, ``largest_magnitudes``): NaN and Inf propagate through it and a
finite tensor always gives a finite value, so it never raises for finite data. Outputs computed from non-finite
inputs inside the block are garbage; the error arrives at the block's end instead of at the call.

A *speculative* block (opened by a patched model's forward, :class:`DeferredForward`, never by
:func:`deferred_checks`) lets code inside it go on without a value that only the device knows yet: the Triton
encoder queues, instead of reading at once, whether its result must be computed again another way (``queue_retry``)
and the sizes it wrote (``queue_value``). If any retry flag is set when the block ends, the block raises
:class:`Retry` and :class:`DeferredForward` runs the forward once more in an ordinary block, where every such value
is read where it is needed. Values queued with ``queue_value`` reach their callbacks only from a block that ended
without error and without retry.

Inside ``kvbound.capture`` (:func:`graph_staging`) a block that ends does not read: it queues its concatenation on
the device, where the CUDA graph captures it, and hands over the function that reads it
(:meth:`DeferredChecks.stage`), which the captured forward calls after every replay. A patched model's forward is
captured speculative where it would speculate eagerly (compressed K/V): a replay whose retry flag is set raises
:class:`Retry` from that function, and the captured forward runs the model eagerly instead.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["deferred_checks", "DeferredChecks", "Retry", "active"]

_LOCAL = threading.local()


def largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as a float64 scalar: NaN or Inf exactly when ``t`` holds one, for every floating dtype.

    One read pass in ``t``'s own dtype, then the scalar is widened: the largest magnitude is one of ``t``'s values,
    so it cannot overflow, and no copy of ``t`` is made (asking the reduction for float64 directly converts the
    whole tensor first: on the H200 that wrote 4x the input's bytes per check)."""
    return torch.linalg.vector_norm(t, ord=math.inf).to(torch.float64)


def largest_magnitude_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``largest_magnitude`` of each of ``tensors`` (floating), as 0-dim tensors in each tensor's own dtype, in order.

    One multi-tensor call per (device, dtype) (``torch._foreach_norm`` with ``ord=inf``, whose infinity norm
    propagates NaN) instead of a Python-level reduction per tensor: a patched model layer checks six tensors per call
    (q, k, v and the relative keys in bfloat16, the two biases in float32), and on a GPU at batch 1 the host cost of
    those calls is what the layer waits for. On CUDA a list of one dtype whose tensors are each dense in some order
    (the heads-split views of a projection are) takes the multi-tensor kernel; a list of mixed dtypes takes one
    reduction kernel per tensor, hence the grouping. Each norm is taken in its tensor's own dtype (the largest
    magnitude is one of the values, so it cannot overflow). Nothing is joined or widened here: a deferred block
    (:meth:`DeferredChecks.queue`) keeps the parts as they are and joins every call's parts once at its end."""
    if not tensors:
        raise ValueError("largest_magnitudes: expected at least one tensor, got none")
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(index)
    peaks: list[torch.Tensor] = [tensors[0]] * len(tensors)
    for indices in groups.values():
        for index, peak in zip(indices, torch._foreach_norm([tensors[i] for i in indices], math.inf), strict=True):
            peaks[index] = peak
    return peaks


def largest_magnitudes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``largest_magnitude`` of each of ``tensors`` (floating, one device), as one float64 tensor ``[len(tensors)]``:
    :func:`largest_magnitude_parts` stacked, widened to their common dtype, then to float64, which keeps every
    finite value finite."""
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        raise ValueError(f"largest_magnitudes: expected tensors on one device, got {devices}")
    return torch.stack(largest_magnitude_parts(tensors)).to(torch.float64)


# A check of largest magnitudes (name -> float, all finite): an error message, or None when they are acceptable.
Limit = Callable[[dict[str, float]], "str | None"]


class Retry(Exception):
    """A speculative block ended with a retry flag set: what ran inside it must run again (``reasons``: what
    was flagged, one label per flag)."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class DeferredChecks:
    """The checks queued inside one :func:`deferred_checks` block (``len`` = calls queued).

    ``speculative``: whether code inside may queue retry flags (``queue_retry``) instead of reading them.

    Queueing keeps the given tensors as they are (views too): no conversion or concatenation runs per entry. The
    block's end concatenates them once per (device, dtype), widens each concatenation to float64 and reads
    everything of a device in one transfer, so the device work of a block's checks does not grow with the number
    of entries beyond the finite checks' reductions."""

    def __init__(self, *, speculative: bool = False) -> None:
        self.speculative = speculative
        self._parts: list[torch.Tensor] = []
        # (label, names, indices of the names' peak parts, messages, indices of the count parts, magnitude limit)
        self._pending: list[tuple[object, list[str], list[int], list[str], list[int], Limit | None, int]] = []
        self._calls = 0  # attention calls among the pending entries (see queue)
        # The model layer the next attention calls come from (set by kvbound.patch's layers), for their labels.
        self.layer: str | None = None
        self._retries: list[tuple[str, int, Callable[[], None] | None]] = []
        self._values: list[tuple[int, Callable[[list[float]], None]]] = []
        self._streams: dict[tuple, torch.cuda.Stream] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def _keep(self, t: torch.Tensor | tuple[int, int, int]) -> int | tuple[int, int, int]:
        """Keep ``t`` for the block's read; its index among the parts. A ``(index, start, stop)`` triple (elements
        ``start:stop`` of a part kept before, :meth:`keep`) is returned as it is."""
        if isinstance(t, tuple):
            return t
        return self._keep_all([t])[0]

    def keep(self, t: torch.Tensor) -> int:
        """Keep ``t`` (any shape) for the block's read and return its index: ``(index, start, stop)`` then stands
        for elements ``start:stop`` of its flattened values wherever a count, flag or values tensor is taken
        (``queue``'s conditions, ``queue_retry``, ``queue_value``), so that several entries share one part."""
        return self._keep_all([t])[0]

    def _keep_all(self, parts: list[torch.Tensor]) -> list[int]:
        """Keep ``parts`` for the block's read; their indices among the parts. The block's end may read on another
        stream, so the stream that wrote each device's parts is remembered (looked up once per device and call)."""
        device = None
        for t in parts:
            if t.is_cuda and t.device != device:
                device = t.device
                # (stream id, device index, device type): what torch.cuda.current_stream builds its Stream from
                data = torch._C._cuda_getCurrentStream(device.index)
                if data not in self._streams:
                    stream_id, index, kind = data
                    self._streams[data] = torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=kind)
        start = len(self._parts)
        self._parts.extend(parts)
        return list(range(start, len(self._parts)))

    def queue(
        self,
        label: object,
        tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        conditions: Iterable[tuple[str, torch.Tensor]] = (),
        limit: Limit | None = None,
        *,
        call: bool = True,
    ) -> None:
        """Queue the finite check of ``tensors`` (name -> tensor, a dict or ``(name, tensor)`` pairs) for the call
        described by ``label`` (anything; formatted with ``str`` only in an error), and ``conditions``: ``(message,
        count)`` pairs, ``count`` a tensor (any shape, any real dtype; or an ``(index, start, stop)`` triple,
        :meth:`keep`) whose sum must be zero, else ``ValueError(message.format(count=...))``. ``limit``: called with
        the tensors' largest magnitudes (name -> float) once they are known to be finite; a message it returns is
        raised as ``ValueError``. ``call``: the entry is an attention call, numbered among the block's calls in an
        error (``calls``); otherwise (an encoder, a call's output) the error names it by ``label`` alone."""
        pairs = tensors.items() if isinstance(tensors, dict) else tensors
        present = [(name, t) for name, t in pairs if t.numel()]
        names = [name for name, _ in present]
        peaks = self._keep_all(largest_magnitude_parts([t for _, t in present])) if present else []
        messages, counts = [], []
        for message, count in conditions:
            messages.append(message)
            counts.append(self._keep(count))
        if names or messages:
            self._calls += call
            self._pending.append((label, names, peaks, messages, counts, limit, self._calls if call else 0))

    @property
    def calls(self) -> int:
        """How many attention calls this block has queued since it was last staged: the number of the latest."""
        return self._calls

    def queue_retry(
        self, reason: str, flag: torch.Tensor, on_flag: Callable[[], None] | None = None
    ) -> None:
        """Queue ``flag`` (a tensor, any shape and real dtype, or an ``(index, start, stop)`` triple, :meth:`keep`):
        any nonzero element at the block's end means the block's results cannot be returned, and the end raises
        :class:`Retry` (after the NaN/Inf checks, which raise first), having called ``on_flag`` (for example to stop
        speculating where the flag would be raised again). Only in a speculative block."""
        if not self.speculative:
            raise RuntimeError("queue_retry: this deferred-check block is not speculative")
        self._retries.append((reason, self._keep(flag), on_flag))

    def queue_value(self, values: torch.Tensor, callback: Callable[[list[float]], None]) -> None:
        """Read ``values`` (any shape, or an ``(index, start, stop)`` triple, :meth:`keep`; integers up to 2**53 and
        floats come back exact in float64) with the block's checks and hand them to ``callback`` as a flat list of
        floats, once the block has ended without error and without retry."""
        self._values.append((self._keep(values), callback))

    def stage(self, *, repeatable: bool = False) -> Callable[[], None]:
        """Queue on the device everything the block's read needs (one concatenation per (device, dtype), widened to
        float64) and return the function that reads it back in one transfer per device and raises as :meth:`read`
        does. The queued entries move into that function; the block starts empty again.

        ``repeatable``: the function may be called once after each replay of a CUDA graph that captured this
        staging (``kvbound.capture``): it then reads the same device buffers each time, and each call raises or
        hands over what that replay wrote: ``ValueError`` for NaN or Inf, :class:`Retry` for a retry flag (the
        replay's results cannot be used: ``kvbound.capture`` then runs the forward eagerly), else the queued values
        to their callbacks."""
        pending, self._pending = self._pending, []
        calls, self._calls = self._calls, 0
        retries, self._retries = self._retries, []
        queued_values, self._values = self._values, []
        streams, self._streams = self._streams, {}
        parts, self._parts = self._parts, []
        if not (pending or retries or queued_values):
            return _nothing
        for stream in streams.values():
            current = torch.cuda.current_stream(stream.device)
            if current.cuda_stream != stream.cuda_stream:
                current.wait_stream(stream)
        gathered = _gather(parts)
        sizes = [t.numel() for t in parts]
        del parts

        def finish() -> None:
            values = _read_gathered(gathered, sizes)
            for label, names, peaks, messages, counts, limit, number in pending:
                if number:
                    where = f"kvbound.attention call {number} of {calls} in this deferred-check block: {label}"
                else:
                    where = f"{label}, in this deferred-check block"
                for name, part in zip(names, peaks, strict=True):
                    (value,) = values[part]
                    if not math.isfinite(value):
                        raise ValueError(
                            f"{name}: expected finite values, found {'NaN' if math.isnan(value) else 'Inf'} ({where})"
                        )
                if limit is not None:
                    message = limit({name: values[part][0] for name, part in zip(names, peaks, strict=True)})
                    if message is not None:
                        raise ValueError(f"{message} ({where})")
                for message, part in zip(messages, counts, strict=True):
                    count = sum(_part(values, part))
                    if count != 0:
                        shown = round(count) if math.isfinite(count) else count
                        raise ValueError(f"{message.format(count=shown)} ({where})")
            flagged = [
                (reason, on_flag) for reason, part, on_flag in retries if any(v != 0 for v in _part(values, part))
            ]
            if flagged:
                for _, on_flag in flagged:
                    if on_flag is not None:
                        on_flag()
                raise Retry([reason for reason, _ in flagged])
            for part, callback in queued_values:
                callback(_part(values, part))

        return finish

    def read(self) -> None:
        """One host read of every queued check, flag and value; raise ``ValueError`` for the first call with NaN
        or Inf, then :class:`Retry` if a retry flag is set; else hand the values to their callbacks."""
        self.stage()()


def _part(values: list[list[float]], part: int | tuple[int, int, int]) -> list[float]:
    """The values read for ``part``: a kept part's index, or ``(index, start, stop)`` (``DeferredChecks.keep``)."""
    if isinstance(part, tuple):
        index, start, stop = part
        return values[index][start:stop]
    return values[part]


def _nothing() -> None:
    return None


def _gather(parts: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """``parts`` as one float64 tensor per device (one concatenation per (device, dtype), widened, then joined),
    each with the indices of the parts it holds, in order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, t in enumerate(parts):
        groups.setdefault((t.device, t.dtype), []).append(index)
    by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for (device, _), indices in groups.items():
        flats = [parts[i].reshape(-1) for i in indices]
        flat = torch.cat(flats) if len(flats) > 1 else flats[0]
        by_device.setdefault(device, []).append((indices, flat.to(torch.float64)))
    gathered = []
    for items in by_device.values():
        flats = [flat for _, flat in items]
        joined = torch.cat(flats) if len(flats) > 1 else flats[0]
        gathered.append((joined, [i for indices, _ in items for i in indices]))
    return gathered


def _read_gathered(gathered: list[tuple[torch.Tensor, list[int]]], sizes: list[int]) -> list[list[float]]:
    """Every part's values, flat, in the order of ``sizes`` (the parts' element counts): one read per device."""
    read: list[list[float]] = [[] for _ in sizes]
    for joined, order in gathered:
        values = joined.tolist()
        at = 0
        for i in order:
            read[i] = values[at : at + sizes[i]]
            at += sizes[i]
    return read


def _stack() -> list[DeferredChecks]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def active() -> DeferredChecks | None:
    """The innermost open block of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def _open(speculative: bool = False) -> DeferredChecks:
    scope = DeferredChecks(speculative=speculative)
    _stack().append(scope)
    return scope


def _close(scope: DeferredChecks, *, read: bool) -> None:
    stack = _stack()
    if scope in stack:
        del stack[stack.index(scope) :]
    if read:
        staged = getattr(_LOCAL, "graph", None)
        if staged is not None:  # inside kvbound.capture: read after each replay of the graph
            staged.append(scope.stage(repeatable=True))
        else:
            scope.read()


@contextmanager
def graph_staging() -> Iterator[list[Callable[[], None]]]:
    """While open (``kvbound.capture`` around a CUDA graph capture), blocks that close stage their read
    (:meth:`DeferredChecks.stage`, repeatable) into the yielded list instead of reading: the graph captures the
    device side, and each function of the list reads it back after a replay."""
    if getattr(_LOCAL, "graph", None) is not None:
        raise RuntimeError("kvbound.capture: already capturing a forward in this thread")
    _LOCAL.graph = staged = []
    try:
        yield staged
    finally:
        _LOCAL.graph = None


def _stream_capturing() -> bool:
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Defer the NaN/Inf checks of ``kvbound.attention`` calls to the end of the block (one host read).

    Dense calls defer every check. Compressed calls defer the checks of q, the bias and the relative positions; the
    compressed K/V themselves are checked at the first call that reads them (the kernel variant depends on their
    block modes) and the result is kept on the object until a stored tensor changes; K/V fresh from the Triton
    encoder carry it already (outside ``torch.inference_mode``, whose tensors have no version counter to keep it by;
    the speculative encoder's always), so such calls need no host read at all.

    ``kvbound.patch`` opens one such block around each forward of the model it patched. When the block is left
    by an exception, the queued checks are dropped and the exception propagates unchanged."""
    with _block(speculative=False) as scope:
        yield scope


@contextmanager
def _block(*, speculative: bool) -> Iterator[DeferredChecks]:
    scope = _open(speculative)
    try:
        yield scope
    except BaseException:
        _close(scope, read=False)
        raise
    _close(scope, read=True)


class DeferredForward:
    """A module's ``forward`` run inside :func:`deferred_checks` (placed on the instance by ``kvbound.patch``).

    The block is a ``with`` around the call, so an exception of any kind raised by the forward (also
    ``KeyboardInterrupt``) closes it and propagates unchanged, and a forward called while the caller handles another
    exception still reads its checks. Under ``torch.compile`` the forward runs as it is (the compiled attention
    calls check their inputs at the call).

    ``before``: called before each eager forward (it may raise: ``kvbound.patch`` refuses a training-mode forward
    there, before any layer updates its state). ``speculate``: called before each forward; when it returns True the
    block is speculative (see the module docstring), and a :class:`Retry` at its end runs the forward again in an
    ordinary block, after calling ``on_retry`` with the exception. The forward must then be free of side effects
    that a second run would repeat (``kvbound.patch`` speculates only when no module of the model with parameters,
    buffers or dropout is in training mode)."""

    __slots__ = ("wrapped", "speculate", "on_retry", "before", "__weakref__")

    def __init__(
        self,
        wrapped,
        speculate: Callable[[], bool] | None = None,
        on_retry: Callable[[Retry], None] | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        self.wrapped = wrapped
        self.speculate = speculate
        self.on_retry = on_retry
        self.before = before

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.wrapped(*args, **kwargs)
        if self.before is not None:
            self.before()  # what would refuse the forward part-way, checked before any layer runs
        if _stream_capturing():
            if getattr(_LOCAL, "graph", None) is None:
                raise RuntimeError(
                    "a kvbound-patched forward is being captured in a CUDA graph outside kvbound.capture: its NaN/Inf "
                    "checks are read on the host after the forward, which a graph cannot do; use "
                    "kvbound.capture(model, *inputs), which reads them after each replay"
                )
            # Nothing is read during a capture: the block's read (its retry flags too) runs after each replay.
            with _block(speculative=self.speculate is not None and self.speculate()):
                return self.wrapped(*args, **kwargs)
        if self.speculate is not None and self.speculate():
            try:
                with _block(speculative=True):
                    return self.wrapped(*args, **kwargs)
            except Retry as retry:
                if self.on_retry is not None:
                    self.on_retry(retry)
        with _block(speculative=False):
            return self.wrapped(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<forward inside kvbound.deferred_checks: {self.wrapped!r}>"

    # Copying would keep calling the original module's bound forward; refuse as the patched methods do.
    def __deepcopy__(self, memo):
        raise TypeError(
            "a kvbound-patched model cannot be copied or pickled; call handle.undo() first (state_dict() is "
            "unaffected)"
        )

    def __reduce_ex__(self, protocol):
        self.__deepcopy__(None)
