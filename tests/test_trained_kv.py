"""benchmarks/trained_kv.py end to end on the CPU: capture q, k, v from (toy, random) evaluation models on the
synthetic fixture, then every step of the timing script except the timing, in Triton's interpreter."""

from __future__ import annotations

import csv
import json

import pytest

from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)


def _module():
    return load("trained_kv")


def test_capture_then_time_on_the_fixture(tmp_path):
    from safetensors import safe_open

    tkv = _module()
    captured = tmp_path / "kv.safetensors"
    assert tkv.main(["capture", str(captured), "--tokens", "200", "--fixture", str(tmp_path / "fixture")]) == 0
    with safe_open(str(captured), framework="pt") as handle:
        meta = json.loads(handle.metadata()["trained_kv"])
        shapes = {name: handle.get_tensor(name).shape for name in handle.keys()}
    assert set(meta) == {"enformer", "alphagenome"}
    # 200 tokens from consecutive 64-bin toy windows of the test split; one K/V head for the AlphaGenome-style model
    assert shapes["enformer.q"][2] == 200 and shapes["enformer.k"][1] == shapes["enformer.q"][1]
    assert shapes["alphagenome.k"][1] == 1 and shapes["alphagenome.q"][1] > 1
    windows = meta["enformer"]["windows_bp"]
    assert all(b - a == 64 * 128 for a, b in zip(windows, windows[1:], strict=False))

    out = tmp_path / "rows.csv"
    assert tkv.main(["time", str(captured), str(out), "--cpu-smoke", "--lengths", "128", "200", "--configs", "r8b4",
                     "r16b8"]) == 0  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert [(r["model"], r["N"], r["provider"], r["config"]) for r in rows] == [
        (m, n, p, c) for n in ("128", "200") for m in ("enformer", "alphagenome")
        for p, c in (("kvbound-dense", ""), ("kvbound-compressed", "r8b4"), ("kvbound-compressed", "r16b8"))
    ]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok" and float(r["err_rel"]) < 1e-5  # float32 in the interpreter
        if r["provider"] == "kvbound-compressed":
            assert float(r["kv_max_err_over_tau"]) <= 1.0
            assert abs(sum(float(x) for x in r["k_shares"].split("/")) - 1) < 1e-6


def test_time_refuses_more_tokens_than_captured(tmp_path):
    tkv = _module()
    captured = tmp_path / "kv.safetensors"
    tkv.main(["capture", str(captured), "--tokens", "100", "--fixture", str(tmp_path / "fixture"), "--models",
              "enformer"])  # fmt: skip
    with pytest.raises(SystemExit, match="more than the 100 tokens"):
        tkv.main(["time", str(captured), str(tmp_path / "x.csv"), "--cpu-smoke", "--lengths", "101"])
    with pytest.raises(SystemExit, match="no rank-4 basis"):
        tkv.main(["time", str(captured), str(tmp_path / "x.csv"), "--cpu-smoke", "--configs", "r4b4"])
    with pytest.raises(SystemExit, match="expected labels like r8b4"):
        tkv.main(["time", str(captured), str(tmp_path / "x.csv"), "--cpu-smoke", "--configs", "rank8"])


def test_captured_queries_carry_each_model_s_softmax_scale(tmp_path):
    """Plain attention with scale 1 on the captured q must be the models' own logit scale: the Enformer-style
    model hands its attention function q already multiplied by dk**-0.5, the AlphaGenome-style model scales inside
    its attention function, so the capture scales that one."""
    import torch
    from safetensors.torch import load_file

    from kvbound.eval.data import load_data
    from kvbound.eval.models import ModelConfig, build_model
    from kvbound.eval.windows import one_hot

    tkv = _module()
    captured = tmp_path / "kv.safetensors"
    fixture = tmp_path / "fixture"
    tkv.main(["capture", str(captured), "--tokens", "64", "--fixture", str(fixture)])
    tensors = load_file(str(captured))
    data = load_data(fixture)
    from safetensors import safe_open

    with safe_open(str(captured), framework="pt") as handle:
        meta = json.loads(handle.metadata()["trained_kv"])
    for kind, expected_scale in (("enformer", 1.0), ("alphagenome", None)):
        model = build_model(ModelConfig.toy(kind, 4), seed=0).eval()  # the capture's toy model
        start = meta[kind]["windows_bp"][0]
        window = torch.from_numpy(data.codes[start : start + model.config.window_bp].copy())
        seen = tkv._record(model, [one_hot(window[None])], meta[kind]["layer"])
        scale = model.config.key_dim**-0.5 if expected_scale is None else expected_scale
        n = seen["q"][0].shape[2]
        stored = tensors[f"{kind}.q"][:, :, :n].float()
        assert torch.allclose(stored, (seen["q"][0] * scale).bfloat16().float(), rtol=0, atol=0)
