"""The ring scaling table: 2-process over 1-process time and bytes on the wire against the targets."""

from kvbound.bench import tables


def _row(provider, n, world, ms, sent=None, dense=None, status="ok", date="2026-11-30T12:00:00Z"):
    return {"mode": "ring", "provider": provider, "shape": f"ring-n{n}", "q_len": n, "head_dim_qk": 64,
            "world_size": world, "ms_p50": ms, "bytes_sent": sent, "dense_bytes_sent": dense, "status": status,
            "date": date}  # fmt: skip


def test_ring_scaling_verdicts():
    rows = [
        _row("ring-compressed", 131072, 1, 200.0),
        _row("ring-compressed", 131072, 2, 110.0, sent=30, dense=120),  # 0.55x, 4.0x: both met
        _row("ring-dense", 131072, 1, 100.0),
        _row("ring-dense", 131072, 2, 70.0, sent=120, dense=120),  # 0.70x: missed
        _row("ring-compressed", 65536, 1, 50.0),
        _row("ring-compressed", 65536, 2, 40.0, sent=40, dense=120),  # below the target's N; 3.0x bytes: missed
        _row("ring-dense", 262144, 2, 90.0, sent=120, dense=120),  # no 1-process row
        _row("ring-dense", 262144, 1, 1.0, status="error"),  # not ok: ignored
    ]
    headers, table = tables.ring_scaling_table(rows)
    by = {(r[0], r[2]): dict(zip(headers, r, strict=True)) for r in table}
    assert by[("131072", "ring-compressed")]["2 / 1"] == "0.55x"
    assert by[("131072", "ring-compressed")]["time target"].startswith("met")
    assert by[("131072", "ring-compressed")]["bytes target"].startswith("met")
    assert by[("131072", "ring-dense")]["time target"].startswith("MISSED")
    assert by[("131072", "ring-dense")]["bytes target"] == "-"
    assert by[("65536", "ring-compressed")]["time target"].startswith("- (below")
    assert by[("65536", "ring-compressed")]["bytes target"].startswith("MISSED")
    assert by[("262144", "ring-dense")]["time target"] == "no 1-process row"
    assert len(table) == 4  # one row per 2-process measurement
