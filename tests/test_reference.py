import math

import pytest
import torch

import kvbound


def plain_softmax_attention(q, k, v, scale, causal=False, bias=None, softcap=None):
    """Written independently of kvbound: explicit loops over heads, max-subtracted exponentials."""
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hq, nq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h * hkv // hq
            s = torch.einsum("id,jd->ij", q[bi, h].double(), k[bi, kh].double()) * scale
            if bias is not None:
                s = s + bias.double().expand(b, hq, nq, k.shape[2])[bi, h]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if causal:
                i = torch.arange(nq)[:, None]
                j = torch.arange(k.shape[2])[None, :]
                s = torch.where(j <= i, s, torch.tensor(-math.inf, dtype=torch.float64))
            e = torch.exp(s - s.max(dim=1, keepdim=True).values)
            out[bi, h] = (e / e.sum(dim=1, keepdim=True)) @ v[bi, kh].double()
    return out


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("dk, dv", [(40, 40), (64, 192)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_plain_softmax(hq, hkv, dk, dv, causal):
    gen = torch.Generator().manual_seed(hq * 10 + hkv + dk)
    q = torch.randn(2, hq, 37, dk, generator=gen)
    k = torch.randn(2, hkv, 53, dk, generator=gen)
    v = torch.randn(2, hkv, 53, dv, generator=gen)
    bias = torch.randn(1, hq, 37, 53, generator=gen)
    for kwargs in ({}, {"bias": bias}, {"bias": bias, "softcap": 5.0}, {"scale": 0.3, "softcap": 2.0}):
        scale = kwargs.get("scale", 1 / math.sqrt(dk))
        got = kvbound.reference_attention(q, k, v, causal=causal, **kwargs)
        want = plain_softmax_attention(q, k, v, scale, causal, kwargs.get("bias"), kwargs.get("softcap"))
        assert got.dtype == torch.float64
        err = (got - want).abs().max().item()
        assert err < 1e-12, err


def test_reference_rejects_bad_input():
    q, k, v = torch.randn(1, 3, 4, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="multiple of k's 2"):
        kvbound.reference_attention(q, k, v)
    with pytest.raises(ValueError, match="k: expected head dim 16"):
        kvbound.reference_attention(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 5, 8), v)
    bad = torch.randn(1, 2, 4, 16)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"q: expected finite values, found nan at index \(0, 0, 0, 0\)"):
        kvbound.reference_attention(bad, k, v)
    with pytest.raises(ValueError, match="bias: expected a shape broadcastable"):
        kvbound.reference_attention(torch.randn(1, 2, 4, 16), k, v, bias=torch.randn(3, 3))


def test_reference_accepts_float64_bias():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5, generator=gen, dtype=torch.float64)
    got = kvbound.reference_attention(q, k, v, bias=bias)
    want = plain_softmax_attention(q, k, v, 0.25, bias=bias)
    assert (got - want).abs().max().item() < 1e-12


def test_reference_accepts_float64_inputs_and_refuses_integers():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    got = kvbound.reference_attention(q.double(), k.double(), v.double(), causal=True)
    assert torch.equal(got, kvbound.reference_attention(q, k, v, causal=True))  # both computed in float64
    with pytest.raises(TypeError, match=r"^v: expected dtype in \(float16, bfloat16, float32, float64\), got int64$"):
        kvbound.reference_attention(q, k, v.long())


def test_reference_refuses_nan_bias_and_scale_and_keeps_masks():
    """The oracle never turns NaN into a valid-looking output: a NaN or +Inf bias and a NaN or non-number scale
    raise naming them. A bias of -inf is a mask: a row masked over every key gives zeros, the others the softmax
    over the keys left."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^bias: expected finite values or -inf \(a mask\)"):
            kvbound.reference_attention(q, k, v, bias=torch.full((6, 6), value))
    with pytest.raises(ValueError, match=r"^scale: expected a finite float or None, got nan"):
        kvbound.reference_attention(q, k, v, scale=math.nan)
    with pytest.raises(TypeError, match=r"^scale: expected a float or None, got Tensor"):
        kvbound.reference_attention(q, k, v, scale=torch.tensor(0.5))
    mask = torch.zeros(6, 6)
    mask[2] = -math.inf  # query 2 sees no key
    mask[3, :4] = -math.inf  # query 3 sees keys 4 and 5
    out = kvbound.reference_attention(q, k, v, bias=mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    expected = kvbound.reference_attention(q[:, :, 3:4], k[:, :, 4:], v[:, :, 4:], scale=8**-0.5)
    torch.testing.assert_close(out[:, :, 3:4], expected, rtol=1e-12, atol=1e-12)
