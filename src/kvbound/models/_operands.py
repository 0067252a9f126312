"""Parameters in the form the patched forwards multiply them, made once per handle and reused while unchanged.

Under autocast every ``nn.Linear`` call casts its float32 weight (and bias) to the autocast dtype, and a patched
Enformer/Borzoi layer projects its positional features to the same relative keys in every forward. On a GPU at
small batches these launches are what a forward waits for (the host path, ``kvbound/models/README.md``). A
:class:`OperandCache` keeps each such tensor after its first use and hands it back for as long as its sources are
unchanged, which it tells from each source's storage, offset, shape, strides and version counter (every in-place
write through the tensor, ``load_state_dict``, ``nn.init`` and the optimizers included, raises the version). Each
entry keeps its sources' storages alive, so that a storage that was replaced (``model.to(...)``, ``param.data =
...``) cannot be followed by a new one at the same address. A write through ``param.data``, which PyTorch's
version counter does not see, is not seen here either: call ``handle.clear_operands()`` after one. A value made
again keeps its memory where its shape and dtype allow (always, for a weight changed in place), so that a CUDA graph
that reads it (``kvbound.capture``, which refreshes the entries it reads before each replay) reads the new value.

Not cached (made in each call instead): sources that are inference tensors (no version counter) or that autograd
would differentiate, since the cached tensor would carry no graph. ``KVBOUND_OPERAND_CACHE=0`` turns the cache off
(read at each call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbound.models._ports import _switch

__all__ = ["OperandCache", "operand_cache_enabled"]


def operand_cache_enabled() -> bool:
    """``KVBOUND_OPERAND_CACHE``: on by default (unset, empty, ``1``, ``true``, ``on``, ``yes``), off with ``0``
    (``false``, ``off``, ``no``); other values raise. Read at each call."""
    return _switch("KVBOUND_OPERAND_CACHE")


def _stamp(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


def cacheable(t: torch.Tensor) -> bool:
    """Whether a tensor derived from ``t`` may be kept: ``t`` has a version counter (not an inference tensor) and
    autograd does not need the derivation's graph."""
    if t.is_inference() or t.is_meta:
        return False
    return not (torch.is_grad_enabled() and t.requires_grad)


def _made(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return make()


@dataclass
class _Entry:
    sources: tuple[torch.Tensor, ...]
    make: Callable[[], torch.Tensor]
    stamps: tuple
    storages: tuple  # the sources' storages, kept alive (see the module docstring)
    value: torch.Tensor

    def refresh(self) -> bool:
        """Make the value again if a source changed; in place when it keeps its shape and dtype, so that whatever
        holds the value (a CUDA graph that reads it) reads the new one. Whether it was made again."""
        stamps = tuple(_stamp(s) for s in self.sources)
        if stamps == self.stamps:
            return False
        value = _made(self.make)
        if value.shape == self.value.shape and value.dtype == self.value.dtype and value.device == self.value.device:
            self.value.copy_(value)
        else:
            self.value = value
        self.stamps, self.storages = stamps, tuple(s.untyped_storage() for s in self.sources)
        return True


class OperandCache:
    """Tensors derived from parameters, by key; ``len`` = entries held, ``bytes`` = their size, ``made`` = entries
    made so far (a remade entry counts again)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self.made = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(e.value.numel() * e.value.element_size() for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def entries(self) -> list[_Entry]:
        """The entries held now (``kvbound.capture`` keeps those its graph reads and refreshes them per replay)."""
        return list(self._entries.values())

    def get(self, key: tuple, sources: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, or what it returned for ``key`` before, made again (in place where it keeps its shape and
        dtype) if a source changed since. ``make`` must depend on nothing but ``sources`` and ``key`` (enter any
        autocast state it needs inside it). Made without autograd and outside inference mode, so that the value can
        be read by later forwards under either."""
        if not operand_cache_enabled() or not all(cacheable(s) for s in sources):
            return make()
        entry = self._entries.get(key)
        if entry is not None and len(entry.sources) == len(sources) and all(
            a is b for a, b in zip(entry.sources, sources, strict=True)
        ):
            entry.make = make  # this call's (the same function of the same sources, by the key)
            self.made += entry.refresh()
            return entry.value
        stamps = tuple(_stamp(s) for s in sources)
        value = _made(make)
        self._entries[key] = _Entry(sources, make, stamps, tuple(s.untyped_storage() for s in sources), value)
        self.made += 1
        return value

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, kept while ``t`` is unchanged (``t`` itself when it has that dtype)."""
        if t.dtype == dtype:
            return t
        return self.get(("cast", id(t), dtype), (t,), lambda: t.to(dtype))
