"""Float64 references of the three ports' attention math, written from the formulas.

Nothing here imports a port or calls a port's function: every step (projections, norms, positional features,
RoPE, relative shift, tile-bias expansion, soft-cap) is re-derived so that the ports' own forwards and
kvbound's memory-lean paths can both be checked against it. Optimised code never imports this module.

Index convention of relative positions (Enformer, Borzoi): a table ``relative_keys[h, m]`` of ``2N - 1`` rows
holds the key of distance ``d = m - (N - 1)``, and query ``i`` attending key ``j`` reads row
``m = N - 1 + (j - i)`` (distance = key position minus query position). This is what the ports'
``relative_shift`` / ``fast_relative_shift`` produce.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "relative_position_attention_reference",
    "tile_bias_attention_reference",
    "enformer_positional_features_reference",
    "borzoi_positional_features_reference",
    "rope_reference",
    "enformer_attention_module_reference",
    "borzoi_attention_module_reference",
    "alphagenome_mha_module_reference",
    "alphagenome_tile_bias_reference",
]

_F64 = torch.float64


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(_F64)


# -------------------------------------------------------------------------------------- attention cores
def relative_position_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    relative_keys: torch.Tensor,
    content_bias: torch.Tensor,
    position_bias: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Transformer-XL attention with relative positions (Enformer, Borzoi), eager float64.

    Args:
        q: ``[B, H, N, Dk]`` queries before scaling.
        k: ``[B, H, N, Dk]``; v: ``[B, H, N, Dv]``.
        relative_keys: ``[H, 2N - 1, Dk]``: row ``m`` is the projected positional feature of distance
            ``m - (N - 1)``.
        content_bias: ``u``, broadcastable to ``[H, Dk]`` (the ports store ``[1, H, 1, Dk]``).
        position_bias: ``v``, same shape as ``content_bias``.
        scale: multiplies ``q`` before the biases are added (``Dk ** -0.5`` in both ports).

    Returns:
        ``[B, H, N, Dv]`` float64::

            logits[i, j] = (scale q_i + u) . k_j + (scale q_i + v) . relative_keys[N - 1 + j - i]
            out_i = sum_j softmax_j(logits[i, :]) v_j
    """
    b, h, n, dk = q.shape
    if relative_keys.shape != (h, 2 * n - 1, dk):
        raise ValueError(f"relative_keys: expected shape {(h, 2 * n - 1, dk)}, got {tuple(relative_keys.shape)}")
    qs = _f64(q) * scale
    u = _f64(content_bias).reshape(1, h, 1, dk)
    pv = _f64(position_bias).reshape(1, h, 1, dk)
    content = (qs + u) @ _f64(k).transpose(-1, -2)  # [B, H, N, N]
    table = (qs + pv) @ _f64(relative_keys).transpose(-1, -2)  # [B, H, N, 2N - 1]
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    rows = (n - 1 + j - i).expand(b, h, n, n)
    relative = torch.gather(table, -1, rows)
    weights = torch.softmax(content + relative, dim=-1)
    return weights @ _f64(v)


def tile_bias_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_bias: torch.Tensor,
    *,
    tile_size: int = 16,
    scale: float | None = None,
    softcap: float | None = 5.0,
) -> torch.Tensor:
    """AlphaGenome's attention core, eager float64.

    Args:
        q: ``[B, Hq, N, Dk]`` queries after LayerNorm and RoPE.
        k: ``[B, Hkv, N, Dk]`` after LayerNorm and RoPE; ``Hq`` a multiple of ``Hkv`` (AlphaGenome: 8 and 1).
        v: ``[B, Hkv, N, Dv]``.
        tile_bias: ``[B, Hq, ceil(N / tile_size), ceil(N / tile_size)]``: the pair bias, constant over each
            ``tile_size x tile_size`` block of (query, key) positions.
        scale: default ``Dk ** -0.5``.
        softcap: ``c`` in ``c * tanh(x / c)`` applied after the bias; None for none.

    Returns:
        ``[B, Hq, N, Dv]`` float64::

            logits[h, i, j] = c * tanh((scale q_hi . k_j + tile_bias[h, i // T, j // T]) / c)
    """
    b, hq, n, dk = q.shape
    hkv = k.shape[1]
    tiles = -(-n // tile_size)
    if tile_bias.shape != (b, hq, tiles, tiles):
        raise ValueError(f"tile_bias: expected shape {(b, hq, tiles, tiles)}, got {tuple(tile_bias.shape)}")
    scale = dk**-0.5 if scale is None else scale
    group = hq // hkv
    kk = _f64(k).repeat_interleave(group, dim=1)
    vv = _f64(v).repeat_interleave(group, dim=1)
    tile_of = torch.arange(n, device=q.device) // tile_size
    bias = _f64(tile_bias)[:, :, tile_of][:, :, :, tile_of]
    logits = (_f64(q) @ kk.transpose(-1, -2)) * scale + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.softmax(logits, dim=-1) @ vv


# ---------------------------------------------------------------------------------- positional features
def enformer_positional_features_reference(n: int, num_features: int) -> torch.Tensor:
    """Enformer's relative positional features ``[2N - 1, num_features]`` float64 (not the TF gamma table).

    Distances ``d = -(N-1) .. N-1``; ``num_features / 6`` basis functions of ``|d|`` in each of three classes,
    then the same features times ``sign(d)``:

    - exponential: ``exp(-ln 2 * |d| / h_f)``, half-lives ``h_f = 2 ** linspace(3, log2 N, F6)``;
    - central mask: ``[2**f - 1 > |d|]`` for ``f = 1 .. F6``;
    - gamma: the gamma pdf of ``|d|`` with means ``linspace(N / F6, N, F6)``, std ``N / (2 F6)``, plus 1e-8,
      divided by its maximum over the F6 features at each distance.
    """
    if num_features % 6:
        raise ValueError(f"num_features: expected a multiple of 6, got {num_features}")
    f6 = num_features // 6
    d = torch.arange(-n + 1, n, dtype=_F64)
    a = d.abs()[:, None]
    half_life = 2.0 ** torch.linspace(3.0, math.log2(n), f6, dtype=_F64)
    exponential = torch.exp(-math.log(2.0) / half_life[None] * a)
    widths = 2.0 ** torch.arange(1, f6 + 1, dtype=_F64) - 1.0
    central = (widths[None] > a).to(_F64)
    stddev = n / (2 * f6)
    mean = torch.linspace(n / f6, n, f6, dtype=_F64)[None]
    concentration = (mean / stddev) ** 2
    rate = mean / stddev**2
    log_pdf = (
        torch.xlogy(concentration - 1.0, a) - rate * a - (torch.lgamma(concentration) - concentration * torch.log(rate))
    )
    gamma = torch.exp(log_pdf) + 1e-8
    gamma = gamma / gamma.amax(dim=-1, keepdim=True)
    features = torch.cat([exponential, central, gamma], dim=-1)
    return torch.cat([features, torch.sign(d)[:, None] * features], dim=-1)


def borzoi_positional_features_reference(n: int, num_features: int, train_length: int = 4096) -> torch.Tensor:
    """Borzoi's relative positional features ``[2N - 1, num_features]`` float64: central masks only.

    ``F2 = num_features / 2`` widths ``w_f = (train_length + 1) ** (f / F2) - 1`` for ``f = 1 .. F2`` (fixed by
    the training length 4096, not by N); features ``[w_f > |d|]`` then the same times ``sign(d)``.
    """
    if num_features % 2:
        raise ValueError(f"num_features: expected an even number, got {num_features}")
    f2 = num_features // 2
    d = torch.arange(-n + 1, n, dtype=_F64)
    widths = float(train_length + 1) ** (torch.arange(1, f2 + 1, dtype=_F64) / f2) - 1.0
    central = (widths[None] > d.abs()[:, None]).to(_F64)
    return torch.cat([central, torch.sign(d)[:, None] * central], dim=-1)


def rope_reference(x: torch.Tensor, max_position: int = 8192) -> torch.Tensor:
    """AlphaGenome's rotary embedding on ``[B, S, H, C]`` (positions ``0 .. S-1``), float64.

    Channel pairs are interleaved: ``(2f, 2f + 1)`` rotates by ``theta = p / (f + g_f)`` with
    ``g = geomspace(1, max_position - C/2 + 1, C/2)`` (endpoint included)::

        y[2f]     = x[2f] cos theta - x[2f+1] sin theta
        y[2f + 1] = x[2f] sin theta + x[2f+1] cos theta
    """
    s, c = x.shape[1], x.shape[3]
    half = c // 2
    g = torch.logspace(0.0, math.log10(max_position - half + 1), half, dtype=_F64)
    inv_freq = 1.0 / (torch.arange(half, dtype=_F64) + g)
    theta = torch.arange(s, dtype=_F64)[:, None] * inv_freq[None]  # [S, C/2]
    cos, sin = torch.cos(theta)[None, :, None], torch.sin(theta)[None, :, None]
    x = _f64(x)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------- whole-module forms
def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    y = x @ _f64(layer.weight).T
    return y if layer.bias is None else y + _f64(layer.bias)


def _relative_module_reference(module, x: torch.Tensor, features: torch.Tensor) -> dict[str, torch.Tensor]:
    b, n, _ = x.shape
    h = module.heads
    x = _f64(x)
    q, k, v = (
        _linear(x, layer).reshape(b, n, h, -1).transpose(1, 2) for layer in (module.to_q, module.to_k, module.to_v)
    )
    relative_keys = _linear(features.to(x.device), module.to_rel_k).reshape(2 * n - 1, h, -1).transpose(0, 1)
    core = relative_position_attention_reference(
        q, k, v, relative_keys, module.rel_content_bias, module.rel_pos_bias, scale=module.scale
    )
    out = _linear(core.transpose(1, 2).reshape(b, n, -1), module.to_out)
    return {"out": out, "core": core, "q": q, "k": k, "v": v, "relative_keys": relative_keys}


def enformer_attention_module_reference(module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """An ``enformer_pytorch`` ``Attention`` module's forward on ``x [B, N, dim]`` in float64 (eval mode).

    Returns a dict: ``out`` ``[B, N, dim]``, ``core`` ``[B, H, N, Dv]`` (before ``to_out``), and the float64
    ``q``, ``k``, ``v``, ``relative_keys`` it used. Uses the module's parameters only.
    """
    features = enformer_positional_features_reference(x.shape[1], module.num_rel_pos_features)
    return _relative_module_reference(module, x, features)


def borzoi_attention_module_reference(module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A ``borzoi_pytorch`` ``Attention`` module's forward on ``x [B, N, dim]`` in float64 (eval mode); same
    dict as :func:`enformer_attention_module_reference`."""
    features = borzoi_positional_features_reference(x.shape[1], module.num_rel_pos_features)
    return _relative_module_reference(module, x, features)


def _rms_batch_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """AlphaGenome ``RMSBatchNorm`` (channels last): ``x * weight / sqrt(running_var + eps) + bias``."""
    return x * (_f64(norm.weight) / torch.sqrt(_f64(norm.running_var) + norm.eps)) + _f64(norm.bias)


def _layer_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """AlphaGenome ``LayerNorm`` over the last dimension (centred unless ``rms_norm``)."""
    if not norm.rms_norm:
        x = x - x.mean(-1, keepdim=True)
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps)
    return y * _f64(norm.weight) + _f64(norm.bias) if norm.elementwise_affine else y


def alphagenome_tile_bias_reference(attention_bias_block, pair: torch.Tensor) -> torch.Tensor:
    """``AttentionBiasBlock`` before its 16x16 repeat: ``[B, s, s, P] -> [B, 8, s, s]`` float64.

    ``tile_bias[b, h, I, J] = (W gelu(RMSBatchNorm(pair[b, I, J])))_h`` with the exact (erf) GELU; row tile ``I``
    indexes queries, column tile ``J`` keys.
    """
    h = _rms_batch_norm(_f64(pair), attention_bias_block.norm)
    h = torch.nn.functional.gelu(h)
    return _linear(h, attention_bias_block.proj).permute(0, 3, 1, 2)


def alphagenome_mha_module_reference(module, x: torch.Tensor, tile_bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """An ``alphagenome_pytorch`` ``MHABlock`` forward on ``x [B, S, D]`` with a tile bias
    ``[B, 8, S/16, S/16]``, float64. Returns ``out`` ``[B, S, D]``, ``core`` ``[B, 8, S, 192]``, and the
    float64 ``q`` ``[B, 8, S, 128]``, ``k``, ``v`` ``[B, 1, S, *]`` (after norms and RoPE) it used."""
    b, s, _ = x.shape
    h = _rms_batch_norm(_f64(x), module.norm)
    dk = module.norm_q.normalized_shape[0]
    dv = module.norm_v.normalized_shape[0]
    q = _layer_norm(_linear(h, module.q_proj).reshape(b, s, -1, dk), module.norm_q)
    k = _layer_norm(_linear(h, module.k_proj).reshape(b, s, -1, dk), module.norm_k)
    v = _layer_norm(_linear(h, module.v_proj).reshape(b, s, -1, dv), module.norm_v)
    q, k = rope_reference(q).transpose(1, 2), rope_reference(k).transpose(1, 2)
    v = v.transpose(1, 2)
    core = tile_bias_attention_reference(q, k, v, tile_bias, tile_size=16, scale=dk**-0.5, softcap=5.0)
    y = _linear(core.transpose(1, 2).reshape(b, s, -1), module.linear_embedding)
    return {"out": _rms_batch_norm(y, module.final_norm), "core": core, "q": q, "k": k, "v": v}
