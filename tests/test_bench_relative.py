"""``kvbound bench --suite relative`` on the CPU (tiny layer, interpreter): every provider runs, matches the float64
Transformer-XL reference, and the report's table compares each with the ports' math and the best alternative."""

import pytest

from kvbound.bench import records, report, tables
from kvbound.bench.cli import main
from kvbound.bench.relative import RELATIVE_PROVIDERS


@pytest.fixture(scope="module")
def relative_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("relative") / "relative.csv"
    assert main(["--suite", "relative", "--cpu-smoke", "--out", str(out)]) == 0
    return records.read_rows(out)


def test_every_provider_matches_the_reference(relative_rows):
    shapes = ["enformer-layer-b1", "enformer-layer-b2", "borzoi-layer-b1"]  # Borzoi: the port's strided shift
    assert [(r["shape"], r["provider"]) for r in relative_rows] == [(s, p) for s in shapes for p in RELATIVE_PROVIDERS]
    for row in relative_rows:
        if row["provider"].startswith("kvbound-relative-runs") and row["shape"].startswith("enformer"):
            assert row["status"] == "unsupported" and "no runs" in row["reason"]  # Gaussian relative keys
            continue
        assert row["status"] == "ok", (row["provider"], row["reason"])
        assert row["mode"] == "time" and row["suite"] == "relative" and row["family"] == "relative"
        assert 0 < row["err_rel"] < 2e-3 and row["ms_p50"] > 0  # float16 operands, float64 reference
    compressed = [r for r in relative_rows if r["provider"] == "kvbound-relative-compressed"]
    assert all(r["config"] == "r8b4" and r["compression_ratio"] > 1 and r["compress_ms"] > 0 for r in compressed)
    assert all("includes encoding" in r["note"] for r in compressed)
    for provider in ("kvbound-relative-runs", "kvbound-relative-runs-deferred"):
        runs = [r for r in relative_rows if r["provider"] == provider and r["status"] == "ok"]
        assert [r["shape"] for r in runs] == ["borzoi-layer-b1"] and "runs of equal relative keys" in runs[0]["note"]


def test_report_table(relative_rows):
    headers, body = tables.relative_table(relative_rows)
    assert len(body) == 3 * len(RELATIVE_PROVIDERS)
    port = [line for line in body if line[headers.index("provider")] == "port-eager"]
    assert all(line[headers.index("vs port-eager")] == "1.00x" for line in port)
    best = [line[headers.index("vs best alternative")] for line in body
            if line[headers.index("provider")] in ("sdpa-built-bias", "flex-built-table")]
    assert "1.00x" in best
    assert "enformer-layer-b1" not in report._speed_tables(relative_rows)  # its own table only


def test_a_wrong_batch_item_is_caught():
    # the check reads the first and the last batch item: a provider that gets only a later item wrong fails it
    import torch

    from kvbound.bench import relative

    spec = relative.RelativeSpec("t", 24, (3,), heads=2, dk=8, dv=8)
    import kvbound

    config = kvbound.CompressionConfig(block_size=16, rank=4)
    x = relative._inputs(spec, 3, torch.device("cpu"), torch.float32, config, 0, 0.5)
    references = {item: relative._reference(x, x["k"], x["v"], item) for item in (0, 2)}
    options = relative.RelativeOptions(warmup_ms=1, rep_ms=1)

    def wrong_last(inputs):
        out = relative._port_eager(inputs)
        out[2] += 1.0
        return out

    assert relative._measured(relative._port_eager, x, references, torch.device("cpu"), options, 1)["status"] == "ok"
    bad = relative._measured(wrong_last, x, references, torch.device("cpu"), options, 1)
    assert bad["status"] == "check_failed" and "err_rel" in bad["reason"]
