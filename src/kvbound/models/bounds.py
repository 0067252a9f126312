"""A certified element-wise bound on the attention output when K and V are within ``tau_k``, ``tau_v``.

Write one query's logits as ``s_j = a . k_j + r_j`` (``a`` the effective query, ``r_j`` whatever does not
depend on K: relative-position or pair bias). Replacing ``k_j`` by ``k^_j`` with ``|k - k^| <= tau_k``
element-wise moves each logit by at most ``delta = ||a||_1 tau_k``; a soft-cap ``c tanh(x / c)`` is
1-Lipschitz, so the capped logits move by no more. The two softmax distributions ``p``, ``p^`` then have a
log-ratio confined to an interval of width ``2 delta``, which bounds their total variation by
``tanh(delta / 2)``. With ``|v - v^| <= tau_v``::

    |o_d - o^_d| = |sum_j (p_j - p^_j) v_jd + sum_j p^_j (v_jd - v^_jd)|
                <= tanh(delta / 2) * (max_j v_jd - min_j v_jd) + tau_v

(the first sum is unchanged by subtracting the midpoint of ``v_{.d}``, since both distributions sum to 1).
This bounds the exact-arithmetic outputs; a float32 evaluation adds its own rounding on top.
"""

from __future__ import annotations

import math

import torch

from kvbound._validate import FLOAT_DTYPES_AND_64 as _DTYPES
from kvbound._validate import check_tensor

__all__ = ["attention_output_bound", "linear_output_bound"]


def attention_output_bound(
    effective_query: torch.Tensor, v: torch.Tensor, *, tau_k: float, tau_v: float, logit_scale: float = 1.0
) -> torch.Tensor:
    """Element-wise bound on ``|attention(K, V) - attention(K^, V^)|``.

    Args:
        effective_query: ``[B, Hq, N, Dk]``: the vector each key is dotted with, before ``logit_scale``
            (Enformer/Borzoi: ``scale q + u``; AlphaGenome: ``q`` with ``logit_scale = 1 / sqrt(128)``).
        v: ``[B, Hkv, Nk, Dv]`` original values; ``Hq`` a multiple of ``Hkv``.
        tau_k, tau_v: the codec bounds on K and V.

    Returns:
        ``[B, Hq, N, Dv]`` float64.

    Raises ``TypeError``/``ValueError`` naming the argument for non-float or non-finite tensors, shapes that do not
    pair (batch, head groups, empty keys), and taus or a scale that are not finite numbers >= 0 (taus) / finite.
    """
    check_tensor(effective_query, "effective_query", ndim=4, dtypes=_DTYPES)
    check_tensor(v, "v", ndim=4, dtypes=_DTYPES)
    for name, value in (("tau_k", tau_k), ("tau_v", tau_v), ("logit_scale", logit_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
        if not math.isfinite(value) or (name != "logit_scale" and value < 0):
            kind = "finite float" if name == "logit_scale" else "finite float >= 0"
            raise ValueError(f"{name}: expected a {kind}, got {value!r}")
    if v.shape[0] != effective_query.shape[0]:
        raise ValueError(f"v: expected batch {effective_query.shape[0]} (from effective_query), got {v.shape[0]}")
    if effective_query.shape[1] % v.shape[1]:
        raise ValueError(f"effective_query: expected a head count that is a multiple of v's {v.shape[1]}, "
                         f"got {effective_query.shape[1]}")  # fmt: skip
    a = effective_query.detach().to(torch.float64)
    vv = v.detach().to(torch.float64)
    group = a.shape[1] // vv.shape[1]
    delta = a.abs().sum(-1, keepdim=True) * (abs(logit_scale) * tau_k)  # [B, Hq, N, 1]
    spread = (vv.amax(dim=2) - vv.amin(dim=2)).repeat_interleave(group, dim=1)[:, :, None]  # [B, Hq, 1, Dv]
    return torch.tanh(delta / 2) * spread + tau_v


def linear_output_bound(bound: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bound after ``y = x W^T + b``: ``|W| @ bound`` (``bound`` ``[..., in]`` -> ``[..., out]``), float64."""
    check_tensor(bound, "bound", dtypes=_DTYPES)
    check_tensor(weight, "weight", ndim=2, dtypes=_DTYPES)
    if bool((bound < 0).any()):
        raise ValueError("bound: expected values >= 0 (a bound on absolute differences), got negative ones")
    if bound.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected [out, {bound.shape[-1]}] (in from bound), got {list(weight.shape)}")
    return bound.to(torch.float64) @ weight.detach().to(torch.float64).abs().T
