"""kvbound/bench/alternatives.py: the stock-attention cores a user could assemble for Enformer's and Borzoi's layers
(SDPA with a built position bias, FlexAttention over a built table), run inside the ports' own layers by the models
suite's ``--alternatives``. On the CPU in float32: each gives the port's output, runs in every layer, and leaves the
layers exactly as they were."""

from __future__ import annotations

import pytest
import torch

from kvbound.bench import alternatives, ports, relative
from test_bench_ports import OPTIONS, SMOKE, _toy_spec
from test_models_ports import _attention_modules, borzoi, enformer  # noqa: F401 (fixtures; skip without the ports)


@pytest.mark.parametrize("port_name", ["enformer", "borzoi"])
@pytest.mark.parametrize("name", alternatives.ALTERNATIVES)
def test_alternative_core_gives_the_port_output_in_every_layer(port_name, name, request, monkeypatch):
    model, attention_cls = request.getfixturevalue(port_name)[:2]
    modules = _attention_modules(model, attention_cls)
    n, dim = (40, 96) if port_name == "enformer" else (32, 64)
    x = torch.randn(2, n, dim, generator=torch.Generator().manual_seed(3))
    calls = []
    if name == "sdpa-built-bias":
        core = relative._sdpa_built_bias

        def counted(x):
            calls.append(name)
            return core(x)

        monkeypatch.setattr(relative, "_sdpa_built_bias", counted)
    else:
        build = relative._flex_built_table

        def counted(*args, **kwargs):  # each core built counts its calls
            run = build(*args, **kwargs)

            def run_counted(x):
                calls.append(name)
                return run(x)

            return run_counted

        monkeypatch.setattr(relative, "_flex_built_table", counted)
    forwards = [m.__dict__.get("forward") for m in modules]
    with torch.no_grad():
        expected = [m(x) for m in modules]
        with alternatives.alternative_core(name, modules, torch.device("cpu")):
            got = [m(x) for m in modules]
            got_again = modules[0](x)
    assert len(calls) == len(modules) + 1  # the core ran in every layer call
    for out, ref in zip(got, expected, strict=True):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    torch.testing.assert_close(got_again, got[0], rtol=0, atol=0)
    assert [m.__dict__.get("forward") for m in modules] == forwards  # restored: nothing left on the instances
    with torch.no_grad():
        torch.testing.assert_close(modules[0](x), expected[0], rtol=0, atol=0)


def test_alternative_core_refuses_other_layers_and_names(enformer):  # noqa: F811
    model, attention_cls = enformer[:2]
    modules = _attention_modules(model, attention_cls)
    with pytest.raises(ValueError, match=r"^alternative: expected one of"):
        with alternatives.alternative_core("sdpa", modules, torch.device("cpu")):
            pass
    with pytest.raises(ValueError, match=r"relative-position layers only, got \['Linear'\]"):
        with alternatives.alternative_core("sdpa-built-bias", [torch.nn.Linear(2, 2)], torch.device("cpu")):
            pass
    assert all("forward" not in m.__dict__ for m in modules)


def test_models_suite_marks_alternatives_unsupported_where_there_is_no_relative_layer():
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), alternatives=alternatives.ALTERNATIVES)
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE, options))
    assert [r["provider"] for r in rows] == list(ports.VARIANTS + alternatives.ALTERNATIVES)
    for r in rows[len(ports.VARIANTS):]:
        assert r["status"] == "unsupported" and "Enformer, Borzoi" in r["reason"]
    assert OPTIONS.alternatives == ()  # off unless asked for
