"""kvbound/bench/alternatives.py: the stock-attention cores a user could assemble for the ports' layers (Enformer and
Borzoi: SDPA with a built position bias, FlexAttention over a built table; AlphaGenome: FlexAttention reading the
compact pair bias), run inside the ports' own layers by the models suite's ``--alternatives``. On the CPU in
float32: each gives the port's output, runs in every layer, and leaves the layers exactly as they were."""

from __future__ import annotations

import pytest
import torch

from kvbound.bench import alternatives, ports, relative
from test_bench_ports import OPTIONS, SMOKE, _toy_spec
from test_models_ports import _alphagenome_input, _attention_modules, alphagenome, borzoi, enformer  # noqa: F401


@pytest.mark.parametrize("port_name", ["enformer", "borzoi"])
@pytest.mark.parametrize("name", alternatives.RELATIVE_ALTERNATIVES)
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


def test_flex_tile_bias_gives_the_port_output_in_every_alphagenome_block(alphagenome, monkeypatch):  # noqa: F811
    tower, mha_class = alphagenome[:2]
    modules = _attention_modules(tower, mha_class)
    x = _alphagenome_input(48)
    calls = []
    build = alternatives._flex_tile_bias

    def counted(*args, **kwargs):
        run = build(*args, **kwargs)

        def run_counted(inputs):
            calls.append(tuple(inputs["tiles"].shape))
            return run(inputs)

        return run_counted

    monkeypatch.setattr(alternatives, "_flex_tile_bias", counted)
    with torch.no_grad():
        expected, expected_pair = tower(x)
        with alternatives.alternative_core("flex-tile-bias", modules, torch.device("cpu"), tower):
            got, got_pair = tower(x)
            # the block hands the MHABlock its bias at tile resolution; an expanded bias is refused by name
            with pytest.raises(ValueError, match=r"tiles: expected the compact pair bias \(1, 8, 3, 3\), got"):
                modules[0](x, torch.zeros(1, 8, 48, 48))
    assert calls == [(1, 8, 3, 3)] * len(modules) == [(1, 8, 3, 3)] * 9  # the core ran in every block, compact bias
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-5 * scale
    # the pair stream is the port's own, updated from the blocks' (rounding-different) outputs
    assert (got_pair - expected_pair).abs().max().item() <= 1e-5 * expected_pair.abs().max().item()
    assert "_forward_block" not in tower.__dict__ and all("forward" not in m.__dict__ for m in modules)
    with torch.no_grad():
        torch.testing.assert_close(tower(x)[0], expected, rtol=0, atol=0)


def test_flex_tile_bias_refuses_without_its_tower(alphagenome, enformer):  # noqa: F811
    tower, mha_class = alphagenome[:2]
    modules = _attention_modules(tower, mha_class)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="model is needed"):
        with alternatives.alternative_core("flex-tile-bias", modules, cpu):
            pass
    with pytest.raises(ValueError, match=r"9 of 9 MHABlocks are in no TransformerTower"):
        with alternatives.alternative_core("flex-tile-bias", modules, cpu, torch.nn.Linear(2, 2)):
            pass
    relative_layers = _attention_modules(*enformer[:2])
    with pytest.raises(ValueError, match=r"flex-tile-bias: AlphaGenome's MHABlock layers only, got \['Attention'"):
        with alternatives.alternative_core("flex-tile-bias", relative_layers, cpu, enformer[0]):
            pass
    with pytest.raises(ValueError, match=r"sdpa-built-bias: the ports' relative-position layers only, got \['MHA"):
        with alternatives.alternative_core("sdpa-built-bias", modules, cpu, tower):
            pass
    assert "_forward_block" not in tower.__dict__ and all("forward" not in m.__dict__ for m in modules)
    assert alternatives.supported_alternatives(modules) == alternatives.TILE_BIAS_ALTERNATIVES
    assert alternatives.supported_alternatives(relative_layers) == alternatives.RELATIVE_ALTERNATIVES
    assert alternatives.supported_alternatives([]) == alternatives.supported_alternatives(modules + relative_layers)
    assert alternatives.supported_alternatives([]) == ()


def test_models_suite_marks_alternatives_unsupported_where_no_layer_takes_them():
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), alternatives=alternatives.ALTERNATIVES)
    rows = list(ports.model_rows((_toy_spec(),), torch.device("cpu"), SMOKE, options))
    assert [r["provider"] for r in rows] == list(ports.VARIANTS + alternatives.ALTERNATIVES)
    for r in rows[len(ports.VARIANTS):]:
        assert r["status"] == "unsupported"
        port = "Enformer, Borzoi" if r["provider"] in alternatives.RELATIVE_ALTERNATIVES else "AlphaGenome port"
        assert port in r["reason"], r["reason"]
    assert OPTIONS.alternatives == ()  # off unless asked for


def test_models_suite_times_flex_tile_bias_on_the_tiny_alphagenome_tower():
    """The models suite's path: the variant runs the tower through ``alternative_core`` with the model, its output
    is compared with the unpatched forward, and only the variants asked for run (``variants``)."""
    pytest.importorskip("alphagenome_pytorch")
    spec = next(s for s in ports.port_models(cpu_smoke=True) if s.name == "alphagenome-tower-tiny")
    options = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), alternatives=alternatives.ALTERNATIVES,
                                 variants=("unpatched", "sdpa-built-bias", "flex-tile-bias"))  # fmt: skip
    rows = list(ports.model_rows((spec,), torch.device("cpu"), SMOKE, options))
    by = {r["provider"]: r for r in rows}
    assert list(by) == ["unpatched", "sdpa-built-bias", "flex-tile-bias"]
    assert by["unpatched"]["status"] == "ok" and by["sdpa-built-bias"]["status"] == "unsupported"
    flex = by["flex-tile-bias"]
    assert flex["status"] == "ok", flex["reason"]
    # the suite runs under bfloat16 autocast: within bfloat16 rounding (2**-7) of the port's output, not equal to it
    assert 0 < flex["diff_rel"] < 2**-7 and flex["ms_p50"] > 0 and flex["attention_ms_p50"] > 0
    # without the unpatched forward there is nothing to compare with, and the row says why
    alone = ports.ModelOptions(warmup=0, repeats=1, batches=(1,), alternatives=alternatives.ALTERNATIVES,
                               variants=("flex-tile-bias",))  # fmt: skip
    (row,) = ports.model_rows((spec,), torch.device("cpu"), SMOKE, alone)
    assert row["status"] == "ok" and row.get("diff_rel") is None
    assert "no output difference: the unpatched forward not run (--variants)" in row["note"]


def test_cli_models_refuses_variants_not_offered(tmp_path):
    from kvbound.bench import cli

    out = tmp_path / "m.csv"
    argv = ["--suite", "models", "--cpu-smoke", "--only", "alphagenome*", "--out", str(out), "--variants"]
    assert cli.main([*argv, "flex-tile-bias"]) == 2  # an alternative without --alternatives
    assert cli.main([*argv, "unpatched-graph"]) == 2  # a graph variant without --graphs
    assert cli.main([*argv, "patch-sparse"]) == 2
    assert not out.exists()


def test_flex_built_table_runs_a_batch_whose_table_is_too_large_in_chunks(monkeypatch):
    """A batch whose ``[B, H, N, 2N - 1]`` table would reach ``FLEX_TABLE_ELEMENTS`` runs in chunks of batches whose
    tables stay below it (compiled FlexAttention faulted on a table of 8.3e9 elements), with the same output."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(5)
    b, h, n, dk, dv = 5, 2, 24, 8, 12
    x = {"q": torch.randn(b, h, n, dk, generator=g), "k": torch.randn(b, h, n, dk, generator=g),
         "v": torch.randn(b, h, n, dv, generator=g), "relative_keys": torch.randn(h, 2 * n - 1, dk, generator=g),
         "u": torch.randn(h, dk, generator=g), "w": torch.randn(h, dk, generator=g), "scale": dk**-0.5}
    batches = []

    def flex(q, *args, **kwargs):
        batches.append(q.shape[0])
        return flex_attention(q, *args, **kwargs)

    whole = relative._flex_built_table(flex)(x)
    assert batches == [5]
    batches.clear()
    monkeypatch.setattr(relative, "FLEX_TABLE_ELEMENTS", 2 * h * n * (2 * n - 1) + 1)  # two batches' tables
    chunked = relative._flex_built_table(flex)(x)
    assert batches == [2, 2, 1]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
