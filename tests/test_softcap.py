"""The soft-cap ``c tanh(x / c)`` at any cap: the kernels' two forms of tanh and the attention they give.

Form 1 (``1 - 2 / (1 + e^(2t))``) has an absolute error of a few 2**-24, which near t = 0 is a large relative error;
form 2 sums tanh's series there. ``softcap_form`` takes form 1 only where its error stays far below the input
dtype's rounding, so a large cap (or float32 input) keeps every logit to a few 2**-24 of itself."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from kvbound import CompressionConfig, compress_kv
from kvbound.attention import attention
from kvbound.kernels._common import SOFTCAP_EXP, SOFTCAP_SERIES, soft_capped, softcap_form
from test_attention import check_against_reference, structured


@triton.jit
def _soft_capped_kernel(t_ptr, out_ptr, n, softcap_log2, FORM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(t_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, soft_capped(t, softcap_log2, FORM), mask=offs < n)


def _soft_capped(t: torch.Tensor, form: int, softcap_log2: float = 1.0) -> torch.Tensor:
    out = torch.empty_like(t)
    _soft_capped_kernel[(triton.cdiv(t.numel(), 256),)](t, out, t.numel(), softcap_log2, FORM=form, BLOCK=256)
    return out


def _arguments(device: str) -> torch.Tensor:
    """t from 1e-20 to 30 (both signs, and 0), densest around the series' limit 0.55."""
    magnitudes = torch.cat([torch.logspace(-20, math.log10(30.0), 700), torch.linspace(0.4, 0.7, 301)])
    return torch.cat([magnitudes, -magnitudes, torch.zeros(1)]).float().to(device)


def _relative_errors(t: torch.Tensor, form: int) -> torch.Tensor:
    exact = torch.tanh(t.double())
    got = _soft_capped(t, form).double()
    return (got - exact).abs() / exact.abs().clamp_min(1e-300)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The CPU under Triton's interpreter, and the GPU (tests marked ``gpu``)."""
    return request.param


def test_series_form_keeps_every_tanh_to_a_few_units_of_float32(device):
    t = _arguments(device)
    rel = _relative_errors(t, SOFTCAP_SERIES)
    assert torch.isfinite(rel).all()
    assert float(rel.max()) <= 8 * 2.0**-24, float(rel.max())
    assert float(_soft_capped(t[-1:], SOFTCAP_SERIES)) == 0.0


def test_exp_form_loses_small_arguments_that_the_series_keeps(device):
    """Form 1's absolute error is a few 2**-24: at |t| = 1e-6 that is a relative error far above float32's."""
    t = _arguments(device)
    small = t.abs() < 1e-4
    exp_form = _relative_errors(t, SOFTCAP_EXP)
    assert float(exp_form[small].max()) > 1e-3
    assert float(exp_form[t.abs() > 2.0].max()) <= 8 * 2.0**-24
    assert float(_relative_errors(t, SOFTCAP_SERIES)[small].max()) <= 8 * 2.0**-24


def test_soft_capped_scales_by_the_cap_in_log2_units(device):
    t = torch.tensor([-3.0, -0.25, 1e-3, 0.5, 2.0], device=device)
    cap_log2 = 7.0 * 1.4426950408889634
    exact = cap_log2 * torch.tanh(t.double())
    # Form 1 to a few 2**-24 of the cap, form 2 to a few 2**-24 of each value.
    exp_form = _soft_capped(t, SOFTCAP_EXP, cap_log2).double()
    torch.testing.assert_close(exp_form, exact, rtol=0.0, atol=cap_log2 * 2.0**-21)
    torch.testing.assert_close(_soft_capped(t, SOFTCAP_SERIES, cap_log2).double(), exact, rtol=2.0**-21, atol=0.0)


@pytest.mark.parametrize(
    "softcap, dtype, form",
    [
        (None, torch.bfloat16, 0),
        (5.0, torch.bfloat16, SOFTCAP_EXP),
        (8192.0, torch.bfloat16, SOFTCAP_EXP),
        (8193.0, torch.bfloat16, SOFTCAP_SERIES),
        (1024.0, torch.float16, SOFTCAP_EXP),
        (1025.0, torch.float16, SOFTCAP_SERIES),
        (5.0, torch.float32, SOFTCAP_SERIES),
        (0.125, torch.float32, SOFTCAP_EXP),
    ],
)
def test_softcap_form_follows_the_input_dtype(softcap, dtype, form):
    assert softcap_form(softcap, dtype) == form


# Caps the kernels refused before their series form (above 4096), float32 at caps where form 1 was used, and tiny caps.
LARGE_CAPS = [
    (torch.float32, 50.0),
    (torch.float32, 1.0e4),
    (torch.float32, 1.0e9),
    (torch.float16, 5.0e3),
    (torch.float16, 1.0e6),
    # the smallest caps allowed: every logit saturates at +-cap
    (torch.float32, 2.0**-60),
    (torch.float16, 2.0**-60),
]


# tanh's exp2 overflows to inf for saturated logits by design (the interpreter's NumPy says so; a GPU does not)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "compressed"])
@pytest.mark.parametrize("dtype, softcap", LARGE_CAPS, ids=lambda x: str(x).replace("torch.", ""))
def test_attention_at_large_caps_matches_the_reference(dtype, softcap, compressed, device):
    """Within twice plain PyTorch attention's error in the same dtype, dense and compressed, causal, with a bias."""
    _large_cap_case(dtype, softcap, compressed, device)


@pytest.mark.gpu
@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "compressed"])
@pytest.mark.parametrize("softcap", [1.0e4, 1.0e6, 2.0**-60])
def test_gpu_bfloat16_attention_at_large_caps_matches_the_reference(softcap, compressed):
    """bfloat16 (whose products the interpreter cannot run) at caps above 8192, which take the series form, and at
    the smallest caps."""
    if softcap > 1.0:
        assert softcap_form(softcap, torch.bfloat16) == SOFTCAP_SERIES
    _large_cap_case(torch.bfloat16, softcap, compressed, "cuda")


def _large_cap_case(dtype, softcap, compressed, device):
    g = torch.Generator().manual_seed(int(softcap) % 1000 + 7)
    q = torch.randn(1, 4, 37, 32, generator=g).to(device, dtype)
    k = structured(1, 2, 70, 32, dtype, 31).to(device)
    v = structured(1, 2, 70, 24, dtype, 32).to(device)
    bias = (torch.randn(1, 4, 37, 1, generator=g) * 3.0).to(device)
    cfg = CompressionConfig(block_size=16, rank=4)
    kk, vv = (compress_kv(k, cfg), compress_kv(v, cfg)) if compressed else (k, v)
    k_ref, v_ref = (kk.decompress(), vv.decompress()) if compressed else (k, v)
    out = attention(q, kk, vv, causal=True, bias=bias, softcap=softcap)
    check_against_reference(out, q, k_ref, v_ref, causal=True, bias=bias, softcap=softcap)


def test_a_cap_far_above_the_logits_gives_uncapped_attention(device):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(device) for _ in range(3))
    capped = attention(q, k, v, softcap=1.0e9)
    torch.testing.assert_close(capped, attention(q, k, v), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "compressed"])
def test_tiny_caps_with_huge_logits_raise_instead_of_nan(compressed, device):
    """The kernels divide each logit term by the cap in float32: terms of 2e20 and -1e20 (a bias) over a cap of
    2**-64 would overflow to inf - inf. Such inputs raise, naming the dominant term; so do query rows whose
    multiplier scale / softcap would overflow."""
    q = torch.full((1, 1, 4, 16), 1.0e10, device=device)
    k = torch.full((1, 1, 32, 16), 1.25e9, device=device)
    v = torch.randn(1, 1, 32, 16, generator=torch.Generator().manual_seed(5)).to(device)
    cfg = CompressionConfig(block_size=16, rank=0)
    kk, vv = (compress_kv(k, cfg), compress_kv(v, cfg)) if compressed else (k, v)
    bias = torch.full((1, 1, 4, 1), -1.0e20, device=device)
    with pytest.raises(ValueError, match=r"^q, k: expected magnitudes whose logits stay below 7\.2\de\+16 \(float32's "
                                         r"range times the soft-cap over 2\*\*8\), got logits of up to 3e\+20"):
        attention(q, kk, vv, bias=bias, scale=1.0, softcap=2.0**-64)
    tiny_k = torch.full((1, 1, 32, 16), 1.0e-30, device=device)
    kk = compress_kv(tiny_k, cfg) if compressed else tiny_k
    multiplier = r"^q: expected \|scale\| max\|q\| / softcap below 1\.33e\+36 .*, got 1\.84e\+49"
    with pytest.raises(ValueError, match=multiplier):
        attention(torch.full((1, 1, 4, 16), 1.0e30, device=device), kk, vv, scale=1.0, softcap=2.0**-64)
