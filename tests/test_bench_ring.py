"""``kvbound bench --suite ring`` on the CPU: gloo processes through the same code path as NCCL on GPUs."""

import torch

from kvbound.bench import cli, records, ring, tables


def test_check_rows_split_over_ranks_cover_the_global_subsample():
    n, rows, world = 1000, 37, 4
    everyone = torch.linspace(0, n - 1, rows).round().long().unique()
    parts = []
    for rank in range(world):
        start, stop = rank * n // world, (rank + 1) * n // world
        local = ring.check_row_index(n, rows, start, stop)
        assert bool(((local >= 0) & (local < stop - start)).all())
        parts.append(local + start)
    assert torch.equal(torch.cat(parts), everyone)
    assert ring.check_row_index(10, 64, 0, 10).tolist() == list(range(10))


def test_world_sizes_that_cannot_run_are_reported_without_starting_processes():
    options = ring.RingOptions(lengths=(65,), world_sizes=(2,), heads=1, head_dim=16)
    rows = list(ring.ring_rows(torch.device("cpu"), options))
    assert [r["provider"] for r in rows] == list(ring.RING_PROVIDERS)
    assert all(r["status"] == "unsupported" and "not divisible by 2" in r["reason"] for r in rows)


def test_cli_ring_smoke_two_processes(tmp_path):
    out = tmp_path / "ring.csv"
    status = cli.main(["--suite", "ring", "--cpu-smoke", "--world-sizes", "2", "--lengths", "128", "--heads", "1",
                       "--head-dim", "32", "--warmup", "0", "--repeats", "1", "--out", str(out)])
    rows = records.read_rows(out)
    for r in rows:
        print(f"{r['provider']:16s} x{r['world_size']} {r['status']} {r['ms_p50']} ms, sent {r['bytes_sent']} "
              f"of {r['dense_bytes_sent']} dense, err {r['err_max']} (rel {r['err_rel']}, vs dense "
              f"{r['err_vs_dense_rel']}) {r['reason']}")
    assert status == 0
    by = {r["provider"]: r for r in rows}
    assert set(by) == set(ring.RING_PROVIDERS)
    shard = 64 * 1 * (32 + 32) * 2  # 64 tokens, 1 head, K and V of 32, float16
    for r in rows:
        assert r["status"] == "ok" and r["world_size"] == 2 and r["q_len"] == 128 and r["suite"] == "ring"
        assert r["dense_bytes_sent"] == shard and r["kv_dense_bytes"] == 2 * shard
        assert r["err_rel"] < 3e-2 and r["ms_p50"] > 0 and r["check_rows"] == 16
    assert by["ring-dense"]["bytes_sent"] == shard and by["allgather-dense"]["bytes_sent"] == shard
    compressed = by["ring-compressed"]
    assert compressed["bytes_sent"] < shard and compressed["compression_ratio"] > 1
    assert compressed["kv_dense_bytes"] / compressed["kv_bytes"] == compressed["compression_ratio"]
    assert compressed["err_vs_dense_rel"] < 3e-2 and compressed["compress_ms"] > 0
    headers, body = tables.ring_table(rows)
    assert len(body) == 3 and dict(zip(headers, body[0], strict=True))["provider"] == "ring-compressed"
