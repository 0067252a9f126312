"""The dense kernel checks q, K and V itself (``attention_dense_fwd(..., peaks=)``): each program folds the largest
magnitude of its query rows and of its share of the K/V rows into three int32 peaks (float32 bit patterns), so a
dense call runs no separate reduction over its three largest inputs. Every element must be covered (any position,
any layout), NaN and Inf must survive the integer maximum, and the peaks must be the exact largest magnitudes.
CPU: the kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

import kvbound
from kvbound.kernels.attention_dense import attention_dense_fwd

# (B, Hq, Hkv, Nq, Nk, dk, dv): plain, GQA with more K/V rows than query tiles can split evenly, ragged lengths,
# a value width split in two parts (192 -> 128 + 64), more query programs than K/V rows.
LAYOUTS = [
    (1, 2, 2, 24, 24, 16, 16),
    (2, 4, 1, 19, 53, 16, 24),
    (1, 1, 1, 37, 5, 32, 192),
    (1, 2, 2, 130, 7, 16, 40),
]


def _inputs(layout, seed=0, dtype=torch.float32):
    b, hq, hkv, nq, nk, dk, dv = layout
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, dk, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, dk, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, dv, generator=g).to(dtype)
    return q, k, v


def _peaks(q, k, v):
    peaks = torch.zeros(3, dtype=torch.int32)
    attention_dense_fwd(q, k, v, None, q.shape[-1] ** -0.5, False, None, peaks=peaks)
    return peaks.view(torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_peaks_are_the_exact_largest_magnitudes(layout, dtype):
    q, k, v = _inputs(layout, dtype=dtype)
    # plant the largest magnitude of each tensor at its last element, with a negative sign
    for t, value in ((q, 7.5), (k, 9.25), (v, 11.0)):
        t.view(-1)[-1] = -value
    peaks = _peaks(q, k, v)
    expected = torch.stack([t.float().abs().max() for t in (q, k, v)])
    assert torch.equal(peaks, expected), (peaks, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_every_element_is_covered(layout, name):
    """A NaN at each of many positions of each tensor (first and last row and column of every head and batch, and
    random ones) reaches the peak: the programs' shares of the rows leave none out."""
    tensors = dict(zip("qkv", _inputs(layout, seed=1), strict=True))
    t = tensors[name]
    b, h, n, d = t.shape
    g = torch.Generator().manual_seed(2)
    positions = {(bi, hi, ni, di) for bi in (0, b - 1) for hi in (0, h - 1) for ni in (0, n - 1) for di in (0, d - 1)}
    positions |= {tuple(int(torch.randint(0, s, (1,), generator=g)) for s in t.shape) for _ in range(4)}
    for position in sorted(positions):
        bad = t.clone()
        bad[position] = float("nan")
        peaks = _peaks(**{**tensors, name: bad})
        index = "qkv".index(name)
        assert torch.isnan(peaks[index]), position
        assert torch.isfinite(peaks[[i for i in range(3) if i != index]]).all()


@pytest.mark.parametrize("bad", [float("inf"), -float("inf")])
def test_inf_stays_inf_and_nan_outranks_it(bad):
    q, k, v = _inputs(LAYOUTS[1], seed=3)
    k = k.clone()
    k[0, 0, 3, 2] = bad
    peaks = _peaks(q, k, v)
    assert peaks[1].item() == float("inf") and torch.isfinite(peaks[[0, 2]]).all()
    k[1, 0, 40, 5] = float("nan")
    assert torch.isnan(_peaks(q, k, v)[1])


def test_peaks_fold_into_earlier_values_and_are_checked():
    q, k, v = _inputs(LAYOUTS[0])
    peaks = torch.tensor([0.0, 1e30, 0.0]).view(torch.int32)
    attention_dense_fwd(q, k, v, None, 0.25, False, None, peaks=peaks)
    assert peaks.view(torch.float32)[1].item() == pytest.approx(1e30)
    assert peaks.view(torch.float32)[0].item() == q.abs().max().item()
    with pytest.raises(ValueError, match=r"peaks: expected an int32 tensor of shape \[3\]"):
        attention_dense_fwd(q, k, v, None, 0.25, False, None, peaks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"peaks: expected an int32 tensor of shape \[3\]"):
        attention_dense_fwd(q, k, v, None, 0.25, False, None, peaks=torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("deferred", [False, True])
def test_public_call_names_the_tensor_on_strided_views(name, deferred):
    """The heads-split views of one projection (as a patched model passes them): the kernel reads, and checks,
    exactly the view's elements; a NaN elsewhere in the projection is not the call's business."""
    g = torch.Generator().manual_seed(4)
    b, n, h, dk, dv = 2, 21, 2, 16, 24
    projection = torch.randn(b, n, h * (2 * dk + dv) + 3, generator=g)
    projection[..., -3:] = float("nan")  # outside every view
    q = projection[..., : h * dk].unflatten(-1, (h, dk)).transpose(1, 2)
    k = projection[..., h * dk : 2 * h * dk].unflatten(-1, (h, dk)).transpose(1, 2)
    v = projection[..., 2 * h * dk : h * (2 * dk + dv)].unflatten(-1, (h, dv)).transpose(1, 2)
    out = kvbound.attention(q, k, v)  # no error: the NaN columns are outside the views
    assert torch.isfinite(out).all()
    views = {"q": q, "k": k, "v": v}
    views[name][1, 1, n - 1, 0] = float("nan")  # through the view, into the projection
    pattern = rf"^{name}: expected finite values, found (NaN|nan)"
    if deferred:
        with pytest.raises(ValueError, match=pattern):
            with kvbound.deferred_checks():
                kvbound.attention(q, k, v)
    else:
        with pytest.raises(ValueError, match=pattern):
            kvbound.attention(q, k, v)


def test_relative_runs_call_checks_q_k_v_in_the_kernel():
    g = torch.Generator().manual_seed(5)
    h, n, dk, dv = 2, 40, 16, 24
    starts = [0, 20, 35, 39, 40, 44, 60]
    q, k, v = (torch.randn(1, h, n, d, generator=g) for d in (dk, dk, dv))
    keys = torch.randn(h, 2 * n - 1, dk, generator=g)
    for start, end in zip(starts, [*starts[1:], 2 * n - 1], strict=True):
        keys[:, start:end] = keys[:, start : start + 1]
    u, w = torch.randn(h, dk, generator=g), torch.randn(h, dk, generator=g)
    common = dict(relative_keys=keys, relative_content_bias=u, relative_position_bias=w, relative_runs=starts)
    kvbound.attention(q, k, v, **common)
    v[0, 1, n - 1, dv - 1] = float("inf")
    with pytest.raises(ValueError, match=r"^v: expected finite values, found Inf"):
        with kvbound.deferred_checks():
            kvbound.attention(q, k, v, **common)


@pytest.mark.gpu
def test_gpu_peaks_bf16_heads_split_views():
    """On the GPU, bf16 heads-split views of one projection at Borzoi's head sizes (dk 64, dv 192 in two value
    parts): the peaks are the exact largest magnitudes, and a NaN or Inf planted anywhere is found, in the
    kernel's grid of many programs per head."""
    b, n, h, dk, dv = 2, 1000, 8, 64, 192
    g = torch.Generator().manual_seed(8)
    projection = torch.randn(b, n, h * (2 * dk + dv), generator=g).to(torch.bfloat16).cuda()
    q = projection[..., : h * dk].unflatten(-1, (h, dk)).transpose(1, 2)
    k = projection[..., h * dk : 2 * h * dk].unflatten(-1, (h, dk)).transpose(1, 2)
    v = projection[..., 2 * h * dk :].unflatten(-1, (h, dv)).transpose(1, 2)

    def peaks():
        found = torch.zeros(3, dtype=torch.int32, device="cuda")
        attention_dense_fwd(q, k, v, None, dk**-0.5, False, None, peaks=found)
        return found.view(torch.float32).cpu()

    expected = torch.stack([t.float().abs().max().cpu() for t in (q, k, v)])
    assert torch.equal(peaks(), expected)
    for index, t in enumerate((q, k, v)):
        for position, bad in (((1, 7, n - 1, t.shape[-1] - 1), float("nan")), ((0, 3, 517, 5), float("inf"))):
            saved = t[position].clone()
            t[position] = bad
            found = peaks()
            assert (torch.isnan(found[index]) if bad != bad else found[index] == float("inf")), (index, position)
            t[position] = saved
    with pytest.raises(ValueError, match=r"^k: expected finite values, found NaN"):
        with kvbound.deferred_checks():
            k[1, 2, 999, 63] = float("nan")
            kvbound.attention(q, k, v)
