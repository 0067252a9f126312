"""kvbound.kernels.norm_rope: AlphaGenome's LayerNorm, RoPE and operand cast in one kernel (CPU interpreter here;
float16 and float32 operands, as the interpreter rounds to bfloat16 by truncation), and its use by patched
AlphaGenome attention blocks."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvbound.kernels.norm_rope import norm_rope  # noqa: E402

alphagenome_pytorch = pytest.importorskip("alphagenome_pytorch", reason="pip install kvbound[models]")


def _layer_norm(c: int, seed: int, dtype: torch.dtype = torch.float32):
    from alphagenome_pytorch import layers

    norm = layers.LayerNorm(c).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c, generator=gen))
        norm.bias.copy_(torch.randn(c, generator=gen))
    return norm


def _tables(s: int, c: int, dtype: torch.dtype):
    """(cos, sin) of the port's apply_rope, read off pairs (1, 0)."""
    from alphagenome_pytorch.attention import apply_rope

    pattern = torch.zeros(1, s, 1, c, dtype=dtype)
    pattern[..., 0::2] = 1
    out = apply_rope(pattern)[0, :, 0]
    return out[:, 0::2].float().contiguous(), out[:, 1::2].float().contiguous()


@pytest.mark.parametrize(
    "in_dtype, param_dtype, c, rope, out_dtype",
    [
        # float16 projections, float32 norm parameters: AlphaGenome's q and k under float16 autocast
        (torch.float16, torch.float32, 128, True, torch.float16),
        # its v: a width that is not a power of two, no rotation
        (torch.float16, torch.float32, 192, False, torch.float16),
        (torch.float16, torch.float32, 128, True, torch.float32),
        (torch.float32, torch.float32, 128, True, torch.float32),  # a float32 model without autocast
        (torch.float32, torch.float32, 24, True, torch.float16),
        # a float16 model: the affine step and the rotation round to float16 too
        (torch.float16, torch.float16, 128, True, torch.float16),
        (torch.float16, torch.float16, 192, False, torch.float16),
    ],
)
def test_norm_rope_equals_the_port_modules(in_dtype, param_dtype, c, rope, out_dtype):
    """The kernel against the port's own LayerNorm and in-place apply_rope, then the cast: with a 16-bit input
    the centred values and the inverse deviation are rounded to it at the same points, so the outputs are equal
    (a row sum in another order may flip a rounding: at most one unit in the last place, rarely); in float32 they
    differ by the sums' order only."""
    from alphagenome_pytorch.attention import apply_rope

    b, s, h = 2, 40, 3
    gen = torch.Generator().manual_seed(c)
    x = (torch.randn(b, s, h, c, generator=gen) * 3 + 0.7).to(in_dtype)
    norm = _layer_norm(c, seed=c + 1, dtype=param_dtype)
    with torch.no_grad():
        expected = norm(x)
        norm_dtype = expected.dtype
        if rope:
            expected = apply_rope(expected, inplace=True)
        expected = expected.to(out_dtype)
        tables = _tables(s, c, norm_dtype) if rope else None
        got = norm_rope(x, norm.weight, norm.bias, norm.eps, rope=tables, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape and got.is_contiguous()
    diff = (got.float() - expected.float()).abs()
    if in_dtype == torch.float32 and out_dtype == torch.float32:
        assert diff.max().item() <= 1e-5 * expected.abs().max().item()
    else:
        ulp = torch.finfo(out_dtype).eps * expected.float().abs().clamp_min(torch.finfo(out_dtype).tiny)
        assert (diff <= ulp).all() and (diff > 0).float().mean().item() <= 1e-3
    # Without the rounding of the centred values to the input dtype the float16 outputs would differ widely: the
    # comparison above can tell the emulation from plain float32 arithmetic.
    if in_dtype == torch.float16 and not rope and out_dtype == torch.float16:
        xf = x.float()
        centred = xf - xf.mean(-1, keepdim=True)
        plain = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias
        assert (plain.to(out_dtype) != expected).float().mean().item() > 0.01


def test_norm_rope_against_float64():
    """Both rounding paths stay within float32 / float16 rounding of the float64 formula."""
    from kvbound.models.reference import rope_reference

    b, s, h, c = 1, 33, 2, 64
    x = torch.randn(b, s, h, c, generator=torch.Generator().manual_seed(3))
    norm = _layer_norm(c, seed=4)
    xd = x.double()
    centred = xd - xd.mean(-1, keepdim=True)
    exact = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + norm.eps)
    exact = rope_reference(exact * norm.weight.double() + norm.bias.double())
    got = norm_rope(x, norm.weight.detach(), norm.bias.detach(), norm.eps, rope=_tables(s, c, torch.float32),
                    out_dtype=torch.float32)  # fmt: skip
    assert (got.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()


def test_norm_rope_refuses_bad_input():
    x = torch.randn(1, 4, 2, 8)
    w, bias = torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"x: expected a non-empty contiguous \[B, S, H, C\]"):
        norm_rope(x[..., :6], w[:6], bias[:6], 1e-5, rope=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x: expected a non-empty contiguous"):
        norm_rope(x.transpose(1, 2), w, bias, 1e-5, rope=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\]"):
        norm_rope(x, torch.ones(7), bias, 1e-5, rope=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bias: expected shape \[8\]"):
        norm_rope(x, w, torch.zeros(8, dtype=torch.float64), 1e-5, rope=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"bias: expected weight's dtype \(torch.float32\), got torch.float16"):
        norm_rope(x, w, torch.zeros(8, dtype=torch.float16), 1e-5, rope=None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"rope cos: expected a float32 tensor of shape \[4, 4\]"):
        norm_rope(x, w, bias, 1e-5, rope=(torch.ones(4, 3), torch.ones(4, 4)), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="rotary embedding needs an even last dimension, got C=7"):
        norm_rope(torch.randn(1, 4, 2, 7), torch.ones(7), torch.zeros(7), 1e-5,
                  rope=(torch.ones(4, 3), torch.ones(4, 3)), out_dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="out_dtype: expected float32, float16 or bfloat16"):
        norm_rope(x, w, bias, 1e-5, rope=None, out_dtype=torch.float64)


# ------------------------------------------------------------------------------- in patched AlphaGenome blocks
@pytest.fixture
def mha(monkeypatch):
    """A full-width AlphaGenome attention block (8 x 128 / 1 x 128 / 1 x 192 heads) on 48 positions, random
    weights and norms, with the fused norm allowed on CPU tensors (it runs in the interpreter there)."""
    from alphagenome_pytorch.attention import MHABlock

    import kvbound.models._ports as ports

    torch.manual_seed(0)
    module = MHABlock(64).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "proj" in name or "linear" in name else 1.0))
        for m in module.modules():
            if hasattr(m, "running_var"):
                m.running_var.uniform_(0.5, 2.0, generator=gen)
    monkeypatch.setattr(ports, "_fused_norm_device", lambda x: True)
    import kvbound.kernels.norm_rope as kernel

    calls = []  # one entry per kernel call: whether it rotated
    dtypes = []  # and the operand dtype it wrote
    real = kernel.norm_rope

    def spy(*args, **kwargs):
        calls.append(kwargs["rope"] is not None)
        dtypes.append(kwargs["out_dtype"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "norm_rope", spy)
    module.operand_dtypes = dtypes  # read by the tests below
    return module, calls


def _run(module, x, tiles, *, autocast: torch.dtype | None):
    from kvbound.models import TileBias, patch

    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        with patch(module, compress=False, backend="eager", query_chunk=16):
            return module(x, TileBias(tiles, 16, x.shape[1], x.shape[1]))


@pytest.mark.parametrize("autocast", [None, torch.float16])
def test_patched_block_fuses_its_norms_and_matches_the_port_path(mha, monkeypatch, autocast):
    """With the fused norm the patched block runs one kernel for each of q, k (rotated) and v, writing the operand
    dtype, and gives the outputs of the port's modules (KVBOUND_FUSED_NORM=0): equal under float16 autocast, where
    the operands are rounded to float16 at the same points, and equal up to float32 sums without autocast."""
    module, calls = mha
    x = torch.randn(1, 48, 64, generator=torch.Generator().manual_seed(5))
    tiles = torch.randn(1, 8, 3, 3, generator=torch.Generator().manual_seed(6))
    fused = _run(module, x, tiles, autocast=autocast)
    assert calls == [True, True, False] and module.operand_dtypes == [autocast or torch.float32] * 3
    monkeypatch.setenv("KVBOUND_FUSED_NORM", "0")
    plain = _run(module, x, tiles, autocast=autocast)
    assert len(calls) == 3
    err = (fused.float() - plain.float()).abs().max().item()
    print(f"patched AlphaGenome block, fused norm vs the port's modules ({autocast}): max diff {err:.2e}")
    if autocast:  # every rounding of q, k, v is a float16 one, at the same points: the same operands
        assert torch.equal(fused, plain)
    else:
        assert err <= 1e-5 * plain.float().abs().max().item()
    monkeypatch.setenv("KVBOUND_FUSED_NORM", "sometimes")
    with pytest.raises(ValueError, match="KVBOUND_FUSED_NORM: expected one of"):
        _run(module, x, tiles, autocast=autocast)


def test_patched_block_keeps_the_port_modules_where_the_kernel_would_change_behaviour(mha):
    """A hook on a norm, autograd through the parameters, or an RMS norm: the port's modules run, not the kernel."""
    module, calls = mha
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(7))
    tiles = torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(8))
    seen = []
    handle = module.norm_k.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        _run(module, x, tiles, autocast=None)
    finally:
        handle.remove()
    assert calls == [] and seen == [torch.Size([1, 32, 1, 128])]

    from kvbound.models import TileBias, patch

    with patch(module, compress=False, backend="eager", query_chunk=16):
        out = module(x, TileBias(tiles, 16, 32, 32))  # grad enabled, parameters require grad
    assert calls == [] and out.requires_grad
    out.sum().backward()
    assert module.norm_q.weight.grad is not None and module.q_proj.weight.grad is not None
    module.zero_grad(set_to_none=True)

    for name, value in (("rms_norm", True), ("elementwise_affine", False)):
        setattr(module.norm_v, name, value)
        try:
            _run(module, x, tiles, autocast=None)
        finally:
            setattr(module.norm_v, name, not value)
        assert calls == [], name
    hooks = [
        module.norm_q.register_forward_pre_hook(lambda m, args: None),
        torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None),
        torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: None),
    ]
    for hook in hooks:
        try:
            _run(module, x, tiles, autocast=None)
        finally:
            hook.remove()
        assert calls == []
    _run(module, x, tiles, autocast=None)
    assert calls == [True, True, False]


def test_patched_block_keeps_the_port_rope_when_its_tables_do_not_read_as_a_rotation(mha, monkeypatch):
    """A rotation whose (1, 0) and (0, 1) readings disagree (here: the pairs swapped, not rotated) is not one the
    kernel models: the port's function runs instead, and its result is what the block uses."""
    import alphagenome_pytorch.attention as port

    module, calls = mha
    monkeypatch.setattr(port, "apply_rope", lambda x, inplace=False, **kw: x.flip(-1) if not inplace else
                        x.copy_(x.flip(-1)))  # fmt: skip
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(14))
    tiles = torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(15))
    got = _run(module, x, tiles, autocast=None)
    assert calls == []
    monkeypatch.setenv("KVBOUND_FUSED_NORM", "0")
    assert torch.equal(got, _run(module, x, tiles, autocast=None))


def test_float64_block_under_autocast_runs_in_float64(mha):
    """Autocast never casts float64: a float64 block under bfloat16 autocast keeps float64 operands, as the port
    does, and gives the port's output (up to the float32 logits both take: the port's ``.float()``)."""
    module, calls = mha
    module.double()
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    tiles = torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    from kvbound.models import TileBias

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        port = module(x, TileBias(tiles, 16, 32, 32).expand())
    got = _run(module, x, tiles, autocast=torch.bfloat16)
    assert got.dtype == torch.float64
    assert (got - port).abs().max().item() <= 1e-6 * port.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("c, rope", [(128, True), (192, False)])
def test_gpu_norm_rope_equals_the_port_modules_bf16(c, rope):
    """On the GPU under bfloat16 autocast (the models suite's setting): AlphaGenome's q / v shapes at 8,192
    positions, the kernel against the port's LayerNorm, apply_rope and the cast to bfloat16."""
    from alphagenome_pytorch.attention import apply_rope

    s, h = 8192, 8 if rope else 1
    gen = torch.Generator().manual_seed(c)
    norm = _layer_norm(c, seed=c).cuda()
    x = (torch.randn(1, s, h, c, generator=gen) * 3).cuda().to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = norm(x)
        tables = None
        if rope:
            pattern = torch.zeros(1, s, 1, c, dtype=expected.dtype, device="cuda")
            pattern[..., 0::2] = 1
            out = apply_rope(pattern)[0, :, 0]
            tables = (out[:, 0::2].float().contiguous(), out[:, 1::2].float().contiguous())
            expected = apply_rope(expected, inplace=True)
        expected = expected.to(torch.bfloat16)
        got = norm_rope(x, norm.weight, norm.bias, norm.eps, rope=tables, out_dtype=torch.bfloat16)
    diff = (got.float() - expected.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * expected.float().abs()
    share = (diff > 0).float().mean().item()
    print(f"norm_rope on the GPU, C={c}: {share:.2e} of the elements differ from the port's, by at most one ulp")
    assert (diff <= ulp).all() and share <= 1e-3


@pytest.mark.parametrize("autocast", [None, torch.float16])
def test_patched_block_casts_once_and_skips_exact_round_trips(mha, autocast):
    """The patched block casts the normalised input once for its three projections and, under autocast in the
    attention output's dtype, hands that output to linear_embedding without widening it to the float32 compute
    dtype (which the layer would narrow back): the projections and linear_embedding then see 16-bit inputs, and the
    output equals that of a block whose inputs are widened to float32 again before each of those layers."""
    module, _ = mha
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(12))
    tiles = torch.randn(1, 8, 2, 2, generator=torch.Generator().manual_seed(13))
    layers = (module.q_proj, module.k_proj, module.v_proj, module.linear_embedding)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype)) for m in layers]
    try:
        got = _run(module, x, tiles, autocast=autocast)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [autocast or torch.float32] * 4
    hooks = [m.register_forward_pre_hook(lambda m, args: (args[0].float(), *args[1:])) for m in layers]
    try:
        widened = _run(module, x, tiles, autocast=autocast)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(got, widened)
