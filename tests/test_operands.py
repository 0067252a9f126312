"""The patched forwards' kept operands (``kvbound/models/_operands.py``): casts of the patched layers' weights and
their relative keys, made once per handle and made again whenever a weight changes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kvbound.models import patch
from kvbound.models._operands import OperandCache, operand_cache_enabled


def _randomize_(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


@pytest.fixture
def enformer():
    """A two-block Enformer (dim 96, 4 heads of key dim 16) with every attention weight random (the port starts
    ``to_out`` at zero), and a 40-token input."""
    port = pytest.importorskip("enformer_pytorch", reason="enformer_pytorch is not installed (kvbound[models])")
    from enformer_pytorch.modeling_enformer import Attention

    torch.manual_seed(0)
    model = port.Enformer.from_hparams(
        dim=96, depth=2, heads=4, attn_dim_key=16, num_downsamples=3, dim_divisible_by=8, target_length=-1,
        output_heads=dict(human=8),
    ).eval()  # fmt: skip
    attention = [m for m in model.modules() if type(m) is Attention]
    for i, m in enumerate(attention):
        _randomize_(m, seed=10 + i)
    x = torch.randn(1, 8 * 40, 4, generator=torch.Generator().manual_seed(1)).softmax(-1)
    return model, attention, x


@pytest.fixture
def fused_norm_on_cpu(monkeypatch):
    """Let the fused pre-norm and feed-forward run on CPU tensors (the norm kernel in the interpreter)."""
    import kvbound.models._ports as ports

    monkeypatch.setattr(ports, "_fused_norm_device", lambda x: True)


def _forward(model, x, dtype=torch.bfloat16):
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return model(x)["human"]


def test_kept_operands_give_the_port_s_forward_bit_for_bit(enformer, fused_norm_on_cpu, monkeypatch):
    """Under autocast a patched layer keeps the casts of to_q, to_k, to_v, to_out (weight and bias) and of the
    feed-forward's two Linears (weights and biases), and its relative keys: 10 per block. The next forward makes
    none of them again, and its output equals, bit for bit, the forward that casts in every call."""
    model, _, x = enformer
    with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
        first = _forward(model, x)
        assert len(handle._operands) == 2 * 10 and handle._operands.made == 20
        assert handle.operand_bytes == handle._operands.bytes > 0
        second = _forward(model, x)
        assert handle._operands.made == 20  # nothing made again
        monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "0")
        uncached = _forward(model, x)
        assert handle._operands.made == 20
        monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "1")
        half = _forward(model, x, torch.float16)  # another autocast dtype: its own casts and relative keys
        assert len(handle._operands) == 40
    assert len(handle._operands) == 0  # undo drops them
    assert first.dtype == torch.bfloat16 and torch.equal(first, second) and torch.equal(first, uncached)
    assert not torch.equal(first, half)


def test_another_length_replaces_the_relative_keys(enformer, monkeypatch):
    """The relative keys are kept for the latest input length only (one entry per layer), and each length's forward
    equals the one that makes them in every call."""
    model, _, x = enformer
    longer = torch.randn(1, 8 * 48, 4, generator=torch.Generator().manual_seed(3)).softmax(-1)
    with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
        outs = [_forward(model, t) for t in (x, longer, x)]
        keys = [k for k in handle._operands._entries if k[0] == "relative_keys"]
        assert len(keys) == 2 and len(handle._operands) == 12
        monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "0")
        fresh = [_forward(model, t) for t in (x, longer)]
    assert torch.equal(outs[0], fresh[0]) and torch.equal(outs[1], fresh[1]) and torch.equal(outs[2], fresh[0])


def test_a_changed_weight_is_seen(enformer, monkeypatch):
    """In-place writes, load_state_dict and a replaced storage (``param.data = ...``) each make the operands again;
    a write through ``.data`` is not seen until ``handle.clear_operands()``."""
    model, attention, x = enformer
    rel_k, to_v = attention[0].to_rel_k.weight, attention[1].to_v.weight
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
        base = _forward(model, x)
        made = handle._operands.made
        assert made == 2 * 6  # q, k, v, to_out's weight and bias, the relative keys (the feed-forward runs itself)

        def forward_made(expected: int) -> tuple[torch.Tensor, torch.Tensor]:
            """This forward, after which ``expected`` operands were made in all, and one that casts in each call."""
            out = _forward(model, x)
            assert handle._operands.made == expected
            monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "0")
            fresh = _forward(model, x)
            monkeypatch.delenv("KVBOUND_OPERAND_CACHE")
            return out, fresh

        first_keys = ("relative_keys", id(attention[0].to_rel_k))
        (keys,) = [e.value for k, e in handle._operands._entries.items() if k[:2] == first_keys]
        where, previous = keys.data_ptr(), keys.clone()
        with torch.no_grad():
            rel_k.mul_(2)  # the first block's relative keys are made again, in their own memory
        out, fresh = forward_made(made + 1)
        assert torch.equal(out, fresh) and not torch.equal(out, base)
        (again,) = [e.value for k, e in handle._operands._entries.items() if k[:2] == first_keys]
        assert again is keys and keys.data_ptr() == where and torch.equal(keys.float(), 2 * previous.float())

        model.load_state_dict(state)  # every weight written in place: every operand again
        out, fresh = forward_made(2 * made + 1)
        assert torch.equal(out, base) and torch.equal(fresh, base)

        to_v.data = to_v.data * 3  # a new storage for one weight: its cast only
        out, fresh = forward_made(2 * made + 2)
        assert torch.equal(out, fresh) and not torch.equal(out, base)

        with torch.no_grad():
            to_v.data.mul_(0)  # through .data: the version counter does not see it
        stale = _forward(model, x)
        assert handle._operands.made == 2 * made + 2 and torch.equal(stale, out)
        handle.clear_operands()
        out, fresh = forward_made(3 * made + 2)
        assert torch.equal(out, fresh) and not torch.equal(stale, fresh)


def test_nothing_is_kept_where_it_could_go_stale_or_lose_a_graph(enformer, monkeypatch):
    """No operand is kept for an observed Linear (its hook runs), without autocast (nothing to cast, and the
    relative keys are kept only where their sources are plain), for sources that autograd differentiates, for
    inference tensors, or with the switch off."""
    model, attention, x = enformer
    calls = []
    hook = attention[0].to_q.register_forward_hook(lambda *args: calls.append(1))
    with patch(model, compress=False, backend="eager", query_chunk=16) as handle:
        _forward(model, x)
        assert calls == [1]
        kept = {key[1] for key in handle._operands._entries if key[0] == "cast"}
        assert id(attention[0].to_q.weight) not in kept and id(attention[1].to_q.weight) in kept
        hook.remove()
        handle.clear_operands()
        monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "off")
        _forward(model, x)
        assert len(handle._operands) == 0 and not operand_cache_enabled()
        monkeypatch.setenv("KVBOUND_OPERAND_CACHE", "sometimes")
        with pytest.raises(ValueError, match="KVBOUND_OPERAND_CACHE"):
            _forward(model, x)
        monkeypatch.delenv("KVBOUND_OPERAND_CACHE")

    cache, made = OperandCache(), []
    w = torch.randn(4, 4, requires_grad=True)

    def make():
        made.append(1)
        return w * 2

    for _ in range(2):
        with torch.enable_grad():
            assert cache.get(("w",), (w,), make).requires_grad
    assert len(made) == 2 and len(cache) == 0
    with torch.no_grad():
        cache.get(("w",), (w,), make), cache.get(("w",), (w,), make)
    assert len(made) == 3 and len(cache) == 1
    with torch.inference_mode():
        frozen = torch.randn(4, 4)
    cache.get(("f",), (frozen,), lambda: frozen * 2)
    assert len(cache) == 1  # an inference tensor has no version counter


def test_a_kept_operand_holds_its_source_storage():
    """A replaced storage stays alive while its entry does, so a new storage cannot reuse its address and pass for
    the old one."""
    cache = OperandCache()
    w = torch.randn(8, 8)
    before = w.untyped_storage().data_ptr()
    cache.cast(w, torch.bfloat16)
    w.data = torch.randn(8, 8)
    (entry,) = cache._entries.values()
    assert entry.storages[0].data_ptr() == before != w.untyped_storage().data_ptr()
    assert torch.equal(cache.cast(w, torch.bfloat16), w.to(torch.bfloat16)) and cache.made == 2
    assert cache.cast(w, torch.float32) is w
