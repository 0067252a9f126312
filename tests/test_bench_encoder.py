"""``kvbound bench --suite encoder`` on the CPU: rows, their formulas, the bound check, and the command line."""

import math

import pytest
import torch

import kvbound
from kvbound.bench import cli, encoder, records
from kvbound.bench.shapes import AttentionShape

CONFIG = kvbound.CompressionConfig(block_size=16, rank=4, bits=4)


def _shape(**kw):
    base = dict(name="t", q_len=64, kv_len=64, head_dim_qk=16, head_dim_v=32, q_heads=2, kv_heads=2,
                dtype="float16", family="model", zero_tile_share=0.5)
    base.update(kw)
    return AttentionShape(**base)


def _rows(encoders, **kw):
    options = encoder.EncoderOptions(warmup_ms=0, rep_ms=0, encoders=encoders, **kw)
    return list(encoder.encoder_rows([_shape()], torch.device("cpu"), CONFIG, options))


def test_rows_carry_the_formulas_and_pass_the_bound(tmp_path):
    rows = _rows(("encoder-eager", "encoder-triton", "encoder-triton-noverify", "device-copy"))
    calibration, *encoded = rows
    assert calibration["mode"] == "calibrate" and calibration["suite"] == "encoder" and calibration["ms_p50"] > 0
    assert calibration["kv_dense_bytes"] == 2 * 64 * (16 + 32) * 2  # one K and one V sample, float16
    by = {r["provider"]: r for r in encoded}
    dense = 2 * 64 * (16 + 32) * 2
    for name, r in by.items():
        assert r["mode"] == "encode" and r["status"] == "ok", (name, r["reason"])
        assert r["kv_dense_bytes"] == dense
        assert r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
        assert r["gbps"] == pytest.approx(dense / (r["ms_p50"] * 1e-3) / 1e9)
        assert 0.0 <= r["max_err_over_tau"] <= 1.0
    records.write_rows(tmp_path / "rows.csv", rows)  # every key is a known column
    assert len(records.read_rows(tmp_path / "rows.csv")) == len(rows)
    for name in ("encoder-eager", "encoder-triton", "encoder-triton-noverify"):
        r = by[name]
        assert r["config"] == "r4b4-block16" and r["rank"] == 4 and r["basis"] == "calibrated"
        assert r["compression_ratio"] == pytest.approx(dense / r["kv_bytes"])
        assert r["bytes_moved"] == dense + r["kv_bytes"]
        assert r["kv_max_abs_error"] == pytest.approx(r["max_err_over_tau"] * CONFIG.tau)
        for which in ("k", "v"):
            shares = [r[f"{which}_share_{m}"] for m in ("lowrank", "packed", "promoted", "raw")]
            assert sum(shares) == pytest.approx(1.0)
        # 4 blocks per head, 2 heads, K and V: the residual-free share is a count over 16 blocks
        assert r["zero_residual_share"] * 16 == pytest.approx(round(r["zero_residual_share"] * 16))
    # The Triton encoder stores what the eager encoder stores.
    assert by["encoder-triton"]["kv_bytes"] == by["encoder-eager"]["kv_bytes"]
    assert by["device-copy"]["bytes_moved"] == 2 * dense and by["device-copy"]["max_err_over_tau"] == 0.0


def test_a_result_outside_the_bound_is_flagged():
    inputs = encoder.encoder_inputs(_shape(), torch.device("cpu"), block_size=16)
    k, v = inputs["k"], inputs["v"]
    basis_k = kvbound.calibrate(inputs["k_sample"], CONFIG)
    basis_v = kvbound.calibrate(inputs["v_sample"], CONFIG)
    shifted = kvbound.compress_kv(k + 3 * CONFIG.tau, CONFIG, basis_k)  # a correct encoding of the wrong tensor
    good_v = kvbound.compress_kv(v, CONFIG, basis_v)
    fields, status, reason = encoder._check("encoder-eager", (shifted, good_v), k, v, CONFIG.tau)
    print(f"tampered: max err / tau = {fields['max_err_over_tau']:.3f}")
    assert status == "check_failed" and "tau" in reason and fields["max_err_over_tau"] > 1.0
    fields, status, _ = encoder._check("device-copy", (k.clone(), v.clone() + 1), k, v, CONFIG.tau)
    assert status == "check_failed" and math.isinf(fields["max_err_over_tau"])


def test_encoder_inputs_match_the_attention_suite():
    from kvbound.bench.providers import Case

    shape = _shape()
    case = Case(shape, torch.device("cpu"), block_size=16)
    inputs = encoder.encoder_inputs(shape, torch.device("cpu"), block_size=16)
    assert torch.equal(inputs["k"], case.k[0]) and torch.equal(inputs["v"], case.v[0])
    assert torch.equal(inputs["k_sample"], case.calibration_samples("k"))
    assert not torch.equal(inputs["k"], inputs["k_sample"])


def test_config_label():
    assert encoder.config_label(kvbound.CompressionConfig()) == "r8b4"
    assert encoder.config_label(kvbound.CompressionConfig(rank=4, bits=2, block_size=64, tau=0.5)) == \
        "r4b2-block64-tau0.5"


def test_cli_encoder_smoke(tmp_path):
    out = tmp_path / "encoder.csv"
    status = cli.main(["--suite", "encoder", "--cpu-smoke", "--only", "smoke-tile-softcap", "--encoders",
                       "encoder-triton", "device-copy", "--rep-ms", "0", "--out", str(out)])
    assert status == 0
    rows = records.read_rows(out)
    assert [(r["mode"], r["provider"]) for r in rows] == [
        ("calibrate", "kvbound.calibrate"), ("encode", "encoder-triton"), ("encode", "device-copy")]
    for r in rows:
        assert r["status"] == "ok" and r["suite"] == "encoder" and r["shape"] == "smoke-tile-softcap"
        assert r["command"].startswith("python -m kvbound.bench --suite encoder --cpu-smoke")
        assert r["gpu"].startswith("cpu")
    assert rows[1]["head_dim_qk"] == 16 and rows[1]["head_dim_v"] == 32 and rows[1]["kv_heads"] == 1
    assert cli.main(["--suite", "encoder", "--cpu-smoke", "--encoders", "encoder-cuda", "--out",
                     str(tmp_path / "x.csv")]) == 2
