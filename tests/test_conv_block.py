"""The ports' convolution blocks (BatchNorm1d -> GELU -> Conv1d) with the inference norm and the GELU in one kernel,
installed by kvbound.patch as helpers of a model whose Enformer or Borzoi attention it patches.

On CPU tensors the kernel runs in Triton's interpreter only where a test allows it (``_fused_norm_device``); these
tests use float16 and float32 (the interpreter's float32 -> bfloat16 conversion truncates)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from kvbound.kernels.norm_gelu import add_channel_bias_, batch_norm_gelu  # noqa: E402
from kvbound.models import patch  # noqa: E402
from small_models import small_borzoi, small_enformer  # noqa: E402  (tests/ is on sys.path: rootdir conftest)

_GELUS = {
    "sigmoid": lambda y: torch.sigmoid(1.702 * y) * y,  # Enformer's
    "tanh": lambda y: F.gelu(y, approximate="tanh"),  # Borzoi's
}


def _statistics(c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mean, var = torch.randn(c, generator=g), torch.rand(c, generator=g) * 2 + 0.05
    weight, bias = 1 + 0.5 * torch.randn(c, generator=g), torch.randn(c, generator=g)
    return mean, var, weight, bias


@pytest.mark.parametrize("form", ["sigmoid", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_batch_norm_gelu_against_float64_within_twice_the_port_arithmetic(form, dtype):
    """Against ``gelu(batch_norm(x))`` in float64, the kernel's error is at most twice that of the port's own
    arithmetic in x's dtype (the norm in float32 rounded to x's dtype, then the GELU in x's dtype)."""
    mean, var, weight, bias = _statistics(6, 0)
    x = (3 * torch.randn(2, 6, 2500, generator=torch.Generator().manual_seed(1))).to(dtype)
    exact = _GELUS[form](F.batch_norm(x.double(), mean.double(), var.double(), weight.double(), bias.double(),
                                      False, 0.0, 1e-3))  # fmt: skip
    normed = F.batch_norm(x.float(), mean, var, weight, bias, False, 0.0, 1e-3).to(dtype)
    port = _GELUS[form](normed)
    out = batch_norm_gelu(x, mean, var, weight, bias, 1e-3, form)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    port_error = (port.double() - exact).abs().max().item()
    error = (out.double() - exact).abs().max().item()
    assert 0 < port_error and error <= 2 * port_error, (error, port_error)


def test_batch_norm_gelu_strided_input_no_affine_and_output_dtype():
    """Any strides in, a contiguous result in the asked dtype; without weight and bias only the normalisation."""
    mean, var, _, _ = _statistics(5, 2)
    base = torch.randn(3, 40, 5, generator=torch.Generator().manual_seed(3))
    x = base.transpose(1, 2)  # [3, 5, 40], channels innermost in memory
    assert not x.is_contiguous()
    out = batch_norm_gelu(x, mean, var, None, None, 1e-5, "tanh", out_dtype=torch.float16)
    want = F.gelu(F.batch_norm(x.double(), mean.double(), var.double(), None, None, False, 0.0, 1e-5),
                  approximate="tanh")  # fmt: skip
    assert out.dtype == torch.float16 and out.is_contiguous()
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-3)
    assert torch.equal(x, base.transpose(1, 2))  # the input is read, never written


@pytest.mark.parametrize("form", ["sigmoid", "tanh"])
def test_batch_norm_gelu_propagates_nan_and_inf_as_the_port(form):
    x = torch.tensor([[[float("inf"), -float("inf"), float("nan"), 0.0, -1e20, 1e20, -30.0, 30.0]]])
    zero, one = torch.zeros(1), torch.ones(1)
    out = batch_norm_gelu(x, zero, one, None, None, 0.0, form)
    port = _GELUS[form](F.batch_norm(x, zero, one, None, None, False, 0.0, 0.0))
    assert torch.equal(out.isnan(), port.isnan()) and out.isnan()[0, 0, 1:3].all()
    assert torch.equal(out.isinf(), port.isinf())
    finite = port.isfinite()
    torch.testing.assert_close(out[finite], port[finite], rtol=1e-6, atol=1e-30)


def test_batch_norm_gelu_rejects_bad_input():
    mean, var, weight, bias = _statistics(4, 0)
    with pytest.raises(ValueError, match=r"x: expected a \[B, C, L\] tensor, got \[4, 8\]"):
        batch_norm_gelu(torch.zeros(4, 8), mean, var, weight, bias, 1e-3, "tanh")
    with pytest.raises(TypeError, match="x: expected float32, float16 or bfloat16, got int64"):
        batch_norm_gelu(torch.zeros(1, 4, 8, dtype=torch.long), mean, var, weight, bias, 1e-3, "tanh")
    with pytest.raises(ValueError, match="activation: expected one of sigmoid, tanh, got 'erf'"):
        batch_norm_gelu(torch.zeros(1, 4, 8), mean, var, weight, bias, 1e-3, "erf")
    with pytest.raises(ValueError, match=r"running_var: expected shape \[4\].*got \[3\], float32, on cpu"):
        batch_norm_gelu(torch.zeros(1, 4, 8), mean, var[:3], weight, bias, 1e-3, "tanh")
    with pytest.raises(ValueError, match="weight, bias: expected both tensors or both None"):
        batch_norm_gelu(torch.zeros(1, 4, 8), mean, var, weight, None, 1e-3, "tanh")
    with pytest.raises(ValueError, match="eps: expected a float >= 0, got -1.0"):
        batch_norm_gelu(torch.zeros(1, 4, 8), mean, var, weight, bias, -1.0, "tanh")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_add_channel_bias_equals_torch_add_bit_for_bit(dtype):
    """In place, the bias rounded to the output's dtype first (as autocast casts a convolution's bias), any
    non-overlapping strides; the same bits as ``add_``."""
    g = torch.Generator().manual_seed(4)
    bias = 10 * torch.randn(6, generator=g)
    for out in (torch.randn(2, 6, 1500, generator=g).to(dtype),
                torch.randn(2, 1500, 6, generator=g).to(dtype).transpose(1, 2)):  # fmt: skip
        want = out.clone().add_(bias.to(dtype).view(1, -1, 1))
        assert add_channel_bias_(out, bias) is out
        assert torch.equal(out, want)


def test_add_channel_bias_rejects_bad_input():
    with pytest.raises(ValueError, match=r"out: expected a \[B, C, L\] float32, float16 or bfloat16 tensor, got \[4\] "
                                         r"float32"):
        add_channel_bias_(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"out: expected non-overlapping elements \(written in place\), got strides "
                                         r"\(0, 3, 1\)"):
        add_channel_bias_(torch.zeros(1, 4, 3).expand(2, 4, 3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"bias: expected shape \[4\]"):
        add_channel_bias_(torch.zeros(1, 4, 3), torch.zeros(3))


# ---------------------------------------------------------------------------------------------- in the models
def _randomise_norms(model: nn.Module, seed: int) -> None:
    """Running statistics and affine parameters away from their initial 0 / 1 (else the norm is nearly the
    identity and a wrong statistic would go unseen)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m) is nn.BatchNorm1d:
                c = m.num_features
                m.running_mean.copy_(0.3 * torch.randn(c, generator=g))
                m.running_var.copy_(0.5 + torch.rand(c, generator=g))
                m.weight.copy_(1 + 0.3 * torch.randn(c, generator=g))
                m.bias.copy_(0.2 * torch.randn(c, generator=g))


@pytest.fixture(scope="module")
def enformer():
    model, port = small_enformer()
    _randomise_norms(model, 4)
    return model, port


@pytest.fixture
def conv_calls(monkeypatch):
    """Allow the fused blocks on CPU tensors (interpreter) and count the kernels' calls: ``n`` the norm-and-GELU
    kernel's, ``bias`` the bias kernel's."""
    import kvbound.kernels.norm_gelu as kernel
    import kvbound.models._ports as ports

    monkeypatch.setattr(ports, "_fused_norm_device", lambda x: True)
    calls = {"n": 0, "bias": 0}
    real, real_bias = kernel.batch_norm_gelu, kernel.add_channel_bias_

    def spy(*args):
        calls["n"] += 1
        return real(*args)

    def bias_spy(*args, **kwargs):
        calls["bias"] += 1
        return real_bias(*args, **kwargs)

    monkeypatch.setattr(kernel, "batch_norm_gelu", spy)
    monkeypatch.setattr(kernel, "add_channel_bias_", bias_spy)
    return calls


def _blocks(model: nn.Module) -> list[nn.Module]:
    from kvbound.models._ports import conv_block_parts

    return [m for m in model.modules() if conv_block_parts(m) is not None]


def test_patch_installs_the_conv_blocks_as_helpers_and_undo_restores_them(enformer):
    model, port = enformer
    blocks = _blocks(model)
    # the stem's residual block, two per tower stage (num_downsamples=3: two stages), the final pointwise block
    assert len(blocks) == 1 + 2 * 2 + 1
    assert all(type(m[1]) is port.modeling_enformer.GELU for m in blocks)
    convs = [m for m in model.modules() if type(m) is nn.Conv1d and m.bias is not None]
    assert len(convs) == 1 + len(blocks)  # the stem's convolution and each block's
    residuals = [m for m in model.modules() if type(m) is port.modeling_enformer.Residual and m.fn in blocks]
    assert len(residuals) == 3  # the stem's and one per tower stage
    with patch(model, compress=False, backend="eager") as handle:
        helpers = [r for r in handle.helpers if r.role == "conv"]
        assert [r.module for r in helpers] == blocks
        assert [r.module for r in handle.helpers if r.role == "conv-bias"] == convs
        assert [r.module for r in handle.helpers if r.role == "conv-residual"] == residuals
        assert all(r.kind == "enformer" and r.target is handle.modules[0].module
                   for r in handle.helpers if r.role in ("conv", "conv-bias"))  # fmt: skip
        assert "BatchNorm and GELU in one kernel" in handle.summary()
        assert "Conv1d, its bias added in one pass" in handle.summary()
    assert not any("forward" in vars(m) for m in blocks + convs + residuals)
    with patch(model, compress=False, backend="eager", filter_fn=lambda name, m: False) as handle:
        assert handle.helpers == [] and not any("forward" in vars(m) for m in blocks)


def test_fused_conv_block_under_autocast_against_float64(enformer, conv_calls, monkeypatch):
    """One block of the tower under float16 autocast: the kernel writes float16, the convolution's operand dtype;
    the norm-and-GELU output's error against float64 is at most twice that of the port's arithmetic there (the
    norm on float16 input, the GELU's three steps in float16), and the block's output matches the port's."""
    model, port = enformer
    block = _blocks(model)[1]  # the first tower stage's ConvBlock(kernel_size=5)
    norm, gelu, conv = block
    x = torch.randn(2, norm.num_features, 64, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    stats = [t.double() for t in (norm.running_mean, norm.running_var, norm.weight, norm.bias)]
    exact = _GELUS["sigmoid"](F.batch_norm(x.double(), *stats[:2], *stats[2:], False, 0.0, norm.eps))
    with torch.no_grad(), patch(model, compress=False, backend="eager"):
        inputs = []
        hook = conv.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                fused = block(x)
                assert conv_calls["n"] == 1
                monkeypatch.setenv("KVBOUND_FUSED_CONV", "0")
                own = block(x)
                assert conv_calls["n"] == 1
        finally:
            hook.remove()
    kernel_out, port_out = inputs
    assert kernel_out.dtype == port_out.dtype == torch.float16
    port_error = (port_out.double() - exact).abs().max().item()
    error = (kernel_out.double() - exact).abs().max().item()
    assert 0 < port_error and error <= 2 * port_error, (error, port_error)
    assert fused.dtype == own.dtype
    torch.testing.assert_close(fused.float(), own.float(), rtol=2e-2, atol=2e-2)


def test_fused_conv_blocks_in_the_whole_model_and_where_a_block_runs_itself(enformer, conv_calls, monkeypatch):
    model, port = enformer
    blocks = _blocks(model)
    seq = torch.randint(0, 4, (1, 8 * 48), generator=torch.Generator().manual_seed(3))
    x = F.one_hot(seq, 4).float()
    with torch.no_grad(), patch(model, compress=False, backend="eager", query_chunk=16):
        with torch.autocast("cpu", dtype=torch.float16):
            fused = model(x)["human"]
            assert conv_calls["n"] == len(blocks) and conv_calls["bias"] == len(blocks) + 1
            monkeypatch.setenv("KVBOUND_FUSED_CONV", "0")
            plain = model(x)["human"]
            assert conv_calls["n"] == len(blocks) and conv_calls["bias"] == len(blocks) + 1
            monkeypatch.delenv("KVBOUND_FUSED_CONV")
        # no autocast: float32 in and out, fused too
        fused32 = model(x)["human"]
        assert conv_calls["n"] == 2 * len(blocks)
        monkeypatch.setenv("KVBOUND_FUSED_CONV", "0")
        plain32 = model(x)["human"]
        monkeypatch.delenv("KVBOUND_FUSED_CONV")
        calls = conv_calls["n"]
        norm = blocks[0][0]
        hook = norm.register_forward_hook(lambda *a: None)
        try:
            model(x)
        finally:
            hook.remove()
        assert conv_calls["n"] == calls + len(blocks) - 1  # the hooked norm's block ran itself
        norm.train()  # batch statistics: the block's own forward
        try:
            model(x)
        finally:
            norm.eval()
        assert conv_calls["n"] == calls + 2 * (len(blocks) - 1)
    torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused32, plain32, rtol=1e-5, atol=1e-6)


def test_residual_block_adds_bias_and_residual_in_one_pass_with_the_same_bits(enformer, conv_calls):
    """Enformer's ``Residual`` around a convolution block: one kernel adds the convolution's bias and the residual,
    each sum rounded as the port's ``add_`` and ``+``; the result has the bits of the fused block plus a separate
    addition (a hook on the block makes the residual run itself: ``fn(x) + x``)."""
    model, port = enformer
    residual = next(m for m in model.modules() if type(m) is port.modeling_enformer.Residual and m.fn in _blocks(model))
    c = residual.fn[0].num_features
    x = torch.randn(2, c, 80, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    with torch.no_grad(), patch(model, compress=False, backend="eager"):
        with torch.autocast("cpu", dtype=torch.float16):
            one_pass = residual(x)
            assert conv_calls["n"] == 1 and conv_calls["bias"] == 1
            hook = residual.fn.register_forward_hook(lambda *a: None)
            try:
                two_passes = residual(x)
            finally:
                hook.remove()
            assert conv_calls["n"] == 2 and conv_calls["bias"] == 2
    assert one_pass.dtype == two_passes.dtype == torch.float16
    assert torch.equal(one_pass, two_passes)


@pytest.mark.parametrize("padding", [7, "same", "valid"])
def test_narrow_convolution_as_one_matmul(padding):
    """A convolution over few input channels (the stem's one-hot DNA: 4 x 15 columns) as one matmul of its weight
    with the unfolded input: the convolution's values (no bias), under autocast in its dtype."""
    from kvbound.models._ports import _narrow_conv1d

    conv = nn.Conv1d(4, 24, 15, padding=padding).double()
    seq = torch.randint(0, 4, (2, 300), generator=torch.Generator().manual_seed(1))
    x = F.one_hot(seq, 4).double().transpose(1, 2)  # the port's rearranged one-hot input: not contiguous
    got = _narrow_conv1d(conv, x)
    want = conv._conv_forward(x, conv.weight, None)
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv32 = conv.float()
        low = _narrow_conv1d(conv32, x.float())
        assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), want, rtol=2e-2, atol=2e-2)
    assert _narrow_conv1d(nn.Conv1d(8, 4, 9), torch.zeros(1, 8, 20)) is None  # 72 columns: cuDNN's own
    assert _narrow_conv1d(nn.Conv1d(4, 4, 3, stride=2), torch.zeros(1, 4, 20)) is None


def test_conv_block_runs_itself_where_autograd_needs_it(enformer, conv_calls):
    model, _ = enformer
    block = _blocks(model)[0]
    x = torch.randn(1, block[0].num_features, 32, requires_grad=True)
    with patch(model, compress=False, backend="eager"):
        out = block(x)
        assert conv_calls["n"] == 0 and conv_calls["bias"] == 0
        out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_borzoi_conv_blocks_fused(conv_calls):
    model, x = small_borzoi()
    _randomise_norms(model, 5)
    blocks = _blocks(model)
    assert blocks and all(b.activation.approximate == "tanh" for b in blocks)
    with torch.no_grad():
        want = model(x)
        with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
            assert [r.module for r in handle.helpers if r.role == "conv"] == blocks
            assert all(r.kind == "borzoi" for r in handle.helpers if r.role == "conv")
            got = model(x)
            assert conv_calls["n"] == len(blocks)
            convs = [m for m in model.modules() if type(m) is nn.Conv1d and m.bias is not None]
            assert [r.module for r in handle.helpers if r.role == "conv-bias"] == convs
            assert not [r for r in handle.helpers if r.role == "conv-residual"]  # Enformer's Residual only
            assert conv_calls["bias"] >= len(blocks)
        assert not any("forward" in vars(b) for b in blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # float32 throughout


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["sigmoid", "tanh"])
def test_gpu_batch_norm_gelu_at_enformer_width_bf16(form):
    """At the width of Enformer's first tower block (768 channels, 2 x 16384 positions here) on bfloat16 input: the
    kernel's error against float64 is at most twice that of the port's arithmetic under CUDA's autocast (the norm
    rounded to bfloat16, the GELU's steps in bfloat16); float32 input written as bfloat16 rounds once."""
    mean, var, weight, bias = (t.cuda() for t in _statistics(768, 11))
    x = (2 * torch.randn(2, 768, 16384, device="cuda")).to(torch.bfloat16)
    stats = [t.double() for t in (mean, var, weight, bias)]
    exact = _GELUS[form](F.batch_norm(x.double(), *stats[:2], *stats[2:], False, 0.0, 1e-3))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        port = _GELUS[form](F.batch_norm(x, mean, var, weight, bias, False, 0.0, 1e-3))
    out = batch_norm_gelu(x, mean, var, weight, bias, 1e-3, form)
    assert port.dtype == out.dtype == torch.bfloat16
    port_error = (port.double() - exact).abs().max().item()
    error = (out.double() - exact).abs().max().item()
    assert 0 < port_error and error <= 2 * port_error, (error, port_error)
    x32 = x.float()
    out32 = batch_norm_gelu(x32, mean, var, weight, bias, 1e-3, form, out_dtype=torch.bfloat16)
    want = _GELUS[form](F.batch_norm(x32.double(), *stats[:2], *stats[2:], False, 0.0, 1e-3)).to(torch.bfloat16)
    assert (out32.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()


@pytest.mark.gpu
def test_gpu_conv_bias_bit_for_bit_with_the_port_under_autocast():
    """A full-width ``Conv1d`` (Enformer's tower, 768 -> 896, kernel 5) under bfloat16 autocast: the convolution
    without its bias plus the bias kernel gives the bits of the module's own forward (cuDNN, then ``add_``)."""
    from types import SimpleNamespace

    from kvbound.models._ports import _fusable_conv_bias, conv_bias_forward

    conv = nn.Conv1d(768, 896, 5, padding=2).cuda().eval()
    with torch.no_grad():
        conv.bias.normal_(0, 1)
    x = torch.randn(2, 768, 8192, device="cuda")
    handle = SimpleNamespace(_patches_attention=lambda target: True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert _fusable_conv_bias(conv, x)
        fused = conv_bias_forward(conv, SimpleNamespace(target=None), handle, x)
        own = conv(x)
    assert fused.dtype == own.dtype == torch.bfloat16
    assert torch.equal(fused, own)


@pytest.mark.gpu
def test_gpu_stem_convolution_as_one_matmul_against_float64():
    """Enformer's stem (4 -> 768 channels, width 15) over one-hot DNA under bfloat16 autocast: the matmul over the
    unfolded input plus the bias kernel is within twice the module's own error against float64 (both round the
    float32 sums to bfloat16, then add the bias rounded to bfloat16)."""
    from types import SimpleNamespace

    from kvbound.models._ports import _narrow_conv1d, conv_bias_forward

    conv = nn.Conv1d(4, 768, 15, padding=7).cuda().eval()
    seq = torch.randint(0, 4, (2, 20_000), generator=torch.Generator().manual_seed(3))
    x = F.one_hot(seq, 4).float().cuda().transpose(1, 2)  # as the port's stem receives it
    handle = SimpleNamespace(_patches_attention=lambda target: True)
    weight = conv.weight.to(torch.bfloat16).double()
    bias = conv.bias.to(torch.bfloat16).double()
    exact = F.conv1d(x.double(), weight, bias, padding=7)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert _narrow_conv1d(conv, x) is not None
        fused = conv_bias_forward(conv, SimpleNamespace(target=None), handle, x)
        own = conv(x)
    assert fused.dtype == own.dtype == torch.bfloat16 and fused.shape == own.shape
    own_error = (own.double() - exact).abs().max().item()
    error = (fused.double() - exact).abs().max().item()
    assert 0 < own_error and error <= 2 * own_error, (error, own_error)
