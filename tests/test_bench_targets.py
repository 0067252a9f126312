"""Speed targets against cuDNN (same-run ratios, verdicts), the Nsight Compute traffic table and the seed's claims
beside the measured ratios, on synthetic rows shaped like the bench CSV."""

from kvbound.bench import records, report, tables
from kvbound.bench.formulas import attention_flops, dense_bytes_moved

RUN_A = {"gpu": "NVIDIA H200", "commit": "aaaaaaa", "date": "2026-12-01T10:00:00Z", "torch": "2.11", "triton": "3.6",
         "cuda": "13.0", "cudnn": "91900", "command": "python -m kvbound.bench --out a.csv"}
RUN_B = {**RUN_A, "commit": "bbbbbbb", "date": "2026-12-02T10:00:00Z", "command": "python -m kvbound.bench --out b.csv"}


def _row(n, d, provider, ms, config=None, env=RUN_A, mode="time", **kw):
    row = {"mode": mode, "provider": provider, "config": config, "shape": f"seed-n{n}-d{d}", "family": "seed",
           "batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": n, "kv_len": n, "head_dim_qk": d, "head_dim_v": d,
           "causal": False, "dtype": "bfloat16", "bias": "none", "status": "ok",
           "flops": attention_flops(1, 8, n, n, d, d, False),
           "bytes_moved": dense_bytes_moved(1, 8, 8, n, n, d, d, "bfloat16"), "err_rel": 1.7e-3, **env}
    if ms is not None:
        row.update(ms_p20=ms * 0.99, ms_p50=ms, ms_p80=ms * 1.02)
    row.update(kw)
    return row


def _rows():
    rows = []
    for d, cudnn in ((64, 19.2), (128, 28.8)):
        rows += [_row(65536, d, "sdpa-cudnn", cudnn),
                 _row(65536, d, "kvbound-compressed", cudnn / 1.35, "r8b4", err_vs_dense_rel=4.6e-3,
                      rank=8, bits=4, tau=0.03125),
                 _row(65536, d, "kvbound-compressed", cudnn / 1.6, "lowrank-r8", err_vs_dense_rel=1.3e-2,
                      rank=8, bits=4, tau=0.25),
                 _row(65536, d, "kvbound-compressed", cudnn / 0.5, "quant-r0b4", rank=0, bits=4, tau=0.03125),
                 _row(65536, d, "kvbound-dense", cudnn / 0.92)]
        rows += [_row(16384, d, "sdpa-cudnn", 1.2), _row(16384, d, "kvbound-dense", 1.1),
                 _row(4096, d, "sdpa-cudnn", 0.1), _row(4096, d, "kvbound-dense", 0.2)]
    return rows


def test_target_rules():
    def target(n, d, provider, config=None, family="seed"):
        found = tables.target_for(_row(n, d, provider, 1.0, config, family=family))
        return None if found is None else found[0]

    assert target(65536, 64, "kvbound-compressed", "r8b4") == 1.3
    assert target(65536, 64, "kvbound-compressed", "lowrank-r8") == 1.5
    assert target(65536, 128, "kvbound-compressed", "lowrank-r8") == 2.0
    assert target(16384, 128, "kvbound-compressed", "r8b4") == 1.0
    assert target(65536, 64, "kvbound-dense") == 1.0 and target(16384, 64, "kvbound-dense") == 1.0
    assert target(4096, 64, "kvbound-dense") is None
    assert target(65536, 64, "kvbound-compressed", "quant-r0b4") is None
    assert target(65536, 64, "sdpa-flash") is None
    assert target(8192, 128, "kvbound-dense", family="model") is None


def test_targets_table_verdicts_and_errors_next_to_speed():
    headers, body = tables.targets_table(_rows())
    by = {(r[0], r[1], r[2]): dict(zip(headers, r, strict=True)) for r in body}
    fused = by[("seed-n65536-d64", "kvbound-compressed", "r8b4")]
    assert fused["vs cuDNN"] == "1.35x" and fused["verdict"] == "met"
    assert fused["rel err"] == "1.70e-03" and fused["err vs dense ref"] == "4.60e-03"
    assert fused["vs cuDNN (p80..p20)"] == f"{1.35 / 1.02:.2f}..{1.35 / 0.99:.2f}"
    assert by[("seed-n65536-d64", "kvbound-compressed", "lowrank-r8")]["verdict"] == "met"
    low128 = by[("seed-n65536-d128", "kvbound-compressed", "lowrank-r8")]
    assert low128["vs cuDNN"] == "1.60x" and low128["verdict"].startswith("MISSED")
    assert by[("seed-n65536-d64", "kvbound-dense", "")]["verdict"].startswith("MISSED")
    assert by[("seed-n65536-d64", "kvbound-compressed", "quant-r0b4")]["verdict"] == "-"
    assert by[("seed-n4096-d64", "kvbound-dense", "")]["target"] == "-"
    assert fused["commit"] == "aaaaaaa"  # each row names the run it comes from
    # order: d, then N, then provider
    assert [r[0] for r in body][:2] == ["seed-n4096-d64", "seed-n16384-d64"]
    summary = tables.targets_summary(_rows())
    # per d: r8b4, lowrank-r8 and dense at 65536 (3), dense at 16384 (1); r8b4 and lowrank-r8 at 16384 not run
    assert summary.startswith("**5 of 12 speed targets met.**")
    assert "Not measured (counted as not met): seed-n16384-d64 kvbound-compressed[r8b4]" in summary
    assert "seed-n65536-d128 kvbound-compressed[lowrank-r8]: 1.60x < 2.0x" in summary


def test_failed_row_never_meets_its_target():
    rows = _rows()
    for r in rows:
        if r["provider"] == "kvbound-compressed" and r["config"] == "r8b4" and r["head_dim_qk"] == 64:
            r["status"] = "check_failed"
    headers, body = tables.targets_table(rows)
    row = next(dict(zip(headers, r, strict=True)) for r in body if r[2] == "r8b4" and r[0] == "seed-n65536-d64")
    assert row["verdict"].startswith("check_failed")
    assert "seed-n65536-d64 kvbound-compressed[r8b4]: check_failed" in tables.targets_summary(rows)


def test_ratio_uses_cudnn_of_the_same_run():
    rows = _rows()
    # A later run re-times cuDNN at one shape only (e.g. the sweep part): kvbound rows of run A keep run A's cuDNN.
    rows.append(_row(65536, 64, "sdpa-cudnn", 10.0, env=RUN_B))
    ratios = tables.cudnn_ratios(rows)
    fused = next(r for r in rows if r.get("config") == "r8b4" and r["head_dim_qk"] == 64)
    ratio, ref, same = ratios[id(fused)]
    assert same and ref["commit"] == "aaaaaaa" and abs(ratio - 1.35) < 1e-9
    # A row of a run without its own cuDNN row falls back to the latest one, flagged.
    other = _row(65536, 64, "kvbound-compressed", 5.0, "r16b4", env={**RUN_B, "date": "2026-12-03T00:00:00Z"})
    ratio, ref, same = tables.cudnn_ratios([*rows, other])[id(other)]
    assert not same and ref["commit"] == "bbbbbbb" and abs(ratio - 2.0) < 1e-9
    # The tables keep the latest row per provider and shape, but still compare each with its own run's cuDNN.
    headers, table = tables.targets_table(rows)
    line = next(t for t in table if t[0] == "seed-n65536-d64" and t[2] == "r8b4")
    assert line[headers.index("vs cuDNN")] == "1.35x" and "other run" not in line[headers.index("cuDNN p50 ms")]
    assert "r8b4]: " not in tables.targets_summary(rows).split("d64 kvbound-compressed[r8b4")[0]
    rendered = report._speed_tables(rows)
    assert "1.35x" in rendered


def test_traffic_table_and_seed_claims():
    n, d = 65536, 64
    ncu = [_row(n, d, "sdpa-cudnn", None, mode="ncu", dram_read_bytes=3 * 8 * n * d * 2.0, dram_write_bytes=1e3,
                l2_read_bytes=5e8, l2_write_bytes=6.7e7, ncu_kernels=1),
           _row(n, d, "kvbound-compressed", None, "r8b4", mode="ncu", dram_read_bytes=1.2e8, dram_write_bytes=2e3,
                l2_read_bytes=2e8, l2_write_bytes=6.7e7, ncu_kernels=3, bytes_moved=1.68e8, kv_bytes=3.37e7,
                kv_dense_bytes=1.34e8)]
    headers, body = tables.traffic_table(ncu)
    first = dict(zip(headers, body[0], strict=True))
    assert first["provider"] == "sdpa-cudnn" and first["DRAM read"] == "201 MB" and first["kernels"] == "1"
    assert first["DRAM / formula"] == f"{(3 * 8 * n * d * 2.0 + 1e3) / (4 * 8 * n * d * 2):.2f}"
    headers, body = tables.data_movement_table(ncu)
    row = dict(zip(headers, body[0], strict=True))
    assert row["design figure"] == "4.1x" and row["K+V ratio"] == "3.98x"
    assert row["measured ratio"] == f"{(3 * 8 * n * d * 2.0 + 1e3) / (1.2e8 + 2e3):.2f}x"


def test_report_states_targets_and_reproduce_commands(tmp_path):
    results = tmp_path / "results" / "h200_2026-12-01_aaaaaaa" / "attention"
    results.mkdir(parents=True)
    records.write_rows(results / "attention_seed.csv", _rows())
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "## Speed targets against cuDNN SDPA" in text and "speed targets met" in text and "MISSED" in text
    assert "bash benchmarks/h200.sh attention" in text and "bash benchmarks/h200.sh ring" in text
    assert "h200_2026-12-01_aaaaaaa/attention/attention_seed.csv" in text
    assert "2.6x at N = 4096 rising to 4.1x" in text


def test_share_sweep_table_and_plot(tmp_path):
    from kvbound.bench import plots

    rows = []
    for d, cudnn in ((64, 19.0), (128, 29.0)):
        for share, ms in ((0.0, 90.0), (0.5, 50.0), (1.0, 14.0)):
            shape = f"share-n65536-d{d}-z{round(share * 10000):04d}"
            rows += [
                _row(65536, d, "sdpa-cudnn", cudnn, family="share", shape=shape),
                _row(65536, d, "kvbound-compressed", ms * d / 64, "r8b4", family="share", shape=shape,
                     zero_residual_share=share, compression_ratio=3.0),
            ]
    headers, table = tables.share_table(rows)
    assert [(t[1], t[2]) for t in table] == [(str(d), s) for d in (64, 128) for s in ("0.0%", "50.0%", "100.0%")]
    assert table[2][headers.index("vs cuDNN")] == f"{19.0 / 14.0:.2f}x"
    # the share rows stay out of the per-shape speed tables and the targets (family "share", not "seed")
    assert "share-n65536" not in report._speed_tables(rows)
    assert tables.targets_table(rows)[1] == []
    assert plots.speed_vs_share(rows, tmp_path / "share.png").stat().st_size > 10_000
    # the split launch, where the run has it, in its own columns of the same row
    assert table[1][headers.index("split launch p50 ms")] == "-"
    split = _row(65536, 64, "kvbound-compressed-split", 38.0, "r8b4", family="share", shape="share-n65536-d64-z5000",
                 zero_residual_share=0.5, compression_ratio=3.0)
    one = _row(65536, 64, "kvbound-compressed-one", 47.5, "r8b4", family="share", shape="share-n65536-d64-z5000",
               zero_residual_share=0.5, compression_ratio=3.0)
    headers, table = tables.share_table([*rows, split, one])
    assert len(table) == 6
    assert table[1][headers.index("split launch p50 ms")] == "38"
    assert table[1][headers.index("split vs cuDNN")] == f"{19.0 / 38.0:.2f}x"
    assert table[1][headers.index("one launch p50 ms")] == "47.5"
    assert table[1][headers.index("one vs cuDNN")] == f"{19.0 / 47.5:.2f}x"
    assert table[0][headers.index("one launch p50 ms")] == "-"
    assert table[1][headers.index("kvbound p50 ms")] == "50"
    assert plots.speed_vs_share([*rows, split, one], tmp_path / "share_split.png").stat().st_size > 10_000
