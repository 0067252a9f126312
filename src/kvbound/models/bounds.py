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

import torch

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
    """
    a = effective_query.detach().to(torch.float64)
    vv = v.detach().to(torch.float64)
    group = a.shape[1] // vv.shape[1]
    delta = a.abs().sum(-1, keepdim=True) * (abs(logit_scale) * tau_k)  # [B, Hq, N, 1]
    spread = (vv.amax(dim=2) - vv.amin(dim=2)).repeat_interleave(group, dim=1)[:, :, None]  # [B, Hq, 1, Dv]
    return torch.tanh(delta / 2) * spread + tau_v


def linear_output_bound(bound: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Bound after ``y = x W^T + b``: ``|W| @ bound`` (``bound`` ``[..., in]`` -> ``[..., out]``), float64."""
    return bound.to(torch.float64) @ weight.detach().to(torch.float64).abs().T
