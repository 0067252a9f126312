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


# Transformer-XL relative positions with one global table [H, 2N - 1, Dk] (Hq == Hkv).
REL_H, REL_DK, REL_DV = 2, 32, 24


def _relative_inputs(lengths: list[int]):
    gen = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    n = sum(lengths)
    q = torch.randn(B, REL_H, n, REL_DK, generator=gen)
    k = (torch.randn(B, REL_H, n, 4, generator=gen) @ torch.randn(4, REL_DK, generator=gen)) / 2
    v = torch.randn(B, REL_H, n, REL_DV, generator=gen) / 2
    relative_keys = torch.randn(REL_H, 2 * n - 1, REL_DK, generator=gen) / 2
    u = torch.randn(1, REL_H, 1, REL_DK, generator=gen) / 2
    w = torch.randn(REL_H, REL_DK, generator=gen) / 2
    return q, k, v, relative_keys, u, w


def _relative_oracle(q, k, v, relative_keys, u, w, *, causal: bool, softcap: float | None):
    """Float64 Transformer-XL attention with the [N, N] relative logits materialised."""
    n, dk = q.shape[2], q.shape[3]
    qs = q.double() * dk**-0.5
    table = (qs + w.double().reshape(1, REL_H, 1, dk)) @ relative_keys.double().transpose(-1, -2)
    rows = (n - 1 + torch.arange(n)[None, :] - torch.arange(n)[:, None]).expand(*q.shape[:2], n, n)
    logits = (qs + u.double()) @ k.double().transpose(-1, -2) + torch.gather(table, -1, rows)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if causal:
        logits = logits.masked_fill(torch.arange(n)[None, :] > torch.arange(n)[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double()


def _relative_worker(rank, world, init, out_dir, lengths, causal, compress, softcap):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        from kvbound.distributed import allgather_attention, context_parallel_attention

        q, k, v, relative_keys, u, w = _relative_inputs(lengths)
        start = sum(lengths[:rank])
        shard = slice(start, start + lengths[rank])
        q, k, v = q[:, :, shard], k[:, :, shard], v[:, :, shard]
        result = {}
        try:  # the shard-local table is the natural mistake; every rank raises at the same point
            local = relative_keys[:, : 2 * lengths[rank] - 1]
            context_parallel_attention(q, k, v, config=_config(), compress=compress, relative_keys=local)
        except ValueError as error:
            result["wrong_shape_error"] = str(error)
        result["out"] = context_parallel_attention(
            q, k, v, config=_config(), compress=compress, causal=causal, softcap=softcap,
            relative_keys=relative_keys, relative_content_bias=u, relative_position_bias=w,
        )
        if len(set(lengths)) == 1 and not causal:
            result["allgather"] = allgather_attention(
                q, k, v, softcap=softcap, relative_keys=relative_keys, relative_content_bias=u,
                relative_position_bias=w,
            )
        torch.save(result, f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "lengths, causal, compress, softcap",
    [([24, 24], False, False, None), ([21, 32, 11], True, True, 4.0)],
)
def test_ring_relative_positions_equal_single_device(tmp_path, lengths, causal, compress, softcap):
    """Each (query shard, key shard) block reads its view of the global relative table: the ring equals
    single-device attention over the whole sequence with the whole table (dense ring with equal shards and the
    all-gather baseline; compressed ring with unequal shards, causal and soft-cap)."""
    world = len(lengths)
    init = f"file://{tmp_path}/init"
    mp.spawn(
        _relative_worker, args=(world, init, str(tmp_path), lengths, causal, compress, softcap), nprocs=world, join=True
    )
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    n = sum(lengths)
    for r, result in enumerate(results):
        expected_shape = [REL_H, 2 * n - 1, REL_DK]
        message = result.get("wrong_shape_error", "")
        assert "relative_keys" in message and str(expected_shape) in message, (r, message)

    q, k, v, relative_keys, u, w = _relative_inputs(lengths)
    if compress:  # the same per-shard compression, decompressed and concatenated
        starts = [sum(lengths[:r]) for r in range(world)]
        parts = [slice(s, s + m) for s, m in zip(starts, lengths, strict=True)]
        k = torch.cat([kvbound.compress_kv(k[:, :, s], _config()).decompress() for s in parts], dim=2)
        v = torch.cat([kvbound.compress_kv(v[:, :, s], _config()).decompress() for s in parts], dim=2)
    relative = {"relative_keys": relative_keys, "relative_content_bias": u, "relative_position_bias": w}
    single = kvbound.attention(q, k, v, causal=causal, softcap=softcap, **relative)
    exact = _relative_oracle(q, k, v, relative_keys, u, w, causal=causal, softcap=softcap)
    single_err = (single.double() - exact).abs().max().item()
    outputs = {"ring": torch.cat([r["out"] for r in results], dim=2)}
    if "allgather" in results[0]:
        outputs["allgather"] = torch.cat([r["allgather"] for r in results], dim=2)
    assert ("allgather" in outputs) == (not compress)  # the all-gather baseline ran where it applies
    for name, out in outputs.items():
        err = (out.double() - exact).abs().max().item()
        print(f"relative, shards {lengths}: {name} error {err:.3g}, single-device error {single_err:.3g}")
        assert out.shape == (B, REL_H, n, REL_DV)
        assert err <= 2 * single_err + 1e-5
