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


def _encode(provider, ms, **kw):
    dense = 2 * 8 * 16384 * 64 * 2
    row = {"mode": "encode", "suite": "encoder", "provider": provider, "shape": "seed-n16384-d64", "family": "seed",
           "batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": 16384, "kv_len": 16384, "head_dim_qk": 64,
           "head_dim_v": 64, "dtype": "bfloat16", "status": "ok", "ms_p20": ms * 0.9, "ms_p50": ms, "ms_p80": ms * 1.1,
           "kv_dense_bytes": dense, "gbps": dense / (ms * 1e-3) / 1e9, **ENV}
    if provider != "device-copy":
        row.update(config="r8b4", rank=8, bits=4, block_size=128, tau=0.03125, kv_bytes=dense // 4,
                   compression_ratio=4.0, max_err_over_tau=0.62, kv_max_abs_error=0.62 * 0.03125,
                   k_share_lowrank=0.5, k_share_packed=0.5, k_share_promoted=0.0, k_share_raw=0.0,
                   v_share_lowrank=0.25, v_share_packed=0.5, v_share_promoted=0.25, v_share_raw=0.0)
    else:
        row.update(max_err_over_tau=0.0)
    row.update(kw)
    return row


def _model(name, batch, provider, ms, attention_ms, peak_gib, **kw):
    return {"mode": "model", "suite": "models", "provider": provider, "shape": name, "family": "port",
            "batch": batch, "q_heads": 8, "kv_heads": 8, "q_len": 1536, "kv_len": 1536, "head_dim_qk": 64,
            "head_dim_v": 192, "dtype": "bfloat16", "input_len": 196608, "layers": 11, "repeats": 5, "status": "ok",
            "ms_p20": ms * 0.95, "ms_p50": ms, "ms_p80": ms * 1.05, "attention_ms_p20": attention_ms * 0.9,
            "attention_ms_p50": attention_ms, "attention_ms_p80": attention_ms * 1.1,
            "baseline_bytes": 2 * 2**30, "peak_bytes": int((2 + peak_gib) * 2**30), **ENV, **kw}


def _ring(n, world, provider, ms, sent, **kw):
    shard = n // world * 8 * 128 * 2
    return {"mode": "ring", "suite": "ring", "provider": provider, "shape": f"ring-n{n}-d64", "family": "ring",
            "batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": n, "kv_len": n, "head_dim_qk": 64, "head_dim_v": 64,
            "dtype": "bfloat16", "world_size": world, "status": "ok", "ms_p20": ms, "ms_p50": ms, "ms_p80": ms,
            "flops": attention_flops(1, 8, n, n, 64, 64, False), "bytes_sent": sent,
            "dense_bytes_sent": (world - 1) * shard, "err_max": 1e-3, "err_rel": 4e-4,
            "tflops": attention_flops(1, 8, n, n, 64, 64, False) / (ms * 1e-3) / 1e12 if ms else None, **ENV, **kw}


def suite_rows():
    rows = [_encode("encoder-triton", 2.0), _encode("encoder-triton-noverify", 1.5), _encode("encoder-eager", 8.0),
            _encode("device-copy", 0.05),
            {"mode": "calibrate", "suite": "encoder", "provider": "kvbound.calibrate", "config": "r8",
             "shape": "seed-n16384-d64", "status": "ok", "ms_p20": 3.0, "ms_p50": 3.5, "ms_p80": 4.0,
             "note": "one K and one V sample of 16384 tokens x 8 heads", **ENV}]
    for batch, scale in ((1, 1.0), (8, 7.0)):
        rows += [
            _model("enformer", batch, "unpatched", 25.0 * scale, 6.7 * scale, 3.0 * scale, ref_max_abs=2.0),
            _model("enformer", batch, "patch-dense", 20.0 * scale, 1.7 * scale, 1.0 * scale, diff_max_abs=4e-3,
                   diff_rel=6e-4),
            _model("enformer", batch, "patch-compressed", 22.0 * scale, 2.0 * scale, 1.1 * scale, diff_max_abs=6e-3,
                   diff_rel=9e-4, compression_ratio=3.9, calibration_ms=80.0, compress_ms=1.5, config="r8b4"),
        ]
    rows.append(_model("alphagenome", 1, "patch-dense", 0.0, 0.0, 0.0, status="error", ms_p50=None,
                       reason="out of memory: CUDA out of memory"))
    for n in (65536, 131072):
        shard = n // 2 * 8 * 128 * 2
        rows += [_ring(n, 1, "ring-compressed", 20.0 * n / 65536, 0, compress_ms=0.8, compression_ratio=4.0,
                       err_vs_dense_rel=5e-3),
                 _ring(n, 2, "ring-compressed", 11.0 * n / 65536, shard // 4, compress_ms=0.5, compression_ratio=4.0,
                       err_vs_dense_rel=5e-3),
                 _ring(n, 2, "ring-dense", 12.0 * n / 65536, shard),
                 _ring(n, 2, "allgather-dense", 13.0 * n / 65536, shard)]
    rows.append(_ring(65536, 4, "ring-dense", 0.0, 0, status="unsupported", ms_p50=None,
                      reason="needs 4 GPUs; 2 present"))
    return rows


LEGACY_ENCODER = (
    "encoder,shape,ms,input_GBps,copy_ms,ratio,lowrank,packed,promoted,raw,max_err_over_tau,gpu,torch,triton,commit,"
    "date\n"
    "triton,1x8x65536x64,8.1811,8.2,0.0363,2.66,0.0,1.0,0.0,0.0,0.2363,NVIDIA H200,2.11.0+cu130,3.6.0,96bd3af,"
    "2026-11-30\n"
)
LEGACY_PUBLIC_API = (
    "device,date,commit,command,N,heads,d,kv_modes,kv_ratio,cudnn_ms,kvbound_compressed_ms,compressed_vs_cudnn,"
    "kvbound_dense_ms,dense_vs_cudnn\n"
    "NVIDIA H200,2026-11-30,ace6c27,python benchmarks/public_api_timing.py OUT,65536,8,64,all lowrank,7.94,19.536,"
    "14.470,1.35,21.192,0.92\n"
)
KERNEL_DEV = """device,date,commit,plan,shape,provider,ms_p50
NVIDIA H200,2026-11-30,3f6727e,main,h8_n16k_d64,sdpa_cudnn,1.17
"""


@pytest.fixture()
def results(tmp_path):
    directory = tmp_path / "benchmarks" / "results"
    directory.mkdir(parents=True)
    records.write_rows(directory / "h200.csv", fixture_rows())
    return directory


@pytest.fixture()
def all_results(results):
    records.write_rows(results / "suites_h200.csv", suite_rows())
    for folder, name, text in (("encoder", "encoder_old.csv", LEGACY_ENCODER),
                               ("public_api", "public_api_old.csv", LEGACY_PUBLIC_API),
                               ("kernel_dev", "attention_run1.csv", KERNEL_DEV)):
        (results / folder).mkdir()
        (results / folder / name).write_text(text)
    return results


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
    commit = ENV["commit"]
    assert tables.calibration_table(fixture_rows())[1] == [
        ["enformer", "0.812", "0.812-0.812 (1)", "11 layers x (K, V)", "NVIDIA H200", commit, "0.8 s"]
    ]
    earlier = {**fixture_rows()[-4], "ms_p50": 950.0, "date": "2020-01-01"}  # an older run of the same model
    assert earlier["mode"] == "calibrate"
    assert tables.calibration_table([earlier, *fixture_rows()])[1] == [
        ["enformer", "0.812", "0.812-0.950 (2)", "11 layers x (K, V)", "NVIDIA H200", commit, "0.8 s"]
    ]
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
    with pytest.raises(SystemExit) as info:
        roofline.main(["--no-measure", "--results", str(tmp_path / "none.csv")])
    assert info.value.code == 2
    assert "--results: expected bench CSV files, got " in capsys.readouterr().err


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


def test_encoder_tables():
    headers, body = tables.encoder_table(suite_rows())
    rows = {r[2]: dict(zip(headers, r, strict=True)) for r in body}
    assert [r[2] for r in body] == ["encoder-triton", "encoder-triton-noverify", "encoder-eager", "device-copy"]
    triton = rows["encoder-triton"]
    assert triton["time / copy"] == "40.0x" and triton["K+V ratio"] == "4.00" and triton["max err / tau"] == "0.620"
    assert triton["K modes lr/pk/pr/raw"] == "50%/50%/0%/0%" and triton["V modes"] == "25%/50%/25%/0%"
    assert triton["input GB/s"] == f"{2 * 8 * 16384 * 64 * 2 / 2e-3 / 1e9:.3g}"
    assert triton["K / V"] == "[1, 8, 16384, 64 / 64] bfloat16"
    assert rows["device-copy"]["K modes lr/pk/pr/raw"] == "-"
    _, calibration = tables.encoder_calibration_table(suite_rows())
    assert calibration == [["seed-n16384-d64", "one K and one V sample of 16384 tokens x 8 heads", "3.5", "3-4",
                             "NVIDIA H200"]]
    assert tables.calibration_table(suite_rows())[1] == []  # per-sample rows are not model loads


def test_models_table():
    headers, body = tables.models_table(suite_rows())
    rows = [dict(zip(headers, r, strict=True)) for r in body]
    assert [(r["model"], r["batch"], r["variant"]) for r in rows] == [
        ("enformer", "1", "unpatched"), ("enformer", "1", "patch-dense"), ("enformer", "1", "patch-compressed"),
        ("enformer", "8", "unpatched"), ("enformer", "8", "patch-dense"), ("enformer", "8", "patch-compressed"),
        ("alphagenome", "1", "patch-dense")]
    dense = rows[1]
    assert dense["vs unpatched"] == "1.25x" and dense["attention share"] == "8%" and dense["peak GiB"] == "3.00"
    assert dense["peak above baseline GiB"] == "1.00" and dense["rel diff"] == "6.00e-04"
    compressed = rows[5]
    assert compressed["K+V ratio"] == "3.90" and compressed["calibration s"] == "0.080"
    assert compressed["peak above baseline GiB"] == "7.70" and compressed["encode ms / forward"] == "1.5"
    assert rows[6]["status"] == "error" and "out of memory" in rows[6]["note / reason"]


def test_models_table_lists_repeated_runs_with_their_own_unpatched_forward():
    """Two runs of the newest commit (each its own command line) are both listed, each patched forward divided by
    the unpatched forward of its own run; a variant measured only at an older commit (an alternative) keeps its row,
    divided by its own run's unpatched forward, or by the latest one (marked ``*``) where its run had none."""
    old = {"commit": "aaaaaaa", "date": "2026-12-01"}
    first = {"commit": "bbbbbbb", "date": "2026-12-02", "command": "bench --out run1.csv"}
    second = {"commit": "bbbbbbb", "date": "2026-12-02", "command": "bench --out run2.csv"}
    rows = [
        _model("enformer", 1, "unpatched", 26.0, 7.0, 2.0, **old, command="bench --out old.csv"),
        _model("enformer", 1, "sdpa-built-bias", 23.0, 4.0, 2.0, **old, command="bench --out old.csv"),
        _model("enformer", 1, "flex-built-table", 23.5, 4.0, 2.0, **old, command="bench --out old-flex.csv"),
        _model("enformer", 1, "unpatched", 39.0, 18.0, 2.0, **first),
        _model("enformer", 1, "patch-dense", 40.0, 5.0, 2.0, **first),
        _model("enformer", 1, "unpatched", 26.0, 7.0, 2.0, **second),
        _model("enformer", 1, "patch-dense", 21.5, 2.3, 2.0, **second),
    ]
    headers, body = tables.models_table(rows)
    got = [dict(zip(headers, r, strict=True)) for r in body]
    assert [(r["variant"], r["commit"], r["vs unpatched"]) for r in got] == [
        ("unpatched", "bbbbbbb", "1.00x"),
        ("patch-dense", "bbbbbbb", f"{26.0 / 21.5:.2f}x"),
        ("sdpa-built-bias", "aaaaaaa", f"{26.0 / 23.0:.2f}x"),
        ("flex-built-table", "aaaaaaa", f"{26.0 / 23.5:.2f}x*"),
        ("unpatched", "bbbbbbb", "1.00x"),
        ("patch-dense", "bbbbbbb", f"{39.0 / 40.0:.2f}x"),
    ]
    assert [r["forward p50 ms"] for r in got][:2] == ["26", "21.5"] and got[5]["forward p50 ms"] == "40"


def test_models_table_and_plot_take_the_latest_run_without_switches(tmp_path):
    """A later run with a ``KVBOUND_*`` switch (its command line opens with it) is not the latest run of a variant:
    it is listed with the other runs of its commit, its switch in the note, and the speed-up plot leaves it out."""
    default = {"commit": "bbbbbbb", "date": "2026-12-02", "command": "bench --out run1.csv"}
    switched = {"commit": "bbbbbbb", "date": "2026-12-03", "command": "KVBOUND_FUSED_CONV=0 bench --out run2.csv"}
    rows = [
        _model("enformer", 1, "unpatched", 26.0, 7.0, 2.0, **default),
        _model("enformer", 1, "patch-dense", 13.0, 2.3, 2.0, **default),
        _model("enformer", 1, "unpatched", 26.0, 7.0, 2.0, **switched),
        _model("enformer", 1, "patch-dense", 20.0, 2.3, 2.0, **switched),
    ]
    headers, body = tables.models_table(rows)
    got = [dict(zip(headers, r, strict=True)) for r in body]
    assert [(r["variant"], r["vs unpatched"]) for r in got] == [
        ("unpatched", "1.00x"), ("patch-dense", "2.00x"), ("unpatched", "1.00x"), ("patch-dense", "1.30x")]
    assert got[3]["note / reason"].startswith("KVBOUND_FUSED_CONV=0") and "KVBOUND" not in got[1]["note / reason"]
    assert records.row_settings(rows[2]) == ["KVBOUND_FUSED_CONV=0"] and records.default_settings(rows[0])
    assert plots.model_speedups(rows, tmp_path / "speedups.png") == tmp_path / "speedups.png"
    assert (tmp_path / "speedups.png").stat().st_size > 0
    assert plots.model_speedups(rows[2:], tmp_path / "none.png") is None  # only switched runs: nothing to draw
    assert not (tmp_path / "none.png").exists()


def test_ring_table():
    headers, body = tables.ring_table(suite_rows())
    rows = [dict(zip(headers, r, strict=True)) for r in body]
    assert [(r["N"], r["processes"], r["provider"]) for r in rows][:5] == [
        ("65536", "1", "ring-compressed"), ("65536", "2", "ring-compressed"), ("65536", "2", "ring-dense"),
        ("65536", "2", "allgather-dense"), ("65536", "4", "ring-dense")]
    two = rows[1]
    assert two["dense / sent"] == "4.00x" and two["sent per rank"] == "16.8 MB" and two["dense per rank"] == "67.1 MB"
    assert two["TFLOP/s"] == f"{attention_flops(1, 8, 65536, 65536, 64, 64, False) / 11e-3 / 1e12:.1f}"
    assert rows[0]["sent per rank"] == "0 B" and rows[0]["dense / sent"] == "-"
    assert rows[4]["status"] == "unsupported" and "needs 4 GPUs" in rows[4]["note / reason"]


def test_suite_plots_are_png(tmp_path):
    rows = suite_rows()
    for path in (plots.model_forwards(rows, tmp_path / "m.png"), plots.ring_vs_n(rows, tmp_path / "r.png")):
        assert path is not None and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    assert plots.model_forwards(fixture_rows(), tmp_path / "none.png") is None
    assert plots.ring_vs_n(fixture_rows(), tmp_path / "none.png") is None


def test_report_has_every_suite_and_lists_older_schemas(all_results, tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    plots_dir = tmp_path / "benchmarks" / "plots"
    assert report.main(["--results", str(all_results), "--out", str(out), "--plots-dir", str(plots_dir)]) == 0
    text = out.read_text()
    for heading in ("## Encoder", "## Models end to end", "## Context-parallel ring",
                    "## Earlier measurements (schemas of removed scripts)"):
        assert heading in text
    assert "| seed-n16384-d64 | [1, 8, 16384, 64 / 64] bfloat16 | encoder-triton | r8b4 | ok | 2 |" in text
    assert "| enformer | 8 | patch-compressed | ok | 154 |" in text
    assert "| 131072 | 64 | 2 | ring-compressed | ok | 22 |" in text
    # the former scripts' CSVs: listed with their provenance and shown as recorded
    assert "`benchmarks/results/encoder/encoder_old.csv` (1 rows in the schema of the former " in text
    assert "| 1x8x65536x64 | triton | 8.1811 | 8.2 | 0.0363 | 2.66 | 0.0/1.0/0.0/0.0 | 0.2363 |" in text
    assert "| 65536 | 8 | 64 | all lowrank | 7.94 | 19.536 | 14.470 | 1.35x | 21.192 | 0.92x |" in text
    assert "command: `python benchmarks/public_api_timing.py OUT`" in text
    assert "`benchmarks/results/kernel_dev/attention_run1.csv` (1 rows): not read by this report" in text
    assert "![model forwards](benchmarks/plots/model_forwards.png)" in text
    assert "![ring vs N](benchmarks/plots/ring_vs_n.png)" in text
    assert (plots_dir / "ring_vs_n.png").read_bytes()[:8] == PNG_MAGIC
    # the attention suite's tables are unaffected by the other suites' rows
    assert "| 65536 | 64 |" in text and "seed-n16384-d64 (seed)" in text


def test_report_reads_only_legacy_files(tmp_path):
    directory = tmp_path / "results" / "encoder"
    directory.mkdir(parents=True)
    (directory / "old.csv").write_text(LEGACY_ENCODER)
    out = tmp_path / "B.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "| 1x8x65536x64 | triton |" in text and "_(no timed rows)_" in text


def test_csvs_under_kernel_dev_are_listed_and_never_read(tmp_path):
    """A bench-schema CSV under ``kernel_dev/`` (a trial, perhaps of reverted code) is listed as a development
    measurement and feeds no table, even where it is the newest run of its model."""
    from kvbound.bench import records

    row = {"mode": "model", "suite": "models", "provider": "unpatched", "shape": "alphagenome", "batch": 1,
           "status": "ok", "ms_p50": 123.0, "commit": "abc1234", "gpu": "NVIDIA H100"}  # fmt: skip
    results = tmp_path / "results"
    records.write_rows(results / "kernel_dev" / "trial" / "models.csv", [row])
    files = report.read_results(results)
    assert [f.kind for f in files] == ["development"]
    out = tmp_path / "B.md"
    assert report.main(["--results", str(results), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "`results/kernel_dev/trial/models.csv` (1 rows): not read by this report (a development measurement" in text
    assert "abc1234" not in text and "123" not in text.split("## Where these numbers come from")[0]
    records.write_rows(results / "run" / "models.csv", [row])  # the same row outside kernel_dev is read
    assert sorted(f.kind for f in report.read_results(results)) == ["bench", "development"]


def _report_of_one_file(tmp_path, name: str, header: str, rows: list[str], kind: str) -> str:
    """BENCHMARKS.md rendered from one CSV ``name`` (``header`` and ``rows``), which must be read as ``kind``."""
    directory = tmp_path / "results" / "run"
    directory.mkdir(parents=True)
    (directory / name).write_text("\n".join([header, *rows]) + "\n")
    files = report.read_results(tmp_path / "results")
    assert [f.kind for f in files] == [kind]
    out = tmp_path / "B.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    return out.read_text()


def test_report_shows_trained_kv_rows(tmp_path):
    """benchmarks/trained_kv.py's CSV is recognised by its columns and shown row by row with its provenance."""
    header = ",".join(["model", "layer", "N", "q_heads", "kv_heads", "dk", "dv", "provider", "config", "status",
                       "ms_p20", "ms_p50", "ms_p80", "vs_cudnn", "err_rel", "err_vs_original_rel",
                       "kv_max_err_over_tau", "k_shares", "v_shares", "kv_ratio", "reason", "device", "torch",
                       "triton", "commit", "date"])  # fmt: skip
    rows = [
        "enformer,3,65536,8,8,64,32,sdpa-cudnn,,ok,17.8,17.9,18.0,,1.69e-3,,,,,,,H200,2.11,3.6.0,abc1234,2026-12-01",
        "enformer,3,65536,8,8,64,32,kvbound-compressed,r8b4,ok,110,110.8,111,0.1615,1.7e-3,1.86e-3,0.999,"
        "0.000/0.000/1.000/0.000,0.000/0.000/1.000/0.000,1.688,,H200,2.11,3.6.0,abc1234,2026-12-01",
    ]
    text = _report_of_one_file(tmp_path, "trained_kv.csv", header, rows, "trained-kv")
    section = text.split("## Speed on K/V of the trained evaluation models")[1].split("\n## ")[0]
    assert "| enformer | 65536 | 8/8 | 64 / 32 | kvbound-compressed | r8b4 | ok | 110.8 | 0.16x |" in section
    assert "0.000/0.000/1.000/0.000" in section and "| 0.9990 |" in section
    assert "trained_kv.csv` (2 rows of `benchmarks/trained_kv.py`)" in text and "commit: `abc1234`" in text


def test_report_shows_largest_batch_rows(tmp_path):
    """benchmarks/largest_batch.py's CSV is recognised by its columns and shown row by row with its provenance."""
    header = ("model,variant,status,largest_batch,first_out_of_memory,first_timeout,peak_gib,probes,limit,"
              "failed_batch,input_len,seconds,reason,device,torch,commit")  # fmt: skip
    rows = [
        "enformer,unpatched,ok,69,70,,137.02,14,256,,196608,16.7,,NVIDIA H200,2.11.0+cu130,b07ccf7",
        "borzoi,patch-dense,ok,24,,32,52.50,7,256,,524288,210.0,,NVIDIA H100 80GB HBM3,2.11.0+cu130,d86f854",
    ]
    text = _report_of_one_file(tmp_path, "largest_batch.csv", header, rows, "largest-batch")
    section = text.split("### The largest batch that fits")[1].split("\n## ")[0]
    assert "| enformer | unpatched | ok | 69 | 70 | - | 137.02 | 14 | 196608 | 16.7 | H200 | b07ccf7 |" in section
    assert "| borzoi | patch-dense | ok | 24 | - | 32 | 52.50 | 7 | 524288 | 210.0 | H100 | d86f854 |" in section
    assert "largest_batch.csv` (2 rows of `benchmarks/largest_batch.py`)" in text
    assert "commit: `b07ccf7, d86f854`" in text


def test_report_shows_relative_ncu_rows(tmp_path):
    """benchmarks/relative_ncu.py's CSV is recognised by its columns and shown row by row with its provenance."""
    header = ("case,layer,N,B,variant,tile,status,err_max,call_ms_p50,kernel,duration_ms,useful_tflops,"
              "registers_per_thread,achieved_occupancy_pct,theoretical_occupancy_pct,issue_active_pct,tensor_pipe_pct,"
              "tensor_pipe_metric,instructions,dram_read_bytes,dram_write_bytes,l2_bytes,local_load_bytes,"
              "local_store_bytes,stall_1,stall_2,stall_3,stall_4,stall_5,ncu_metrics,reason,device,torch,triton,"
              "commit")  # fmt: skip
    rows = [
        "enformer-b8,enformer-layer,1536,8,keys,autotuned,ok,2.003e-02,0.6067,_attention_dense_fwd,0.5061,152.8,"
        "255.0,12.16,12.5,21.92,28.21,m,102094854.0,1,1,1,152567808.0,10233856.0,long_scoreboard=3.29,barrier=1.73,"
        "wait=1.28,selected=1,,metrics+sections,,NVIDIA H200,2.11.0+cu130,3.6.0,af59b50",
        "borzoi-b4,borzoi-layer,4096,4,runs,64x64x8x3,error,,,,,,,,,,,,,,,,,,,,,,,,boom,NVIDIA H200,2.11.0+cu130,"
        "3.6.0,af59b50",
    ]
    text = _report_of_one_file(tmp_path, "relative_ncu.csv", header, rows, "relative-ncu")
    section = text.split("### The relative term inside the dense kernel (Nsight Compute)")[1].split("\n## ")[0]
    assert ("| enformer-b8 | keys | autotuned | - | ok | 0.607 | 0.506 | 153 | 255 | 152.6 | 12.2 | 21.9 | 28.2 | "
            "102.1 | long_scoreboard=3.29, barrier=1.73, wait=1.28 | 2.003e-02 | af59b50 |  |") in section  # fmt: skip
    assert "| borzoi-b4 | runs | 64x64x8x3 | - | error | - |" in section and "| af59b50 | boom |" in section
    assert "relative_ncu.csv` (2 rows of `benchmarks/relative_ncu.py`)" in text and "Triton 3.6.0" in text


def test_report_shows_forward_timelines(tmp_path):
    """benchmarks/forward_timeline.py's CSV is recognised by its columns: one row per (model, batch, variant) from its
    timeline rows, with the patched forward's speed-up and its bound without attention against the same file's
    unpatched forward."""
    header = "model,batch,variant,row,name,calls,ms,commit"
    rows = []
    for variant, forward, attention in (("unpatched", "190.0", "50.0"), ("patch-dense", "150.0", "10.0")):
        rows += [
            f"enformer,8,{variant},timeline,forward_ms,,{forward},abc1234",
            f"enformer,8,{variant},timeline,busy_ms,,149.5,abc1234",
            f"enformer,8,{variant},timeline,idle_ms,,0.5,abc1234",
            f"enformer,8,{variant},timeline,tower_busy_ms,,16.0,abc1234",
            f"enformer,8,{variant},timeline,tower_idle_ms,,0.25,abc1234",
            f"enformer,8,{variant},timeline,attention_launched_ms,330,{attention},abc1234",
            f"enformer,8,{variant},kernels,matmul,100,80.0,abc1234",
        ]
    text = _report_of_one_file(tmp_path, "forward_timeline.csv", header, rows, "forward-timeline")
    section = text.split("### Where a whole forward's device time goes")[1].split("\n## ")[0]
    assert "| enformer | 8 | unpatched | 190.00 | - | - | 149.5 | 0.5 | 50.00 | 16.0 / 0.2 | abc1234 |" in section
    # 190 / 150 and 190 / (150 - 10)
    patched = "| enformer | 8 | patch-dense | 150.00 | 1.27x | 1.36x | 149.5 | 0.5 | 10.00 | 16.0 / 0.2 | abc1234 |"
    assert patched in section
    assert "forward_timeline.csv` (14 rows of `benchmarks/forward_timeline.py`)" in text
    assert "Inside the attention modules" not in section  # no module rows in this file


def test_report_lists_the_kernels_inside_the_attention_modules(tmp_path):
    """A forward_timeline CSV with ``module`` rows gets a second table: per forward, its longest kernels inside the
    attention modules with their share of all of them (the ``other`` row included in the total)."""
    header = "model,batch,variant,row,name,calls,ms,commit"
    rows = [
        "alphagenome,1,patch-dense,timeline,forward_ms,,430.0,abc1234",
        "alphagenome,1,patch-dense,module,_attention_dense_fwd,9,6.000,abc1234",
        "alphagenome,1,patch-dense,module,elementwise_kernel<float>,90,3.000,abc1234",
        "alphagenome,1,patch-dense,module,other (5 kernels),20,1.000,abc1234",
    ]
    text = _report_of_one_file(tmp_path, "forward_timeline.csv", header, rows, "forward-timeline")
    section = text.split("### Where a whole forward's device time goes")[1].split("\n## ")[0]
    assert "Inside the attention modules" in section
    assert "| alphagenome | 1 | patch-dense | `_attention_dense_fwd` | 9 | 6.000 | 60% | abc1234 |" in section
    assert "| alphagenome | 1 | patch-dense | `elementwise_kernel<float>` | 90 | 3.000 | 30% | abc1234 |" in section
    assert "| alphagenome | 1 | patch-dense | `other (5 kernels)` | 20 | 1.000 | 10% | abc1234 |" in section


def test_report_shows_the_fused_norm_comparison(tmp_path):
    """benchmarks/fused_norm_ab.py's CSV: its rows with their speed-ups over the same file's unpatched row."""
    header = "model,batch,variant,repeat,forward_ms,attention_ms,max_abs_diff,rel_diff,commit"
    rows = [
        "alphagenome,1,unpatched,1,570.00,150.000,,,abc1234",
        "alphagenome,1,patch-dense,1,420.00,13.500,9.382e-02,3.700e-03,abc1234",
        "alphagenome,1,patch-dense-port-norms,1,435.00,18.000,9.382e-02,3.700e-03,abc1234",
    ]
    text = _report_of_one_file(tmp_path, "fused_norm_ab.csv", header, rows, "fused-norm")
    section = text.split("### AlphaGenome's q, k, v norms fused")[1].split("\n## ")[0]
    assert "| alphagenome | 1 | unpatched | 1 | 570.0 | - | 150.00 | - | - | - | abc1234 |" in section
    # 570 / 420 and 150 / 13.5; 570 / 435 and 150 / 18
    assert "| alphagenome | 1 | patch-dense | 1 | 420.0 | 1.357x | 13.50 | 11.1x | 9.382e-02 | 3.700e-03 |" in section
    assert "| alphagenome | 1 | patch-dense-port-norms | 1 | 435.0 | 1.310x | 18.00 | 8.3x |" in section
    assert "fused_norm_ab.csv` (3 rows of `benchmarks/fused_norm_ab.py`)" in text


def test_model_speedups_plot_divides_by_its_own_runs_unpatched_forward(tmp_path, monkeypatch):
    """Each bar is the unpatched forward of the same run over the variant's; the graph-replayed patched forward gets
    one bar against the eager and one against the graph-replayed unpatched forward; models without a target (the
    smoke configs) and runs without an unpatched forward are left out."""
    run = {"commit": "ccccccc", "date": "2026-12-03", "command": "bench --graphs"}
    rows = [
        _model("enformer", 1, "unpatched", 30.0, 7.0, 2.0, **run),
        _model("enformer", 1, "patch-dense", 20.0, 4.0, 1.0, **run),
        _model("enformer", 1, "unpatched-graph", 24.0, 0.0, 2.0, **run),
        _model("enformer", 1, "patch-dense-graph", 15.0, 0.0, 1.0, **run),
        _model("borzoi", 4, "patch-dense", 70.0, 9.0, 5.0, commit="ddddddd", date="2026-12-03", command="other"),
        _model("enformer-tiny", 1, "unpatched", 3.0, 1.0, 0.1, **run),
    ]
    seen = {}
    real_bar = plots._pyplot().Axes.bar

    def bar(self, xs, ys, *args, **kwargs):
        seen[kwargs.get("label")] = [round(y, 6) for y in ys]
        return real_bar(self, xs, ys, *args, **kwargs)

    real_labels = plots._pyplot().Axes.set_xticklabels
    groups = []

    def set_xticklabels(self, labels, *args, **kwargs):
        groups.extend(labels)
        return real_labels(self, labels, *args, **kwargs)

    monkeypatch.setattr(plots._pyplot().Axes, "bar", bar)
    monkeypatch.setattr(plots._pyplot().Axes, "set_xticklabels", set_xticklabels)
    path = plots.model_speedups(rows, tmp_path / "s.png")
    assert path is not None and path.read_bytes()[:8] == PNG_MAGIC
    assert seen == {"patched dense": [1.5], "patched dense, CUDA graph / unpatched eager": [2.0],
                    "patched dense / unpatched, both CUDA graphs": [1.6]}
    # the run's commit and GPU; no empty group for borzoi's batch without an unpatched forward
    assert groups == ["enformer\nB=1\nccccccc H200"]
    assert plots.model_speedups(fixture_rows(), tmp_path / "none.png") is None


def test_model_target_ratios_keep_the_digits_that_tell_a_miss_from_a_hit():
    # two decimals, unless they round a ratio onto the other side of its target
    assert tables._x(1.41, 1.3) == "1.41x" and tables._x(1.7964, 1.8) == "1.796x" and tables._x(1.8, 1.8) == "1.80x"
    assert tables._x(1.2999, 1.3) == "1.300x" and tables._x(9.996, 10.0) == "9.996x"
    assert tables._met(1.7964, 1.8) == "MISSED (99.8% of the target)" and tables._met(1.8, 1.8) == "met"
    assert tables._met(1.2, 1.3) == "MISSED (92% of the target)" and tables._met(None, 1.3) == "not measured"
    rows = [
        _model("borzoi", 1, "unpatched", 40.58, 21.0, 3.0),
        _model("borzoi", 1, "patch-dense", 15.33, 2.6, 2.5),
        _model("borzoi", 1, "patch-compressed", 22.59, 9.8, 2.5),
    ]
    headers, table = tables.model_targets_table(rows)
    row = dict(zip(headers, table[0], strict=True))
    assert row["compressed K/V"] == "1.796x (MISSED (99.8% of the target))"
    assert "borzoi batch 1 compressed forward: 1.796x < 1.8x" in tables.model_targets_summary(rows)


def test_model_targets_judge_each_target_within_one_run_and_leave_older_days_uncounted():
    day = {**ENV, "date": "2026-12-04T10:00:00Z", "commit": "ccccccc"}
    later = {**ENV, "date": "2026-12-04T12:00:00Z", "commit": "ddddddd", "gpu": "NVIDIA H100 80GB HBM3"}
    older = {**ENV, "date": "2026-12-01T10:00:00Z", "commit": "aaaaaaa"}
    switched = {**later, "date": "2026-12-04T13:00:00Z", "command": "KVBOUND_RELATIVE_RUNS=0 python -m kvbound.bench"}
    rows = [
        # enformer batch 8: forward and modules from `day`; graphs from `day`; the alternatives from `later`
        _model("enformer", 8, "unpatched", 190.0, 52.0, 15.0, **day),
        _model("enformer", 8, "patch-dense", 70.0, 9.5, 7.0, **day),
        _model("enformer", 8, "unpatched-graph", 188.0, 0.0, 15.0, **day),
        _model("enformer", 8, "patch-dense-graph", 69.0, 0.0, 7.0, **day),
        _model("enformer", 8, "patch-compressed", 76.0, 14.0, 7.0, **day),
        _model("enformer", 8, "patch-compressed-graph", 75.0, 0.0, 7.0, **day),
        _model("enformer", 8, "patch-dense", 71.0, 9.4, 7.0, **later),
        _model("enformer", 8, "sdpa-built-bias", 170.0, 32.0, 15.0, **later),
        _model("enformer", 8, "flex-built-table", 162.0, 24.0, 15.5, **later),
        # a run with a switch never counts, however fast
        _model("enformer", 8, "unpatched", 190.0, 52.0, 15.0, **switched),
        _model("enformer", 8, "patch-dense", 10.0, 0.5, 7.0, **switched),
        # an older day of the same model: listed, not counted
        _model("enformer", 32, "unpatched", 800.0, 200.0, 60.0, **older),
        _model("enformer", 32, "patch-dense", 650.0, 34.0, 60.0, **older),
        # alphagenome: modules met; its only alternative row failed, so there is no comparison
        _model("alphagenome", 1, "flex-tile-bias", 1.0, 1.0, 1.0, **{**day, "status": "error"}),
        _model("alphagenome", 1, "unpatched", 580.0, 150.0, 28.0, **day),
        _model("alphagenome", 1, "patch-dense", 430.0, 12.5, 28.0, **day),
        # its compressed forward was measured on an older day only: shown with that day, not counted
        _model("alphagenome", 1, "unpatched", 575.0, 150.0, 28.0, **older),
        _model("alphagenome", 1, "patch-compressed", 500.0, 88.0, 28.0, **older),
        # a smoke model has no target
        _model("enformer-tiny", 1, "unpatched", 5.0, 1.0, 0.1, **day),
        _model("enformer-tiny", 1, "patch-dense", 4.0, 1.0, 0.1, **day),
    ]
    entries = {(e["model"], e["batch"]): e for e in tables.model_targets(rows)}
    assert list(entries) == [("enformer", 8), ("enformer", 32), ("alphagenome", 1)]
    e = entries[("enformer", 8)]
    assert e["forward"] == pytest.approx(190 / 70) and e["modules"] == pytest.approx(52 / 9.5)
    assert e["graph"] == pytest.approx(188 / 69)
    assert e["alternative"]["provider"] == "flex-built-table" and e["versus"] == pytest.approx(162 / 71)
    assert not e["older"] and entries[("enformer", 32)]["older"] and not entries[("alphagenome", 1)]["older"]
    headers, table = tables.model_targets_table(rows)
    by = {(r[0], r[1]): dict(zip(headers, r, strict=True)) for r in table}
    row = by[("enformer", "8")]
    assert row["verdict"] == "met" and row["verdict (10x)"] == "MISSED (55% of the target)"
    assert row["in CUDA graphs"] == "2.72x (met)" and row["best alternative (ms)"] == "flex-built-table (162)"
    assert row["compressed K/V"] == "2.50x (met); in CUDA graphs 2.51x (met)"
    assert by[("alphagenome", "1")]["compressed K/V"] == "1.15x (MISSED (88% of the target)), 2026-12-01, not counted"
    assert row["commits (GPU)"] == "ccccccc (H200), ddddddd (H100)"  # each run's commit and GPU
    assert row["peak GiB: unpatched / patched / alternative"] == "17.00 / 9.00 / 17.50"  # baseline 2 GiB included
    assert by[("enformer", "32")]["day"] == "2026-12-01 (older)"
    assert by[("alphagenome", "1")]["verdict (10x)"] == "met" and by[("alphagenome", "1")]["patched vs it"] == "-"
    summary = tables.model_targets_summary(rows)
    # counted: enformer 8 (forward met, modules missed, vs alternative met, compressed met), alphagenome 1 (forward
    # met, modules met; its compressed forward is from an older day)
    assert summary.startswith("**5 of 6 model targets met**")
    assert "enformer batch 8 modules: 5.47x < 10.0x" in summary and "not counted: enformer batch 32" in summary
    # enformer 32 on its older day: forward 800 / 650 = 1.23x < 1.3x, modules 200 / 34 = 5.9x < 10x
    assert summary.endswith("not counted: enformer batch 32 (0 of 2 of their targets met there).")


def test_model_target_whose_newest_run_lost_its_unpatched_forward_keeps_the_older_one_uncounted():
    """Borzoi at a batch where the port ran out of memory in the newest run (which still timed the patched forward
    and the alternatives): the patched-vs-alternative judgment of that run counts; the forward and modules judgments
    come from an older run and day, are shown with that day and are not counted."""
    older = {**ENV, "date": "2026-12-04T10:00:00Z", "commit": "aaaaaaa"}
    newest = {**ENV, "date": "2026-12-06T10:00:00Z", "commit": "bbbbbbb", "gpu": "NVIDIA H100 80GB HBM3"}
    rows = [
        _model("borzoi", 31, "unpatched", 1107.0, 563.0, 72.0, **older),
        _model("borzoi", 31, "patch-dense", 414.5, 74.0, 38.0, **older),
        _model("borzoi", 31, "unpatched", 1.0, 1.0, 1.0, **{**newest, "status": "error"}),
        _model("borzoi", 31, "patch-dense", 435.0, 72.0, 33.0, **newest),
        _model("borzoi", 31, "flex-built-table", 1076.0, 508.0, 55.0, **newest),
        _model("borzoi", 4, "unpatched", 156.0, 81.0, 10.0, **newest),
        _model("borzoi", 4, "patch-dense", 58.0, 9.5, 7.0, **newest),
    ]
    entry = next(e for e in tables.model_targets(rows) if e["batch"] == 31)
    assert not entry["older"] and entry["forward_older"]
    assert entry["versus"] == pytest.approx(1076 / 435)  # within the newest run, not against the older patched row
    headers, table = tables.model_targets_table(rows)
    cells = next(r for r in table if r[1] == "31")
    row = dict(zip(headers, cells, strict=True))
    assert row["day"] == "2026-12-06"
    # two columns are named "verdict": the forward's follows its speed-up, the alternative's comes last
    assert cells[headers.index("forward speed-up") + 1] == "met, 2026-12-04, not counted"
    assert row["verdict"] == "met" and row["patched vs it"] == "2.47x"
    assert row["verdict (10x)"] == "MISSED (76% of the target), 2026-12-04, not counted"
    summary = tables.model_targets_summary(rows)
    # counted: batch 31 vs the alternative (met), batch 4 forward (met) and modules (8.5x, missed)
    assert summary.startswith("**2 of 3 model targets met**")
    assert "borzoi batch 31 modules" not in summary.split("Measured only")[0]
    assert summary.endswith("not counted: borzoi batch 31 forward and modules (1 of 2 of their targets met there).")
