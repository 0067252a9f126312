"""The LayerNorm in front of a patched Enformer/Borzoi attention module: one kernel that writes the autocast dtype;
and the feed-forward of the same transformer block: that kernel, then the first Linear with its ReLU in one matmul.

On CPU tensors the kernel runs in Triton's interpreter only where a test allows it (``_fused_norm_device``); the
interpreter's float32 -> bfloat16 conversion truncates, so these tests use float16 autocast.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from kvbound.models import patch  # noqa: E402
from small_models import small_enformer  # noqa: E402  (tests/ is on sys.path: rootdir conftest)


def _randomize_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "weight" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def borzoi():
    port = pytest.importorskip("borzoi_pytorch", reason="borzoi_pytorch is not installed (kvbound[models])")
    from borzoi_pytorch.config_borzoi import BorzoiConfig

    torch.manual_seed(0)
    model = port.Borzoi(
        BorzoiConfig(dim=64, depth=2, heads=2, attn_dim_key=8, attn_dim_value=16, bins_to_return=64)
    ).eval()
    _randomize_(model.transformer, seed=3)
    x = torch.randn(1, 4, 128 * 32, generator=torch.Generator().manual_seed(2))
    return model, x


@pytest.fixture(scope="module")
def enformer():
    model, _ = small_enformer(depth=2)
    _randomize_(model.transformer, seed=4)  # to_out starts at zero
    return model


def _norms(model):
    return [m for name, m in model.named_modules() if type(m) is nn.LayerNorm and name.endswith(".0.fn.0")]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Allow the fused norm on CPU tensors (interpreter) and record each kernel call's output dtype."""
    import kvbound.kernels.norm_rope as kernel
    import kvbound.models._ports as ports

    monkeypatch.setattr(ports, "_fused_norm_device", lambda x: True)
    calls = []
    real = kernel.norm_rope

    def spy(*args, **kwargs):
        calls.append((kwargs["rope"], kwargs["out_dtype"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "norm_rope", spy)
    return calls


def test_patch_installs_one_norm_helper_per_attention_and_undo_removes_it(borzoi, enformer):
    for model, kind, width in ((borzoi[0], "borzoi", 64), (enformer, "enformer", 96)):
        norms = _norms(model)
        with patch(model, compress=False, backend="eager") as handle:
            helpers = [r for r in handle.helpers if r.role == "norm"]
            assert [r.module for r in helpers] == norms and len(norms) == len(handle.modules) == 2
            assert all(r.kind == kind and r.target is m.module for r, m in zip(helpers, handle.modules, strict=True))
            assert all("forward" in vars(n) for n in norms)
            assert "LayerNorm in the attention's operand dtype" in handle.summary()
            assert norms[0].normalized_shape == (width,)
        assert not any("forward" in vars(n) for n in norms)
        # Patching only one attention module patches only its norm.
        with patch(model, compress=False, backend="eager", filter_fn=lambda name, m: ".0.0." in name) as handle:
            assert [r.module for r in handle.helpers if r.role == "norm"] == norms[:1]
            assert "forward" not in vars(norms[1])


def test_fused_norm_writes_the_autocast_dtype_as_the_port_casts_it(borzoi, kernel_calls, monkeypatch):
    """Under float16 autocast each patched norm is one kernel writing float16, equal to the float32 LayerNorm cast
    to float16 up to one float16 step (the order of the float32 row sums), and the model's output matches the
    unfused patched model's (KVBOUND_FUSED_NORM=0) to float16 rounding."""
    model, x = borzoi
    norms = _norms(model)
    seen = {}

    def keep(i):
        def hook(module, args, out):
            seen.setdefault(i, args[0])

        return hook

    hooks = [m.register_forward_hook(keep(i)) for i, m in enumerate(model.transformer)]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            with patch(model, compress=False, backend="eager", query_chunk=16):
                fused = model(x)
                monkeypatch.setenv("KVBOUND_FUSED_NORM", "0")
                plain = model(x)
    finally:
        for h in hooks:
            h.remove()
    assert kernel_calls == [(None, torch.float16)] * (2 * len(norms))  # and each block's feed-forward norm
    with torch.no_grad():
        for norm in norms[:1]:  # the first layer's input is the transformer's (a permuted, non-contiguous view)
            inp = seen[0]
            assert not inp.is_contiguous()
            assert inp.dtype == torch.float16  # the port's residual stream is in the autocast dtype
            ref = F.layer_norm(inp.float(), norm.normalized_shape, norm.weight, norm.bias, norm.eps).to(torch.float16)
            import kvbound.models._ports as ports

            with torch.autocast("cpu", dtype=torch.float16):
                got = ports._fusable_pre_norm(norm, inp)
                assert got is torch.float16
            out = _fused(norm, inp)
            assert out.dtype == torch.float16 and out.shape == inp.shape
            steps = (out.float() - ref.float()).abs() / torch.finfo(torch.float16).eps / ref.float().abs().clamp_min(
                2**-14
            )
            print(f"fused pre-attention norm vs float32 LayerNorm cast to float16: {int((out != ref).sum())} of "
                  f"{out.numel()} differ, largest {steps.max().item():.2f} steps")  # fmt: skip
            assert steps.max().item() <= 1.0 and (out != ref).float().mean().item() < 0.01
    err = (fused.float() - plain.float()).abs().max().item()
    print(f"borzoi under float16 autocast, fused norm vs the module's: max diff {err:.2e} (|out| "
          f"{plain.abs().max():.2f})")  # fmt: skip
    assert err <= 2e-2 * plain.float().abs().max().item()


def _fused(norm, x):
    from kvbound.kernels.norm_rope import norm_rope

    c = x.shape[-1]
    return norm_rope(x.contiguous().view(1, -1, 1, c), norm.weight, norm.bias, norm.eps, rope=None,
                     out_dtype=torch.float16, round_to_input=False).view(x.shape)  # fmt: skip


def test_norm_runs_itself_where_the_kernel_would_change_behaviour(enformer, kernel_calls):
    """No autocast, a hook on the norm, autograd through it, an unpatched attention behind it:
    the module's own forward (float32 output where the input is float32). A bfloat16 input is normalised in
    float32 as autocast's LayerNorm does, and written in the autocast dtype."""
    model = enformer
    norm = _norms(model)[0]
    x = torch.randn(1, 20, 96, generator=torch.Generator().manual_seed(1))
    with patch(model, compress=False, backend="eager") as handle:
        with torch.no_grad():
            assert torch.equal(norm(x), F.layer_norm(x, (96,), norm.weight, norm.bias, norm.eps))
            with torch.autocast("cpu", dtype=torch.float16):
                hook = norm.register_forward_hook(lambda m, a, out: None)
                try:
                    assert norm(x).dtype == torch.float32
                finally:
                    hook.remove()
        with torch.autocast("cpu", dtype=torch.float16):
            assert norm(x.requires_grad_()).dtype == torch.float32
            x.requires_grad_(False)
            assert not kernel_calls
            with torch.no_grad():
                assert norm(x).dtype == torch.float16 and len(kernel_calls) == 1
                half = x.to(torch.bfloat16)
                got, ref = norm(half), F.layer_norm(half.float(), (96,), norm.weight, norm.bias, norm.eps)
                assert got.dtype == torch.float16 and len(kernel_calls) == 2
                assert (got.float() - ref.half().float()).abs().max().item() <= 2e-3 * ref.abs().max().item()
                handle._attention_ids.clear()  # as if its attention module were no longer patched
                assert norm(x).dtype == torch.float32 and len(kernel_calls) == 2


@pytest.mark.gpu
def test_gpu_pre_norm_kernel_bf16():
    """On the GPU at Borzoi's width (1536, eps 1e-3): the kernel on a bfloat16 residual stream (a permuted view, as
    the first layer's input) against autocast's float32 LayerNorm cast to bfloat16: within one bfloat16 step."""
    from kvbound.models._ports import _fusable_pre_norm, pre_norm_forward

    norm = nn.LayerNorm(1536, eps=1e-3).cuda()
    _randomize_(norm, seed=5)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 1536, 4096, device="cuda", generator=g).to(torch.bfloat16).permute(0, 2, 1)

    class Handle:
        def _patches_attention(self, module):
            return True

    class Record:
        target = None

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert _fusable_pre_norm(norm, x) is torch.bfloat16
        got = pre_norm_forward(norm, Record(), Handle(), x)
        ref = norm(x).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # One bfloat16 step of the reference, or float32 rounding of the affine step's terms (|w x_hat|, |b| < 8) where
    # they cancel to a value near zero.
    step = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(2**-126))) - 7)
    diff = (got.float() - ref.float()).abs()
    worst = (diff / step).max().item()
    differ = int((got != ref).sum())
    print(f"pre-attention norm on the GPU: {differ} of {got.numel()} differ, largest {worst:.1f} bf16 steps, "
          f"{diff.max().item():.2e} absolute")  # fmt: skip
    assert bool((diff <= step + 8 * 2.0**-23).all()) and differ < 1e-3 * got.numel()


def _feed_forwards(model):
    return [m for name, m in model.named_modules() if name.startswith("transformer.") and name.endswith(".1.fn")]


@pytest.fixture
def relu_matmuls(monkeypatch):
    """Record the operand dtypes of each fused Linear-with-ReLU matmul of the feed-forward."""
    import kvbound.models._ports as ports

    calls = []
    real = ports._linear_relu

    def spy(x, weight, bias):
        calls.append((x.dtype, weight.dtype, bias.dtype))
        return real(x, weight, bias)

    monkeypatch.setattr(ports, "_linear_relu", spy)
    return calls


def test_patch_installs_one_feed_forward_helper_per_block_and_undo_removes_it(borzoi, enformer):
    """One helper per transformer block whose attention is patched (the block's own feed-forward, not the next
    block's), listed in the summary; undo restores each Sequential's own forward."""
    for model, kind in ((borzoi[0], "borzoi"), (enformer, "enformer")):
        ffns = _feed_forwards(model)
        assert len(ffns) == 2
        with patch(model, compress=False, backend="eager") as handle:
            helpers = [r for r in handle.helpers if r.role == "feed-forward"]
            assert [r.module for r in helpers] == ffns
            assert [r.target for r in helpers] == [r.module for r in handle.modules]
            assert all(r.kind == kind and "forward" in vars(f) for r, f in zip(helpers, ffns, strict=True))
            assert "feed-forward: fused LayerNorm, Linear with ReLU" in handle.summary()
        assert not any("forward" in vars(f) for f in ffns)
        with patch(model, compress=False, backend="eager", filter_fn=lambda name, m: name.startswith("transformer.1")):
            assert "forward" in vars(ffns[1]) and "forward" not in vars(ffns[0])
        assert not any("forward" in vars(f) for f in ffns)


def _feed_forward64(seq: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The feed-forward in float64 (dropouts inactive)."""
    norm, first, _, _, second, _ = seq
    h = F.layer_norm(x.double(), norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
    h = torch.relu(F.linear(h, first.weight.double(), first.bias.double()))
    return F.linear(h, second.weight.double(), second.bias.double())


def test_linear_relu_is_relu_of_the_linear():
    from kvbound.models._ports import _linear_relu

    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(7, 12, generator=g), torch.randn(5, 12, generator=g), torch.randn(5, generator=g)
    got = _linear_relu(x, w, b)
    assert torch.allclose(got, torch.relu(F.linear(x, w, b)), atol=1e-6)
    assert bool((got == 0).any()) and bool((got > 0).any())


def test_fused_feed_forward_is_as_close_as_the_module(borzoi, kernel_calls, relu_matmuls, monkeypatch):
    """Under float16 autocast the patched feed-forward is one norm kernel writing float16, one matmul with the ReLU
    in its epilogue on float16 operands, and the second Linear; its error against float64 is at most about that of
    the module's own forward (KVBOUND_FUSED_NORM=0), and the whole model's output matches the unfused one's."""
    model, x = borzoi
    ffn = _feed_forwards(model)[0]
    h = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        with patch(model, compress=False, backend="eager", query_chunk=16):
            fused = ffn(h)
            assert len(kernel_calls) == 1 and len(relu_matmuls) == 1
            assert relu_matmuls == [(torch.float16,) * 3]
            whole = model(x)
            assert len(kernel_calls) == 5 and len(relu_matmuls) == 3  # two pre-norms and two feed-forwards
            monkeypatch.setenv("KVBOUND_FUSED_NORM", "0")
            plain = ffn(h)
            whole_plain = model(x)
            assert len(kernel_calls) == 5 and len(relu_matmuls) == 3
    ref = _feed_forward64(ffn, h)
    assert fused.dtype == plain.dtype == torch.float16 and fused.shape == plain.shape == h.shape
    err, err_plain = ((t.double() - ref).abs().max().item() for t in (fused, plain))
    print(f"feed-forward under float16 autocast: fused {err:.2e}, the module's own {err_plain:.2e} from float64 "
          f"(|out| {ref.abs().max().item():.2f}); {int((fused != plain).sum())} of {fused.numel()} differ")  # fmt: skip
    assert err <= 2 * err_plain + 1e-3
    whole_err = (whole.float() - whole_plain.float()).abs().max().item()
    assert whole_err <= 2e-2 * whole_plain.float().abs().max().item()


def test_feed_forward_runs_itself_where_fusing_would_change_behaviour(enformer, kernel_calls, relu_matmuls):
    """No autocast, active dropout (training), a hook on a child, autograd through the weights: the Sequential's
    own forward, with the same result as the unpatched module."""
    model = enformer
    ffn = _feed_forwards(model)[0]
    x = torch.randn(1, 20, 96, generator=torch.Generator().manual_seed(1))
    with patch(model, compress=False, backend="eager"):
        with torch.no_grad():
            assert torch.equal(ffn(x), nn.Sequential.forward(ffn, x))
            with torch.autocast("cpu", dtype=torch.float16):
                ffn.train()
                try:
                    torch.manual_seed(3)
                    got = ffn(x)
                    torch.manual_seed(3)
                    assert torch.equal(got, nn.Sequential.forward(ffn, x))
                finally:
                    ffn.eval()
                seen = []
                hook = ffn[3].register_forward_hook(lambda m, a, out: seen.append(out))
                try:
                    assert torch.equal(ffn(x), nn.Sequential.forward(ffn, x)) and len(seen) == 2
                finally:
                    hook.remove()
        with torch.autocast("cpu", dtype=torch.float16):
            assert ffn(x).requires_grad  # the Linears' weights require grad
        assert not kernel_calls and not relu_matmuls
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            ffn(x)
            assert len(kernel_calls) == 1 and len(relu_matmuls) == 1


@pytest.mark.gpu
def test_gpu_feed_forward_bf16():
    """On the GPU at Borzoi's width (1536, eps 1e-3) on a bfloat16 residual stream: the fused feed-forward against
    the module's own forward under bfloat16 autocast, both against float64: at most about the module's error."""
    from types import SimpleNamespace

    from kvbound.models._operands import OperandCache
    from kvbound.models._ports import _fusable_feed_forward, feed_forward_forward

    ffn = nn.Sequential(nn.LayerNorm(1536, eps=1e-3), nn.Linear(1536, 3072), nn.Dropout(0.4), nn.ReLU(),
                        nn.Linear(3072, 1536), nn.Dropout(0.4)).cuda().eval()  # fmt: skip
    _randomize_(ffn, seed=6)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, 4096, 1536, device="cuda", generator=g).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert _fusable_feed_forward(ffn, x) is torch.bfloat16
        handle = SimpleNamespace(_operands=OperandCache())
        got = feed_forward_forward(ffn, None, handle, x)
        again = feed_forward_forward(ffn, None, handle, x)  # on the kept casts of both Linears' weights and biases
        own = ffn(x)
    assert len(handle._operands) == 4 and torch.equal(got, again)
    ref = _feed_forward64(ffn, x)
    assert got.dtype == own.dtype == torch.bfloat16 and got.shape == x.shape
    err, err_own = ((t.double() - ref).abs().max().item() for t in (got, own))
    differ = int((got != own).sum())
    print(f"feed-forward on the GPU: fused {err:.3e}, the module's own {err_own:.3e} from float64; {differ} of "
          f"{got.numel()} outputs differ")  # fmt: skip
    assert err <= 2 * err_own
