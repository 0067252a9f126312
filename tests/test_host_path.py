"""The host path of ``kvbound.attention``: the dense launcher's per-signature plans, the cached zero biases and the
direct call of the op's implementation in plain eager mode never change a result. Every call is compared against
the float64 references after calls of other signatures (CPU: Triton's interpreter, conftest)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvbound
from kvbound.attention import attention
from kvbound.models.reference import relative_position_attention_reference

_TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _qkv(b=1, hq=2, hkv=2, n_q=24, n_k=24, dk=16, dv=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_q, dk, generator=g).to(dtype)
    k = torch.randn(b, hkv, n_k, dk, generator=g).to(dtype)
    v = torch.randn(b, hkv, n_k, dv, generator=g).to(dtype)
    return q, k, v


def _check(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    err = (out.double() - expected).abs().max().item()
    assert err <= _TOL[dtype], f"max error {err:.2e}"


def _expanded_bias(bias, tile, n_q, n_k):
    if tile == 1:
        return bias
    return bias.repeat_interleave(tile, -2).repeat_interleave(tile, -1)[..., :n_q, :n_k]


def test_same_shapes_other_strides_dtypes_and_scalars_are_not_served_a_stale_plan():
    q, k, v = _qkv()
    calls = [
        dict(),
        dict(scale=0.3),
        dict(causal=True),
        dict(softcap=2.0),
        dict(softcap=30.0),  # above the fixed-maximum limit: the running maximum
    ]
    for kwargs in calls:
        for dtype in (torch.float32, torch.float16):
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            # Same shapes, other strides: [B, N, H, D] storage seen as [B, H, N, D], and a strided head dim.
            qt = qd.transpose(1, 2).contiguous().transpose(1, 2)
            kt = torch.empty(1, 2, 24, 32, dtype=dtype)[..., ::2].copy_(kd)
            vt = vd.transpose(1, 2).contiguous().transpose(1, 2)
            expected = kvbound.reference_attention(q, k, v, **kwargs)
            for args in ((qd, kd, vd), (qt, kt, vt), (qd, kt, vd), (qd, kd, vd)):
                assert args[1].stride() != kd.stride() or args[1] is kd
                _check(attention(*args, **kwargs), expected, dtype)


def test_bias_shape_dtype_and_tile_changes_between_calls():
    q, k, v = _qkv(hq=4, hkv=2, n_q=40, n_k=36)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(1, 4, 40, 36, generator=g)
    biases = [
        (full, 1),
        (full[:, :1], 1),  # broadcast over heads: stride 0
        (full[0, 0], 1),  # 2-d
        (full.to(torch.float16), 1),
        (full.transpose(-1, -2).contiguous().transpose(-1, -2), 1),
        (torch.randn(1, 4, 5, 5, generator=g), 8),
        (torch.randn(1, 1, 5, 5, generator=g), 8),
        (torch.randn(1, 4, 3, 3, generator=g), 16),
        (None, 1),
    ]
    for bias, tile in biases * 2:
        kwargs = dict(softcap=5.0) if tile > 1 else {}
        dense = None if bias is None else _expanded_bias(bias, tile, 40, 36)
        expected = kvbound.reference_attention(q, k, v, bias=dense, **kwargs)
        out = attention(q, k, v, bias=bias, bias_tile=tile, **kwargs)
        _check(out, expected, torch.float32)


def test_grouped_heads_and_lengths_change_between_calls():
    for hq, hkv, n_q, n_k in ((4, 2, 24, 24), (4, 1, 24, 24), (4, 4, 24, 24), (4, 1, 17, 33), (4, 1, 33, 17)):
        q, k, v = _qkv(hq=hq, hkv=hkv, n_q=n_q, n_k=n_k, seed=hq + n_q)
        _check(attention(q, k, v, causal=True), kvbound.reference_attention(q, k, v, causal=True), torch.float32)


def test_relative_positions_with_cached_zero_biases_and_converted_biases():
    g = torch.Generator().manual_seed(2)
    h, n, dk, dv = 2, 20, 16, 24
    q, k, v = _qkv(hq=h, hkv=h, n_q=n, n_k=n, dk=dk, dv=dv, seed=5)
    rk = torch.randn(h, 2 * n - 1, dk, generator=g) * 0.5
    u = torch.randn(1, h, 1, dk, generator=g) * 0.5
    w = torch.randn(h, dk, generator=g, dtype=torch.float64) * 0.5
    zeros = torch.zeros(h, dk)
    cases = [
        (u, w),
        (None, None),
        (u, None),
        (None, w),
        (u[0, :, 0].t().contiguous().t(), w[:1].expand(h, dk)),  # non-contiguous [H, Dk], broadcast head
        (u[0, 0, 0], w.to(torch.float16)),  # [Dk]
    ]
    for u_arg, w_arg in cases * 2:
        out = attention(q, k, v, relative_keys=rk, relative_content_bias=u_arg, relative_position_bias=w_arg)
        u_ref = zeros if u_arg is None else u_arg.expand(h, dk) if u_arg.dim() < 4 else u_arg
        w_ref = zeros if w_arg is None else w_arg.expand(h, dk)
        expected = relative_position_attention_reference(
            q, k, v, rk, u_ref.reshape(1, h, 1, dk), w_ref.reshape(1, h, 1, dk), scale=dk**-0.5
        )
        _check(out, expected, torch.float32)
    # The inputs are never written (the cached zero biases are read-only operands).
    assert torch.equal(zeros, torch.zeros(h, dk))


def test_non_finite_input_is_caught_after_a_finite_call_of_the_same_signature():
    q, k, v = _qkv()
    bias = torch.randn(1, 2, 3, 3)
    attention(q, k, v, bias=bias, bias_tile=8)
    bad = bias.clone()
    bad[0, 1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^bias: expected finite values, found nan at index \(0, 1, 2, 0\)"):
        attention(q, k, v, bias=bad, bias_tile=8)
    v_bad = v.clone()
    v_bad[0, 0, 3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"^v: expected finite values, found Inf .*call 2 of 2.*: q \[1, 2, 24, 16\]"):
        with kvbound.deferred_checks():
            attention(q, k, v)
            attention(q, k, v_bad)


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_op_is_dispatched_whenever_something_could_observe_it():
    q, k, v = _qkv()
    direct = attention(q, k, v)
    with _RecordOps() as mode:
        observed = attention(q, k, v)
    assert any("kvbound.attention_dense" in op for op in mode.ops)
    torch.testing.assert_close(observed, direct, rtol=0, atol=0)
    # Inputs that require grad go through the op (autograd sees it; the output is part of the graph).
    out = attention(q.clone().requires_grad_(), k, v)
    assert out.requires_grad
    with torch.no_grad():
        assert not attention(q.clone().requires_grad_(), k, v).requires_grad
    # And the profiler records the op by name.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, k, v)
    assert any("kvbound::attention_dense" in e.name for e in prof.events())


def test_compressed_calls_take_the_same_paths():
    """Compressed K/V: the implementation directly in plain eager mode, the op whenever something observes it
    (which then checks K/V itself); both give the same output."""
    q, k, v = _qkv()
    config = kvbound.CompressionConfig(block_size=16, rank=2, bits=4, tau=2**-5)
    ck, cv = kvbound.compress_kv(k, config), kvbound.compress_kv(v, config)
    direct = attention(q, ck, cv)
    with _RecordOps() as mode:
        observed = attention(q, ck, cv)
    assert any("kvbound.attention_compressed" in op for op in mode.ops)
    torch.testing.assert_close(observed, direct, rtol=0, atol=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, ck, cv)
    assert any("kvbound::attention_compressed" in e.name for e in prof.events())


def test_meta_tensors_take_the_fake_implementation():
    q = torch.empty(1, 2, 16, 16, device="meta")
    k = torch.empty(1, 2, 24, 16, device="meta")
    v = torch.empty(1, 2, 24, 8, device="meta")
    out = kvbound.attention(q, k, v)
    assert out.device.type == "meta" and tuple(out.shape) == (1, 2, 16, 8)
