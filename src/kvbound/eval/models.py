"""Compact Enformer-style and AlphaGenome-style models for the quality benchmark (plain PyTorch).

Both share a convolution tower that turns one-hot DNA ``[B, 4, L]`` into tokens at 128 bp
(``[B, N, C]`` with ``N = L / 128``) and differ in their attention:

* :func:`enformer_attention`: Transformer-XL relative positions as in Enformer: content bias ``u``,
  position bias ``v``, relative positional features (exponential, central mask and gamma basis functions of
  the distance, and the same times its sign) projected per head, and the relative shift that turns
  ``[N, 2N - 1]`` logits over distances into ``[N, N]``. ``dk`` and ``dv`` may differ.
* :func:`alphagenome_attention`: RoPE on LayerNorm-ed queries/keys, one shared K/V head for all query heads,
  LayerNorm on ``v``, a pair bias constant over 16 x 16 token tiles, and the soft-cap ``5 tanh(x / 5)``
  on the logits (in float32).

Every attention layer takes an optional ``kv_hook(layer_index, k, v) -> (k, v)`` applied to K and V right
before the attention math (the place where a cache or a compressed K/V would be read), and its
``attention_fn`` can be swapped (for a fused kernel). :mod:`kvbound.eval.kv_hooks` installs both per model
instance. ``ModelConfig(attention=False)`` replaces every attention sublayer with the identity (ablation).

Shapes: ``B`` batch, ``N`` tokens (128 bp bins), ``H`` query heads, ``C`` channels, ``T`` tracks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "BIN_SIZE",
    "KVHook",
    "ModelConfig",
    "TrackModel",
    "alphagenome_attention",
    "build_model",
    "enformer_attention",
    "relative_positional_features",
    "relative_shift",
]

BIN_SIZE = 128
KVHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelConfig:
    """Size of a compact model. ``window_bins * 128`` bp in, ``target_bins`` central bins out."""

    kind: str = "enformer"  # "enformer" | "alphagenome"
    n_tracks: int = 17
    window_bins: int = 1536
    target_bins: int = 896
    channels: int = 128
    tower_channels: int = 48  # after the stem; grows geometrically to ``channels``
    depth: int = 4
    heads: int = 8
    key_dim: int = 64
    value_dim: int = 32
    positional_features: int = 48  # Enformer: relative positional features (a multiple of 6)
    pair_channels: int = 32  # AlphaGenome: pair representation width
    pair_tile: int = 16  # AlphaGenome: tokens per pair-bias tile
    soft_cap: float = 5.0
    attention: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("enformer", "alphagenome"):
            raise ValueError(f"ModelConfig.kind: expected 'enformer' or 'alphagenome', got {self.kind!r}")
        if not 0 < self.target_bins <= self.window_bins or (self.window_bins - self.target_bins) % 2:
            raise ValueError(
                f"ModelConfig.target_bins: expected 0 < target <= window with an even difference, "
                f"got target {self.target_bins}, window {self.window_bins}"
            )
        if self.kind == "alphagenome" and self.window_bins % self.pair_tile:
            raise ValueError(
                f"ModelConfig.window_bins: expected a multiple of pair_tile {self.pair_tile}, got {self.window_bins}"
            )
        if self.positional_features % 6:
            raise ValueError(
                f"ModelConfig.positional_features: expected a multiple of 6, got {self.positional_features}"
            )

    @property
    def window_bp(self) -> int:
        return self.window_bins * BIN_SIZE

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def toy(cls, kind: str, n_tracks: int, **changes) -> ModelConfig:
        """A CPU-sized model (seconds per step): 8 kb in, 32 bins out."""
        values = dict(
            kind=kind,
            n_tracks=n_tracks,
            window_bins=64,
            target_bins=32,
            channels=32,
            tower_channels=16,
            depth=2,
            heads=2,
            key_dim=32,
            value_dim=32,
            positional_features=12,
            pair_channels=8,
        )
        values.update(changes)
        return cls(**values)


# ------------------------------------------------------------------------------------------------- attention
def relative_shift(logits: torch.Tensor) -> torch.Tensor:
    """``[..., N, 2N - 1]`` logits over distances ``-(N-1) .. N-1`` -> ``[..., N, N]`` logits over keys.

    Output ``[i, j]`` is input ``[i, (j - i) + N - 1]`` (the Transformer-XL pad-and-reshape trick).
    """
    *lead, n, width = logits.shape
    if width != 2 * n - 1:
        raise ValueError(f"logits: expected last dimension 2N - 1 = {2 * n - 1}, got {width}")
    padded = F.pad(logits, (1, 0))  # [..., N, 2N]
    padded = padded.reshape(*lead, 2 * n, n)[..., 1:, :]  # drop one row: row i now starts n - i later
    return padded.reshape(*lead, n, 2 * n - 1)[..., :n]


def relative_positional_features(n: int, features: int, device=None) -> torch.Tensor:
    """``[2N - 1, features]`` Enformer-style features of the distances ``-(N-1) .. N-1``.

    A third each of exponential decays (half-lives ``2^3 .. N``), central masks (widths ``2^1 ..``) and
    gamma densities (means spread over ``0 .. N``), each a symmetric function of ``|d|``; the second half
    repeats them multiplied by ``sign(d)``.
    """
    per_kind = features // 6
    distance = torch.arange(-(n - 1), n, device=device, dtype=torch.float32)
    absolute = distance.abs()[:, None]
    max_range = float(max(n, 2))
    half_life = 2.0 ** torch.linspace(3.0, math.log2(max_range), per_kind, device=device)
    exponential = torch.exp(-math.log(2.0) / half_life * absolute)
    widths = 2.0 ** torch.arange(1, per_kind + 1, device=device, dtype=torch.float32) - 1.0
    central = (widths > absolute).float()
    mean = torch.linspace(max_range / per_kind, max_range, per_kind, device=device)
    std = torch.full_like(mean, max_range / (2 * per_kind))
    concentration, rate = (mean / std) ** 2, mean / std**2
    log_pdf = (
        torch.xlogy(concentration - 1.0, absolute)
        - rate * absolute
        + concentration * torch.log(rate)
        - torch.lgamma(concentration)
    )
    gamma = torch.exp(log_pdf) + 1e-8
    gamma = gamma / gamma.amax(dim=0, keepdim=True)
    symmetric = torch.cat([exponential, central, gamma], dim=-1)
    return torch.cat([symmetric, torch.sign(distance)[:, None] * symmetric], dim=-1)


def enformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    relative_k: torch.Tensor,
    content_bias: torch.Tensor,
    position_bias: torch.Tensor,
) -> torch.Tensor:
    """Transformer-XL relative-position attention as in Enformer (softmax in float32 or wider).

    Args:
        q: ``[B, H, N, dk]`` queries, already scaled by ``dk ** -0.5``.
        k: ``[B, H, N, dk]`` keys. v: ``[B, H, N, dv]`` values.
        relative_k: ``[H, 2N - 1, dk]`` projected relative positional features (distances ``-(N-1)..N-1``).
        content_bias: ``[H, dk]`` (``u``). position_bias: ``[H, dk]`` (``v``).

    Returns ``[B, H, N, dv]`` = ``softmax((q + u) k^T + shift((q + v) R^T)) v``.
    """
    content = torch.einsum("bhid,bhjd->bhij", q + content_bias[:, None], k)
    position = torch.einsum("bhid,hrd->bhir", q + position_bias[:, None], relative_k)
    logits = content + relative_shift(position)
    softmax_dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.softmax(logits.to(softmax_dtype), dim=-1).to(v.dtype) @ v


def alphagenome_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pair_bias: torch.Tensor, tile: int, soft_cap: float
) -> torch.Tensor:
    """Multi-query attention with a tiled pair bias and a soft-cap, as in AlphaGenome.

    Args:
        q: ``[B, H, N, dk]`` (LayerNorm-ed, RoPE-rotated). k: ``[B, 1, N, dk]`` (the same), shared by all
            query heads. v: ``[B, 1, N, dv]`` (LayerNorm-ed).
        pair_bias: ``[B, H, N / tile, N / tile]``: one value per ``tile x tile`` block of the logits.

    Returns ``[B, H, N, dv]`` = ``softmax(cap * tanh((q k^T / sqrt(dk) + bias) / cap)) v``, logits in float32
    (or float64 for float64 inputs).
    """
    scale = q.shape[-1] ** -0.5
    logits_dtype = torch.promote_types(q.dtype, torch.float32)
    logits = torch.einsum("bhid,bjd->bhij", q.to(logits_dtype), k[:, 0].to(logits_dtype)) * scale
    bias = pair_bias.to(logits_dtype).repeat_interleave(tile, dim=-1).repeat_interleave(tile, dim=-2)
    logits = soft_cap * torch.tanh((logits + bias) / soft_cap)
    return torch.einsum("bhij,bjd->bhid", torch.softmax(logits, dim=-1).to(v.dtype), v[:, 0])


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half form, base 10000) over the last dimension of ``[B, heads, N, d]``."""
    n, d = x.shape[-2], x.shape[-1]
    half = d // 2
    frequency = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * frequency[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


class _HookedAttention(nn.Module):
    """Common plumbing: ``kv_hook`` and ``attention_fn`` are per-instance and default to None / the eager math."""

    def __init__(self, layer_index: int, attention_fn: Callable):
        super().__init__()
        self.layer_index = layer_index
        self.kv_hook: KVHook | None = None
        self.attention_fn = attention_fn

    def _hooked(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_hook is None:
            return k, v
        return self.kv_hook(self.layer_index, k, v)


class EnformerAttention(_HookedAttention):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(layer_index, enformer_attention)
        self.config = config
        h, dk, dv = config.heads, config.key_dim, config.value_dim
        self.to_q = nn.Linear(config.channels, h * dk, bias=False)
        self.to_k = nn.Linear(config.channels, h * dk, bias=False)
        self.to_v = nn.Linear(config.channels, h * dv, bias=False)
        self.to_relative_k = nn.Linear(config.positional_features, h * dk, bias=False)
        self.content_bias = nn.Parameter(torch.randn(h, dk) * dk**-0.5)
        self.position_bias = nn.Parameter(torch.randn(h, dk) * dk**-0.5)
        self.to_out = nn.Linear(h * dv, config.channels)  # not zero-initialised: random weights must matter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, dk, dv = self.config.heads, self.config.key_dim, self.config.value_dim
        q = self.to_q(x).view(b, n, h, dk).transpose(1, 2) * dk**-0.5
        k = self.to_k(x).view(b, n, h, dk).transpose(1, 2)
        v = self.to_v(x).view(b, n, h, dv).transpose(1, 2)
        features = relative_positional_features(n, self.config.positional_features, x.device).to(x.dtype)
        relative_k = self.to_relative_k(features).view(2 * n - 1, h, dk).transpose(0, 1)
        k, v = self._hooked(k, v)
        out = self.attention_fn(q, k, v, relative_k, self.content_bias.to(q.dtype), self.position_bias.to(q.dtype))
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * dv))


class AlphaGenomeAttention(_HookedAttention):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(layer_index, alphagenome_attention)
        self.config = config
        h, dk, dv = config.heads, config.key_dim, config.value_dim
        self.to_q = nn.Linear(config.channels, h * dk, bias=False)
        self.to_k = nn.Linear(config.channels, dk, bias=False)
        self.to_v = nn.Linear(config.channels, dv, bias=False)
        self.norm_q, self.norm_k, self.norm_v = nn.LayerNorm(dk), nn.LayerNorm(dk), nn.LayerNorm(dv)
        self.to_pair_bias = nn.Linear(config.pair_channels, h)
        self.to_out = nn.Linear(h * dv, config.channels)

    def forward(self, x: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, dk, dv = self.config.heads, self.config.key_dim, self.config.value_dim
        q = _rotary(self.norm_q(self.to_q(x).view(b, n, h, dk)).transpose(1, 2))
        k = _rotary(self.norm_k(self.to_k(x)).unsqueeze(1))
        v = self.norm_v(self.to_v(x)).unsqueeze(1)
        pair_bias = self.to_pair_bias(pair).permute(0, 3, 1, 2)  # [B, H, N/tile, N/tile]
        k, v = self._hooked(k, v)
        out = self.attention_fn(q, k, v, pair_bias, self.config.pair_tile, self.config.soft_cap)
        return self.to_out(out.transpose(1, 2).reshape(b, n, h * dv))


# ------------------------------------------------------------------------------------------------- blocks
class _ChannelNorm(nn.Module):
    """LayerNorm over channels at every position of ``[B, C, L]`` (batch- and position-independent)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.transpose(1, 2)).transpose(1, 2)


def _conv_block(c_in: int, c_out: int, width: int) -> nn.Sequential:
    return nn.Sequential(_ChannelNorm(c_in), nn.GELU(), nn.Conv1d(c_in, c_out, width, padding=width // 2))


class _Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ConvTower(nn.Module):
    """One-hot ``[B, 4, L]`` -> ``[B, N, C]`` at 128 bp: a stem at 1 bp and six stages, each halving length."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c0, c = config.tower_channels, config.channels
        widths = [round(c0 * (c / c0) ** (i / 6)) for i in range(7)]
        layers: list[nn.Module] = [
            nn.Conv1d(4, c0, 15, padding=7),
            _Residual(_conv_block(c0, c0, 1)),
            nn.MaxPool1d(2),
        ]
        for c_in, c_out in zip(widths[:-1], widths[1:], strict=True):
            layers += [_conv_block(c_in, c_out, 5), _Residual(_conv_block(c_out, c_out, 1)), nn.MaxPool1d(2)]
        self.layers = nn.Sequential(*layers)

    def forward(self, one_hot: torch.Tensor) -> torch.Tensor:
        return self.layers(one_hot).transpose(1, 2)


class _FeedForward(nn.Module):
    def __init__(self, channels: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(channels),
            nn.Linear(channels, 2 * channels),
            nn.Dropout(dropout),
            nn.GELU(),
            nn.Linear(2 * channels, channels),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


class _PairRepresentation(nn.Module):
    """AlphaGenome-style pair activations at ``tile``-token resolution: ``[B, N/tile, N/tile, P]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tile = config.pair_tile
        p = config.pair_channels
        self.norm = nn.LayerNorm(config.channels)
        self.left = nn.Linear(config.channels, p)
        self.right = nn.Linear(config.channels, p)
        self.max_distance = 32
        self.distance = nn.Embedding(2 * self.max_distance + 1, p)
        self.out = nn.Sequential(nn.GELU(), nn.Linear(p, p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        pooled = self.norm(x).view(b, n // self.tile, self.tile, c).mean(2)
        tiles = pooled.shape[1]
        index = torch.arange(tiles, device=x.device)
        offset = (index[None, :] - index[:, None]).clamp(-self.max_distance, self.max_distance) + self.max_distance
        pair = self.left(pooled)[:, :, None] + self.right(pooled)[:, None, :] + self.distance(offset)[None]
        return self.out(pair)


class TrackModel(nn.Module):
    """Tower -> ``depth`` x (attention, feed-forward) -> central crop -> per-bin track head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tower = ConvTower(config)
        layer = EnformerAttention if config.kind == "enformer" else AlphaGenomeAttention
        self.attention = nn.ModuleList(layer(config, index) for index in range(config.depth))
        self.attention_norm = nn.ModuleList(nn.LayerNorm(config.channels) for _ in range(config.depth))
        self.feed_forward = nn.ModuleList(_FeedForward(config.channels, config.dropout) for _ in range(config.depth))
        self.pair = _PairRepresentation(config) if config.kind == "alphagenome" else None
        self.head = nn.Sequential(
            nn.LayerNorm(config.channels),
            nn.Linear(config.channels, 2 * config.channels),
            nn.GELU(),
            nn.Linear(2 * config.channels, config.n_tracks),
        )

    def forward(self, one_hot: torch.Tensor) -> torch.Tensor:
        """``[B, 4, window_bins * 128]`` one-hot (N = all zeros) -> ``[B, target_bins, n_tracks]``."""
        expected = (4, self.config.window_bp)
        if one_hot.dim() != 3 or tuple(one_hot.shape[1:]) != expected:
            raise ValueError(f"one_hot: expected [B, {expected[0]}, {expected[1]}], got {tuple(one_hot.shape)}")
        x = self.tower(one_hot)
        pair = self.pair(x) if self.pair is not None and self.config.attention else None
        for attention, norm, feed_forward in zip(self.attention, self.attention_norm, self.feed_forward, strict=True):
            if self.config.attention:
                y = norm(x)
                x = x + (attention(y, pair) if pair is not None else attention(y))
            x = feed_forward(x)
        crop = (self.config.window_bins - self.config.target_bins) // 2
        return self.head(x[:, crop : crop + self.config.target_bins])


def build_model(config: ModelConfig, seed: int | None = None) -> TrackModel:
    """A freshly initialised model (seeded when ``seed`` is given)."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TrackModel(config)
    return TrackModel(config)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# ------------------------------------------------------------------------------------------------- files
def save_model(model: TrackModel, path: str, metadata: dict, *, dtype: torch.dtype | None = None) -> None:
    """Write the weights as safetensors; ``metadata`` (JSON-serialisable) travels in the header.

    ``dtype``: store floating-point tensors in this dtype (e.g. bfloat16, half the bytes; :func:`load_model`
    reads them back into the model's float32 parameters).
    """
    import json

    from safetensors.torch import save_file

    header = {"model_config": json.dumps(model.config.as_dict()), "kvbound_eval": json.dumps(metadata)}
    header["stored_dtype"] = str(dtype or "as trained").removeprefix("torch.")
    tensors = {
        name: (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)
        .detach()
        .cpu()
        .contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(tensors, path, metadata=header)


def load_model(path: str, device: torch.device | str = "cpu") -> tuple[TrackModel, dict]:
    """Inverse of :func:`save_model`: the model (eval mode) and its metadata."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as handle:
        header = handle.metadata() or {}
    if "model_config" not in header:
        raise ValueError(f"{path}: not a kvbound.eval model (no 'model_config' in the safetensors metadata)")
    config = ModelConfig(**json.loads(header["model_config"]))
    model = TrackModel(config)
    model.load_state_dict(load_file(path, device=str(device)))
    return model.to(device).eval(), json.loads(header.get("kvbound_eval", "{}"))
