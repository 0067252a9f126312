"""kvbound.patch on small random instances of the three ports (CPU, seconds each).

Each port's tests skip with the reason when that port is not installed (pip install kvbound[models]).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kvbound  # noqa: E402
from kvbound.models import TileBias, attention_output_bound, linear_output_bound, patch  # noqa: E402
from kvbound.models.reference import (  # noqa: E402
    alphagenome_mha_module_reference,
    alphagenome_tile_bias_reference,
    borzoi_attention_module_reference,
    borzoi_positional_features_reference,
    enformer_attention_module_reference,
    enformer_positional_features_reference,
    rope_reference,
)

CONFIG = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)


def _port(name: str):
    return pytest.importorskip(
        name, reason=f"{name} is not installed (src/kvbound/models/README.md: installing the ports)"
    )


class SquareTensors(TorchDispatchMode):
    """Counts op outputs whose last two dimensions are (n, n): an N x N matrix per head."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.n, self.n):
                self.count += 1
        return out


def _snapshot(model: nn.Module):
    """Every parameter/buffer value, and for each module its class and the identity of every attribute."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    attrs = {name: (type(m), {k: id(v) for k, v in vars(m).items()}) for name, m in model.named_modules()}
    return state, attrs


def _assert_same_snapshot(before, after):
    (state0, attrs0), (state1, attrs1) = before, after
    assert state0.keys() == state1.keys()
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
    assert attrs0 == attrs1


def _randomize_(module: nn.Module, seed: int) -> None:
    """Random weights everywhere, including the zero-initialised output projections and unit norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "weight" in name or name.endswith("scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _attention_modules(model, cls):
    return [m for m in model.modules() if type(m) is cls]


def _capture_inputs(modules):
    """Forward pre-hooks that record the first positional input(s) of each module."""
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, args)) for i, m in enumerate(modules)]
    return seen, hooks


# ------------------------------------------------------------------------------------------------ Enformer
@pytest.fixture(scope="module")
def enformer():
    port = _port("enformer_pytorch")
    from enformer_pytorch.modeling_enformer import Attention

    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=96,
        depth=2,
        heads=4,
        attn_dim_key=16,
        num_downsamples=3,
        dim_divisible_by=8,
        target_length=-1,
        output_heads=dict(human=8),
    )
    for i, m in enumerate(_attention_modules(model, Attention)):
        _randomize_(m, seed=10 + i)  # to_out starts at zero: attention would add exactly nothing
    return model.eval(), Attention


def _enformer_input(length_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8 * length_tokens, 4, generator=g).softmax(-1)


def test_enformer_features_match_port_formula():
    _port("enformer_pytorch")
    from enformer_pytorch.modeling_enformer import get_positional_embed

    for n in (1, 7, 40, 300):
        ours = enformer_positional_features_reference(n, 48)
        port32 = get_positional_embed(n, 48, "cpu", False).double()
        assert (ours - port32).abs().max().item() < 5e-4  # the port's gamma pdf runs in float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            port64 = get_positional_embed(n, 48, "cpu", False, dtype=torch.float64)
        finally:
            torch.set_default_dtype(previous)
        assert (ours - port64).abs().max().item() < 1e-12


def test_enformer_port_forward_matches_float64_reference(enformer):
    model, attention = enformer
    module = _attention_modules(model, attention)[0]
    x = torch.randn(2, 37, 96, generator=torch.Generator().manual_seed(1))
    ref = enformer_attention_module_reference(module, x)["out"]
    with torch.no_grad():
        port = module(x)
        with patch(model, compress=False, query_chunk=16, backend="eager"):
            lean = module(x)
    port_err = (port.double() - ref).abs().max().item()
    lean_err = (lean.double() - ref).abs().max().item()
    print(f"enformer attention vs float64: port {port_err:.2e}, patched {lean_err:.2e}, |ref| {ref.abs().max():.2f}")
    assert port_err < 1e-5 * ref.abs().max().item() + 1e-6  # the reference describes the port
    assert lean_err <= 2 * port_err + 1e-6


def test_enformer_patched_dense_matches_unpatched(enformer):
    model, attention = enformer
    x = _enformer_input(43)
    with torch.no_grad():
        expected = model(x)["human"]
        with patch(model, compress=False, query_chunk=16, backend="eager") as handle:
            got = model(x)["human"]
    err = (got - expected).abs().max().item()
    print(f"enformer model, patched dense vs port: max err {err:.2e} (|out| {expected.abs().max():.2f})")
    assert [r.calls for r in handle.modules] == [1, 1]
    assert err <= 1e-5 * expected.abs().max().item()


def test_enformer_compressed_within_bound(enformer):
    model, attention = enformer
    modules = _attention_modules(model, attention)
    assert len(modules) == 2  # depth 2: the bound is checked on every layer
    x = _enformer_input(43)
    with torch.no_grad():
        expected = model(x)["human"]
        seen, hooks = _capture_inputs(modules)
        try:
            handle = patch(model, CONFIG, calibrate_on=x, query_chunk=16, backend="eager")
            got = model(x)["human"]
        finally:
            for h in hooks:
                h.remove()
        try:
            print(handle.summary())
            assert handle.calibrated and handle.calibration_seconds > 0
            assert all(r.basis_k.rank == CONFIG.rank and r.last_k_ratio > 1 for r in handle.modules)
            print(f"enformer model output, compressed vs port: max err {(got - expected).abs().max():.2e}")
            for i, module in enumerate(modules):
                inp = seen[i][0]
                ref = enformer_attention_module_reference(module, inp)
                out = module(inp)
                b, h, n, _ = ref["q"].shape
                effective = ref["q"] * module.scale + module.rel_content_bias.double()
                core = attention_output_bound(effective, ref["v"], tau_k=CONFIG.tau, tau_v=CONFIG.tau)
                bound = linear_output_bound(core.transpose(1, 2).reshape(b, n, -1), module.to_out.weight)
                err = (out.double() - ref["out"]).abs()
                print(
                    f"  layer {i}: attention output max err {err.max():.2e} (mean {err.mean():.2e}), "
                    f"certified bound max {bound.max():.2e} min {bound.min():.2e}"
                )
                assert (err <= bound + 1e-5 * (1 + ref["out"].abs())).all()
        finally:
            handle.undo()


def test_enformer_patched_with_fused_backend(enformer):
    """The patched forward handing its chunks to kvbound.attention (interpreted on CPU), dense and compressed."""
    model, attention = enformer
    module = _attention_modules(model, attention)[1]
    x = torch.randn(1, 40, 96, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        port = module(x)
        with patch(model, compress=False, backend="kvbound", query_chunk=16):
            dense = module(x)
        with patch(model, CONFIG, backend="kvbound", query_chunk=16):
            fused = module(x)
        with patch(model, CONFIG, backend="eager", query_chunk=16):
            eager = module(x)
    print(
        f"enformer via kvbound.attention: dense vs port {(dense - port).abs().max():.2e}, compressed vs the "
        f"eager compressed path {(fused - eager).abs().max():.2e}, vs port {(fused - port).abs().max():.2e}"
    )
    assert (dense - port).abs().max().item() <= 1e-5 * port.abs().max().item()
    assert (fused - eager).abs().max().item() <= 1e-5 * port.abs().max().item()


def _count_relative_calls(monkeypatch) -> list[tuple[int, bool]]:
    """``(query rows, relative_keys given)`` of every ``kvbound.attention`` call the patched forwards make."""
    from kvbound.attention import attention as fused
    from kvbound.models import _backend

    calls = []

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], kwargs.get("relative_keys") is not None))
        return fused(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    return calls


@pytest.mark.parametrize("port_name", ["enformer", "borzoi"])
def test_relative_ports_take_one_fused_call_per_layer(port_name, request, monkeypatch):
    """compress=False on the kvbound backend: one relative-position kvbound.attention call per layer over all
    queries (the kernel forms the relative term on chip), matching the unpatched port."""
    model, attention_cls = request.getfixturevalue(port_name)[:2]
    module = _attention_modules(model, attention_cls)[0]
    n = 40 if port_name == "enformer" else 32  # Borzoi's port caches its features at its first length (32)
    x = torch.randn(1, n, 96 if port_name == "enformer" else 64, generator=torch.Generator().manual_seed(6))
    calls = _count_relative_calls(monkeypatch)
    with torch.no_grad():
        port = module(x)
        with patch(model, compress=False, backend="kvbound", query_chunk=16):
            fused = module(x)
    err = (fused - port).abs().max().item()
    print(f"{port_name} fused relative positions: calls {calls}, max err vs port {err:.2e}")
    assert calls == [(n, True)]
    assert err <= 1e-5 * port.abs().max().item()


def test_enformer_positional_features_computed_once_per_handle_and_length(enformer, monkeypatch):
    """Every layer of every forward at one length reads one tensor of features, computed once per handle (the
    port computes them again in each layer); the output is the unpatched model's, also when a later forward runs
    with autograd after one under inference mode; undo lets them go."""
    import enformer_pytorch.modeling_enformer as port_module

    model, attention = enformer
    calls = []
    original = port_module.get_positional_embed

    def counted(n, *args, **kwargs):
        calls.append(n)
        return original(n, *args, **kwargs)

    x, other = _enformer_input(43), _enformer_input(40, seed=1)
    with torch.no_grad():
        expected, expected_other = model(x)["human"], model(other)["human"]
    monkeypatch.setattr(port_module, "get_positional_embed", counted)
    handle = patch(model, compress=False, query_chunk=16, backend="eager")
    try:
        with torch.inference_mode():
            first = model(x)["human"]
        assert len(calls) == 1 and len(handle._features) == 1
        second = model(x)["human"]  # autograd on: the cached features must not be inference tensors
        assert second.requires_grad and len(calls) == 1
        with torch.no_grad():
            third = model(other)["human"]
        assert calls == [calls[0], calls[1]] and calls[0] != calls[1] and len(handle._features) == 2
    finally:
        handle.undo()
    assert handle._features == {}
    for got in (first, second.detach()):
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert (third - expected_other).abs().max().item() <= 1e-5 * expected_other.abs().max().item()


@pytest.mark.parametrize(("port_name", "setting"), [("enformer", None), ("borzoi", None), ("borzoi", "0")])
def test_relative_runs_pass_borzoi_runs_only(port_name, setting, request, monkeypatch):
    """By default (KVBOUND_RELATIVE_RUNS unset) and with dense K/V, Borzoi's layers pass the runs of equal
    positional features to kvbound.attention (found once per handle), with one relative key per run; Enformer's
    smooth features give none;
    KVBOUND_RELATIVE_RUNS=0 turns it off. Outputs as unpatched. Other values raise."""
    from kvbound.attention import attention as fused
    from kvbound.models import _backend

    model, attention_cls = request.getfixturevalue(port_name)[:2]
    module = _attention_modules(model, attention_cls)[0]
    n = 40 if port_name == "enformer" else 32
    x = torch.randn(1, n, 96 if port_name == "enformer" else 64, generator=torch.Generator().manual_seed(8))
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append(kwargs.get("relative_runs"))
        rows.append(kwargs["relative_keys"].shape[1])
        return fused(q, k, v, **kwargs)

    rows = []

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    if setting is None:
        monkeypatch.delenv("KVBOUND_RELATIVE_RUNS", raising=False)
    else:
        monkeypatch.setenv("KVBOUND_RELATIVE_RUNS", setting)
    with torch.no_grad():
        port = module(x)
        with patch(model, compress=False, backend="kvbound") as handle:
            first, second = module(x), module(x)
            assert len(handle._features_runs) == (0 if setting == "0" else 1)
    for got in (first, second):
        assert (got - port).abs().max().item() <= 1e-5 * port.abs().max().item()
    if port_name == "enformer" or setting == "0":
        assert seen == [None, None] and rows == [2 * n - 1] * 2
    else:
        assert seen[0] == seen[1] and seen[0][0] == 0 and 2 < len(seen[0]) <= 33
        assert rows == [len(seen[0])] * 2  # one relative key per run, computed from the run's first features
    assert handle._features_runs == {} and handle._features_run_rows == {}
    monkeypatch.setenv("KVBOUND_RELATIVE_RUNS", "sometimes")
    with pytest.raises(ValueError, match=r"^KVBOUND_RELATIVE_RUNS: expected one of"):
        with torch.no_grad(), patch(model, compress=False, backend="kvbound"):
            module(x)


def test_relative_runs_pass_with_compressed_kv(borzoi, monkeypatch):
    """Compressed K/V too: patched Borzoi layers pass their runs (one relative key per run) to kvbound.attention,
    and the output is that of the relative keys (KVBOUND_RELATIVE_RUNS=0) on the same compressed K/V, to float32
    rounding."""
    from kvbound.attention import attention as fused
    from kvbound.models import _backend

    model, attention_cls = borzoi[:2]
    module = _attention_modules(model, attention_cls)[0]
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(9))
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append((type(k).__name__, kwargs.get("relative_runs") is not None))
        return fused(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    outputs = {}
    with torch.no_grad():
        for setting in ("1", "0"):
            monkeypatch.setenv("KVBOUND_RELATIVE_RUNS", setting)
            with patch(model, CONFIG, backend="kvbound"):
                outputs[setting] = module(x)
    assert seen == [("CompressedKV", True), ("CompressedKV", False)]
    diff = (outputs["1"] - outputs["0"]).abs().max().item()
    assert diff <= 1e-5 * outputs["0"].abs().max().item(), diff


def test_enformer_undo_restores_exactly(enformer):
    model, attention = enformer
    x = _enformer_input(40)
    with torch.no_grad():
        before_out = model(x)["human"]
        before = _snapshot(model)
        handle = patch(model, CONFIG, calibrate_on=x, query_chunk=16)
        assert {r.name for r in handle.modules} == {"transformer.0.0.fn.1", "transformer.1.0.fn.1"}
        assert all("forward" in vars(r.module) for r in handle.modules)
        model(x)
        handle.undo()
        after_out = model(x)["human"]
    _assert_same_snapshot(before, _snapshot(model))
    assert torch.equal(before_out, after_out)
    assert all(m.forward.__func__ is attention.forward for m in _attention_modules(model, attention))
    handle.undo()  # idempotent


def test_enformer_training_mode_with_dropout_raises(enformer):
    model, attention = enformer
    module = _attention_modules(model, attention)[0]
    with patch(model, compress=False):
        module.train()
        try:
            with pytest.raises(RuntimeError, match="training mode with attn_dropout.p=0.05"):
                module(torch.randn(1, 20, 96))
        finally:
            module.eval()


def test_training_mode_forward_is_refused_before_any_layer_runs(enformer):
    """The model's forward checks the patched modules first: batch norms before the attention keep their statistics."""
    model, _ = enformer
    x = torch.randn(1, 8 * 20, 4).softmax(-1)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with patch(model, compress=False):
        model.train()
        try:
            with pytest.raises(RuntimeError, match="training mode with attn_dropout.p=0.05"):
                model(x)
        finally:
            model.eval()
    after = model.state_dict()
    assert any("running_mean" in name for name in before)
    assert all(torch.equal(before[name], after[name]) for name in before)


# -------------------------------------------------------------------------------------------------- Borzoi
@pytest.fixture(scope="module")
def borzoi():
    port = _port("borzoi_pytorch")
    from borzoi_pytorch.config_borzoi import BorzoiConfig
    from borzoi_pytorch.pytorch_borzoi_transformer import Attention

    torch.manual_seed(0)
    model = port.Borzoi(
        BorzoiConfig(dim=64, depth=2, heads=2, attn_dim_key=8, attn_dim_value=16, bins_to_return=64)
    ).eval()
    for i, m in enumerate(_attention_modules(model, Attention)):
        _randomize_(m, seed=20 + i)
    x = torch.randn(1, 4, 128 * 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(x)  # the port caches its positional features (for 32 tokens) on the first forward
    return model, Attention, x, expected


def test_borzoi_features_match_port_formula():
    _port("borzoi_pytorch")
    from borzoi_pytorch.pytorch_borzoi_transformer import get_positional_embed

    for n in (1, 9, 40, 200):
        assert torch.equal(
            borzoi_positional_features_reference(n, 32), get_positional_embed(n, 4096, 32, "cpu").double()
        )


def test_borzoi_port_forward_matches_float64_reference(borzoi):
    model, attention, _, _ = borzoi
    module = _attention_modules(model, attention)[0]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))  # the length the port cached
    ref = borzoi_attention_module_reference(module, x)["out"]
    with torch.no_grad():
        port = module(x)
        with patch(model, compress=False, query_chunk=7, backend="eager"):
            lean = module(x)
    port_err = (port.double() - ref).abs().max().item()
    lean_err = (lean.double() - ref).abs().max().item()
    print(f"borzoi attention vs float64: port {port_err:.2e}, patched {lean_err:.2e}, |ref| {ref.abs().max():.2f}")
    assert port_err < 1e-5 * ref.abs().max().item() + 1e-6
    assert lean_err <= 2 * port_err + 1e-6


def test_borzoi_patched_dense_matches_unpatched_and_runs_other_lengths(borzoi):
    model, attention, x, expected = borzoi
    modules = _attention_modules(model, attention)
    short, long = torch.randn(1, 25, 64), torch.randn(1, 60, 64)
    with torch.no_grad():
        port_short = modules[0](short)  # the port reuses its cached 32-token features: silently wrong
        with pytest.raises(RuntimeError, match="as_strided"):
            modules[0](long)  # ... or out of bounds
        with patch(model, compress=False, query_chunk=16, backend="eager"):
            got = model(x)
            lean_short, lean_long = modules[0](short), modules[0](long)
            assert all(m.positions.shape[0] == 2 * 32 - 1 for m in modules)  # never written by the patch
    err = (got - expected).abs().max().item()
    print(f"borzoi model, patched dense vs port: max err {err:.2e} (|out| {expected.abs().max():.2f})")
    assert err <= 1e-5 * expected.abs().max().item()
    for inp, out in ((short, lean_short), (long, lean_long)):
        ref = borzoi_attention_module_reference(modules[0], inp)["out"]
        assert (out.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6
    ref_short = borzoi_attention_module_reference(modules[0], short)["out"]
    print(f"borzoi port at another length, max err vs float64: {(port_short.double() - ref_short).abs().max():.2e}")
    assert (port_short.double() - ref_short).abs().max().item() > 1e-2


def test_borzoi_compressed_within_bound_and_undo(borzoi):
    model, attention, x, expected = borzoi
    modules = _attention_modules(model, attention)
    assert len(modules) == 2  # depth 2: the bound is checked on every layer
    with torch.no_grad():
        before = _snapshot(model)
        seen, hooks = _capture_inputs(modules)
        try:
            handle = patch(model, CONFIG, calibrate_on=x, query_chunk=16, backend="eager")
            got = model(x)
        finally:
            for h in hooks:
                h.remove()
        print(handle.summary())
        print(f"borzoi model output, compressed vs port: max err {(got - expected).abs().max():.2e}")
        for i, module in enumerate(modules):
            inp = seen[i][0]
            ref = borzoi_attention_module_reference(module, inp)
            out = module(inp)
            b, h, n, _ = ref["q"].shape
            effective = ref["q"] * module.scale + module.rel_content_bias.double()
            core = attention_output_bound(effective, ref["v"], tau_k=CONFIG.tau, tau_v=CONFIG.tau)
            bound = linear_output_bound(core.transpose(1, 2).reshape(b, n, -1), module.to_out.weight)
            err = (out.double() - ref["out"]).abs()
            print(f"  layer {i}: attention output max err {err.max():.2e}, certified bound max {bound.max():.2e}")
            assert (err <= bound + 1e-5 * (1 + ref["out"].abs())).all()
        handle.undo()
        after_out = model(x)
    _assert_same_snapshot(before, _snapshot(model))
    assert torch.equal(after_out, expected)


def test_gradients_flow_with_exact_kv_and_are_refused_with_compressed_kv(enformer):
    """Under grad mode the dense patch on the eager backend gives the unpatched model's input gradient; the
    compressed patch runs the forward but refuses the backward, naming the layer, instead of returning a gradient
    that skips the compressed K/V (and so leaves the K projection without one)."""
    model, attention = enformer
    x = _enformer_input(40)

    def input_gradient():
        xx = x.clone().requires_grad_()
        model(xx)["human"].sum().backward()
        return xx.grad

    model.zero_grad(set_to_none=True)
    expected = input_gradient()
    with patch(model, compress=False, backend="eager"):
        got = input_gradient()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    with patch(model, CONFIG, calibrate_on=x, backend="eager"):
        out = model(x.clone().requires_grad_())["human"]
        with pytest.raises(RuntimeError, match=r"^transformer\.\d\..*: expected no backward pass through a layer whose "
                           r"K/V are compressed"):
            out.sum().backward()
        with torch.no_grad():
            assert torch.isfinite(model(x)["human"]).all()
    model.zero_grad(set_to_none=True)


def test_eager_backend_raises_for_nan_like_the_fused_one(enformer):
    """A NaN in the input reaches every layer's q, k and v: the eager backend (PyTorch operations, which would pass
    it through) raises when the forward ends, naming the first layer and tensor, as the kvbound backend does."""
    model, _ = enformer
    x = _enformer_input(40)
    x[0, 17, 2] = float("nan")
    for backend in ("eager", "kvbound"):
        with torch.no_grad(), patch(model, compress=False, backend=backend):
            with pytest.raises(ValueError, match=r"^(transformer\.0\.0\.fn\.1 )?q: expected finite values"):
                model(x)


def test_borzoi_patched_with_fused_backend(borzoi, monkeypatch):
    """Borzoi's layers on compressed K/V through kvbound.attention (relative runs, one relative key per run, the
    content and position biases folded into the queries) give the eager compressed path's output on the same
    compressed K/V to float32 rounding, with calibrated (shared) bases and with per-block bases. Both backends run
    under one handle, so that they read the same bases: a calibration forward of its own on the eager backend rounds
    layer 0's output differently, and so calibrates a slightly different basis for layer 1."""
    from kvbound.attention import attention as fused_attention
    from kvbound.models import _backend

    model, attention, x_model, _ = borzoi
    modules = _attention_modules(model, attention)
    assert len(modules) == 2
    seen = []

    def spy(q, k, v, **kwargs):
        if isinstance(k, kvbound.CompressedKV):  # (the calibration forward reads dense K/V)
            seen.append((k.shared_basis, kwargs.get("relative_runs") is not None))
        return fused_attention(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    monkeypatch.delenv("KVBOUND_RELATIVE_RUNS", raising=False)
    # 40 tokens: a short last block (the unpatched port runs only at the 32 tokens it cached its features for)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        for calibrate_on in (x_model, None):
            with patch(model, CONFIG, backend="kvbound", calibrate_on=calibrate_on) as handle:
                assert handle.calibrated is (calibrate_on is not None)
                for module in modules:
                    handle.backend = "kvbound"
                    fused = module(x)
                    handle.backend = "eager"
                    eager = module(x)
                    diff = (fused - eager).abs().max().item()
                    print(f"borzoi via kvbound.attention, calibrated {handle.calibrated}: compressed vs the eager "
                          f"compressed path {diff:.2e} (|out| {eager.abs().max():.2f})")
                    assert diff <= 1e-5 * eager.abs().max().item(), diff
    assert seen == [(True, True)] * 2 + [(False, True)] * 2


# --------------------------------------------------------------------------------------------- AlphaGenome
@pytest.fixture(scope="module")
def alphagenome():
    _port("alphagenome_pytorch")
    from alphagenome_pytorch.attention import AttentionBiasBlock, MHABlock
    from alphagenome_pytorch.model import TransformerTower

    torch.manual_seed(0)
    tower = TransformerTower(64)
    _randomize_(tower, seed=30)
    with torch.no_grad():
        for m in tower.modules():
            if hasattr(m, "running_var"):
                m.running_var.uniform_(0.5, 2.0)
    return tower.eval(), MHABlock, AttentionBiasBlock


def _alphagenome_input(s: int = 64, seed: int = 4):
    return torch.randn(1, s, 64, generator=torch.Generator().manual_seed(seed))


def test_alphagenome_rope_and_tile_bias_match_port(alphagenome):
    tower, _, bias_block = alphagenome
    from alphagenome_pytorch.attention import apply_rope

    x = torch.randn(2, 50, 3, 128)
    assert (apply_rope(x.clone()).double() - rope_reference(x)).abs().max().item() < 1e-4
    block = tower.blocks[0]["attn_bias"]
    assert type(block) is bias_block
    pair = torch.randn(1, 4, 4, 128)
    with torch.no_grad():
        full = block(pair)
    tiles = alphagenome_tile_bias_reference(block, pair)
    assert (full.double() - TileBias(tiles, 16, 64, 64).expand()).abs().max().item() < 1e-5


def test_alphagenome_port_forward_matches_float64_reference(alphagenome):
    tower, mha_class, _ = alphagenome
    module = tower.blocks[1]["mha"]
    x = _alphagenome_input(48)
    tiles = torch.randn(1, 8, 3, 3)
    ref = alphagenome_mha_module_reference(module, x, tiles)["out"]
    with torch.no_grad():
        port = module(x, TileBias(tiles, 16, 48, 48).expand())
        with patch(tower, compress=False, query_chunk=16, backend="eager"):
            lean = module(x, TileBias(tiles, 16, 48, 48))
    port_err = (port.double() - ref).abs().max().item()
    lean_err = (lean.double() - ref).abs().max().item()
    print(f"alphagenome MHABlock vs float64: port {port_err:.2e}, patched {lean_err:.2e}, |ref| {ref.abs().max():.2f}")
    assert port_err < 1e-5 * ref.abs().max().item() + 1e-6
    assert lean_err <= 2 * port_err + 1e-6


def test_alphagenome_patched_with_fused_backend(alphagenome):
    tower, _, _ = alphagenome
    module = tower.blocks[2]["mha"]
    x = _alphagenome_input(48)
    tiles = torch.randn(1, 8, 3, 3, generator=torch.Generator().manual_seed(6))
    config = kvbound.CompressionConfig(block_size=16, rank=8, bits=4)
    with torch.no_grad():
        port = module(x, TileBias(tiles, 16, 48, 48).expand())
        with patch(tower, compress=False, backend="kvbound", query_chunk=16):
            dense = module(x, TileBias(tiles, 16, 48, 48))
        with patch(tower, config, backend="kvbound", query_chunk=16):
            fused = module(x, TileBias(tiles, 16, 48, 48))
        with patch(tower, config, backend="eager", query_chunk=16):
            eager = module(x, TileBias(tiles, 16, 48, 48))
    print(
        f"alphagenome via kvbound.attention: dense vs port {(dense - port).abs().max():.2e}, compressed vs the "
        f"eager compressed path {(fused - eager).abs().max():.2e}, vs port {(fused - port).abs().max():.2e}"
    )
    assert (dense - port).abs().max().item() <= 1e-5 * port.abs().max().item()
    assert (fused - eager).abs().max().item() <= 1e-5 * port.abs().max().item()


def test_alphagenome_patched_tower_dense_matches_and_never_expands_bias(alphagenome):
    tower, _, _ = alphagenome
    s = 48  # not 128 (the head dim): only attention-shaped tensors are S x S
    x = _alphagenome_input(s)
    with torch.no_grad(), SquareTensors(s) as port_sizes:
        expected, expected_pair = tower(x)
    with torch.no_grad(), patch(tower, compress=False, query_chunk=16, backend="eager") as handle:
        with SquareTensors(s) as lean_sizes:
            got, got_pair = tower(x)
    assert len(handle.modules) == 9 and [r.name for r in handle.helpers] == ["TransformerTower"]
    err = (got - expected).abs().max().item()
    pair_err = (got_pair - expected_pair).abs().max().item()
    print(
        f"alphagenome tower, patched dense vs port: max err {err:.2e} (|out| {expected.abs().max():.2f}), pair "
        f"{pair_err:.2e}; S x S tensors: port {port_sizes.count}, patched {lean_sizes.count}"
    )
    assert err <= 1e-5 * expected.abs().max().item()
    assert pair_err <= 1e-5 * expected_pair.abs().max().item()
    assert port_sizes.count >= 9  # the instrument sees the port's [B, 8, S, S] bias and logits
    assert lean_sizes.count == 0


def test_alphagenome_compressed_within_bound_and_undo(alphagenome):
    tower, mha_class, _ = alphagenome
    config = kvbound.CompressionConfig(block_size=16, rank=8, bits=4)
    x = _alphagenome_input(64)
    modules = [block["mha"] for block in tower.blocks]
    with torch.no_grad():
        expected, _ = tower(x)
        before = _snapshot(tower)
        seen, hooks = _capture_inputs(modules)
        try:
            handle = patch(tower, config, calibrate_on=x, backend="eager")
            got, _ = tower(x)
        finally:
            for h in hooks:
                h.remove()
        print(handle.summary())
        print(f"alphagenome tower output, compressed vs port: max err {(got - expected).abs().max():.2e}")
        for i in (0, 5):
            module = modules[i]
            inp, bias = seen[i][0], seen[i][1]
            assert isinstance(bias, TileBias)  # the patched tower hands over the compact bias
            ref = alphagenome_mha_module_reference(module, inp, bias.values)
            out = module(inp, bias)
            b, hq, s, dv = ref["core"].shape
            core = attention_output_bound(ref["q"], ref["v"], tau_k=config.tau, tau_v=config.tau, logit_scale=128**-0.5)
            bound = linear_output_bound(core.transpose(1, 2).reshape(b, s, -1), module.linear_embedding.weight)
            norm = module.final_norm
            bound = bound * (norm.weight.double() / torch.sqrt(norm.running_var.double() + norm.eps)).abs()
            err = (out.double() - ref["out"]).abs()
            print(f"  block {i}: attention output max err {err.max():.2e}, certified bound max {bound.max():.2e}")
            assert (err <= bound + 1e-5 * (1 + ref["out"].abs())).all()
        handle.undo()
        after, _ = tower(x)
    _assert_same_snapshot(before, _snapshot(tower))
    assert torch.equal(after, expected)
    assert all("forward" not in vars(m) for m in modules) and "_forward_block" not in vars(tower)


# ------------------------------------------------------------------------------------------------- the API
def test_patch_finds_nothing_in_a_model_without_port_modules():
    model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2))
    before = _snapshot(model)
    handle = patch(model)
    assert len(handle) == 0 and handle.helpers == [] and not handle.calibrated
    handle.undo()
    _assert_same_snapshot(before, _snapshot(model))


def test_patch_refuses_truthy_non_bools_and_says_when_nothing_was_patched(enformer):
    model, _ = enformer
    with pytest.raises(TypeError, match=r"^compress: expected bool, got str$"):
        patch(model, compress="no")
    with pytest.raises(TypeError, match=r"^filter_fn: expected a bool for transformer.0.0.fn.1, got str$"):
        patch(model, compress=False, filter_fn=lambda name, m: "no")
    assert all("forward" not in vars(m) for m in model.modules())  # nothing was left patched
    with pytest.warns(UserWarning, match=r"no attention module that filter_fn selects in this Enformer: nothing"):
        handle = patch(model, compress=False, filter_fn=lambda name, m: False)
    assert handle.modules == []
    with pytest.warns(UserWarning, match=r"no attention module of the Enformer, Borzoi or AlphaGenome ports in this "
                                         r"Sequential"):
        patch(torch.nn.Sequential(torch.nn.Linear(4, 4)), compress=False)


def test_calibration_sample_with_nan_or_inf_is_named_and_undone(enformer):
    model, _ = enformer
    sample = torch.randn(1, 8 * 20, 4).softmax(-1)
    sample[0, 3, 1] = math.inf
    with pytest.raises(ValueError, match=r"^calibrate_on: expected finite values, found inf at index \(0, 3, 1\)"):
        patch(model, CONFIG, calibrate_on=sample)
    with pytest.raises(ValueError, match=r"^calibrate_on\[0\]: expected finite values, found inf"):
        patch(model, CONFIG, calibrate_on=(sample,))
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_block_that_raises_keeps_its_exception_when_undo_fails_too(enformer):
    model, _ = enformer
    failed = r"undo at the end of a block that raised KeyError failed too: .*forward was replaced"
    with pytest.warns(RuntimeWarning, match=failed):
        with pytest.raises(KeyError, match="the user's"):
            with patch(model, compress=False):
                model.forward = model.forward.wrapped  # replaced behind the handle's back
                raise KeyError("the user's")
    del model.forward
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy on NaN
def test_nan_on_the_kvbound_backend_names_the_layer(enformer):
    model, _ = enformer
    x = torch.randn(1, 8 * 20, 4).softmax(-1)
    x[0, 5, 1] = math.nan
    with patch(model, compress=False, backend="kvbound"), torch.no_grad():
        named = (r"^q: expected finite values, found NaN \(kvbound.attention call 1 of 2 in this deferred-check block: "
                 r"transformer.0.0.fn.1: q \[1, 4, 20, 16\]\)$")
        with pytest.raises(ValueError, match=named):
            model(x)


def test_patch_filter_double_patch_and_argument_errors(enformer):
    model, attention = enformer
    with patch(model, compress=False, filter_fn=lambda name, m: name.startswith("transformer.1")) as handle:
        assert [r.name for r in handle.modules] == ["transformer.1.0.fn.1"]
        with pytest.raises(ValueError, match="transformer.1.0.fn.1 is already patched by kvbound"):
            patch(model, compress=False)
        other = patch(model, compress=False, filter_fn=lambda name, m: name.startswith("transformer.0"))
        other.undo()
    with pytest.raises(ValueError, match="K: CompressionConfig.rank must be < head dim; got rank 16 for head dim 16"):
        patch(model, kvbound.CompressionConfig(rank=16))
    with pytest.raises(ValueError, match="calibrate_on: given with compress=False"):
        patch(model, compress=False, calibrate_on=torch.zeros(1))
    with pytest.raises(ValueError, match=r"^backend: expected one of \('auto', 'eager', 'kvbound'\), got 'flash'$"):
        patch(model, backend="flash")
    with pytest.raises(TypeError, match=r"^calibrate_on: expected a tensor, .* a callable taking the model, got int$"):
        patch(model, CONFIG, calibrate_on=3)
    assert all("forward" not in vars(m) for m in _attention_modules(model, attention))  # failed calibration undid


def test_patched_model_refuses_to_be_copied(enformer):
    import copy

    model, _ = enformer
    with patch(model, compress=False):
        with pytest.raises(TypeError, match="cannot be copied or pickled; call handle.undo"):
            copy.deepcopy(model)
    copy.deepcopy(model)


def test_patch_skips_modules_with_an_instance_forward(enformer):
    model, attention = enformer
    module = _attention_modules(model, attention)[0]
    module.forward = lambda x: attention.forward(module, x)  # what hook wrappers (e.g. accelerate's) look like
    try:
        with pytest.warns(UserWarning, match="left these modules unpatched: transformer.0.0.fn.1: has an instance"):
            handle = patch(model, compress=False)
        assert [r.name for r in handle.modules] == ["transformer.1.0.fn.1"]
        handle.undo()
    finally:
        del module.forward


def test_undo_refuses_to_clobber_a_later_patch(enformer):
    model, attention = enformer
    handle = patch(model, compress=False)
    module = handle.modules[0].module
    module.forward = lambda x: x
    with pytest.raises(RuntimeError, match=r"transformer.0.0.fn.1.forward was replaced after kvbound.patch"):
        handle.undo()
    assert "forward" not in vars(handle.modules[1].module)
    del module.forward


def test_enformer_patched_under_autocast_projects_as_the_port(enformer):
    # Under autocast the patched forward casts x once for the three projections (the port's nn.Linear calls would
    # each cast it): q, k, v must be the port's own projections bit for bit, in the autocast dtype.
    import kvbound.models._ports as ports

    model, attention = enformer
    module = _attention_modules(model, attention)[0]
    x = torch.randn(1, 40, 96, generator=torch.Generator().manual_seed(5))
    seen = []
    original = ports.relative_position_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q, k, v))
        return original(q, k, v, *args, **kwargs)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [ports._split_heads(layer(x), module.heads) for layer in (module.to_q, module.to_k, module.to_v)]
        port_out = module(x)
        with patch(model, compress=False, backend="eager", query_chunk=16):
            ports.relative_position_attention = spy
            try:
                got = module(x)
            finally:
                ports.relative_position_attention = original
    assert len(seen) == 1
    for name, a, b in zip("qkv", seen[0], expected, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    err = (got.float() - port_out.float()).abs().max().item()
    print(f"enformer attention under bfloat16 autocast: patched vs port {err:.2e} (|out| {port_out.abs().max():.2f})")
    assert err <= 2e-2 * port_out.abs().max().item()


@pytest.mark.parametrize("backend, dtype", [("eager", torch.bfloat16), ("kvbound", torch.float16)])
def test_alphagenome_patched_under_autocast_multiplies_what_the_port_multiplies(alphagenome, backend, dtype):
    # Under autocast the port's torch.matmul calls multiply half-precision copies of q, k, v and the weights;
    # the patched forward hands the kernel the same operands (not float32 ones, which would be slower and
    # different). The CPU interpreter's dot is unreliable on bfloat16, so the fused backend runs float16 here.
    import kvbound.models._ports as ports

    tower, _, _ = alphagenome
    module = tower.blocks[3]["mha"]
    x = _alphagenome_input(48, seed=9)
    tiles = torch.randn(1, 8, 3, 3, generator=torch.Generator().manual_seed(8))
    seen = []
    original = ports.tile_bias_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, *args, **kwargs)

    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        port = module(x, TileBias(tiles, 16, 48, 48).expand())
        with patch(tower, compress=False, backend=backend, query_chunk=16):
            ports.tile_bias_attention = spy
            try:
                got = module(x, TileBias(tiles, 16, 48, 48))
            finally:
                ports.tile_bias_attention = original
    with torch.no_grad():
        exact = module(x, TileBias(tiles, 16, 48, 48).expand())  # float32 throughout
    assert seen == [(dtype, dtype, dtype)]
    err, port_err = (got.float() - exact).abs().max().item(), (port.float() - exact).abs().max().item()
    print(f"alphagenome MHABlock under {dtype} autocast, {backend}: patched vs float32 {err:.2e}, port {port_err:.2e}")
    assert port_err > 0  # autocast really changed the port's numbers
    assert err <= 2 * port_err + 1e-6


def _variant_batch(seed: int) -> torch.Tensor:
    """A reference window (``_enformer_input(64, seed)``) and three variants of it, one input position each."""
    batch = _enformer_input(64, seed=seed).repeat(4, 1, 1)
    for item, position in ((1, 100), (2, 260), (3, 420)):
        batch[item, position] = batch[item, position].roll(1)
    return batch


def test_enformer_variants_block_scores_changes_without_code_flip_noise(enformer):
    # A reference window and three variants of it (one input position changed each), in one batch. Compressed
    # independently, each forward's error is within the bound but the errors do not cancel in variant - reference;
    # inside handle.variants() the variants follow their reference's codes, and the changes come out closer to
    # the exact model's. On this small random model the gain varies from window to window (from none to 2.7x
    # lower median error, by CPU as well: float32 rounding decides which codes flip), so it is measured over
    # eight windows pooled.
    model, _ = enformer
    windows = [_variant_batch(seed) for seed in range(3, 11)]
    with torch.no_grad():
        exact = [model(batch)["human"].double() for batch in windows]
        handle = patch(model, CONFIG, calibrate_on=_enformer_input(64, seed=4), query_chunk=16, backend="eager")
        try:
            independent = [model(batch)["human"].double() for batch in windows]
            with handle.variants([-1, 0, 0, 0]):
                anchored = [model(batch)["human"].double() for batch in windows]
            with pytest.raises(ValueError, match="a reference must be its own"):
                with handle.variants([-1, 0, 1, 0]):
                    pass
            with pytest.raises(ValueError, match=r"handle.variants\(\) was given 2 references for a batch of 4"):
                with handle.variants([-1, 0]):
                    model(windows[0])
            assert handle._anchor_index is None  # left clean after the error
            for bad in ([-1, 0.9], torch.tensor([-1.0, 0.0]), [[-1, 0], [0, 0]], [], None, ["a"]):
                with pytest.raises(ValueError, match="references: expected a non-empty 1-D sequence of ints"):
                    with handle.variants(bad):
                        pass
            import numpy as np

            for accepted in (np.array([-1, 0, 0, 0]), [np.int64(-1), 0, np.int32(0), 0]):
                with handle.variants(accepted):
                    assert handle._anchor_index.tolist() == [-1, 0, 0, 0]
            with handle.variants(torch.tensor([-1, 0, 0, 0])):
                with pytest.raises(RuntimeError, match="already inside a variants"):
                    with handle.variants([-1, 0, 0, 0]):
                        pass
        finally:
            handle.undo()
        with pytest.raises(RuntimeError, match="this handle was undone"):
            with handle.variants([-1, 0, 0, 0]):
                pass

    def change(out: torch.Tensor) -> torch.Tensor:
        return out[1:] - out[:1]

    exact_change = torch.cat([change(out).flatten() for out in exact])
    noise_independent = torch.cat([change(out).flatten() for out in independent]) - exact_change
    noise_anchored = torch.cat([change(out).flatten() for out in anchored]) - exact_change
    noise_independent, noise_anchored = noise_independent.abs(), noise_anchored.abs()
    ratio = float(noise_anchored.median()) / float(noise_independent.median())
    print(
        f"enformer variant changes over {len(windows)} windows: |change| median {exact_change.abs().median():.2e}; "
        f"error of the change: independent median {noise_independent.median():.2e} max "
        f"{noise_independent.max():.2e}, anchored median {noise_anchored.median():.2e} max "
        f"{noise_anchored.max():.2e} (ratio {ratio:.2f})"
    )
    for a, i in zip(anchored, independent, strict=True):
        assert torch.equal(a[0], i[0])  # the reference is encoded on its own either way
    assert ratio < 0.85


def test_encode_time_accumulates_per_forward(enformer):
    model, _ = enformer
    x = _enformer_input(32, seed=5)
    with torch.no_grad(), patch(model, CONFIG, query_chunk=16, backend="eager") as handle:
        model(x)
        first = [r.encode_seconds for r in handle.modules]
        model(x)
        second = [r.encode_seconds for r in handle.modules]
    assert all(t > 0 for t in first) and all(b > a for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
def test_gpu_borzoi_layer_full_size_one_key_per_run_bf16(monkeypatch):
    """One Borzoi attention layer at its published size (dim 1536, 8 heads, dk 64, dv 192, 4096 tokens) on the GPU
    under bf16 autocast: the patched layer passes one relative key per run (31 runs of equal positional features) and
    its output is within twice the port's own bf16 error of the float64 reference."""
    _port("borzoi_pytorch")
    from borzoi_pytorch.pytorch_borzoi_transformer import Attention

    from kvbound.attention import attention as fused
    from kvbound.models import _backend

    torch.manual_seed(0)
    module = Attention(1536, heads=8, dim_key=64, dim_value=192, num_rel_pos_features=32).eval()
    _randomize_(module, seed=5)
    x = torch.randn(1, 4096, 1536, generator=torch.Generator().manual_seed(6))
    ref = borzoi_attention_module_reference(module, x)["out"]
    rows = []

    def spy(q, k, v, **kwargs):
        rows.append((kwargs["relative_keys"].shape[1], len(kwargs["relative_runs"])))
        return fused(q, k, v, **kwargs)

    monkeypatch.setattr(_backend, "_kvbound_attention", lambda: spy)
    module, xc = module.cuda(), x.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        port = module(xc).float().cpu()
        with patch(module, compress=False, backend="kvbound"):
            ours = module(xc).float().cpu()
    port_err = (port.double() - ref).abs().max().item()
    our_err = (ours.double() - ref).abs().max().item()
    print(f"Borzoi layer bf16 vs float64: port {port_err:.3e}, patched (one key per run) {our_err:.3e}")
    from kvbound.models.reference import borzoi_positional_features_reference
    from kvbound.models.relative import equal_row_runs

    runs = len(equal_row_runs(borzoi_positional_features_reference(4096, 32)))
    assert runs == 31 and rows == [(runs, runs)]
    assert torch.isfinite(ours).all() and our_err <= 2 * port_err
