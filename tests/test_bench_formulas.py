"""FLOP and byte formulas of kvbound.bench on hand-computed cases."""

import pytest

from kvbound.bench import formulas


def test_attention_flops_seed_shape():
    # 2 * B * H * N * N * (Dk + Dv) = 2 * 1 * 8 * 4096 * 4096 * 128
    assert formulas.attention_flops(1, 8, 4096, 4096, 64, 64, causal=False) == 34_359_738_368


def test_attention_flops_causal_is_half():
    assert formulas.attention_flops(1, 8, 4096, 4096, 64, 64, causal=True) == 17_179_869_184


def test_attention_flops_alphagenome_counts_query_heads_and_both_head_dims():
    # 2 * 1 * 8 * 8192 * 8192 * (128 + 192)
    assert formulas.attention_flops(1, 8, 8192, 8192, 128, 192, causal=False) == 343_597_383_680


def test_tflops():
    assert formulas.tflops(10**12, 1.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="milliseconds"):
        formulas.tflops(10**12, 0.0)


def test_dense_bytes_seed_shape():
    # Q, K, V, O each 8 * 4096 * 64 bf16 elements = 4 MiB
    assert formulas.dense_bytes_moved(1, 8, 8, 4096, 4096, 64, 64, "bfloat16") == 16 * 2**20


def test_dense_bytes_mqa_reads_one_kv_head():
    # Q 8*8192*128 + K 1*8192*128 + V 1*8192*192 + O 8*8192*192 = 23,592,960 elements, 2 bytes each
    got = formulas.dense_bytes_moved(1, 8, 1, 8192, 8192, 128, 192, "bfloat16")
    assert got == 47_185_920
    expanded = formulas.dense_bytes_moved(1, 8, 8, 8192, 8192, 128, 192, "bfloat16")
    assert expanded - got == 7 * 8192 * (128 + 192) * 2


def test_dense_bytes_adds_bias_and_uses_dtype_size():
    base = formulas.dense_bytes_moved(2, 2, 2, 16, 16, 8, 8, "float32")
    assert base == 4 * (2 * 2 * 16 * 8) * 4
    assert formulas.dense_bytes_moved(2, 2, 2, 16, 16, 8, 8, "float32", bias_bytes=100) == base + 100


def test_compressed_bytes_replaces_kv_by_nbytes():
    # Q + O of the seed shape (2 * 4 MiB) + K.nbytes + V.nbytes + bias
    got = formulas.compressed_bytes_moved(1, 8, 4096, 64, 64, "bfloat16", 1000, 2000, bias_bytes=16)
    assert got == 8 * 2**20 + 3016


def test_reconstruction_flops_per_tile():
    assert formulas.reconstruction_flops(128, 8, 64, with_residual=False) == 2 * 128 * 8 * 64
    assert formulas.reconstruction_flops(128, 8, 64, with_residual=True) == 131_072 + 16_384


def test_reconstruction_overhead_is_rank_over_block_m_without_residual():
    assert formulas.reconstruction_overhead(8, 64, 64, block_m=128) == 0.0625
    assert formulas.reconstruction_overhead(8, 128, 192, block_m=128) == 0.0625


def test_reconstruction_overhead_with_coded_tiles_and_shared_heads():
    # (8 * 128 + 64 * 0.5 + 64 * 0.5) / (128 * 128)
    assert formulas.reconstruction_overhead(8, 64, 64, block_m=128, k_coded_share=0.5,
                                            v_coded_share=0.5) == pytest.approx(1088 / 16384)
    assert formulas.reconstruction_overhead(8, 64, 64, block_m=128, heads_per_program=8) == 0.0625 / 8
    with pytest.raises(ValueError, match="k_coded_share"):
        formulas.reconstruction_overhead(8, 64, 64, k_coded_share=1.5)


def test_rank_space_flops_one_tile():
    # pairs 128 * 128: 4 * r each; one query tile: 2 * 128 * r * (Dk + Dv)
    assert formulas.rank_space_flops(1, 1, 128, 128, 64, 64, 8, False, block_m=128) == 524_288 + 262_144


def test_formulas_reject_negative_sizes():
    with pytest.raises(ValueError, match="q_len"):
        formulas.attention_flops(1, 8, -1, 16, 64, 64, False)


def test_gbps_and_ring_bytes():
    # 1 GB in 2 ms = 500 GB/s
    assert formulas.gbps(10**9, 2.0) == pytest.approx(500.0)
    with pytest.raises(ValueError, match="milliseconds"):
        formulas.gbps(10, 0.0)
    # a ring of 4: each rank forwards 3 shards
    assert formulas.ring_dense_bytes_per_rank(4, 1000) == 3000
    assert formulas.ring_dense_bytes_per_rank(1, 1000) == 0
    with pytest.raises(ValueError, match="world_size"):
        formulas.ring_dense_bytes_per_rank(0, 1000)


def test_quantiles_and_time_calls():
    import torch

    from kvbound.bench.runner import quantiles, time_calls

    assert quantiles([4.0, 1.0, 3.0, 2.0, 5.0]) == pytest.approx([1.8, 3.0, 4.2])
    calls = []
    times = time_calls(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=3)
    assert len(times) == 3 and len(calls) == 5 and all(t >= 0 for t in times)
    with pytest.raises(ValueError, match="repeats"):
        time_calls(lambda: None, torch.device("cpu"), warmup=0, repeats=0)
