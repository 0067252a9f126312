"""A compressed K/V that misses tau reaches the eval CSVs, the console summary and EVAL.md as violations, not "ok"."""

import csv
import math
import re

import pytest

import kvbound
import test_eval_chr22
import test_eval_pipeline
from kvbound.eval import cli, report
from kvbound.eval.models import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

_rows = test_eval_pipeline._rows
fixture_dir = test_eval_pipeline.fixture_dir
fixture_cache, chr22_cache = test_eval_chr22.fixture_cache, test_eval_chr22.chr22_cache

KINDS = ("enformer", "alphagenome")
OFFSET = 1.0  # 32 tau at the default tau 2^-5
BATCH = 4


def _forwards(windows: int, variants: int) -> int:
    """Forwards of one ``cli._run``: one per batch of windows, one per batch of variants (with their references)."""
    return math.ceil(windows / BATCH) + math.ceil(variants / BATCH)


def _broken_decompress(monkeypatch) -> list[int]:
    """Make every ``CompressedKV.decompress()`` return its first element ``OFFSET`` too high; the list counts calls."""
    original = kvbound.CompressedKV.decompress
    calls = []

    def broken(self):
        x_hat = original(self)
        x_hat.view(-1)[0] += OFFSET
        calls.append(1)
        return x_hat

    monkeypatch.setattr(kvbound.CompressedKV, "decompress", broken)
    return calls


def _eval(fixture_dir, out, weights):
    argv = ["--fixture", str(fixture_dir), "--weights-dir", str(weights), "--out", str(out), "--models",
            ",".join(KINDS), "--windows", "1", "--max-variants", "9", "--batch-size", str(BATCH), "--settings",
            "default", "--block-size", "16", "--calibration-windows", "1", "--layer-windows", "1", "--scaling", "1",
            "--scaling-windows", "1", "--scaling-variants", "4", "--device", "cpu"]  # fmt: skip
    assert cli.main(argv) == 0


def _section(text: str, title: str) -> str:
    """The markdown of the ``## title...`` section, up to the next ``## `` heading."""
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 3)
    return text[start : None if end < 0 else end]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def _table_rows(section: str, *cells: str) -> list[list[str]]:
    """The cells of the table lines of ``section`` that hold every one of ``cells`` as a whole cell."""
    rows = (_cells(line) for line in section.splitlines() if line.startswith("| "))
    return [row for row in rows if set(cells) <= set(row)]


def test_violations_reach_quality_layers_scaling_and_the_report(fixture_dir, tmp_path, monkeypatch, capsys):
    """With one decoded element of every K and V tensor off by 32 tau, ``kvbound eval`` (its hooks are not strict)
    runs to the end and counts every broken tensor: ``bound_violations`` in quality.csv and scaling.csv is 2 (K and
    V) x attention layers x forwards and the max errors show the offset; layers.csv shows the K error in every layer
    and counts a logit-bound violation wherever the measured logit error exceeds ``L1(q) x tau``. The console summary
    and EVAL.md (headline verdict, ablation and context-length tables, per-layer table) show the counts and "bound
    violated" instead of "ok"; the same files with the counts set to 0 render "ok" there."""
    calls = _broken_decompress(monkeypatch)
    out = tmp_path / "results"
    _eval(fixture_dir, out, tmp_path / "none")
    quality = {(row["model"], row["setting"]): row for row in _rows(out / "quality.csv")}
    layers = _rows(out / "layers.csv")
    scaling = {row["model"]: row for row in _rows(out / "scaling.csv")}
    tau = 2.0**-5
    counted = 0
    for kind in KINDS:
        depth = ModelConfig.toy(kind, 1).depth
        exact, default = quality[(kind, "exact")], quality[(kind, "default r8 b4")]
        assert int(exact["bound_violations"]) == 0 and float(default["tau"]) == tau
        violations = int(default["bound_violations"])
        assert violations == 2 * depth * _forwards(int(default["windows"]), int(default["variants"])) > 0
        assert min(float(default["max_abs_error_k"]), float(default["max_abs_error_v"])) > OFFSET - tau
        scaled = scaling[kind]
        assert int(scaled["bound_violations"]) == 2 * depth * _forwards(int(scaled["windows"]),
                                                                        int(scaled["variants"])) > 0  # fmt: skip
        assert float(scaled["tau"]) == tau
        mine = sorted((r for r in layers if r["model"] == kind), key=lambda r: int(r["layer"]))
        assert [int(r["layer"]) for r in mine] == list(range(depth))
        for row in mine:  # one probed window: one call per layer, its K and V both broken
            assert int(row["windows"]) == 1 and float(row["max_abs_error_k"]) > OFFSET - tau
            assert float(row["max_abs_error_v"]) > OFFSET - tau
            assert int(row["bound_violations"]) == 2
            # the logit bound (row by row) is missed or not depending on the queries; counted apart, once per call
            assert 0 <= int(row["logit_violations"]) <= 1
            if float(row["max_logit_error"]) > float(row["logit_bound_tau"]):  # beyond the largest row's bound
                assert int(row["logit_violations"]) == 1
        counted += violations + int(scaled["bound_violations"]) + 2 * depth  # + the layer probe's calls
    assert len(calls) == counted  # every decode was broken, and each is counted once

    summary = capsys.readouterr().err
    for kind in KINDS:
        assert f"{quality[(kind, 'default r8 b4')]['bound_violations']} violations" in summary

    text = report.render(out)
    headline, ablation = _section(text, "Exact vs the default config"), _section(text, "Ablation")
    per_layer, context = _section(text, "Per attention layer"), _section(text, "Context length")
    for kind in KINDS:
        violations = quality[(kind, "default r8 b4")]["bound_violations"]
        (row,) = _table_rows(headline, kind, "default r8 b4", "random (untrained)")
        assert row[-1].startswith("**BREACH") and "bound violated" in row[-1]
        (row,) = _table_rows(ablation, kind, "default r8 b4")
        assert row[5] == f"{violations} violations"
        (row,) = _table_rows(context, kind, "1x")
        assert row[4] == f"{scaling[kind]['bound_violations']} violations"
        shown = [r[9:11] for r in _table_rows(per_layer, kind)]
        assert shown == [[r["bound_violations"], r["logit_violations"]] for r in layers if r["model"] == kind]
    assert not re.search(r"\|\s*ok\s*\|", text)

    for name in ("quality.csv", "layers.csv", "scaling.csv"):
        rows = _rows(out / name)
        with open(out / name, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({**row, "bound_violations": "0"} for row in rows)
    clean = report.render(out)
    assert not re.search(r"\d+ violations", clean) and "bound violated" not in clean
    for kind in KINDS:
        assert _table_rows(_section(clean, "Ablation"), kind, "default r8 b4")[0][5] == "ok"
        assert _table_rows(_section(clean, "Context length"), kind, "1x")[0][4] == "ok"


def test_violations_on_a_held_out_chromosome_are_counted_with_chrx(chr22_cache, tmp_path, monkeypatch):
    """With ``--test-chromosomes X 22`` the one hook of a setting also encodes chr22's windows and variants: the
    broken tensors of both chromosomes add up in the row's ``bound_violations`` (every broken decode counted once)."""
    calls = _broken_decompress(monkeypatch)
    out = tmp_path / "results"
    argv = ["--fixture", str(chr22_cache), "--weights-dir", str(tmp_path / "none"), "--out", str(out), "--models",
            "alphagenome", "--windows", "1", "--max-variants", "6", "--batch-size", str(BATCH), "--settings",
            "default", "--block-size", "16", "--calibration-windows", "1", "--layer-windows", "0", "--scaling", "",
            "--device", "cpu", "--test-chromosomes", "X", "22"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = {row["setting"]: row for row in _rows(out / "quality.csv")}
    assert int(rows["exact"]["bound_violations"]) == 0
    row = rows["default r8 b4"]
    chrx = _forwards(int(row["windows"]), int(row["variants"]))
    chr22 = _forwards(int(row["windows_chr22"]), int(row["variants_chr22"]))
    assert chr22 > 0 and int(row["variants_chr22"]) > 0
    assert int(row["bound_violations"]) == 2 * ModelConfig.toy("alphagenome", 1).depth * (chrx + chr22) == len(calls)
    assert "bound violated" in report._flag(row)
