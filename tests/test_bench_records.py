"""CSV rows of kvbound.bench and the Nsight Compute export parser."""

import math

import pytest

from kvbound.bench import ncu, records


def _row(**kw):
    row = {"mode": "time", "provider": "sdpa-cudnn", "shape": "s", "status": "ok"}
    row.update(kw)
    return row


def test_round_trip_keeps_types(tmp_path):
    rows = [
        _row(q_len=4096, causal=False, softcap=5.0, ms_p50=1.25, tflops=466.0, flops=34_359_738_368,
             reason="", gpu="NVIDIA H200", command="python -m kvbound.bench --out x.csv"),
        _row(provider="kvbound-compressed", config="r8b4", rank=8, bits=4, tau=0.03125, causal=True,
             status="unsupported", reason="rank 8 needs a head dim above it; k has 8, and a comma"),
    ]
    path = tmp_path / "r.csv"
    records.write_rows(path, rows)
    back = records.read_rows(path)
    assert len(back) == 2
    assert back[0]["q_len"] == 4096 and back[0]["causal"] is False and back[0]["softcap"] == 5.0
    assert back[0]["flops"] == 34_359_738_368 and back[0]["ms_p50"] == 1.25
    assert back[0]["config"] is None and back[0]["err_rel"] is None
    assert back[1]["causal"] is True and back[1]["tau"] == 0.03125 and back[1]["reason"].endswith("a comma")
    assert set(back[0]) == set(records.COLUMNS)


def test_float_repr_round_trips_exactly(tmp_path):
    value = 0.1 + 0.2
    records.write_rows(tmp_path / "f.csv", [_row(ms_p50=value)])
    assert records.read_rows(tmp_path / "f.csv")[0]["ms_p50"] == value


def test_append_writes_header_once(tmp_path):
    path = tmp_path / "a.csv"
    records.append_row(path, _row(shape="one"))
    records.append_row(path, _row(shape="two"))
    assert [r["shape"] for r in records.read_rows(path)] == ["one", "two"]
    assert path.read_text().count("mode,measurement_id") == 1


def test_invalid_rows_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="status"):
        records.write_rows(tmp_path / "x.csv", [_row(status="fine")])
    with pytest.raises(ValueError, match="mode"):
        records.write_rows(tmp_path / "x.csv", [_row(mode="guess")])
    with pytest.raises(ValueError, match="unknown columns"):
        records.write_rows(tmp_path / "x.csv", [_row(speed=3)])
    bad = tmp_path / "bad.csv"
    bad.write_text("mode,provider,shape,status,q_len\ntime,p,s,ok,many\n")
    with pytest.raises(ValueError, match="q_len"):
        records.read_rows(bad)
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a kvbound bench CSV"):
        records.read_rows(other)


def test_environment_has_provenance():
    env = records.environment(["--out", "a b.csv"], commit="abc123")
    assert env["commit"] == "abc123"
    assert env["command"] == "python -m kvbound.bench --out 'a b.csv'"
    assert env["torch"] and env["triton"] and env["date"].endswith("Z")


def test_environment_records_the_switches_that_were_set(monkeypatch):
    """``KVBOUND_*`` switches open the command line as the shell would take them (``KVBOUND_COMMIT`` only labels
    rows and is left out); a row's switches are read back from it."""
    monkeypatch.setenv("KVBOUND_FUSED_CONV", "0")
    monkeypatch.setenv("KVBOUND_DV_SPLIT", "1")
    monkeypatch.setenv("KVBOUND_COMMIT", "abc123")
    env = records.environment(["--suite", "models"])
    assert env["command"] == "KVBOUND_DV_SPLIT=1 KVBOUND_FUSED_CONV=0 python -m kvbound.bench --suite models"
    assert records.row_settings(env) == ["KVBOUND_DV_SPLIT=1", "KVBOUND_FUSED_CONV=0"]
    assert not records.default_settings(env)
    assert records.default_settings({"command": "python -m kvbound.bench --note KVBOUND_X=1"})


_NCU_COLUMNS = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
                "Grid Size", "Device", "CC", "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum",
                "lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_sectors_srcunit_tex_op_write.sum"]
_NCU_UNITS = [""] * 11 + ["byte", "byte", "nsecond", "sector", "sector"]


def _ncu_line(kernel_id, name, *metrics):
    cells = [str(kernel_id), "123", "python", "h", name, "1", "7", "(128, 1, 1)", "(32, 8, 1)", "0", "9.0", *metrics]
    return ",".join(f'"{c}"' for c in cells)


NCU_EXPORT = "\n".join([
    "==PROF== Connected to process 123 (python)",
    ",".join(f'"{c}"' for c in _NCU_COLUMNS),
    ",".join(f'"{c}"' for c in _NCU_UNITS),
    _ncu_line(0, "kvbound_bench:m0003", "1,000", "500", "2000", "100", "10"),
    _ncu_line(1, "kvbound_bench:m0003", "24", "8", "1000", "3", "1"),
    _ncu_line(2, "<default domain>:kvbound_bench:m0005", "64", "32", "500", "2", "2"),
    _ncu_line(3, "void other_kernel(float*)", "7", "7", "7", "7", "7"),
]) + "\n"


def test_parse_ncu_csv_sums_kernels_per_range():
    got = ncu.parse_ncu_csv(NCU_EXPORT)
    assert set(got) == {"m0003", "m0005"}
    m3 = got["m0003"]
    assert m3["kernels"] == 2
    assert m3["dram__bytes_read.sum"] == 1024 and m3["dram__bytes_write.sum"] == 508
    assert m3["lts__t_sectors_srcunit_tex_op_read.sum"] == 103
    assert got["m0005"]["kernels"] == 1 and got["m0005"]["gpu__time_duration.sum"] == 500


def test_parse_ncu_csv_needs_a_header():
    with pytest.raises(ValueError, match="header"):
        ncu.parse_ncu_csv("==PROF== nothing profiled\n")


def test_merge_metrics_fills_bytes_and_flags_unprofiled_rows():
    rows = [_row(mode="ncu", measurement_id="m0003"), _row(mode="ncu", measurement_id="m0004"),
            _row(mode="ncu", measurement_id="m0009", status="unsupported", reason="x")]
    merged = ncu.merge_metrics(rows, ncu.parse_ncu_csv(NCU_EXPORT))
    assert merged[0]["dram_read_bytes"] == 1024 and merged[0]["dram_write_bytes"] == 508
    assert merged[0]["l2_read_bytes"] == 103 * 32 and merged[0]["l2_write_bytes"] == 11 * 32
    assert merged[0]["ncu_kernels"] == 2
    assert math.isclose(merged[0]["ncu_ms"], 3000 / 1e6)
    assert merged[1]["status"] == "error" and "no kernel" in merged[1]["reason"]
    assert merged[2]["status"] == "unsupported" and merged[2].get("dram_read_bytes") is None


def test_ncu_child_command_drops_parent_options(tmp_path):
    child = ncu._child_argv(["--ncu", "--out", "x.csv", "--only", "a", "--ncu-path=/opt/ncu"], tmp_path / "c.csv")
    assert child[1:3] == ["-m", "kvbound.bench"]
    assert "--ncu" not in child and "x.csv" not in child and "--ncu-path=/opt/ncu" not in child
    assert child[-4:-1] == ["--ncu-child", "--no-calibration", "--out"]
    assert child[3:5] == ["--only", "a"] and child[-1] == str(tmp_path / "c.csv")
    cmd = ncu.ncu_command("ncu", tmp_path / "rep", child)
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert "regex:kvbound_bench:.*/" in cmd and "dram__bytes_read.sum" in cmd[cmd.index("--metrics") + 1]


def test_suite_rows_round_trip_and_older_files_still_read(tmp_path):
    rows = [
        _row(mode="encode", suite="encoder", provider="encoder-triton", gbps=812.5, max_err_over_tau=0.62),
        _row(mode="model", suite="models", provider="patch-compressed", batch=8, input_len=196_608, layers=11,
             attention_ms_p50=2.5, peak_bytes=3 * 2**30, baseline_bytes=2**30, diff_max_abs=4e-3, diff_rel=6e-4,
             calibration_ms=80.0, compress_ms=1.5),
        _row(mode="ring", suite="ring", provider="ring-compressed", world_size=2, bytes_sent=10**6,
             dense_bytes_sent=4 * 10**6, repeats=5),
    ]
    records.write_rows(tmp_path / "s.csv", rows)
    back = records.read_rows(tmp_path / "s.csv")
    assert back[0]["gbps"] == 812.5 and back[1]["peak_bytes"] == 3 * 2**30 and back[1]["layers"] == 11
    assert back[2]["world_size"] == 2 and back[2]["bytes_sent"] == 10**6 and back[2]["suite"] == "ring"
    # A CSV written before these columns existed reads with them empty.
    old = tmp_path / "old.csv"
    old.write_text("mode,provider,shape,status,ms_p50\ntime,sdpa-cudnn,s,ok,1.5\n")
    (row,) = records.read_rows(old)
    assert row["ms_p50"] == 1.5 and row["suite"] is None and row["world_size"] is None
