"""What a user could assemble from stock fused attention for the ports' attention layers, as whole-forward variants
of ``kvbound bench --suite models --alternatives``.

Enformer and Borzoi (relative positions):

``sdpa-built-bias``   each layer builds its position term as a ``[B, H, N, N]`` bias (one einsum over the relative
                      keys and the ports' relative shift as a strided view, made contiguous) and runs
                      ``torch.nn.functional.scaled_dot_product_attention`` with it as the mask;
``flex-built-table``  each layer builds the ``[B, H, N, 2N - 1]`` table of position logits and runs FlexAttention
                      (compiled on CUDA) with a ``score_mod`` that reads it at ``N - 1 + j - i``; a batch whose
                      table would reach 2**31 elements runs in chunks of batches
                      (``kvbound.bench.relative.FLEX_TABLE_ELEMENTS``).

Both are the attention cores of ``kvbound bench --suite relative`` (``kvbound/bench/relative.py``) inside the ports'
own layer: the same projections (``to_q``, ``to_k``, ``to_v``, ``to_rel_k``, ``to_out``), the positional features
computed once per length (as ``kvbound.patch`` does; the ports recompute them in every layer), content bias ``u``
and position bias ``v`` cast to the projections' dtype before they are added to the scaled queries (the ports add
them in float32 and round once; kvbound reads them in float32).

AlphaGenome (pair bias over 16 x 16 tiles, soft-cap 5, 8 query heads on one K/V head, dk 128, dv 192):

``flex-tile-bias``    FlexAttention (compiled on CUDA) with ``enable_gqa`` and a ``score_mod`` that adds the pair
                      bias from its compact ``[B, 8, S/16, S/16]`` form (``tiles[b, h, i // 16, j // 16]``) and
                      applies ``5 tanh(x / 5)``; the tower's blocks hand the ``MHABlock`` that compact bias (its
                      ``AttentionBiasBlock`` without the 16 x 16 repeat), so no ``[B, 8, S, S]`` tensor is built.
                      Everything else is the port's own: ``RMSBatchNorm``, the projections, the ``LayerNorm`` of q,
                      k and v, ``apply_rope``, ``linear_embedding`` and ``final_norm``; q, k and v enter in the dtype
                      the port's products run in (the autocast dtype under autocast). SDPA has no form of this
                      layer: it cannot apply the soft-cap after the bias.

The layers' (and AlphaGenome's towers') ``forward`` is replaced on the instances and restored on exit.
FlexAttention's compile raises dynamo's recompile limits for the process
(``kvbound.bench.providers.raise_recompile_limits``); the first ``kernel_options`` that compile at a shape are kept.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = [
    "ALTERNATIVES",
    "RELATIVE_ALTERNATIVES",
    "TILE_BIAS_ALTERNATIVES",
    "alternative_core",
    "supported_alternatives",
    "supports_alternatives",
]

RELATIVE_ALTERNATIVES = ("sdpa-built-bias", "flex-built-table")
TILE_BIAS_ALTERNATIVES = ("flex-tile-bias",)
ALTERNATIVES = RELATIVE_ALTERNATIVES + TILE_BIAS_ALTERNATIVES

_TILE_BIAS_REQUIRED = ("norm", "q_proj", "k_proj", "v_proj", "norm_q", "norm_k", "norm_v", "linear_embedding",
                       "final_norm")  # fmt: skip


def supports_alternatives(module: nn.Module) -> bool:
    """Whether ``module`` is a relative-position layer of the ports (Enformer's or Borzoi's ``Attention``)."""
    return all(hasattr(module, name) for name in ("to_rel_k", "rel_content_bias", "rel_pos_bias", "to_q"))


def _is_tile_bias_layer(module: nn.Module) -> bool:
    """Whether ``module`` is AlphaGenome's ``MHABlock``."""
    return all(hasattr(module, name) for name in _TILE_BIAS_REQUIRED)


def supported_alternatives(modules: list[nn.Module]) -> tuple[str, ...]:
    """The alternatives that can replace the attention core of every one of ``modules``."""
    if modules and all(supports_alternatives(m) for m in modules):
        return RELATIVE_ALTERNATIVES
    if modules and all(_is_tile_bias_layer(m) for m in modules):
        return TILE_BIAS_ALTERNATIVES
    return ()


class _Features:
    """Positional features per length, computed once (``kvbound.models._ports``' feature functions ask this)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def _positional_features(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]


def _flex_core(device: torch.device, build=None) -> Callable[[dict], torch.Tensor]:
    """Compiled FlexAttention (eager on the CPU) with the first ``kernel_options`` that compile per shape."""
    from kvbound.bench import relative

    flex = relative._flex_function(device)
    chosen: dict[tuple, Callable[[dict], torch.Tensor]] = {}

    def run(x: dict) -> torch.Tensor:
        key = (tuple(x["q"].shape), tuple(x["k"].shape), tuple(x["v"].shape), x["q"].dtype)
        if key not in chosen:  # the first kernel_options that compile at this shape (dv = 192 needs smaller tiles)
            chosen[key] = relative._flex_that_compiles(flex, x, device, build)[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return chosen[key](x)

    return run


def _flex_tile_bias(flex: Callable, kernel_options: dict | None = None) -> Callable[[dict], torch.Tensor]:
    """FlexAttention over AlphaGenome's layer: ``x`` holds ``q`` ``[B, Hq, S, Dk]``, ``k`` ``[B, 1, S, Dk]``, ``v``
    ``[B, 1, S, Dv]``, the compact bias ``tiles`` ``[B, Hq, S / tile, S / tile]``, ``tile``, ``scale`` and
    ``softcap``."""

    def run(x: dict) -> torch.Tensor:
        tiles, tile, cap = x["tiles"], x["tile"], x["softcap"]

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh((score + tiles[b, h, q_idx // tile, kv_idx // tile]) / cap)

        return flex(x["q"], x["k"], x["v"], score_mod=score_mod, scale=x["scale"], enable_gqa=True,
                    kernel_options=kernel_options)  # fmt: skip

    return run


def _core(name: str, device: torch.device) -> Callable[[dict], torch.Tensor]:
    from kvbound.bench import relative

    if name == "sdpa-built-bias":
        return relative._sdpa_built_bias
    if name == "flex-tile-bias":
        return _flex_core(device, _flex_tile_bias)
    return _flex_core(device)


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


def _tile_bias_forward(module: nn.Module, x: torch.Tensor, tiles: torch.Tensor, compute_dtype=None, *,
                       core: Callable[[dict], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """``MHABlock.forward`` of alphagenome_pytorch 0.3.1 with its logits, bias, soft-cap, softmax and value product
    replaced by ``core``; ``tiles`` is the compact bias ``[B, Hq, S / 16, S / 16]``."""
    from kvbound.models import _ports

    port = sys.modules[type(module).__module__]
    b, s, _ = x.shape
    compute_dtype = x.dtype if compute_dtype is None else compute_dtype
    h = module.norm(x.to(compute_dtype))
    dk, dv = module.norm_q.normalized_shape[0], module.norm_v.normalized_shape[0]
    q = module.norm_q(module.q_proj(h).view(b, s, -1, dk))
    k = module.norm_k(module.k_proj(h).view(b, s, -1, dk))
    v = module.norm_v(module.v_proj(h).view(b, s, -1, dv))
    q = port.apply_rope(q, inplace=True)
    k = port.apply_rope(k, inplace=True)
    dtype = _ports._matmul_dtype(q)  # the port's products run on operands of this dtype (autocast's, or q's own)
    q, k, v = (t.permute(0, 2, 1, 3).to(dtype) for t in (q, k, v))
    expected = (b, q.shape[1], -(-s // _ports.ALPHAGENOME_TILE), -(-s // _ports.ALPHAGENOME_TILE))
    if tuple(tiles.shape) != expected:
        raise ValueError(f"tiles: expected the compact pair bias {expected}, got {tuple(tiles.shape)}")
    y = core({"q": q, "k": k, "v": v, "tiles": tiles, "tile": _ports.ALPHAGENOME_TILE, "scale": dk**-0.5,
              "softcap": _ports.ALPHAGENOME_SOFTCAP})  # fmt: skip
    y = y.to(compute_dtype).permute(0, 2, 1, 3).reshape(b, s, -1)
    return module.final_norm(module.linear_embedding(y))


def _tile_bias_block(tower: nn.Module, block, x, pair_x, compute_dtype):
    """``TransformerTower._forward_block``, handing the ``MHABlock`` its bias at tile resolution
    (``AttentionBiasBlock`` without the 16 x 16 repeat)."""
    from kvbound.models._ports import alphagenome_block, alphagenome_tile_values

    return alphagenome_block(block, x, pair_x, compute_dtype,
                             lambda pair: alphagenome_tile_values(block["attn_bias"], pair))  # fmt: skip


def _towers_of(model: nn.Module | None, modules: list[nn.Module]) -> list[nn.Module]:
    """The AlphaGenome towers (modules with ``_forward_block`` and ``blocks``) of ``model`` that hold ``modules``."""
    if model is None:
        raise ValueError("alternative flex-tile-bias: model is needed (the TransformerTower that holds the MHABlocks)")
    wanted = {id(m) for m in modules}
    held: set[int] = set()
    towers = []
    for tower in model.modules():
        if hasattr(type(tower), "_forward_block") and hasattr(tower, "blocks"):
            mine = {id(block["mha"]) for block in tower.blocks if "mha" in block} & wanted
            if mine:
                towers.append(tower)
                held |= mine
    missing = len(wanted - held)
    if missing:
        raise ValueError(f"alternative flex-tile-bias: {missing} of {len(modules)} MHABlocks are in no "
                         f"TransformerTower of the model")  # fmt: skip
    return towers


def _replace_forward(module: nn.Module, attribute: str, fn: Callable, saved: list) -> None:
    saved.append((module, attribute, module.__dict__.get(attribute)))
    setattr(module, attribute, types.MethodType(fn, module))


@contextlib.contextmanager
def alternative_core(name: str, modules: list[nn.Module], device: torch.device,
                     model: nn.Module | None = None) -> Iterator[None]:  # fmt: skip
    """``modules`` (the ports' attention layers) run ``name``'s attention core until exit. ``flex-tile-bias``
    (AlphaGenome's ``MHABlock``) also replaces ``_forward_block`` of the towers of ``model`` that hold them."""
    from kvbound.models import _ports

    if name not in ALTERNATIVES:
        raise ValueError(f"alternative: expected one of {ALTERNATIVES}, got {name!r}")
    relative = name in RELATIVE_ALTERNATIVES
    supported = supports_alternatives if relative else _is_tile_bias_layer
    unsupported = [type(m).__name__ for m in modules if not supported(m)]
    if unsupported or not modules:
        kind = "the ports' relative-position layers" if relative else "AlphaGenome's MHABlock layers"
        raise ValueError(f"alternative {name}: {kind} only, got {unsupported or 'none'}")
    towers = [] if relative else _towers_of(model, modules)
    core, features = _core(name, device), _Features()
    saved: list = []
    try:
        for module in modules:
            if relative:
                port = sys.modules[type(module).__module__]
                fn = _ports._borzoi_features if "borzoi" in port.__name__ else _ports._enformer_features
                _replace_forward(module, "forward", lambda self, x, fn=fn: _forward(
                    self, x, core=core, features_fn=fn, features=features), saved)  # fmt: skip
            else:
                _replace_forward(module, "forward", lambda self, x, tiles, compute_dtype=None: _tile_bias_forward(
                    self, x, tiles, compute_dtype, core=core), saved)  # fmt: skip
        for tower in towers:
            _replace_forward(tower, "_forward_block", _tile_bias_block, saved)
        yield
    finally:
        for module, attribute, previous in reversed(saved):
            if previous is None:
                del module.__dict__[attribute]
            else:
                setattr(module, attribute, previous)
