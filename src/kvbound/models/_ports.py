"""The three ports' attention modules: how to recognise them and their memory-lean forwards.

A port's classes are looked up in ``sys.modules`` only: a loaded model instance implies its defining module
is imported, and a port that is not installed (or not imported) simply contributes no classes. Modules are
matched by exact class; a subclass may have changed ``forward`` and is reported as skipped, not patched.

Each lean forward repeats its port's forward step for step, calling the module's own submodules (and the
port's own positional-feature and RoPE functions), and replaces only the attention core by the chunked
:func:`~kvbound.models.relative.relative_position_attention` /
:func:`~kvbound.models.tile_bias.tile_bias_attention`, with K and V optionally compressed in between.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvbound.models.relative import relative_position_attention
from kvbound.models.tile_bias import TileBias, tile_bias_attention

__all__ = ["Port", "PORTS", "UNSUPPORTED", "lookup_class", "port_class", "ALPHAGENOME_TILE", "ALPHAGENOME_SOFTCAP"]

# Constants of alphagenome_pytorch 0.3.1: AttentionBiasBlock repeats its bias 16 x 16, MHABlock soft-caps at 5.
ALPHAGENOME_TILE = 16
ALPHAGENOME_SOFTCAP = 5.0
# borzoi_pytorch 0.5.1: the central-mask widths are fixed by the training length, not by N.
BORZOI_TRAIN_LENGTH = 4096


@dataclass(frozen=True)
class Port:
    """One patchable class of one port."""

    kind: str  # "enformer", "borzoi", "alphagenome"
    module_name: str
    class_name: str
    role: str  # "attention" (its K/V are compressed) or "bias" (feeds a compact bias to patched attention)
    method: str  # the instance attribute replaced
    required: tuple[str, ...]  # attributes the lean forward reads; a module without them is skipped
    forward: Callable  # forward(module, record, handle, *args, **kwargs)
    head_dims: Callable[[nn.Module], tuple[int, int]] | None = None


def lookup_class(module_name: str, class_name: str) -> type | None:
    """The class if its module is imported, else None (nothing is imported here)."""
    module = sys.modules.get(module_name)
    cls = getattr(module, class_name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def port_class(port: Port) -> type | None:
    return lookup_class(port.module_name, port.class_name)


def _check_inference(module: nn.Module, name: str) -> None:
    if not module.training:
        return
    for attr in ("attn_dropout", "pos_dropout"):
        p = getattr(getattr(module, attr, None), "p", 0.0)
        if p > 0:
            raise RuntimeError(
                f"{name}: kvbound's patched forward implements inference only, but this module is in training "
                f"mode with {attr}.p={p}; call model.eval() or handle.undo() first"
            )


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, N, H * D] -> [B, H, N, D]`` (a view)."""
    b, n, _ = t.shape
    return t.reshape(b, n, heads, -1).transpose(1, 2)


def _relative_forward(module, record, handle, x, relative_keys_fn) -> torch.Tensor:
    _check_inference(module, record.name)
    b, n, _ = x.shape
    h = module.heads
    # Under autocast each of the three projections would cast x to the autocast dtype; one cast, the same values.
    x_operand = x.to(_matmul_dtype(x))
    q, k, v = (_split_heads(_linear(layer, x_operand, handle), h) for layer in (module.to_q, module.to_k, module.to_v))
    features = relative_keys_fn(module, handle, n, x.device)
    handle._check_eager(record, q, k, v)
    q = handle._guard_gradients(record, q, k, v)
    k, v = handle._prepare_kv(record, k, v)
    runs = handle._relative_runs(features) if relative_runs_enabled() else None
    if runs is not None:
        # One relative key per run of equal features (Borzoi): the same Linear on the run's first row, and no
        # [2N - 1] keys to compute or check against the runs.
        features = handle._run_features(features, runs)
    relative_keys = _relative_keys(module, handle, features, x.device)
    out = relative_position_attention(
        q,
        k,
        v,
        relative_keys,
        module.rel_content_bias,
        module.rel_pos_bias,
        scale=module.scale,
        query_chunk=handle.query_chunk,
        backend=handle.backend,
        relative_runs=runs,
    )
    out = out.to(q.dtype).transpose(1, 2).reshape(b, n, -1)
    return _linear(module.to_out, out, handle)


def _plain_module(module: nn.Module, kind: type) -> bool:
    """``module`` is exactly ``kind``, with no forward of its own and no hooks (its own or global) that would see
    whether it was called."""
    if type(module) is not kind or "forward" in vars(module):
        return False
    return not _hooked(module) and _no_global_hooks()


def _autocast_linear_dtype(layer: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype ``layer(x)`` multiplies in, where the call may run as ``F.linear`` on cached casts of the
    weight and bias (the same values autocast's casts give): a plain ``nn.Linear`` with float32 parameters on
    ``x``'s device under float16/bfloat16 autocast; else None."""
    if not _plain_module(layer, nn.Linear) or not torch.is_autocast_enabled(x.device.type):
        return None
    dtype = torch.get_autocast_dtype(x.device.type)
    if dtype not in (torch.float16, torch.bfloat16) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    if any(p is not None and (p.dtype != torch.float32 or p.device != x.device) for p in (layer.weight, layer.bias)):
        return None
    return dtype


def _linear(layer: nn.Module, x: torch.Tensor, handle) -> torch.Tensor:
    """``layer(x)``; under autocast on the handle's cached casts of a plain ``nn.Linear`` 's weight and bias
    (:class:`~kvbound.models._operands.OperandCache`), which saves the casts' launches in every call."""
    dtype = _autocast_linear_dtype(layer, x)
    if dtype is None:
        return layer(x)
    cast = handle._operands.cast
    return F.linear(x, cast(layer.weight, dtype), None if layer.bias is None else cast(layer.bias, dtype))


def _relative_keys(module, handle, features: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``to_rel_k(pos_dropout(features))`` as ``[H, rows, Dk]``: the port's relative keys. They depend only on the
    features (a tensor the handle keeps per length) and ``to_rel_k`` 's parameters, so where the dropout is inactive
    and neither module is observed they are kept per layer and autocast state, for the latest length, while
    ``to_rel_k`` is unchanged (``OperandCache``)."""
    dropout, layer, heads = module.pos_dropout, module.to_rel_k, module.heads
    kind = device.type
    enabled, dtype = torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    cached = torch.is_autocast_cache_enabled()

    def make() -> torch.Tensor:  # in this call's autocast state, also when made again before a graph's replay
        with torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cached):
            return layer(dropout(features)).reshape(features.shape[0], heads, -1).transpose(0, 1)

    if not _plain_module(dropout, nn.Dropout) or (dropout.training and dropout.p > 0):
        return make()
    if not _plain_module(layer, nn.Linear):
        return make()
    # One entry per layer and autocast state: another length (other features) replaces it, so that inputs of many
    # lengths do not pile up relative keys. Kept contiguous per head: Borzoi's run keys are then not copied per call.
    key = ("relative_keys", id(layer), enabled, dtype)
    sources = (features, *(p for p in (layer.weight, layer.bias) if p is not None))
    return handle._operands.get(key, sources, lambda: make().contiguous())


def _switch(name: str) -> bool:
    """An on-by-default environment switch: unset, empty, ``1``, ``true``, ``on``, ``yes`` -> True; ``0``,
    ``false``, ``off``, ``no`` -> False; anything else raises."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}: expected one of 1, true, on, yes, 0, false, off, no, got {value!r}")


def relative_runs_enabled() -> bool:
    """``KVBOUND_RELATIVE_RUNS``: on by default (unset, empty, ``1``, ``true``, ``on``, ``yes``), off with ``0``
    (``false``, ``off``, ``no``); other values raise. On: patched Enformer/Borzoi layers, dense or compressed K/V,
    pass the runs of equal positional features to ``kvbound.attention`` (``relative_runs``) when there are few of
    them (Borzoi).
    On an H200 one Borzoi layer took 1.30 ms with the runs against 1.77 ms with the relative keys at batch 4, but
    1.25 against 0.70 ms at batch 1 (one call, checks deferred; benchmarks/results/h200_2026-12-02_5c00c3e); whole
    patched forwards with the runs: 1.68x (batch 4) and 1.61x (batch 1) of the unpatched port's speed
    (h200_2026-12-02_5d68a9b). In whole forwards the runs are faster at every batch measured, batch 1 included:
    23.6 / 44.8 / 85.2 ms at batch 1 / 2 / 4 against 24.2 / 47.1 / 89.7 ms with the keys (h200_2026-12-02_a8e9727),
    so there is no batch below which the keys are chosen."""
    return _switch("KVBOUND_RELATIVE_RUNS")


def _enformer_features(module, handle, n: int, device: torch.device) -> torch.Tensor:
    port = sys.modules[type(module).__module__]
    features, tf_gamma, dtype = module.num_rel_pos_features, module.use_tf_gamma, module.to_rel_k.weight.dtype
    return handle._positional_features(
        (port.get_positional_embed, n, features, tf_gamma, dtype, torch.get_default_dtype(), torch.device(device)),
        lambda: port.get_positional_embed(n, features, device, use_tf_gamma=tf_gamma, dtype=dtype),
    )


def _borzoi_features(module, handle, n: int, device: torch.device) -> torch.Tensor:
    # The port caches its features on the module at the first call and breaks at any other length; reuse a
    # cache of the right length, otherwise compute them once per handle and length (the module is never written).
    cached = getattr(module, "positions", None)
    if isinstance(cached, torch.Tensor) and cached.shape[0] == 2 * n - 1:
        return cached
    port = sys.modules[type(module).__module__]
    features, weight_device = module.num_rel_pos_features, module.to_v.weight.device
    return handle._positional_features(
        (port.get_positional_embed, n, BORZOI_TRAIN_LENGTH, features, torch.get_default_dtype(), weight_device),
        lambda: port.get_positional_embed(n, BORZOI_TRAIN_LENGTH, features, weight_device),
    )


def _enformer_forward(module, record, handle, x):
    return _relative_forward(module, record, handle, x, _enformer_features)


def _borzoi_forward(module, record, handle, x):
    return _relative_forward(module, record, handle, x, _borzoi_features)


def _relative_head_dims(module) -> tuple[int, int]:
    return module.to_k.out_features // module.heads, module.to_v.out_features // module.heads


def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype ``torch.matmul`` multiplies ``t`` in at this point: the autocast dtype where autocast is on for
    ``t``'s device (the port's products then run on those operands, with float32 accumulation), else its own.
    Autocast leaves float64 alone, and so does this."""
    return _operand_dtype(t.dtype, t.device) if t.is_floating_point() else t.dtype


def fused_norm_enabled() -> bool:
    """``KVBOUND_FUSED_NORM``: on by default (unset, empty, ``1``, ``true``, ``on``, ``yes``), off with ``0``
    (``false``, ``off``, ``no``); other values raise. On: patched AlphaGenome attention blocks on CUDA normalise,
    rotate and cast their projected q, k and v in one kernel each (:func:`kvbound.kernels.norm_rope.norm_rope`)
    where the port's own LayerNorm and RoPE would run about twenty kernels per tensor; the LayerNorm in front of a
    patched Enformer/Borzoi attention module writes the autocast dtype in one kernel (``pre_norm_forward``), and
    so does the LayerNorm of the same block's feed-forward, whose first ``Linear`` then runs with the ReLU in one
    matmul (``feed_forward_forward``). Read at each call."""
    return _switch("KVBOUND_FUSED_NORM")


def _fused_norm_device(x: torch.Tensor) -> bool:
    """Where the fused norm runs: CUDA tensors (on the CPU the port's own modules are faster than the interpreter)."""
    return x.is_cuda


def _fusable_norm(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``norm(x)`` may run in :func:`~kvbound.kernels.norm_rope.norm_rope`: a CUDA input of a 16/32-bit float
    dtype, ``norm`` exactly the port's centring, affine ``LayerNorm`` over the last dimension, with no hooks that
    the kernel would skip, and no autograd to feed (the kernel has no backward)."""
    layer_norm = lookup_class("alphagenome_pytorch.layers", "LayerNorm")
    if layer_norm is None or type(norm) is not layer_norm or not _fused_norm_device(x) or not x.is_contiguous():
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.dim() != 4:
        return False
    c = x.shape[-1]
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if getattr(norm, "rms_norm", True) or not getattr(norm, "elementwise_affine", False):
        return False
    if not isinstance(getattr(norm, "eps", None), float):
        return False
    if tuple(getattr(norm, "normalized_shape", ())) != (c,) or not isinstance(weight, torch.Tensor):
        return False
    if not isinstance(bias, torch.Tensor) or tuple(weight.shape) != (c,) or tuple(bias.shape) != (c,):
        return False
    if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16) or bias.dtype != weight.dtype:
        return False
    if weight.device != x.device or bias.device != x.device:
        return False
    return _unobserved(norm, x, weight, bias)


def _hooked(module: nn.Module) -> bool:
    """``module`` has forward hooks or pre-hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _no_global_hooks() -> bool:
    """No global forward hook or pre-hook is registered (``nn.modules.module.register_module_forward_hook``)."""
    hooks = nn.modules.module
    return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _unobserved(norm: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether replacing ``norm(x)`` by a kernel is invisible: no forward hook on ``norm`` or globally (it would
    see the kernel's output, or be skipped), and no autograd to feed (the kernels have no backward)."""
    if _hooked(norm) or not _no_global_hooks():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))


def _fusable_pre_norm(norm: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype in which ``norm(x)`` may run in :func:`~kvbound.kernels.norm_rope.norm_rope` in front of a patched
    Enformer/Borzoi attention module, or None where ``norm`` itself must run. The kernel writes what the attention's
    projections multiply: under autocast (float16 or bfloat16) on the input's device the port's ``LayerNorm`` runs in
    float32 (on ``x.float()``: the ports' residual stream is in the autocast dtype there) and each projection casts
    its float32 output to the autocast dtype; the kernel reads x in its own dtype, normalises in float32 and
    writes that dtype directly. It needs a non-empty float32/float16/bfloat16 CUDA input, ``norm`` exactly torch's
    affine ``nn.LayerNorm`` over the last dimension with float32 parameters on that device, no hooks that would
    see the other dtype, and no autograd to feed (the kernel has no backward)."""
    if type(norm) is not nn.LayerNorm or not _fused_norm_device(x) or x.numel() == 0:
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    weight, bias = norm.weight, norm.bias
    if tuple(norm.normalized_shape) != (x.shape[-1],) or not isinstance(weight, torch.Tensor):
        return None
    if not isinstance(bias, torch.Tensor) or weight.dtype != torch.float32 or bias.dtype != torch.float32:
        return None
    if weight.device != x.device or bias.device != x.device:
        return None
    return dtype if _unobserved(norm, x, weight, bias) else None


def pre_norm_forward(module, record, handle, x):
    """Forward of an ``nn.LayerNorm`` that feeds a patched Enformer/Borzoi attention module (``record.target``; the
    ports' ``Residual(Sequential(LayerNorm, Attention, Dropout))``): where ``_fusable_pre_norm`` allows it and
    ``KVBOUND_FUSED_NORM`` is on, one kernel normalises in float32 and writes the autocast dtype, the values the
    attention's projections would cast the float32 output to (up to the order of the float32 row sums), instead of
    a cast of the input to float32, a float32 output and a cast of that. Everywhere else, and once the attention
    module is no longer patched, the module's own forward runs."""
    dtype = None
    if fused_norm_enabled() and handle._patches_attention(record.target):
        dtype = _fusable_pre_norm(module, x)
    if dtype is None:
        return nn.LayerNorm.forward(module, x)
    return _layer_norm_to(module, x, dtype)


def _layer_norm_to(norm: nn.LayerNorm, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``norm(x)`` over the last dimension in one :func:`~kvbound.kernels.norm_rope.norm_rope` kernel, every step
    in float32 as autocast's ``layer_norm`` does, written in ``dtype``; x's shape."""
    from kvbound.kernels import norm_rope as kernel

    c = x.shape[-1]
    rows = x.contiguous().view(1, -1, 1, c)
    out = kernel.norm_rope(rows, norm.weight, norm.bias, norm.eps, rope=None, out_dtype=dtype, round_to_input=False)
    return out.view(x.shape)


# The ports' feed-forward in each transformer block: Residual(Sequential(LayerNorm, Linear(d, 2d), Dropout, ReLU,
# Linear(2d, d), Dropout)).
FEED_FORWARD_LAYOUT = (nn.LayerNorm, nn.Linear, nn.Dropout, nn.ReLU, nn.Linear, nn.Dropout)


def is_feed_forward(module: nn.Module) -> bool:
    """Whether ``module`` is exactly an ``nn.Sequential`` of :data:`FEED_FORWARD_LAYOUT` (Enformer's and Borzoi's
    feed-forward), with no instance-level forward on its children."""
    if type(module) is not nn.Sequential:
        return False
    children = list(module.children())
    if len(children) != len(FEED_FORWARD_LAYOUT):
        return False
    return all(type(c) is t and "forward" not in vars(c) for c, t in zip(children, FEED_FORWARD_LAYOUT, strict=True))


def _fusable_feed_forward(seq: nn.Sequential, x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in which the feed-forward ``seq`` (:func:`is_feed_forward`) may run its LayerNorm in
    :func:`~kvbound.kernels.norm_rope.norm_rope` and its first ``Linear`` with the ReLU in the matmul's epilogue,
    or None where ``seq`` must run as it is. Beyond :func:`_fusable_pre_norm` (the norm's output feeds only the
    first ``Linear``, which casts it to the autocast dtype): the children have no hooks (the fused path does not
    call them), the dropouts are inactive (eval mode or p 0), and both ``Linear`` s have float32 weights and
    biases on the input's device, with no autograd to feed."""
    if not is_feed_forward(seq):
        return None
    norm, first, drop1, _, second, drop2 = seq.children()
    if any(_hooked(child) for child in seq.children()):
        return None
    if any(d.training and d.p > 0 for d in (drop1, drop2)):
        return None
    for linear in (first, second):
        weight, bias = linear.weight, linear.bias
        if not isinstance(bias, torch.Tensor) or weight.dtype != torch.float32 or bias.dtype != torch.float32:
            return None
        if weight.device != x.device or bias.device != x.device:
            return None
        if torch.is_grad_enabled() and (weight.requires_grad or bias.requires_grad):
            return None
    return _fusable_pre_norm(norm, x)


def feed_forward_forward(module, record, handle, x):
    """Forward of the feed-forward ``nn.Sequential`` of a transformer block whose attention is patched (Enformer's
    and Borzoi's ``Sequential(LayerNorm, Linear, Dropout, ReLU, Linear, Dropout)``). Where
    :func:`_fusable_feed_forward` allows it and ``KVBOUND_FUSED_NORM`` is on: the LayerNorm in one kernel that
    writes the autocast dtype (as :func:`pre_norm_forward`), the first ``Linear`` and the ReLU in one cuBLASLt
    matmul with a bias-and-ReLU epilogue on the operands autocast would pass (``aten._addmm_activation``), and the
    second ``Linear`` as autocast runs it; the dropouts are inactive. Everywhere else the module's own forward
    runs."""
    dtype = _fusable_feed_forward(module, x) if fused_norm_enabled() else None
    if dtype is None:
        return nn.Sequential.forward(module, x)
    norm, first, _, _, second, _ = module.children()
    h = _layer_norm_to(norm, x, dtype).view(-1, x.shape[-1])
    cast = handle._operands.cast  # the casts autocast would make in each call, kept while the weights are unchanged
    h = _linear_relu(h, cast(first.weight, dtype), cast(first.bias, dtype))
    return F.linear(h, cast(second.weight, dtype), cast(second.bias, dtype)).view(*x.shape[:-1], -1)


def _linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(x @ weight.T + bias)`` for 2-D ``x`` in one matmul (cuBLASLt's bias-and-ReLU epilogue on CUDA)."""
    return torch.ops.aten._addmm_activation(bias, x, weight.t(), use_gelu=False)


def fused_pool_enabled() -> bool:
    """``KVBOUND_FUSED_POOL``: on by default (unset, empty, ``1``, ``true``, ``on``, ``yes``), off with ``0``
    (``false``, ``off``, ``no``); other values raise. On: in a model whose Enformer attention is patched, each
    ``AttentionPool`` (pool size 2) runs its softmax pool in one kernel after the logits' matmul
    (``attention_pool_forward``); in a model whose Borzoi attention is patched, each ``nn.MaxPool1d(2)`` runs in one
    kernel (``max_pool_forward``, exact). Read at each call."""
    return _switch("KVBOUND_FUSED_POOL")


def _fusable_attention_pool(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether Enformer's ``AttentionPool`` ``module`` may run on ``x`` as :func:`attention_pool_forward` does:
    exactly the port's class with pool size 2, a CUDA input ``[B, D, N]`` (float32/16, bfloat16) with N even (the
    port pads odd lengths), under float16 or bfloat16 autocast (the port's logits are then the autocast dtype's),
    where autocast runs the softmax in float32 (CUDA's policy; the CPU's keeps the autocast dtype), its
    ``to_attn_logits`` exactly a 1x1 ``nn.Conv2d`` D -> D without bias, float32 weight on x's device, no hooks
    on it or globally (the fused path does not call it), and no autograd to feed."""
    cls = lookup_class("enformer_pytorch.modeling_enformer", "AttentionPool")
    if cls is None or type(module) is not cls or getattr(module, "pool_size", None) != 2:
        return False
    if not _fused_norm_device(x) or x.dim() != 3 or x.shape[-1] % 2 or x.numel() == 0:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not torch.is_autocast_enabled(x.device.type):
        return False
    dtype = torch.get_autocast_dtype(x.device.type)
    if dtype not in (torch.float16, torch.bfloat16) or not _softmax_in_float32(x.device.type, dtype):
        return False
    conv, d = getattr(module, "to_attn_logits", None), x.shape[1]
    if type(conv) is not nn.Conv2d or conv.bias is not None or conv.groups != 1 or conv.padding_mode != "zeros":
        return False
    if (conv.kernel_size, conv.stride, conv.padding, conv.dilation) != ((1, 1), (1, 1), (0, 0), (1, 1)):
        return False
    weight = conv.weight
    if weight.dtype != torch.float32 or weight.device != x.device or tuple(weight.shape) != (d, d, 1, 1):
        return False
    if any(_hooked(child) for child in module.children()):
        return False
    if not _no_global_hooks():
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


_SOFTMAX_IN_FLOAT32: dict[tuple[str, torch.dtype], bool] = {}


def _softmax_in_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast to ``dtype`` on ``device_type`` runs ``softmax`` in float32 (CUDA's policy: the port's pool
    is then float32 from the softmax on, as the kernel computes it). Asked once per device type and dtype, under
    the caller's autocast."""
    key = (device_type, dtype)
    found = _SOFTMAX_IN_FLOAT32.get(key)
    if found is None:
        probe = torch.zeros(1, 2, dtype=dtype, device=device_type)
        found = _SOFTMAX_IN_FLOAT32[key] = probe.softmax(-1).dtype == torch.float32
    return found


def attention_pool_forward(module, record, handle, x):
    """Forward of Enformer's ``AttentionPool`` in a model whose Enformer attention is patched (``record.target``).
    Where :func:`_fusable_attention_pool` allows it and ``KVBOUND_FUSED_POOL`` is on: the logits as one matmul of
    the 1x1 convolution's weight with x (autocast casts both, as for the convolution; float32 accumulation,
    rounded to the autocast dtype as the port's are), then :func:`~kvbound.kernels.pair_pool.softmax_pair_pool`:
    the float32 softmax of each pair of logits and the weighted sum of the pair, in one pass, written in float32
    as the port's product and sum are. Everywhere else the module's own forward runs."""
    if fused_pool_enabled() and handle._patches_attention(record.target) and _fusable_attention_pool(module, x):
        from kvbound.kernels.pair_pool import softmax_pair_pool

        d = x.shape[1]
        logits = torch.matmul(module.to_attn_logits.weight.view(d, d), x)
        return softmax_pair_pool(x, logits)
    return type(module).forward(module, x)


def _fusable_max_pool(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module`` is exactly ``nn.MaxPool1d(2)`` (stride 2, no padding, dilation 1, floor mode, no indices)
    on a CUDA float input whose last dimension is even, with no autograd to feed."""
    if type(module) is not nn.MaxPool1d or not _fused_norm_device(x) or x.dim() not in (2, 3):
        return False
    settings = (module.kernel_size, module.stride, module.padding, module.dilation)
    if any(value not in (k, (k,)) for value, k in zip(settings, (2, 2, 0, 1), strict=True)):
        return False
    if module.ceil_mode or module.return_indices or x.shape[-1] % 2 or x.numel() == 0:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    return not (torch.is_grad_enabled() and x.requires_grad)


def max_pool_forward(module, record, handle, x):
    """Forward of an ``nn.MaxPool1d`` in a model whose Borzoi attention is patched (``record.target``): where
    :func:`_fusable_max_pool` allows it and ``KVBOUND_FUSED_POOL`` is on, the larger of each pair in one kernel
    (:func:`~kvbound.kernels.pair_pool.max_pair_pool`: the same values as ``max_pool1d``, NaN included). Everywhere
    else the module's own forward runs."""
    if fused_pool_enabled() and handle._patches_attention(record.target) and _fusable_max_pool(module, x):
        from kvbound.kernels.pair_pool import max_pair_pool

        return max_pair_pool(x)
    return nn.MaxPool1d.forward(module, x)


def fused_conv_enabled() -> bool:
    """``KVBOUND_FUSED_CONV``: on by default (unset, empty, ``1``, ``true``, ``on``, ``yes``), off with ``0``
    (``false``, ``off``, ``no``); other values raise. On: in a model whose Enformer or Borzoi attention is patched,
    each convolution block ``BatchNorm1d -> GELU -> Conv1d`` runs its normalisation and GELU in one kernel
    (``conv_block_forward``), each ``nn.Conv1d`` adds its bias in one pass (``conv_bias_forward``; a narrow input
    as one matmul, ``_narrow_conv1d``), and Enformer's residual convolution blocks add the bias and the residual
    in one pass (``conv_residual_forward``). Read at each call."""
    return _switch("KVBOUND_FUSED_CONV")


def conv_block_parts(module: nn.Module) -> tuple[nn.BatchNorm1d, nn.Module, str, nn.Conv1d] | None:
    """``(norm, activation, GELU form, conv)`` when ``module`` is one of the ports' convolution blocks: Enformer's
    ``ConvBlock``, an ``nn.Sequential`` of exactly ``nn.BatchNorm1d``, the port's ``GELU`` (``sigmoid(1.702 x) x``)
    and ``nn.Conv1d``; Borzoi's ``ConvBlock`` with ``nn.BatchNorm1d``, ``nn.GELU(approximate="tanh")`` and
    ``nn.Conv1d`` (its "standard" type; the separable one has no norm). Otherwise None."""
    if type(module) is nn.Sequential:
        children = list(module.children())
        gelu = lookup_class("enformer_pytorch.modeling_enformer", "GELU")
        if gelu is None or len(children) != 3:
            return None
        norm, activation, conv = children
        if type(norm) is nn.BatchNorm1d and type(activation) is gelu and type(conv) is nn.Conv1d:
            return norm, activation, "sigmoid", conv
        return None
    block = lookup_class("borzoi_pytorch.pytorch_borzoi_model", "ConvBlock")
    if block is None or type(module) is not block:
        return None
    norm, activation = getattr(module, "norm", None), getattr(module, "activation", None)
    conv = getattr(module, "conv_layer", None)
    if type(norm) is nn.BatchNorm1d and type(activation) is nn.GELU and type(conv) is nn.Conv1d:
        if activation.approximate == "tanh":
            return norm, activation, "tanh", conv
    return None


def _fusable_conv_block(norm: nn.BatchNorm1d, activation: nn.Module, conv: nn.Conv1d, x: torch.Tensor):
    """The dtype in which ``activation(norm(x))`` may be written by
    :func:`~kvbound.kernels.norm_gelu.batch_norm_gelu` for ``conv``, or None where the block must run itself.
    It needs a non-empty ``[B, C, L]`` CUDA input (float32/16, bfloat16) with C the norm's channels, the norm in
    inference (``eval()``, running statistics present: else torch normalises with the batch's statistics), its
    buffers and parameters of float dtypes on x's device, no hooks on the norm or the activation or globally and no
    instance-level forward on them (the kernel skips their calls), and no autograd to feed. The dtype: under
    float16/bfloat16 autocast on x's device the autocast dtype, which the convolution multiplies in (its weight
    float32 or of that dtype); without autocast x's own, the convolution's weight of the same dtype."""
    if not _fused_norm_device(x) or x.dim() != 3 or x.numel() == 0 or x.dtype not in _FLOAT_DTYPES:
        return None
    if norm.training or x.shape[1] != norm.num_features or not isinstance(norm.eps, float):
        return None
    mean, var, weight, bias = norm.running_mean, norm.running_var, norm.weight, norm.bias
    tensors = [mean, var] + ([weight, bias] if weight is not None or bias is not None else [])
    if not all(isinstance(t, torch.Tensor) and t.dtype in _FLOAT_DTYPES and t.device == x.device for t in tensors):
        return None
    if any(_hooked(child) or "forward" in vars(child) for child in (norm, activation)):
        return None
    if not _no_global_hooks():
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)):
        return None
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in (torch.float16, torch.bfloat16) or conv.weight.dtype not in (torch.float32, dtype):
            return None
        return dtype
    return x.dtype if conv.weight.dtype == x.dtype else None


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def conv_block_forward(module, record, handle, x):
    """Forward of one of the ports' convolution blocks (:func:`conv_block_parts`) in a model whose attention is
    patched (``record.target``): where :func:`_fusable_conv_block` allows it and ``KVBOUND_FUSED_CONV`` is on, the
    inference ``BatchNorm1d`` and the GELU in one kernel
    (:func:`~kvbound.kernels.norm_gelu.batch_norm_gelu`: float32 arithmetic, written in the convolution's operand
    dtype), then the block's ``Conv1d`` called as a module. Everywhere else the block's own forward runs."""
    parts = conv_block_parts(module) if fused_conv_enabled() and handle._patches_attention(record.target) else None
    dtype = _fusable_conv_block(parts[0], parts[1], parts[3], x) if parts is not None else None
    if dtype is None:
        return type(module).forward(module, x)
    from kvbound.kernels.norm_gelu import batch_norm_gelu

    norm, _, form, conv = parts
    y = batch_norm_gelu(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, norm.eps, form, dtype)
    return conv(y)


def _fusable_conv_bias(conv: nn.Conv1d, x: torch.Tensor) -> bool:
    """Whether ``conv`` (exactly ``nn.Conv1d``, with a bias) may add its bias in
    :func:`~kvbound.kernels.norm_gelu.add_channel_bias_` after the convolution without one: a ``[B, C, L]`` CUDA
    input of a float dtype, the bias of a float dtype on that device, and no autograd to feed."""
    bias = conv.bias
    if type(conv) is not nn.Conv1d or not isinstance(bias, torch.Tensor) or not _fused_norm_device(x):
        return False
    if x.dim() != 3 or x.dtype not in _FLOAT_DTYPES or bias.dtype not in _FLOAT_DTYPES or bias.device != x.device:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad or bias.requires_grad))


# Input channels times kernel width up to which a convolution runs as one matmul over its unfolded input
# (_narrow_conv1d): the stems' one-hot DNA (4 channels, width 15).
NARROW_CONV_COLUMNS = 64


def _narrow_conv1d(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor | None:
    """``conv`` without its bias as one matmul of its weight ``[C_out, C_in k]`` with the unfolded input ``[B, C_in
    k, L]`` (im2col), in the operand dtype (autocast's, as the convolution's), where ``C_in k <=
    NARROW_CONV_COLUMNS``, stride and dilation 1, one group and zero padding; else None. cuDNN runs such a narrow
    input (the ports' stem over one-hot DNA) in a slow generic kernel. Float32 accumulation, as there."""
    c_in, k = conv.in_channels, conv.kernel_size[0]
    if c_in * k > NARROW_CONV_COLUMNS or conv.groups != 1 or conv.stride != (1,) or conv.dilation != (1,):
        return None
    if conv.padding_mode != "zeros" or x.shape[1] != c_in:
        return None
    if conv.padding == "same":
        left = (k - 1) // 2
        right = k - 1 - left
    elif conv.padding == "valid":
        left = right = 0
    else:
        left = right = conv.padding[0]
    weight = conv.weight
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if dtype not in _FLOAT_DTYPES or weight.dtype not in (torch.float32, dtype):
            return None
    elif weight.dtype == x.dtype:
        dtype = x.dtype
    else:
        return None
    b, n = x.shape[0], x.shape[2] + left + right - k + 1
    if n < 1:
        return None
    padded = F.pad(x.to(dtype), (left, right))
    columns = padded.unfold(2, k, 1).transpose(2, 3).reshape(b, c_in * k, n)  # [B, C_in k, L], one copy
    with torch.autocast(x.device.type, enabled=False):
        return torch.matmul(weight.to(dtype).reshape(conv.out_channels, c_in * k), columns)


def _conv_without_bias(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """``conv`` on ``x`` without its bias: a narrow input as one matmul (:func:`_narrow_conv1d`), else the module's
    own convolution."""
    out = _narrow_conv1d(conv, x)
    return conv._conv_forward(x, conv.weight, None) if out is None else out


def conv_bias_forward(module, record, handle, x):
    """Forward of an ``nn.Conv1d`` with a bias in a model whose Enformer or Borzoi attention is patched
    (``record.target``): where :func:`_fusable_conv_bias` allows it and ``KVBOUND_FUSED_CONV`` is on, the
    convolution without its bias (a narrow input, such as the stem's one-hot DNA, as one matmul:
    :func:`_narrow_conv1d`), then the bias added in place in one pass
    (:func:`~kvbound.kernels.norm_gelu.add_channel_bias_`), as PyTorch's cuDNN path adds it, whose own ``add_`` of
    the broadcast bias is a slower elementwise kernel. Everywhere else the module's own forward runs."""
    if not (fused_conv_enabled() and handle._patches_attention(record.target) and _fusable_conv_bias(module, x)):
        return nn.Conv1d.forward(module, x)
    return _add_bias_(_conv_without_bias(module, x), module.bias)


def _add_bias_(out: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out.add_(bias)`` (then ``+ residual``) as PyTorch's convolution and ``fn(x) + x`` round it: in one pass
    (:func:`~kvbound.kernels.norm_gelu.add_channel_bias_`) where ``out`` is a dense ``[B, C, L]`` float tensor (and
    ``residual`` of its shape and dtype), else with torch's operations."""
    from kvbound.kernels import norm_gelu

    if out.dim() == 3 and out.dtype in _FLOAT_DTYPES and norm_gelu._dense(out):
        if residual is None or (residual.shape == out.shape and residual.dtype == out.dtype):
            return norm_gelu.add_channel_bias_(out, bias, residual=residual)
    out = out.add_(bias.to(out.dtype).view(1, -1, 1))
    return out if residual is None else out + residual


def conv_residual_block(module: nn.Module) -> nn.Module | None:
    """The convolution block inside Enformer's ``Residual`` ``module`` (``fn(x) + x``) when its ``fn`` is one
    (:func:`conv_block_parts`), else None."""
    residual = lookup_class("enformer_pytorch.modeling_enformer", "Residual")
    if residual is None or type(module) is not residual:
        return None
    fn = getattr(module, "fn", None)
    return fn if isinstance(fn, nn.Module) and conv_block_parts(fn) is not None else None


def _bypassable(module: nn.Module, own: Callable) -> bool:
    """No hooks on ``module`` and its forward is its class's or kvbound's helper ``own``: calling its pieces
    directly instead of ``module(x)`` changes nothing observable."""
    if _hooked(module):
        return False
    installed = vars(module).get("forward")
    return installed is None or getattr(installed, "_impl", None) is own


def conv_residual_forward(module, record, handle, x, **kwargs):
    """Forward of Enformer's ``Residual`` around a convolution block (:func:`conv_residual_block`) in a model whose
    Enformer attention is patched (``record.target``): where the block would run fused (:func:`_fusable_conv_block`,
    :func:`_fusable_conv_bias`), the convolution's input dtype equals x's, and ``KVBOUND_FUSED_CONV`` is on, the
    block's norm and GELU in one kernel, its convolution without the bias, then the bias and the residual ``x`` added
    in one pass (:func:`~kvbound.kernels.norm_gelu.add_channel_bias_` with ``residual``; each sum rounded as the
    port's ``add_`` and ``+`` round). Everywhere else the module's own forward runs."""
    block = getattr(module, "fn", None) if not kwargs and fused_conv_enabled() else None
    parts = conv_block_parts(block) if isinstance(block, nn.Module) else None
    if parts is None or not handle._patches_attention(record.target) or not _bypassable(block, conv_block_forward):
        return type(module).forward(module, x, **kwargs)
    norm, activation, form, conv = parts
    dtype = _fusable_conv_block(norm, activation, conv, x)
    if dtype != x.dtype or not _fusable_conv_bias(conv, x) or not _bypassable(conv, conv_bias_forward):
        return type(module).forward(module, x, **kwargs)
    from kvbound.kernels.norm_gelu import batch_norm_gelu

    y = batch_norm_gelu(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, norm.eps, form, dtype)
    return _add_bias_(_conv_without_bias(conv, y), conv.bias, residual=x)


def _rope_tables(handle, port, s: int, c: int, dtype: torch.dtype, device: torch.device):
    """``(cos, sin)``, each ``[s, c / 2]`` float32, of the port's ``apply_rope`` (in place, as ``MHABlock`` calls it)
    on a ``[1, s, 1, c]`` tensor of ``dtype`` under the autocast state of this call: on pairs ``(1, 0)`` it
    returns ``(cos, sin)`` and on ``(0, 1)`` ``(-sin, cos)`` (each product with 0 or 1 exact). Cached per handle
    with that state. None where the two readings disagree (a rotation this kernel does not model)."""
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    def compute() -> torch.Tensor:
        first = torch.zeros(1, s, 1, c, dtype=dtype, device=device)
        first[..., 0::2] = 1
        second = torch.zeros(1, s, 1, c, dtype=dtype, device=device)
        second[..., 1::2] = 1
        # The in-place form, as MHABlock calls it (it writes into the pattern, in the pattern's dtype).
        a, b = port.apply_rope(first, inplace=True)[0, :, 0], port.apply_rope(second, inplace=True)[0, :, 0]
        cos, sin = a[:, 0::2].float(), a[:, 1::2].float()
        if not (torch.equal(cos, b[:, 1::2].float()) and torch.equal(sin, -b[:, 0::2].float())):
            return torch.empty(0, device=device)
        return torch.stack([cos, sin]).contiguous()

    tables = handle._positional_features((port.apply_rope, "rope-tables", s, c, dtype, device, autocast), compute)
    return (tables[0], tables[1]) if tables.numel() else None


def _operand_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype autocast gives a floating operand of ``dtype`` on ``device``: the autocast dtype where autocast is
    on there, except for float64, which it never casts; else ``dtype``."""
    if dtype != torch.float64 and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def _alphagenome_qkv(module, handle, port, h, b: int, s: int, dk: int, dv: int):
    """The port's normalised q, k (rotated) and v as ``[B, S, H, D]`` in the attention's operand dtype: one fused
    kernel per tensor where ``_fusable_norm`` allows it (and ``KVBOUND_FUSED_NORM`` is on), else the port's
    modules and ``apply_rope``, then the cast."""
    from kvbound.kernels.norm_rope import norm_rope

    projected = (
        (module.q_proj(h).view(b, s, -1, dk), module.norm_q, True),
        (module.k_proj(h).view(b, s, -1, dk), module.norm_k, True),
        (module.v_proj(h).view(b, s, -1, dv), module.norm_v, False),
    )
    fused = fused_norm_enabled() and all(_fusable_norm(norm, t) for t, norm, _ in projected)
    norm_dtypes = {torch.promote_types(t.dtype, norm.weight.dtype) for t, norm, _ in projected} if fused else set()
    tables = None
    if len(norm_dtypes) == 1:  # q and k share their width (dk), hence one pair of tables
        (norm_dtype,) = norm_dtypes
        tables = _rope_tables(handle, port, s, dk, norm_dtype, h.device)
    if tables is not None:
        operand = _operand_dtype(norm_dtype, h.device)
        return tuple(
            norm_rope(t, norm.weight, norm.bias, norm.eps, rope=tables if rope else None, out_dtype=operand)
            for t, norm, rope in projected
        )
    q, k, v = (norm(t) for t, norm, _ in projected)
    q = port.apply_rope(q, inplace=True)
    k = port.apply_rope(k, inplace=True)
    # The port's two products are torch.matmul calls: under autocast they multiply bfloat16 (or float16) copies
    # of q, k, v and the weights, accumulating in float32; the fused kernel takes the same operands.
    operand = _matmul_dtype(q)
    return q.to(operand), k.to(operand), v.to(operand)


def _alphagenome_mha_forward(module, record, handle, x, attention_bias, compute_dtype=None):
    b, s, _ = x.shape
    compute_dtype = x.dtype if compute_dtype is None else compute_dtype
    port = sys.modules[type(module).__module__]
    x = x.to(compute_dtype)
    h = module.norm(x)
    # Under autocast each of the three projections would cast h to the autocast dtype; one cast, the same values
    # (forward hooks on the projections see it in that dtype).
    h = h.to(_matmul_dtype(h))
    dk = module.norm_q.normalized_shape[0]
    dv = module.norm_v.normalized_shape[0]
    q, k, v = (t.permute(0, 2, 1, 3) for t in _alphagenome_qkv(module, handle, port, h, b, s, dk, dv))
    handle._check_eager(record, q, k, v)
    q = handle._guard_gradients(record, q, k, v)
    k, v = handle._prepare_kv(record, k, v)
    y = tile_bias_attention(
        q,
        k,
        v,
        attention_bias,
        scale=1.0 / math.sqrt(dk),
        softcap=ALPHAGENOME_SOFTCAP,
        query_chunk=handle.query_chunk,
        backend=handle.backend,
    )
    if not (compute_dtype == torch.float32 and _operand_dtype(torch.float32, y.device) == y.dtype):
        # (Under autocast in y's dtype, widening y to float32 for linear_embedding, which narrows it back, is an
        # exact round trip of two copies: skipped.)
        y = y.to(compute_dtype)
    y = y.permute(0, 2, 1, 3).reshape(b, s, -1)
    return module.final_norm(module.linear_embedding(y))


def _alphagenome_head_dims(module) -> tuple[int, int]:
    return module.norm_k.normalized_shape[0], module.norm_v.normalized_shape[0]


def alphagenome_tile_values(attention_bias_block: nn.Module, pair: torch.Tensor) -> torch.Tensor:
    """``AttentionBiasBlock`` without its 16 x 16 repeat: ``[B, s, s, P] -> [B, 8, s, s]``."""
    h = F.gelu(attention_bias_block.norm(pair))
    return attention_bias_block.proj(h).permute(0, 3, 1, 2)


def alphagenome_block(block, x, pair_x, compute_dtype, bias: Callable[[torch.Tensor], object]):
    """``TransformerTower._forward_block`` of alphagenome_pytorch 0.3.1 with the ``MHABlock``'s bias made by
    ``bias(pair_x)`` instead of the block's ``AttentionBiasBlock``."""
    if block["pair_update"] is not None:
        pair_x = block["pair_update"](x, pair_x, compute_dtype=compute_dtype)
    x = x + block["mha"](x, bias(pair_x), compute_dtype=compute_dtype)
    x = x + block["mlp"](x)
    return x, pair_x


def _alphagenome_tower_block(module, record, handle, block, x, pair_x, compute_dtype):
    # TransformerTower._forward_block, except that a patched MHABlock receives the bias at tile resolution.
    if not handle._patches_attention(block["mha"]):
        return alphagenome_block(block, x, pair_x, compute_dtype, block["attn_bias"])
    s = x.shape[1]
    return alphagenome_block(block, x, pair_x, compute_dtype, lambda pair: TileBias(
        alphagenome_tile_values(block["attn_bias"], pair), ALPHAGENOME_TILE, s, s))


_RELATIVE_REQUIRED = (
    "heads",
    "scale",
    "to_q",
    "to_k",
    "to_v",
    "to_out",
    "to_rel_k",
    "rel_content_bias",
    "rel_pos_bias",
    "num_rel_pos_features",
    "pos_dropout",
)

PORTS: tuple[Port, ...] = (
    Port(
        kind="enformer",
        module_name="enformer_pytorch.modeling_enformer",
        class_name="Attention",
        role="attention",
        method="forward",
        required=(*_RELATIVE_REQUIRED, "use_tf_gamma"),
        forward=_enformer_forward,
        head_dims=_relative_head_dims,
    ),
    Port(
        kind="borzoi",
        module_name="borzoi_pytorch.pytorch_borzoi_transformer",
        class_name="Attention",
        role="attention",
        method="forward",
        required=_RELATIVE_REQUIRED,
        forward=_borzoi_forward,
        head_dims=_relative_head_dims,
    ),
    Port(
        kind="alphagenome",
        module_name="alphagenome_pytorch.attention",
        class_name="MHABlock",
        role="attention",
        method="forward",
        required=("norm", "q_proj", "k_proj", "v_proj", "norm_q", "norm_k", "norm_v", "linear_embedding", "final_norm"),
        forward=_alphagenome_mha_forward,
        head_dims=_alphagenome_head_dims,
    ),
    Port(
        kind="alphagenome",
        module_name="alphagenome_pytorch.model",
        class_name="TransformerTower",
        role="bias",
        method="_forward_block",
        required=("blocks",),
        forward=_alphagenome_tower_block,
    ),
)

# Classes of the ports that look like attention but are not the math above: reported, never patched.
UNSUPPORTED: tuple[tuple[str, str, str], ...] = (
    (
        "borzoi_pytorch.pytorch_borzoi_transformer",
        "FlashAttention",
        "Flashzoi's RoPE attention (flash_attn MHA), not relative positions",
    ),
)
