"""kvbound.kernels.peaks: the largest magnitude of up to eight tensors in one launch (Triton's interpreter on CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from kvbound import _checks
from kvbound.kernels import peaks


def _tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 37, 3 * 24, generator=g).to(dtype)
    heads = base.view(2, 37, 3, 24).transpose(1, 2)  # heads-split view: dense in another order
    return [
        heads,
        torch.randn(5000, generator=g).to(dtype) * 7,  # more than one block
        torch.randn(3, 1, 17, generator=g).to(dtype),
        torch.zeros(4, 4, dtype=dtype),
        torch.full((1,), -3.5, dtype=dtype),
        torch.randn(9000, generator=g).to(dtype)[::1],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_peaks_equal_the_largest_magnitude_of_each_tensor(dtype, monkeypatch):
    monkeypatch.setattr(peaks, "_BLOCK", 1024)  # several blocks per tensor at these sizes
    tensors = _tensors(dtype)
    got = peaks.largest_magnitudes(tensors)
    assert got is not None and got.dtype == torch.float32 and got.shape == (len(tensors),)
    want = torch.stack([t.abs().max().float() for t in tensors])
    assert torch.equal(got, want)
    assert got[3].item() == 0.0 and got[4].item() == 3.5


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_peaks_report_nan_before_inf_and_either_before_any_finite(value, monkeypatch):
    monkeypatch.setattr(peaks, "_BLOCK", 1024)
    tensors = _tensors(torch.bfloat16, seed=1)
    tensors[1][4321] = value  # a later block of the second tensor
    tensors[2][2, 0, 16] = math.inf  # the last element of the third
    got = peaks.largest_magnitudes(tensors)
    assert math.isinf(got[2].item())
    if math.isnan(value):
        assert math.isnan(got[1].item())
        tensors[1][7] = math.inf  # a NaN anywhere wins over an Inf
        assert math.isnan(peaks.largest_magnitudes(tensors)[1].item())
    else:
        assert got[1].item() == math.inf
    assert all(math.isfinite(v) for i, v in enumerate(got.tolist()) if i not in (1, 2))


def test_peaks_refuse_what_they_cannot_read_in_one_launch():
    a = torch.randn(8, 8)
    assert peaks.largest_magnitudes([]) is None
    assert peaks.largest_magnitudes([a] * (peaks.MAX_TENSORS + 1)) is None
    assert peaks.largest_magnitudes([a, a.half()]) is None  # two dtypes
    assert peaks.largest_magnitudes([a.double()]) is None
    assert peaks.largest_magnitudes([a[:, ::2]]) is None  # gaps in its storage
    assert peaks.dense_flat(a[:, ::2]) is None
    assert peaks.dense_flat(a.t()) is not None and peaks.dense_flat(a.t()).numel() == 64
    expanded = torch.randn(8, 1).expand(8, 8)  # stride 0: overlapping
    assert peaks.dense_flat(expanded) is None


def test_checks_take_the_kernel_for_cuda_groups_and_keep_the_order(monkeypatch):
    """_checks.largest_magnitudes groups by dtype, takes the kernel where it applies (here: CPU tensors allowed as
    if they were CUDA ones), falls back to _foreach_norm for a group it refuses, and keeps the input order."""
    calls = []
    real = peaks.largest_magnitudes

    def spy(group):
        calls.append(len(group))
        return real(group)

    monkeypatch.setattr(peaks, "largest_magnitudes", spy)
    monkeypatch.setattr(_checks, "_gpu_peaks", lambda group: peaks.largest_magnitudes(group))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 10, 8, generator=g).to(torch.bfloat16)
    bias = torch.randn(4, 8, generator=g) * 9
    gappy = torch.randn(4, 16, generator=g).to(torch.bfloat16)[:, ::2]
    k = torch.randn(2, 4, 10, 8, generator=g).to(torch.bfloat16)
    k[1, 2, 3, 4] = math.nan
    tensors = [q, bias, k, gappy]
    got = _checks.largest_magnitudes(tensors)
    assert calls == [3, 1]  # bfloat16 (refused: one has gaps, then _foreach_norm), float32
    assert got.dtype == torch.float64
    want = [t.abs().max().double().item() for t in tensors]
    assert got[0].item() == want[0] and got[1].item() == want[1] and got[3].item() == want[3]
    assert math.isnan(got[2].item())
    tensors = [q, bias, k.nan_to_num()]
    got = _checks.largest_magnitudes(tensors)
    assert calls[-2:] == [2, 1]
    assert got.tolist() == [t.abs().max().double().item() for t in tensors]


@pytest.mark.gpu
def test_gpu_peaks_of_a_layer_bf16():
    """On the GPU: Borzoi-sized heads-split q, k, v (batch 2) and small float32 tensors, exact peaks; a NaN and an
    Inf in the middle of v are reported."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, n = 2, 4096
    q, k, v = (torch.randn(b, n, 8 * d, device="cuda", generator=g).to(torch.bfloat16).view(b, n, 8, d).transpose(1, 2)
               for d in (64, 64, 192))  # fmt: skip
    small = [torch.randn(8, 64, device="cuda", generator=g) * 5, torch.randn(8, 64, device="cuda", generator=g)]
    tensors = [q, k, v, *small]
    got = _checks.largest_magnitudes(tensors)
    assert got.tolist() == [t.abs().max().double().item() for t in tensors]
    v[1, 3, 2000, 100] = math.inf
    assert peaks.largest_magnitudes([q, k, v])[2].item() == math.inf
    v[0, 5, 17, 3] = math.nan
    assert math.isnan(_checks.largest_magnitudes(tensors)[2].item())
