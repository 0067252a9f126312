"""Context-parallel attention with gloo on CPU processes against single-device attention."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kvbound

SHARD = 40
B, HQ, HKV, DK, DV = 1, 4, 2, 32, 48


def _inputs(world: int, causal: bool):
    gen = torch.Generator().manual_seed(world * 10 + causal)
    n = SHARD * world
    q = torch.randn(B, HQ, n, DK, generator=gen)
    k = (torch.randn(B, HKV, n, 4, generator=gen) @ torch.randn(4, DK, generator=gen)) / 2
    v = torch.randn(B, HKV, n, DV, generator=gen) / 2
    bias = torch.randn(1, HQ, n, n, generator=gen)
    return q, k, v, bias


def _config():
    return kvbound.CompressionConfig(block_size=16, rank=4, bits=4, tau=0.05)


TILE = 8  # the dense-ring case reads a compact tile bias (SHARD is a multiple of it)


def _tile_bias(world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(world)
    return torch.randn(1, HQ, SHARD * world // TILE, SHARD * world // TILE, generator=gen)


def _worker(rank: int, world: int, init: str, out_dir: str, causal: bool, compress: bool):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        from kvbound.distributed import context_parallel_attention

        q, k, v, bias = _inputs(world, causal)
        shard = slice(rank * SHARD, (rank + 1) * SHARD)
        if compress:
            bias_fn, tile = (lambda qs, ql, ks, kl: bias[:, :, qs : qs + ql, ks : ks + kl]), 1
        else:
            tiles = _tile_bias(world)
            bias_fn, tile = (lambda qs, ql, ks, kl: tiles[:, :, qs // TILE :, ks // TILE :][
                :, :, : -(-ql // TILE), : -(-kl // TILE)]), TILE
        out, stats = context_parallel_attention(
            q[:, :, shard], k[:, :, shard], v[:, :, shard], config=_config(), compress=compress, causal=causal,
            bias=bias_fn, bias_tile=tile, softcap=4.0, return_stats=True,
        )
        torch.save({"out": out, "sent": stats.bytes_sent, "dense": stats.dense_bytes}, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, causal, compress", [(2, False, True), (3, True, True), (3, False, False)])
def test_ring_equals_single_device(tmp_path, world, causal, compress):
    init = f"file://{tmp_path}/init"
    mp.spawn(_worker, args=(world, init, str(tmp_path), causal, compress), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    out = torch.cat([r["out"] for r in results], dim=2)

    q, k, v, bias = _inputs(world, causal)
    if not compress:  # this case used the compact tile bias: expand it for the single-device references
        bias = _tile_bias(world).repeat_interleave(TILE, 2).repeat_interleave(TILE, 3)
    if compress:  # the same per-shard compression, decompressed and concatenated
        parts = [slice(r * SHARD, (r + 1) * SHARD) for r in range(world)]
        k = torch.cat([kvbound.compress_kv(k[:, :, s], _config()).decompress() for s in parts], dim=2)
        v = torch.cat([kvbound.compress_kv(v[:, :, s], _config()).decompress() for s in parts], dim=2)
        for r in results:
            assert r["sent"] * 2 < r["dense"], (r["sent"], r["dense"])  # compressed bytes on the wire
    single = kvbound.attention(q, k, v, causal=causal, bias=bias, softcap=4.0)
    exact = kvbound.reference_attention(q, k, v, causal=causal, bias=bias, softcap=4.0)
    ring_err = (out.double() - exact).abs().max().item()
    single_err = (single.double() - exact).abs().max().item()
    print(f"world {world}: ring error {ring_err:.3g}, single-device error {single_err:.3g}")
    assert ring_err <= 2 * single_err + 1e-5
