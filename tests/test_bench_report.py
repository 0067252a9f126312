"""Tables, plots, roofline and the BENCHMARKS.md generator of kvbound.bench, from a small recorded CSV."""

import pytest

from kvbound.bench import plots, records, report, roofline, tables
from kvbound.bench.formulas import attention_flops, dense_bytes_moved

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0", "cudnn": "91900",
       "commit": "0123456789abcdef", "date": "2026-12-01T10:00:00Z",
       "command": "python -m kvbound.bench --out benchmarks/results/h200.csv"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _seed(n, d, provider, ms, config=None, mode="time", **kw):
    flops = attention_flops(1, 8, n, n, d, d, False)
    row = {"mode": mode, "provider": provider, "config": config, "shape": f"seed-n{n}-d{d}", "family": "seed",
           "batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": n, "kv_len": n, "head_dim_qk": d, "head_dim_v": d,
           "causal": False, "dtype": "bfloat16", "bias": "none", "softcap": 0.0, "status": "ok", "flops": flops,
           "bytes_moved": dense_bytes_moved(1, 8, 8, n, n, d, d, "bfloat16"), "err_rel": 3e-3, **ENV}
    if mode == "time" and ms is not None:
        row.update(ms_p20=ms * 0.98, ms_p50=ms, ms_p80=ms * 1.03, tflops=flops / (ms * 1e-3) / 1e12)
    row.update(kw)
    return row


def _compressed(n, d, config, ms, ratio, rank, bits, mode="time", **kw):
    kv_dense = 2 * 8 * n * d * 2
    kv = int(kv_dense / ratio)
    qo = 2 * 8 * n * d * 2
    kw = {"tau": 0.03125, **kw}
    return _seed(n, d, "kvbound-compressed", ms, config=config, mode=mode, rank=rank, bits=bits,
                 basis="calibrated", kv_bytes=kv, kv_dense_bytes=kv_dense, bytes_moved=qo + kv,
                 compression_ratio=kv_dense / kv, zero_residual_share=0.5, err_vs_dense_rel=2e-3,
                 k_share_lowrank=0.5, k_share_packed=0.5, k_share_promoted=0.0, k_share_raw=0.0,
                 v_share_lowrank=0.5, v_share_packed=0.25, v_share_promoted=0.25, v_share_raw=0.0, **kw)


def fixture_rows():
    rows = []
    for n, cudnn_ms in ((4096, 0.08), (16384, 1.18), (65536, 18.9)):
        rows += [
            _seed(n, 64, "sdpa-cudnn", cudnn_ms),
            _seed(n, 64, "sdpa-flash", cudnn_ms * 1.5),
            _seed(n, 64, "kvbound-dense", cudnn_ms * 1.1),
            _compressed(n, 64, "r8b4", cudnn_ms * 0.8, 4.0, 8, 4),
            _compressed(n, 64, "quant-r0b4", cudnn_ms * 1.6, 1.9, 0, 4),
            _compressed(n, 64, "lowrank-r8", cudnn_ms * 0.7, 7.8, 8, 4, tau=0.25),
            _compressed(n, 64, "r16b8", cudnn_ms * 0.9, 2.0, 16, 8),
            _seed(n, 64, "sdpa-cudnn", None, mode="ncu", dram_read_bytes=3 * 8 * n * 64 * 2.0,
                  dram_write_bytes=8 * n * 64 * 2.0, l2_read_bytes=40.0 * n * 64, l2_write_bytes=8.0 * n * 64),
            _compressed(n, 64, "r8b4", None, 4.0, 8, 4, mode="ncu", dram_read_bytes=1.5 * 8 * n * 64 * 2.0,
                        dram_write_bytes=8 * n * 64 * 2.0, l2_read_bytes=20.0 * n * 64, l2_write_bytes=8.0 * n * 64),
        ]
    rows.append(_seed(4096, 64, "sdpa-efficient", None, status="unsupported", reason="needs a GPU"))
    rows.append({"mode": "calibrate", "provider": "kvbound.calibrate", "shape": "enformer", "family": "model",
                 "status": "ok", "ms_p50": 812.0, "note": "11 layers x (K, V)", **ENV})
    rows.append({"mode": "ceiling", "provider": "device-copy", "shape": "device-copy", "status": "ok",
                 "ms_p50": 0.5, "bytes_moved": 2 * 10**9, **ENV})
    rows.append({"mode": "ceiling", "provider": "l2-copy", "shape": "l2-copy", "status": "ok",
                 "ms_p50": 0.002, "bytes_moved": 2 * 10**7, **ENV})
    rows.append({"mode": "ceiling", "provider": "bf16-matmul", "shape": "bf16-matmul", "status": "ok",
                 "ms_p50": 1.4, "flops": 2 * 8192**3, "tflops": 2 * 8192**3 / 1.4e-3 / 1e12, **ENV})
    return rows


@pytest.fixture()
def results(tmp_path):
    directory = tmp_path / "benchmarks" / "results"
    directory.mkdir(parents=True)
    records.write_rows(directory / "h200.csv", fixture_rows())
    return directory


def test_data_movement_table_ratios():
    headers, body = tables.data_movement_table(fixture_rows())
    assert [row[0] for row in body] == ["4096", "16384", "65536"]
    row = dict(zip(headers, body[0], strict=True))
    assert row["K+V ratio"] == "4.00x"
    # Q + K + V + O = 4 units dense; Q + O + (K + V) / 4 = 2.5 units compressed
    assert row["formula ratio"] == "1.60x"
    # measured: (3 + 1) / (1.5 + 1)
    assert row["measured ratio"] == "1.60x"


def test_ablation_sweep_and_overhead_tables():
    headers, body = tables.ablation_table(fixture_rows())
    first = dict(zip(headers, body[0], strict=True))
    assert first["config"] == "low-rank only" and first["tau"] == "0.25" and first["K/V ratio"] == "7.80x"
    fused = dict(zip(headers, body[2], strict=True))
    assert fused["config"] == "fused (default)" and fused["vs cuDNN"] == "1.25x"
    assert fused["vs kvbound-dense"] == "1.38x"
    _, sweep = tables.sweep_table(fixture_rows())
    assert {row[1] for row in sweep} == {"r16b8", "r8b4"}
    headers, body = tables.overhead_table(fixture_rows())
    row = dict(zip(headers, body[0], strict=True))
    # (8 * 128 + 64 * 0.5 + 64 * 0.5) / (128 * 128) = 6.64%
    assert row["rebuild per head (BM=128)"] == "6.64%" and row["K coded tiles"] == "50%"
    assert tables.calibration_table(fixture_rows())[1] == [["enformer", "0.812", "11 layers x (K, V)", "NVIDIA H200"]]
    assert "| a |" in tables.to_markdown(["x"], [["a"]]) and "no rows" in tables.to_markdown(["x"], [])


def test_plots_are_png(tmp_path):
    rows = fixture_rows()
    for path in (plots.speed_vs_n(rows, tmp_path / "s.png"), plots.bytes_vs_rank_bits(rows, tmp_path / "b.png"),
                 roofline.roofline_from_rows(rows, tmp_path / "r.png")):
        assert path is not None and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    assert plots.speed_vs_n([r for r in rows if r["mode"] != "time"], tmp_path / "none.png") is None


def test_roofline_points_use_measured_bytes_when_profiled():
    points = {(p["label"], p["shape"]): p for p in roofline.roofline_points(fixture_rows())}
    cudnn = points[("sdpa-cudnn", "seed-n4096-d64")]
    flops = attention_flops(1, 8, 4096, 4096, 64, 64, False)
    assert cudnn["measured"] and cudnn["dram_intensity"] == pytest.approx(flops / (4 * 8 * 4096 * 64 * 2))
    flash = points[("sdpa-flash", "seed-n4096-d64")]
    assert not flash["measured"] and flash["l2_intensity"] is None
    c = roofline.ceilings_from_rows(fixture_rows())
    assert c["copy_tbps"] == pytest.approx(4.0) and c["l2_tbps"] == pytest.approx(10.0)
    assert c["matmul_tflops"] == pytest.approx(2 * 8192**3 / 1.4e-3 / 1e12)


def test_roofline_main_without_gpu_redraws_from_results(results, tmp_path, capsys):
    png = tmp_path / "roof.png"
    assert roofline.main(["--no-measure", "--results", str(results / "h200.csv"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "4.00 TB/s" in capsys.readouterr().out


def test_report_writes_benchmarks_md(results, tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    plots_dir = tmp_path / "benchmarks" / "plots"
    assert report.main(["--results", str(results), "--out", str(out), "--plots-dir", str(plots_dir)]) == 0
    text = out.read_text()
    assert "NVIDIA H200" in text and "`0123456789abcdef`" in text
    assert "command: `python -m kvbound.bench --out benchmarks/results/h200.csv`" in text
    assert "benchmarks/results/h200.csv" in text
    assert "| 65536 | 64 |" in text and "1.60x" in text
    assert "seed-n16384-d64" in text and "needs a GPU" in text
    assert "![roofline](benchmarks/plots/roofline.png)" in text
    assert (plots_dir / "speed_vs_n.png").read_bytes()[:8] == PNG_MAGIC


def test_report_without_csv_fails(tmp_path):
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "B.md"), "--no-plots"]) == 2
