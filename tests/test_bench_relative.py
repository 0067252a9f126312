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
    assert [(r["shape"], r["provider"]) for r in relative_rows] == [
        (f"enformer-layer-b{b}", p) for b in (1, 2) for p in RELATIVE_PROVIDERS
    ]
    for row in relative_rows:
        assert row["status"] == "ok", (row["provider"], row["reason"])
        assert row["mode"] == "time" and row["suite"] == "relative" and row["family"] == "relative"
        assert 0 < row["err_rel"] < 2e-3 and row["ms_p50"] > 0  # float16 operands, float64 reference
    compressed = [r for r in relative_rows if r["provider"] == "kvbound-relative-compressed"]
    assert all(r["config"] == "r8b4" and r["compression_ratio"] > 1 and r["compress_ms"] > 0 for r in compressed)


def test_report_table(relative_rows):
    headers, body = tables.relative_table(relative_rows)
    assert len(body) == 2 * len(RELATIVE_PROVIDERS)
    port = [line for line in body if line[headers.index("provider")] == "port-eager"]
    assert all(line[headers.index("vs port-eager")] == "1.00x" for line in port)
    best = [line[headers.index("vs best alternative")] for line in body
            if line[headers.index("provider")] in ("sdpa-built-bias", "flex-built-table")]
    assert "1.00x" in best
    assert "enformer-layer-b1" not in report._speed_tables(relative_rows)  # its own table only
