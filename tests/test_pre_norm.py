"""The LayerNorm in front of a patched Enformer/Borzoi attention module: one kernel that writes the autocast dtype.

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
    port = pytest.importorskip("enformer_pytorch", reason="enformer_pytorch is not installed (kvbound[models])")
    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=96, depth=2, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=8),
    ).eval()  # fmt: skip
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
    assert kernel_calls == [(None, torch.float16)] * len(norms)
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
