"""The float64 attention oracle. Optimised code never imports this module; tests compare against it."""

from __future__ import annotations

import math

import torch

from kvbound._validate import FLOAT_DTYPES_AND_64, check_tensor

__all__ = ["reference_attention"]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Eager float64 softmax attention: the correctness oracle of every fused path.

    Args:
        q: ``[B, Hq, Nq, Dk]``; k: ``[B, Hkv, Nk, Dk]``; v: ``[B, Hkv, Nk, Dv]``; ``Hq`` a multiple of ``Hkv``
            (query head ``h`` reads K/V head ``h // (Hq // Hkv)``); ``Dk`` and ``Dv`` may differ. float16, bfloat16,
            float32 or float64.
        scale: logit scale, default ``1 / sqrt(Dk)``.
        causal: mask key ``j`` for query ``i`` when ``j > i`` (top-left aligned, as torch SDPA's ``is_causal``).
        bias: additive logit bias broadcastable to ``[B, Hq, Nq, Nk]``, added after scaling.
        softcap: if given, logits become ``softcap * tanh(logits / softcap)`` after the bias, before the mask.

    Returns:
        ``[B, Hq, Nq, Dv]`` float64.
    """
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(t, name, ndim=4, dtypes=FLOAT_DTYPES_AND_64)
    b, hq, nq, dk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k, v: expected batch {b} (from q), got {k.shape[0]} and {v.shape[0]}")
    hkv, nk = k.shape[1], k.shape[2]
    if k.shape[3] != dk:
        raise ValueError(f"k: expected head dim {dk} (from q), got {k.shape[3]}")
    if v.shape[1] != hkv or v.shape[2] != nk:
        raise ValueError(f"v: expected [B, {hkv}, {nk}, Dv] (from k), got {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"q: expected a head count that is a multiple of k's {hkv}, got {hq}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap: expected a finite value > 0, got {softcap}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    scale = 1.0 / math.sqrt(dk) if scale is None else float(scale)
    group = hq // hkv
    q64 = q.detach().to(torch.float64)
    k64 = k.detach().to(torch.float64).repeat_interleave(group, dim=1)
    v64 = v.detach().to(torch.float64).repeat_interleave(group, dim=1)
    logits = (q64 @ k64.transpose(-1, -2)) * scale
    if bias is not None:
        check_tensor(bias, "bias", dtypes=FLOAT_DTYPES_AND_64,
                     check_finite=False)
        if torch.isnan(bias).any() or torch.isposinf(bias).any():  # -inf is a mask
            raise ValueError("bias: expected finite values or -inf (a mask), found NaN or +Inf")
        try:
            logits = logits + bias.detach().to(torch.float64)
        except RuntimeError as err:
            raise ValueError(
                f"bias: expected a shape broadcastable to {(b, hq, nq, nk)}, got {tuple(bias.shape)}"
            ) from err
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if causal:
        keep = torch.ones(nq, nk, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~keep, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    # A fully masked row (a bias of -inf over all keys; the top-left causal mask leaves none) gives zeros, not
    # NaN; NaN from anything else stays visible.
    masked = torch.isneginf(logits).all(dim=-1, keepdim=True)
    weights = torch.where(masked, torch.zeros((), dtype=weights.dtype, device=weights.device), weights)
    return weights @ v64
