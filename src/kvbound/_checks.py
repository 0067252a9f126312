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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["deferred_checks", "DeferredChecks", "active"]

_LOCAL = threading.local()


def largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """``max |t|`` as a float64 scalar: NaN or Inf exactly when ``t`` holds one, for every floating dtype.

    One read pass in ``t``'s own dtype, then the scalar is widened: the largest magnitude is one of ``t``'s values,
    so it cannot overflow, and no copy of ``t`` is made (asking the reduction for float64 directly converts the
    whole tensor first: on the H200 that wrote 4x the input's bytes per check)."""
    return torch.linalg.vector_norm(t, ord=math.inf).to(torch.float64)


def largest_magnitudes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``largest_magnitude`` of each of ``tensors`` (floating, one device), as one float64 tensor ``[len(tensors)]``.

    One multi-tensor call (``torch._foreach_norm`` with ``ord=inf``, whose infinity norm propagates NaN) and one
    stack, instead of a Python-level reduction and cast per tensor: a patched model layer checks six tensors per
    call, and on a GPU at batch 1 the host cost of those calls is what the layer waits for. What it saves is host
    dispatch: on the H200 (torch 2.11) the infinity norm still ran one reduction kernel per tensor. Each norm is
    taken in its tensor's own dtype (the largest magnitude is one of the values, so it cannot overflow); the stack
    widens them to their common dtype, then to float64, which keeps every finite value finite."""
    if not tensors:
        raise ValueError("largest_magnitudes: expected at least one tensor, got none")
    if len({t.device for t in tensors}) == 1:
        peaks = torch._foreach_norm(tensors, math.inf)
    else:
        peaks = [torch.linalg.vector_norm(t, ord=math.inf) for t in tensors]
    return torch.stack(peaks).to(torch.float64)


class DeferredChecks:
    """The checks queued inside one :func:`deferred_checks` block (``len`` = calls queued)."""

    def __init__(self) -> None:
        self._pending: list[tuple[object, list[str], torch.Tensor, list[str]]] = []
        self._streams: dict[tuple, torch.cuda.Stream] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def queue(
        self,
        label: object,
        tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        conditions: Iterable[tuple[str, torch.Tensor]] = (),
    ) -> None:
        """Queue the finite check of ``tensors`` (name -> tensor, a dict or ``(name, tensor)`` pairs) for the call
        described by ``label`` (anything; formatted with ``str`` only in an error), and ``conditions``: ``(message,
        count)`` pairs, a float64 scalar that must be zero, else ``ValueError(message.format(count=...))``."""
        pairs = tensors.items() if isinstance(tensors, dict) else tensors
        present = [(name, t) for name, t in pairs if t.numel()]
        names = [name for name, _ in present]
        peaks = [largest_magnitudes([t for _, t in present])] if present else []
        messages = []
        for message, count in conditions:
            messages.append(message)
            peaks.append(count.reshape(1).to(torch.float64))
        if peaks:
            stacked = torch.cat(peaks) if len(peaks) > 1 else peaks[0]
            self._pending.append((label, names, stacked, messages))
            if stacked.is_cuda:  # the block's end may read on another stream: remember which one wrote
                stream = torch.cuda.current_stream(stacked.device)
                self._streams.setdefault((stacked.device, stream.cuda_stream), stream)

    def read(self) -> None:
        """One host read of every queued check; raise ``ValueError`` for the first call with NaN or Inf."""
        pending, self._pending = self._pending, []
        streams, self._streams = self._streams, {}
        if not pending:
            return
        for (device, _), stream in streams.items():
            current = torch.cuda.current_stream(device)
            if current.cuda_stream != stream.cuda_stream:
                current.wait_stream(stream)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, peaks, _ in pending:
            by_device.setdefault(peaks.device, []).append(peaks)
        values = {device: iter(torch.cat(parts).tolist()) for device, parts in by_device.items()}
        for index, (label, names, peaks, messages) in enumerate(pending):
            row = [next(values[peaks.device]) for _ in names]
            counts = [next(values[peaks.device]) for _ in messages]
            where = f"kvbound.attention call {index + 1} of {len(pending)} in this deferred-check block: {label}"
            for name, value in zip(names, row, strict=True):
                if not math.isfinite(value):
                    raise ValueError(
                        f"{name}: expected finite values, found {'NaN' if math.isnan(value) else 'Inf'} ({where})"
                    )
            for message, count in zip(messages, counts, strict=True):
                if count != 0:
                    raise ValueError(f"{message.format(count=round(count))} ({where})")


def _stack() -> list[DeferredChecks]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def active() -> DeferredChecks | None:
    """The innermost open block of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def _open() -> DeferredChecks:
    scope = DeferredChecks()
    _stack().append(scope)
    return scope


def _close(scope: DeferredChecks, *, read: bool) -> None:
    stack = _stack()
    if scope in stack:
        del stack[stack.index(scope) :]
    if read:
        scope.read()


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Defer the NaN/Inf checks of ``kvbound.attention`` calls to the end of the block (one host read).

    Dense calls defer every check. Compressed calls defer the checks of q, the bias and the relative positions; the
    compressed K/V themselves are checked at the first call that reads them (the kernel variant depends on their
    block modes) and the result is kept on the object until a stored tensor changes; K/V fresh from the Triton
    encoder carry it already, so such calls need no host read at all.

    ``kvbound.patch`` opens one such block around each forward of the model it patched. When the block is left
    by an exception, the queued checks are dropped and the exception propagates unchanged."""
    scope = _open()
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
    calls check their inputs at the call)."""

    __slots__ = ("wrapped", "__weakref__")

    def __init__(self, wrapped) -> None:
        self.wrapped = wrapped

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.wrapped(*args, **kwargs)
        with deferred_checks():
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
