"""The whole benchmark on the synthetic fixture, on CPU: train a toy model, then `kvbound eval`."""

import csv
import json
import math
import re

import numpy as np
import pytest
import torch

from kvbound.eval import cli, train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fixture")


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_train_toy_model_is_seeded_and_logged(fixture_dir, tmp_path):
    runs = []
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        argv = [
            "--model",
            "enformer",
            "--size",
            "toy",
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--fixture",
            str(fixture_dir),
            "--weights-dir",
            str(out),
            "--log-dir",
            str(out),
            "--log-every",
            "2",
            "--eval-every",
            "4",
            "--eval-windows",
            "2",
            "--device",
            "cpu",
        ]
        assert train.main(argv) == 0
        runs.append(_rows(out / "train_enformer_toy.csv"))
        summary = json.loads((out / "train_enformer_toy.json").read_text())
        assert (out / "enformer_toy.safetensors").exists()
    assert [row["step"] for row in runs[0]] == ["2", "4"]
    assert all(math.isfinite(float(row["loss"])) and float(row["loss"]) > 0 for row in runs[0])
    assert [row["loss"] for row in runs[0]] == [row["loss"] for row in runs[1]]  # same seed, same run
    assert summary["parameters"] > 10_000 and summary["best"]["step"] == 4
    assert -1.0 <= float(runs[0][-1]["valid_pearson_mean"]) <= 1.0


def _train_toy(fixture_dir, out, *extra, batch=2):
    """Two steps of the toy Enformer on the fixture; its log rows and summary."""
    argv = ["--model", "enformer", "--size", "toy", "--steps", "2", "--batch-size", str(batch), "--fixture",
            str(fixture_dir), "--weights-dir", str(out), "--log-dir", str(out), "--log-every", "2",
            "--eval-every", "2", "--eval-windows", "1", "--device", "cpu", *extra]
    assert train.main(argv) == 0
    return _rows(out / "train_enformer_toy.csv"), json.loads((out / "train_enformer_toy.json").read_text())


def test_track_weights_and_warm_start(fixture_dir, tmp_path):
    """--track-weight changes the loss (normalised weights recorded), bad specs fail with the track names, and
    --init continues from saved weights of the same configuration only."""
    names = ["a", "enhancer", "expression"]
    weights = train.track_weights(["enhancer=4", "expression=2"], names, "cpu")
    assert torch.allclose(weights, torch.tensor([1.0, 4.0, 2.0]) * 3 / 7)
    assert torch.equal(train.track_weights(None, names, "cpu"), torch.ones(3))
    for bad in (["enhancer"], ["nope=2"], ["enhancer=-1"], ["enhancer=x"]):
        with pytest.raises(ValueError, match="--track-weight"):
            train.track_weights(bad, names, "cpu")
    with pytest.raises(ValueError, match="at least one track"):
        train.track_weights(["a=0", "enhancer=0", "expression=0"], names, "cpu")

    plain, _ = _train_toy(fixture_dir, tmp_path / "plain")
    weighted, summary = _train_toy(fixture_dir, tmp_path / "weighted", "--track-weight", "enhancer=8")
    assert weighted[0]["loss"] != plain[0]["loss"]
    assert summary["optimizer"]["track_weights"]["enhancer"] > summary["optimizer"]["track_weights"]["expression"]
    saved = str(tmp_path / "plain" / "enformer_toy.safetensors")
    warm, summary = _train_toy(fixture_dir, tmp_path / "warm", "--init", saved)
    assert warm[0]["loss"] != plain[0]["loss"] and summary["optimizer"]["init"].endswith("enformer_toy.safetensors")
    with pytest.raises(ValueError, match="--init: expected weights of the model being trained"):
        train.main(["--model", "alphagenome", "--size", "toy", "--steps", "2", "--fixture", str(fixture_dir),
                    "--weights-dir", str(tmp_path), "--log-dir", str(tmp_path), "--device", "cpu",
                    "--init", saved])


def test_tss_windows_and_tss_share(fixture_dir, tmp_path):
    """windows_with_tss picks the windows whose output bins (not the flanks) hold a TSS; --tss-share draws that
    share of each batch from them, changes the run, and is recorded."""
    from kvbound.eval.windows import windows_with_tss

    mask = windows_with_tss(np.array([0, 10, 20, 30]), np.array([15, 40]), window_bins=20, target_bins=10)
    assert mask.tolist() == [False, True, False, True]  # outputs [5, 15) [15, 25) [25, 35) [35, 45)

    plain, _ = _train_toy(fixture_dir, tmp_path / "plain", batch=4)
    focused, summary = _train_toy(fixture_dir, tmp_path / "tss", "--tss-share", "0.5", batch=4)
    assert summary["optimizer"]["tss_share"] == 0.5 and summary["optimizer"]["tss_windows"] > 0
    assert focused[0]["loss"] != plain[0]["loss"]
    with pytest.raises(SystemExit, match="--tss-share"):
        train.main(["--model", "enformer", "--tss-share", "1.5"])


def test_train_stops_cleanly_at_its_time_budget(fixture_dir, tmp_path):
    from kvbound.eval.models import load_model

    budget = 5.0
    argv = [
        "--model",
        "alphagenome",
        "--size",
        "toy",
        "--steps",
        "100000",
        "--time-budget-s",
        str(budget),
        "--batch-size",
        "1",
        "--fixture",
        str(fixture_dir),
        "--weights-dir",
        str(tmp_path),
        "--log-dir",
        str(tmp_path),
        "--log-every",
        "3",
        "--eval-every",
        "1000",
        "--eval-windows",
        "1",
        "--device",
        "cpu",
    ]
    assert train.main(argv) == 0
    summary = json.loads((tmp_path / "train_alphagenome_toy.json").read_text())
    assert summary["stopped_by"] == "time_budget" and 1 <= summary["steps_reached"] < 100000
    # the budget counts data loading; the loop stops with room for the closing validation and the save
    assert summary["total_seconds"] <= budget + 3.0 or summary["steps_reached"] == 1
    rows = _rows(tmp_path / "train_alphagenome_toy.csv")
    assert int(rows[-1]["step"]) == summary["steps_reached"] and rows[-1]["valid_pearson_mean"] != ""
    assert [int(row["step"]) for row in rows[:-1]] == list(range(3, 3 * len(rows) - 2, 3))
    _, metadata = load_model(str(tmp_path / "alphagenome_toy.safetensors"))
    assert metadata["steps_reached"] == summary["steps_reached"] and metadata["stopped_by"] == "time_budget"
    assert metadata["seed"] == 0 and metadata["time_budget_s"] == budget
    assert metadata["best_step"] == summary["best"]["step"]


def test_eval_end_to_end_with_trained_weights(fixture_dir, tmp_path):
    weights = tmp_path / "weights"
    for kind in ("enformer", "alphagenome"):
        for extra in ([], ["--no-attention"]):
            argv = [
                "--model",
                kind,
                "--size",
                "toy",
                "--steps",
                "3",
                "--batch-size",
                "2",
                "--fixture",
                str(fixture_dir),
                "--weights-dir",
                str(weights),
                "--log-dir",
                str(tmp_path / "logs"),
                "--eval-every",
                "3",
                "--eval-windows",
                "2",
                "--device",
                "cpu",
                *extra,
            ]
            assert train.main(argv) == 0
    out = tmp_path / "results"
    argv = [
        "--fixture",
        str(fixture_dir),
        "--weights-dir",
        str(weights),
        "--out",
        str(out),
        "--windows",
        "2",
        "--max-variants",
        "30",
        "--settings",
        "default,paired,paired_tau,ablation,floor",
        "--block-size",
        "16",
        "--layer-windows",
        "1",
        "--scaling",
        "1,2",
        "--scaling-windows",
        "1",
        "--scaling-variants",
        "12",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    rows = _rows(out / "quality.csv")
    models = {row["model"] for row in rows}
    layers = _rows(out / "layers.csv")
    assert {(row["model"], int(row["layer"])) for row in layers} == {
        (f"{kind}_toy", layer) for kind in ("enformer", "alphagenome") for layer in (0, 1)
    }
    for row in layers:
        assert int(row["bound_violations"]) == 0 and float(row["max_q_l1"]) > 0
        assert 0 < float(row["max_logit_error"]) <= float(row["logit_bound_measured_k"])
        assert float(row["logit_bound_measured_k"]) <= float(row["logit_bound_tau"])
        assert float(row["logit_bound_tau"]) == pytest.approx(float(row["max_q_l1"]) * 2.0**-5, rel=1e-5)
    scaling = _rows(out / "scaling.csv")
    assert {(row["model"], int(row["window_bins"])) for row in scaling} == {
        (f"{kind}_toy", bins) for kind in ("enformer", "alphagenome") for bins in (64, 128)
    }
    for row in scaling:
        assert int(row["bound_violations"]) == 0 and float(row["ratio"]) > 1.0
        assert int(row["target_bins"]) == int(row["window_bins"]) - 32  # the training edge margin kept
        assert 0 < float(row["max_abs_prediction_change"]) < 1.0
    assert models == {"enformer_toy", "enformer_noattn_toy", "alphagenome_toy", "alphagenome_noattn_toy"}
    assert all(row["weights"].startswith("trained") for row in rows)
    by = {(row["model"], row["setting"]): row for row in rows}
    for kind in ("enformer", "alphagenome"):
        exact = by[(f"{kind}_toy", "exact")]
        assert float(exact["ratio"]) == 1.0 and float(exact["auroc_drop"]) == 0.0
        assert float(exact["auroc_drop_low"]) == 0.0 == float(exact["auroc_drop_high"])  # paired with itself
        default = by[(f"{kind}_toy", "default r8 b4")]
        assert float(default["auroc_drop_low"]) <= float(default["auroc_drop"]) <= float(default["auroc_drop_high"])
        assert int(default["bound_violations"]) == 0
        assert 0 < float(default["max_abs_error_k"]) <= 2.0**-5 and 0 < float(default["max_abs_error_v"]) <= 2.0**-5
        assert float(default["ratio"]) > 1.0
        assert 0.0 <= float(default["auroc_all"]) <= 1.0 and int(default["variants"]) > 0
        for name in ("default r8 b4, anchored", "default r8 b4, anchored to changes"):
            paired = by[(f"{kind}_toy", name)]
            assert int(paired["bound_violations"]) == 0 and float(paired["max_abs_error_k"]) <= 2.0**-5
            # windows have no pairs: their predictions (Pearson) are the default config's, only variants differ
            assert paired["pearson_mean"] == default["pearson_mean"]
            assert paired["effect_median_negatives"] != default["effect_median_negatives"]
        codes, changes = (by[(f"{kind}_toy", f"default r8 b4, anchored{tail}")] for tail in ("", " to changes"))
        assert codes["effect_median_positives"] != changes["effect_median_positives"]  # the source is used
        wide = by[(f"{kind}_toy", "default r8 b4, anchored to changes, float32 K/V")]
        assert int(wide["bound_violations"]) == 0 and float(wide["max_abs_error_k"]) <= 2.0**-5
        assert (wide["kv_storage"], changes["kv_storage"], by[(f"{kind}_toy", "exact")]["kv_storage"]) == (
            "float32", "bfloat16", "")
        assert wide["effect_median_positives"] != changes["effect_median_positives"]  # encoded from float32
        for e in (-6, -7):  # the anchored tau sweep: within its own, smaller bound
            fine = by[(f"{kind}_toy", f"r8 b4 tau 2^{e}, anchored to changes, float32 K/V")]
            assert fine["group"] == "paired_tau" and float(fine["tau"]) == 2.0**e
            assert int(fine["bound_violations"]) == 0 and float(fine["max_abs_error_k"]) <= 2.0**e
        low_rank = by[(f"{kind}_toy", "low-rank only r8")]
        assert float(low_rank["max_abs_error_k"]) > 2.0**-5  # no bound without the residual
        assert {row["setting"] for row in rows if row["model"] == f"{kind}_noattn_toy"} == {"exact"}
    effects = _rows(out / "effects.csv")
    variants = _rows(out / "variants.csv")
    for row in rows:  # one predicted change per variant and setting, matching the variant list
        mine = [e for e in effects if e["model"] == row["model"] and e["setting"] == row["setting"]]
        assert [(e["position"], e["alt"]) for e in mine] == [(v["position"], v["alt"]) for v in variants]
        medians = np.median([abs(float(e["effect"])) for e in mine if e["label"] == "0"])
        assert medians == pytest.approx(float(row["effect_median_negatives"]), rel=1e-4, abs=1e-12)  # CSV digits
    strata = _rows(out / "quality_by_stratum.csv")
    # toy windows (64 bins) reach 3,968 bp from the TSS: the 2-5 kb stratum is cut there, 5-8 kb is out of reach
    assert {row["stratum"] for row in strata} == {"all", "0-2kb", "2-3kb"}
    assert all(int(row["positives"]) > 0 for row in strata)
    assert (out / "pareto.png").stat().st_size > 10_000
    meta = json.loads((out / "eval_run.json").read_text())
    assert meta["data"].startswith("fixture") and set(meta["models"]) == models


def test_eval_says_when_weights_are_random(fixture_dir, tmp_path, capsys):
    out = tmp_path / "results"
    argv = [
        "--fixture",
        str(fixture_dir),
        "--weights-dir",
        str(tmp_path / "none"),
        "--out",
        str(out),
        "--models",
        "alphagenome",
        "--windows",
        "1",
        "--max-variants",
        "9",
        "--settings",
        "default",
        "--block-size",
        "16",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    rows = _rows(out / "quality.csv")
    assert {row["weights"] for row in rows} == {"random (untrained)"}
    assert "RANDOM" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "nosuch"], r"--device: expected a torch device such as cpu or cuda, got 'nosuch'"),
        (["--batch-size", "-1"], r"--batch-size: expected a value >= 1, got -1"),
        (["--windows", "0"], r"--windows: expected a value >= 1, got 0"),
        (["--models", "enformer,nosuch"], r"--models: expected a comma list of enformer and alphagenome"),
        (["--settings", "default,bogus"], r"--settings: expected all or a comma list of .*, got \['bogus'\]"),
        (["--codec-impl", "fast"], r"--codec-impl: expected eager, triton or auto, got 'fast'"),
        (["--test-chromosomes", "22", "X"], r"--test-chromosomes: expected X first"),
    ],
)
def test_eval_refuses_bad_arguments_before_loading_anything(args, message, tmp_path, capsys):
    """Checked before the data and models load (a missing cache would otherwise be reported first)."""
    with pytest.raises(SystemExit) as info:
        cli.main(["--cache", str(tmp_path / "no-cache"), "--out", str(tmp_path / "out"), *args])
    assert info.value.code == 2
    assert re.search(r"kvbound eval: error: " + message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_eval_without_its_data_says_what_to_run(tmp_path, capsys):
    assert cli.main(["--cache", str(tmp_path / "no-cache"), "--out", str(tmp_path / "out"), "--device", "cpu"]) == 1
    assert "kvbound.eval.data fetch" in capsys.readouterr().err
