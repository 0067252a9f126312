"""What a user could assemble from stock fused attention for the ports' relative-position layers (Enformer, Borzoi),
as whole-forward variants of ``kvbound bench --suite models --alternatives``.

``sdpa-built-bias``   each layer builds its position term as a ``[B, H, N, N]`` bias (one einsum over the relative
                      keys and the ports' relative shift as a strided view, made contiguous) and runs
                      ``torch.nn.functional.scaled_dot_product_attention`` with it as the mask;
``flex-built-table``  each layer builds the ``[B, H, N, 2N - 1]`` table of position logits and runs FlexAttention
                      (compiled on CUDA) with a ``score_mod`` that reads it at ``N - 1 + j - i``.

Both are the attention cores of ``kvbound bench --suite relative`` (``kvbound/bench/relative.py``) inside the ports'
own layer: the same projections (``to_q``, ``to_k``, ``to_v``, ``to_rel_k``, ``to_out``), the positional features
computed once per length (as ``kvbound.patch`` does; the ports recompute them in every layer), content bias ``u``
and position bias ``v`` cast to the projections' dtype before they are added to the scaled queries (the ports add
them in float32 and round once; kvbound reads them in float32). The layers' ``forward`` is replaced on the
instances and restored on exit. FlexAttention's compile raises dynamo's recompile limits for the process
(``kvbound.bench.providers.raise_recompile_limits``). AlphaGenome's layers (pair bias, soft-cap, one shared K/V
head) have no such variant here: SDPA cannot apply the soft-cap, and the relative suite has no FlexAttention form of
them.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["ALTERNATIVES", "alternative_core", "supports_alternatives"]

ALTERNATIVES = ("sdpa-built-bias", "flex-built-table")


def supports_alternatives(module: nn.Module) -> bool:
    """Whether ``module`` is a relative-position layer of the ports (Enformer's or Borzoi's ``Attention``)."""
    return all(hasattr(module, name) for name in ("to_rel_k", "rel_content_bias", "rel_pos_bias", "to_q"))


class _Features:
    """Positional features per length, computed once (``kvbound.models._ports``' feature functions ask this)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def _positional_features(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


def _core(name: str, device: torch.device) -> Callable[[dict], torch.Tensor]:
    from kvbound.bench import relative

    if name == "sdpa-built-bias":
        return relative._sdpa_built_bias
    flex = relative._flex_function(device)
    chosen: dict[tuple, Callable[[dict], torch.Tensor]] = {}

    def run(x: dict) -> torch.Tensor:
        key = (tuple(x["q"].shape), tuple(x["v"].shape), x["q"].dtype)
        if key not in chosen:  # the first kernel_options that compile at this shape (dv = 192 needs smaller tiles)
            chosen[key] = relative._flex_that_compiles(flex, x, device)[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return chosen[key](x)

    return run


def _forward(module: nn.Module, x: torch.Tensor, *, core: Callable[[dict], torch.Tensor], features_fn,
             features: _Features) -> torch.Tensor:  # fmt: skip
    b, n, _ = x.shape
    h = module.heads
    q, k, v = (layer(x).reshape(b, n, h, -1).transpose(1, 2) for layer in (module.to_q, module.to_k, module.to_v))
    positions = module.pos_dropout(features_fn(module, features, n, x.device))
    relative_keys = module.to_rel_k(positions).reshape(2 * n - 1, h, -1).transpose(0, 1)
    dk = q.shape[-1]
    inputs = {"q": q, "k": k, "v": v, "relative_keys": relative_keys.to(q.dtype), "scale": module.scale,
              "u": module.rel_content_bias.reshape(h, dk).to(q.dtype),
              "w": module.rel_pos_bias.reshape(h, dk).to(q.dtype)}  # fmt: skip
    out = core(inputs)
    return module.to_out(out.to(q.dtype).transpose(1, 2).reshape(b, n, -1))


@contextlib.contextmanager
def alternative_core(name: str, modules: list[nn.Module], device: torch.device) -> Iterator[None]:
    """``modules`` (the ports' relative-position layers) run ``name``'s attention core until exit."""
    from kvbound.models import _ports

    if name not in ALTERNATIVES:
        raise ValueError(f"alternative: expected one of {ALTERNATIVES}, got {name!r}")
    unsupported = [type(m).__name__ for m in modules if not supports_alternatives(m)]
    if unsupported or not modules:
        raise ValueError(f"alternative {name}: the ports' relative-position layers only, got {unsupported or 'none'}")
    core, features = _core(name, device), _Features()
    saved = []
    try:
        for module in modules:
            port = sys.modules[type(module).__module__]
            features_fn = _ports._borzoi_features if "borzoi" in port.__name__ else _ports._enformer_features
            saved.append((module, module.__dict__.get("forward")))
            module.forward = types.MethodType(
                lambda self, x, fn=features_fn: _forward(self, x, core=core, features_fn=fn, features=features), module
            )
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                del module.__dict__["forward"]
            else:
                module.forward = previous
