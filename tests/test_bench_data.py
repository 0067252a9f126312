"""Benchmark inputs (structured K/V, biases) and the torch providers of kvbound.bench, on the CPU."""

import pytest
import torch

import kvbound
from kvbound.bench import data
from kvbound.bench.providers import Case, Eager, Flex, SdpaBackend, SdpaBias, Unsupported
from kvbound.bench.runner import RunOptions, Task, input_sets_for, run_task
from kvbound.bench.shapes import AttentionShape


def _lowrank_share(x: torch.Tensor, rank: int = 8) -> float:
    config = kvbound.CompressionConfig(rank=rank)
    basis = kvbound.calibrate(x, config)
    ckv = kvbound.compress_kv(x, config, basis)
    return ckv.mode_fractions()["lowrank"]


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_structured_kv_controls_the_residual_free_share(share):
    subspace = data.kv_subspace(2, 32, seed=1)
    x = data.structured_kv(1, 1024, subspace, zero_tile_share=share, seed=2, dtype=torch.float16)
    assert x.shape == (1, 2, 1024, 32) and x.dtype == torch.float16
    assert bool(torch.isfinite(x).all())
    assert 0.7 < float(x.float().std()) < 1.3  # unit-scale activations, not zeros
    assert abs(_lowrank_share(x) - share) <= 0.125


def test_structured_kv_is_low_rank_plus_residual_not_noise():
    subspace = data.kv_subspace(1, 64, seed=3)
    x = data.structured_kv(1, 512, subspace, zero_tile_share=0.5, seed=4, dtype=torch.float32)[0, 0]
    singular = torch.linalg.svdvals(x.double())
    energy = (singular**2).cumsum(0) / (singular**2).sum()
    assert energy[7] > 0.98  # rank 8 holds the energy; pure noise would need ~all 64 directions
    assert energy[7] < 1.0  # and there is a residual


def test_structured_kv_is_deterministic_by_seed():
    subspace = data.kv_subspace(2, 16, seed=0)
    a = data.structured_kv(1, 200, subspace, seed=5)
    assert torch.equal(a, data.structured_kv(1, 200, subspace, seed=5))
    assert not torch.equal(a, data.structured_kv(1, 200, subspace, seed=6))
    with pytest.raises(ValueError, match="zero_tile_share"):
        data.structured_kv(1, 8, subspace, zero_tile_share=2.0)


def test_dense_bias_matches_compact_forms():
    pair = data.tile_pair_bias(1, 2, 32, 48, 16, dtype=torch.float32, seed=1)
    dense = data.dense_bias("tile", pair, 32, 48, 16)
    assert dense.shape == (1, 2, 32, 48)
    assert dense[0, 1, 17, 40] == pair[0, 1, 1, 2]
    table = data.relative_position_table(2, 32, 48, dtype=torch.float32)
    rel = data.dense_bias("relpos", table, 32, 48)
    assert rel.shape == (1, 2, 32, 48)
    assert rel[0, 1, 5, 9] == table[1, 5 - 9 + 47]
    assert torch.equal(rel[0, :, 3, 3], rel[0, :, 10, 10])  # depends on i - j only


def _shape(**kw):
    base = dict(name="t", q_len=48, kv_len=48, head_dim_qk=16, head_dim_v=32, q_heads=4, kv_heads=2,
                dtype="float32", family="model")
    base.update(kw)
    return AttentionShape(**base)


def test_case_reference_subsample_matches_the_oracle_on_all_rows():
    shape = _shape(causal=True, bias="tile", bias_tile=16, softcap=5.0)
    case = Case(shape, torch.device("cpu"), check_rows=7)
    assert case.check_index[0] == 0 and case.check_index[-1] == shape.q_len - 1
    got = case.dense_reference()
    full = kvbound.reference_attention(case.q[0], case.k[0], case.v[0], scale=shape.scale, causal=True,
                                       bias=case.bias_dense, softcap=5.0)
    torch.testing.assert_close(got, full[:, :, case.check_index], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias, softcap", [("none", 0.0), ("tile", 5.0), ("relpos", 0.0)])
def test_torch_providers_match_the_reference(bias, softcap):
    shape = _shape(bias=bias, softcap=softcap, causal=bias == "relpos")
    case = Case(shape, torch.device("cpu"), check_rows=48, input_sets=2)
    options = RunOptions(warmup_ms=0, rep_ms=0)
    for provider in (Eager(), Flex(), SdpaBias()):
        if not provider.applies(shape):
            continue
        row = run_task(Task(shape, provider, None, None), case, options, "m0")
        assert row["status"] == "ok", (provider.name, row["reason"])
        assert row["err_rel"] < 1e-5, (provider.name, row["err_rel"])
        assert row["ms_p50"] > 0 and row["input_sets"] == 2
    flex = run_task(Task(shape, Flex(), None, None), case, options, "m1")
    assert flex["semantics"] == "exact"
    if bias == "tile":
        sdpa = run_task(Task(shape, SdpaBias(), None, None), case, options, "m2")
        assert sdpa["semantics"].startswith("without soft-cap")


def test_sdpa_backend_unsupported_rows_carry_the_reason():
    shape = _shape(dtype="float16", head_dim_v=32)
    case = Case(shape, torch.device("cpu"), check_rows=8)
    row = run_task(Task(shape, SdpaBackend("sdpa-flash", "FLASH_ATTENTION"), None, None), case,
                   RunOptions(warmup_ms=0, rep_ms=0), "m0")
    assert row["status"] == "unsupported"
    assert "same last dimension" in row["reason"]
    with pytest.raises(Unsupported, match="^No viable backend for scaled_dot_product_attention"):
        SdpaBackend("sdpa-cudnn", "CUDNN_ATTENTION").prepare(case, None)


def test_sdpa_floor_is_labelled_and_checked_without_bias():
    shape = _shape(dtype="float32", head_dim_v=16, bias="tile", bias_tile=16, softcap=5.0, q_heads=2, kv_heads=2)
    case = Case(shape, torch.device("cpu"), check_rows=8)
    row = run_task(Task(shape, SdpaBackend("sdpa-flash", "FLASH_ATTENTION"), None, None), case,
                   RunOptions(warmup_ms=0, rep_ms=0), "m0")
    assert row["status"] == "ok", row["reason"]
    assert row["semantics"] == "floor: plain attention without bias and soft-cap"
    assert row["err_rel"] < 1e-5


def test_wrong_output_is_flagged_not_hidden():
    class Broken(Eager):
        name = "broken"

        def prepare(self, case, config):
            prepared = super().prepare(case, config)
            real = prepared.call
            prepared.call = lambda i: real(i) * 1.5
            return prepared

    shape = _shape()
    case = Case(shape, torch.device("cpu"), check_rows=8)
    row = run_task(Task(shape, Broken(), None, None), case, RunOptions(warmup_ms=0, rep_ms=0), "m0")
    assert row["status"] == "check_failed" and "relative error" in row["reason"]
    assert row["ms_p50"] is not None  # still timed, flagged


def test_input_sets_rotate_on_cpu():
    assert input_sets_for(_shape(), torch.device("cpu")) == 3
