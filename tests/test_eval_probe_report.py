"""The per-layer logit probe, the fidelity metrics and the EVAL.md generator."""

import csv
import json
import math

import numpy as np
import pytest
import torch

from kvbound.eval import kv_hooks, report
from kvbound.eval.fidelity import _real_window, sqnr_db
from kvbound.eval.models import ModelConfig, build_model


class _ShiftHook:
    """Returns bf16(k) + shift and bf16(v) + shift (a constant), as a stand-in codec whose error is known exactly."""

    storage = torch.bfloat16

    def __init__(self, shift: float, tau: float):
        self.shift = shift
        self.config = type("Config", (), {"tau": tau})()

    def __call__(self, layer, k, v):
        self.last_decoded = {name: x.to(torch.bfloat16).double() + self.shift for name, x in (("k", k), ("v", v))}
        self.last_error = {name: abs(self.shift) for name in ("k", "v")}
        # what the model consumes: the decoded K and V rounded to bf16 (as under autocast on the GPU)
        return tuple(self.last_decoded[name].to(torch.bfloat16).to(x.dtype) for name, x in (("k", k), ("v", v)))


@pytest.mark.parametrize("kind", ["enformer", "alphagenome"])
@pytest.mark.parametrize(("shift", "tau"), [(2.0**-7, 2.0**-6), (2.0**-5, 2.0**-8)])
def test_logit_probe_measures_the_logit_change_exactly(kind, shift, tau):
    """Every key moved by one known shift: the probe's maxima are the exact logit change, query 1-norm and K error.
    A shift below tau keeps every row within the Hoelder bound ``||q_eff||_1 * tau``; a shift of 4 tau breaks it in
    the rows whose effective query sums to more than a quarter of its 1-norm, and the probe counts the call."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.toy(kind, 5, window_bins=48, target_bins=16), seed=1).double().eval()
    seen = []

    def spy(q, k, v, *rest):  # runs as the probe's "original" attention: records q and the content bias
        seen.append((q.detach().clone(), rest[1].detach().clone() if kind == "enformer" else None))
        return original(q, k, v, *rest)

    original = model.attention[0].attention_fn
    probe = kv_hooks.LogitProbe(_ShiftHook(shift, tau=tau), kind)
    with kv_hooks.install(model, lambda layer, k, v: (k, v), spy):
        with kv_hooks.install(model, probe.kv_hook, probe.attention_fn(model)), torch.no_grad():
            model(torch.nn.functional.one_hot(torch.randint(0, 4, (1, 48 * 128)), 4).double().transpose(1, 2))
    assert sorted(probe.records) == [0, 1] and len(seen) == 2
    for layer, (q, bias) in enumerate(seen):
        dk = q.shape[-1]
        query = q + bias[:, None] if kind == "enformer" else q * dk**-0.5
        # every key moved by the same shift: the logit change of row i is -shift * sum_d q_eff[i, d]
        expected_error = shift * float(query.sum(-1).abs().max())
        record = probe.records[layer]
        assert record["max_logit_error"] == pytest.approx(expected_error, rel=1e-9)
        assert record["max_q_l1"] == pytest.approx(float(query.abs().sum(-1).max()), rel=1e-12)
        assert record["max_abs_error_k"] == pytest.approx(shift, rel=1e-9)
        # rows beyond the bound, by the same formula in float64 here: none while shift < tau, some at 4 tau
        beyond = int((shift * query.sum(-1).abs() > tau * query.abs().sum(-1)).sum())
        assert (beyond > 0) == (shift > tau), beyond
        assert record["logit_violations"] == int(beyond > 0)  # one call per layer, counted once whatever its rows
        # K and V decoded beyond tau: counted per tensor whatever the queries (every element moved by the shift)
        assert record["max_abs_error_v"] == pytest.approx(shift, rel=1e-9)
        assert record["bound_violations"] == (2 if shift > tau else 0)
        # rounding the decoded K to bf16 moves the consumed logits by a different amount, measured apart
        assert record["max_logit_error_consumed"] != pytest.approx(expected_error, rel=1e-6)


def test_logit_probe_needs_its_kv_hook():
    model = build_model(ModelConfig.toy("alphagenome", 5, window_bins=32, target_bins=16), seed=0).eval()
    probe = kv_hooks.LogitProbe(_ShiftHook(0.0, 1.0), "alphagenome")
    with kv_hooks.install(model, lambda layer, k, v: (k, v), probe.attention_fn(model)):
        without_hook = r"^LogitProbe: attention ran without its K/V hook; install probe.kv_hook too$"
        with pytest.raises(RuntimeError, match=without_hook):
            model(torch.zeros(1, 4, 32 * 128))
    with pytest.raises(ValueError, match=r"^kind: expected 'enformer' or 'alphagenome', got 'borzoi'$"):
        kv_hooks.LogitProbe(_ShiftHook(0.0, 1.0), "borzoi")


def test_sqnr_and_real_window():
    reference = torch.tensor([3.0, 4.0])
    result = sqnr_db(reference + torch.tensor([0.3, -0.4]), reference)
    assert result["sqnr_db"] == pytest.approx(20.0) and result["max_abs_error"] == pytest.approx(0.4)
    assert result["rel_error"] == pytest.approx(0.1)
    assert sqnr_db(reference, reference)["sqnr_db"] == math.inf
    assert not sqnr_db(reference * math.nan, reference)["finite"]
    with pytest.raises(ValueError, match=r"^out: expected shape \(2,\) as the reference, got \(1,\)$"):
        sqnr_db(reference[:1], reference)
    codes = np.array([0, 1, 4, 2, 3, 0, 1, 4, 2, 2, 2, 2], dtype=np.uint8)
    np.testing.assert_array_equal(_real_window(codes, 4, 0), [2, 3, 0, 1])
    np.testing.assert_array_equal(_real_window(codes, 3, 5), [2, 2, 2])
    with pytest.raises(ValueError, match=r"^no N-free window of 5 bp at or after 0 in a sequence of 12 bp$"):
        _real_window(codes, 5, 0)


def _write(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _quality_row(model, group, setting, tau, auroc_drop, pearson_drop, method="codec"):
    return {
        "model": model, "weights": f"trained: {model}.safetensors", "group": group, "setting": setting,
        "method": method, "tau": tau, "ratio": 4.0 if method != "exact" else 1.0, "max_abs_error_k": 0.01,
        "max_abs_error_v": 0.01, "bound_violations": 0, "pearson_mean": 0.8, "pearson_expression": 0.7,
        "pearson_expression_tss": 0.6, "pearson_mean_drop_pct": pearson_drop, "pearson_expression_drop_pct": 0.0,
        "auroc_all": 0.9 - auroc_drop, "auroc_drop": auroc_drop, "auroc_0-10kb": 0.9, "windows": 32,
        "variants": 300,
    }  # fmt: skip


def test_report_flags_breaches_and_chooses_tau(tmp_path):
    rows = []
    for model in ("enformer", "alphagenome"):
        rows.append(_quality_row(model, "exact", "exact", "nan", 0.0, 0.0, method="exact"))
        rows.append(_quality_row(model, "default", "default r8 b4", 2.0**-5, 0.001, 0.1))
        for exponent, auroc_drop in ((-6, 0.0), (-5, 0.001), (-4, 0.003 if model == "enformer" else 0.0),
                                     (-3, 0.02)):  # fmt: skip
            rows.append(_quality_row(model, "sweep_tau", f"tau 2^{exponent}", 2.0**exponent, auroc_drop, 0.2))
    rows.append(_quality_row("enformer_noattn", "exact", "exact", "nan", 0.0, 0.0, method="exact"))
    _write(tmp_path / "quality.csv", rows)
    (tmp_path / "eval_run.json").write_text(json.dumps({"data": "GRCh37 chrX", "skipped": ["x scaling x4"]}))
    text = report.render(tmp_path)
    assert text.count("**BREACH: AUROC drop > 0.004**") == 2  # tau 2^-3 on both models
    assert "Chosen: tau = 2^-4" in text and "confirms" not in text.split("Chosen:")[1].split("\n")[0]
    assert "| enformer_noattn |" in text and "| enformer |" in text  # the no-attention comparison
    assert "- enformer minus enformer_noattn: Pearson mean +0.000" in text
    assert "Not run yet: `bash eval/gpu_eval.sh fidelity`" in text and "x scaling x4" in text
    assert "RANDOM" not in text
    assert "AUROC is not informative" not in text  # exact AUROC 0.9
    at_chance = [dict(r, auroc_all=0.52) if r["model"] == "alphagenome" and r["method"] == "exact" else r for r in rows]
    _write(tmp_path / "quality.csv", at_chance)
    assert "**AUROC is not informative for alphagenome**" in report.render(tmp_path)
    assert "Positive control" not in report.render(tmp_path)  # older quality.csv: no control columns
    controls = [dict(r, effect_median_positives=6.5e-5, effect_median_negatives=4.5e-5, effect_pearson_positives=0.23)
                for r in at_chance]  # fmt: skip
    _write(tmp_path / "quality.csv", controls)
    assert "| alphagenome | 6.50e-05 | 4.50e-05 | 0.230 | 0.5200 |" in report.render(tmp_path)
    # The noise floor on negatives, exact against compressed, for the attention models only.
    noisy = [dict(r, effect_median_negatives=1.8e-4) if r["setting"] == "default r8 b4" else r for r in controls]
    _write(tmp_path / "quality.csv", noisy)
    text = report.render(tmp_path)
    assert "### Why compression costs AUROC here" in text
    # without effects.csv the change errors are unknown
    assert "| enformer | default r8 b4 | 0.03125 | 4.00 | 1.80e-04 | 4.00x | 6.50e-05 | n/a | n/a | 0.8990 |" in text
    assert "| enformer_noattn | exact" not in text.split("### Why compression")[1].split("##")[0]
    _write(tmp_path / "quality.csv", at_chance)
    assert "float32 (shorter rerun)" not in report.render(tmp_path)
    (tmp_path / "variants_fp32").mkdir()
    _write(tmp_path / "variants_fp32" / "quality.csv", at_chance)
    text = report.render(tmp_path)
    assert "## Variant effects scored in float32 (shorter rerun)" in text
    assert "Still at chance level in float32" not in text  # enformer's exact AUROC is 0.9 there
    _write(tmp_path / "variants_fp32" / "quality.csv", [dict(r, auroc_all=0.5) for r in rows])
    assert "Still at chance level in float32" in report.render(tmp_path)
    tau, reason = report.choose_tau(rows)
    assert tau == 2.0**-4 and "largest" in reason
    # no tau within target: the least worst-case loss, and the reason says so
    worse = [dict(r, auroc_drop=float(r["auroc_drop"]) + 0.01) if r["group"] == "sweep_tau" else r for r in rows]
    tau, reason = report.choose_tau(worse)
    assert tau == 2.0**-6 and reason.startswith("no swept tau")
    assert report.choose_tau([r for r in rows if r["group"] != "sweep_tau"])[0] is None


def test_report_on_empty_results_names_the_commands(tmp_path):
    text = report.render(tmp_path)
    assert "Not run yet: `kvbound eval` (quality.csv)." in text
    assert "Not run yet: `bash eval/gpu_run.sh`" in text
    out = tmp_path / "EVAL.md"
    assert report.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text() == text


def test_fidelity_smoke_on_fixture_dna(tmp_path):
    pytest.importorskip("enformer_pytorch", reason="the Enformer port (enformer-pytorch==0.8.12) is not installed")
    from kvbound.eval import fidelity

    out = tmp_path / "fidelity.csv"
    argv = ["--fixture", str(tmp_path / "fixture"), "--cpu-smoke", "--ports", "enformer", "--device", "cpu"]
    assert fidelity.main([*argv, "--out", str(out)]) == 0
    with open(out, newline="") as handle:
        rows = {row["variant"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"patch-dense", "patch-compressed"}
    assert all(row["weights"].endswith("weak evidence") and "fixture" in row["input"] for row in rows.values())
    dense, compressed = rows["patch-dense"], rows["patch-compressed"]
    assert int(compressed["patched_modules"]) == 2 and float(compressed["kv_ratio_mean"]) > 1.0
    # the widths the layers used: Enformer's relative-position layers keep config.bits
    assert compressed["code_widths"] == "code widths 4 (not calibrated: relative positions)"
    assert dense["code_widths"] == ""
    # exact K/V through kvbound's attention is closer to the port than compressed K/V, and both are close
    assert float(dense["vs_unpatched_sqnr_db"]) > float(compressed["vs_unpatched_sqnr_db"]) > 20.0
    assert 0 < float(compressed["vs_dense_max_abs_error"]) and float(compressed["vs_dense_sqnr_db"]) > 20.0


def test_change_errors_match_each_variant_to_its_exact_change():
    def row(setting, gene, position, label, effect):
        return {"model": "m", "setting": setting, "gene": gene, "position": str(position), "alt": "A",
                "label": str(label), "effect": str(effect)}

    effects = [
        row("exact", "g", 1, 0, 0.010), row("exact", "g", 2, 0, -0.020), row("exact", "g", 2, 0, 0.030),  # a repeat
        row("exact", "h", 9, 1, 0.500),
        # the compressed rows come in another order: matched by gene, position, allele and repeat, not by row
        row("codec", "h", 9, 1, 0.450), row("codec", "g", 2, 0, -0.021), row("codec", "g", 1, 0, 0.014),
        row("codec", "g", 2, 0, 0.036),
    ]
    errors = report.change_errors(effects)
    assert set(errors) == {("m", "codec")}
    negatives, positives = errors[("m", "codec")]
    assert negatives == pytest.approx(0.004)  # median of 0.004, 0.001 and 0.006
    assert positives == pytest.approx(0.05)


def test_report_pools_the_test_chromosomes_when_present(tmp_path):
    """quality.csv from `kvbound eval --test-chromosomes X 22`: a table of the chrX, chr22 and pooled AUROC drops,
    judged on the pooled one; without those columns no such table."""
    rows = [_quality_row("enformer", "exact", "exact", "nan", 0.0, 0.0, method="exact"),
            _quality_row("enformer", "default", "default r8 b4", 2.0**-5, 0.006, 0.1),
            _quality_row("enformer", "sweep_tau", "tau 2^-7", 2.0**-7, 0.001, 0.1)]  # fmt: skip
    _write(tmp_path / "quality.csv", rows)
    assert "Pooled over the test chromosomes" not in report.render(tmp_path)
    pooled = {"default r8 b4": (0.001, 0.0035, -0.001, 0.008), "tau 2^-7": (-0.002, -0.0005, -0.004, 0.003)}
    blank = dict.fromkeys(("auroc_drop_chr22", "auroc_drop_pooled", "auroc_drop_pooled_low", "auroc_drop_pooled_high",
                           "positives_pooled", "variants_pooled"), "")  # fmt: skip
    pearson_22 = {"exact": 0.8, "default r8 b4": 0.796, "tau 2^-7": 0.8}
    extended = [
        dict(r, **blank, pearson_expression_chr22=0.8) if r["method"] == "exact"
        else dict(r, auroc_drop_chr22=pooled[r["setting"]][0], pearson_expression_chr22=pearson_22[r["setting"]],
                                             auroc_drop_pooled=pooled[r["setting"]][1],
                                             auroc_drop_pooled_low=pooled[r["setting"]][2],
                                             auroc_drop_pooled_high=pooled[r["setting"]][3],
                                             positives_pooled=727, variants_pooled=2181)
        for r in rows
    ]  # fmt: skip
    _write(tmp_path / "quality.csv", extended)
    text = report.render(tmp_path)
    section = text.split("### Pooled over the test chromosomes")[1].split("\n#")[0]
    assert "| dAUROC chrX test | dAUROC chr22 | dPearson expr % chr22 | dAUROC pooled |" in section
    # the chr22 Pearson drop is relative to the exact row's: (0.8 - 0.796) / 0.8 = 0.5 %
    assert "| enformer | default r8 b4 | 0.03125 | +0.0060 | +0.0010 | +0.500 | +0.0035 [-0.0010, +0.0080] | 727 | " \
           "2181 | within target |" in section  # fmt: skip
    assert "| enformer | tau 2^-7 | 0.00781 | +0.0010 | -0.0020 | +0.000 | -0.0005 [-0.0040, +0.0030] |" in section
    assert "BREACH" not in section
    breach = [dict(r, auroc_drop_pooled=0.0045) if r["setting"] == "tau 2^-7" else r for r in extended]
    _write(tmp_path / "quality.csv", breach)
    section = report.render(tmp_path).split("### Pooled over the test chromosomes")[1].split("\n#")[0]
    assert section.count("**BREACH: AUROC drop > 0.004**") == 1
    undefined = [dict(r, auroc_drop_pooled="nan") if r["setting"] == "tau 2^-7" else r for r in extended]
    _write(tmp_path / "quality.csv", undefined)
    section = report.render(tmp_path).split("### Pooled over the test chromosomes")[1].split("\n#")[0]
    assert "| n/a [-0.0040, +0.0030] | 727 | 2181 | n/a |" in section  # no verdict on an undefined drop


def test_report_reads_the_pooled_table_from_a_separate_heldout_run(tmp_path):
    """The held-out run may write its own directory (eval/results/heldout) so that the main run keeps its sweeps:
    the pooled table then comes from there, names that run, and the main run's own pooled columns win when present."""
    main_rows = [_quality_row("enformer", "exact", "exact", "nan", 0.0, 0.0, method="exact"),
                 _quality_row("enformer", "default", "default r8 b4", 2.0**-5, 0.006, 0.1)]  # fmt: skip
    _write(tmp_path / "quality.csv", main_rows)
    (tmp_path / "heldout").mkdir()
    heldout = [dict(r, auroc_drop_chr22=0.002, auroc_drop_pooled=0.0041, auroc_drop_pooled_low=-0.001,
                    auroc_drop_pooled_high=0.009, positives_pooled=727, variants_pooled=2181)
               for r in main_rows]  # fmt: skip
    _write(tmp_path / "heldout" / "quality.csv", heldout)
    run = {"date": "2026-12-01T02:00:00+00:00", "commit": "abc1234", "device": "cuda (NVIDIA H200)", "seconds": 512.0,
           "argv": ["--test-chromosomes", "X", "22"], "skipped": ["alphagenome paired_tau: time budget"]}  # fmt: skip
    (tmp_path / "heldout" / "eval_run.json").write_text(json.dumps(run))
    section = report.render(tmp_path).split("### Pooled over the test chromosomes")[1].split("\n#")[0]
    assert "From a separate run in `heldout/`" in section and "commit abc1234" in section
    assert "Skipped by its time budget: alphagenome paired_tau: time budget." in section
    assert "| enformer | default r8 b4 | 0.03125 | +0.0060 | +0.0020 | n/a | +0.0041 [-0.0010, +0.0090] | 727 | 2181 " \
           "| **BREACH: AUROC drop > 0.004** |" in section  # fmt: skip (no chr22 Pearson in these rows: n/a)
    assert section.count("| enformer |") == 1  # the exact row is not a setting to judge
    # the main run's own pooled columns take precedence over the separate run
    _write(tmp_path / "quality.csv", [dict(r, auroc_drop_chr22=0.0, auroc_drop_pooled=0.001, auroc_drop_pooled_low=0.0,
                                           auroc_drop_pooled_high=0.002, positives_pooled=1, variants_pooled=3)
                                      for r in main_rows])  # fmt: skip
    section = report.render(tmp_path).split("### Pooled over the test chromosomes")[1].split("\n#")[0]
    assert "separate run" not in section and "| +0.0010 [+0.0000, +0.0020] | 1 | 3 | within target |" in section


def test_pooled_variant_tau_takes_the_largest_tau_within_target_on_every_model():
    """The tau rule on the variant-scoring rows (anchored to changes, float32 K/V), judged on the pooled drop: a
    tau breached by one model, or run on only one, does not qualify; rows scored otherwise are not read."""

    def row(model, tau, pooled, anchored="changes", storage="float32", pearson=0.0):
        return dict(_quality_row(model, "paired_tau", f"tau {tau}", tau, 0.0, pearson), anchored=anchored,
                    kv_storage=storage, auroc_drop_pooled=pooled)  # fmt: skip

    rows = [row("enformer", 2.0**-4, 0.001), row("alphagenome", 2.0**-4, 0.0045),  # breach on one model
            row("enformer", 2.0**-5, -0.002), row("alphagenome", 2.0**-5, 0.0028),
            row("enformer", 2.0**-6, 0.0),
            row("enformer", 2.0**-3, 0.0, anchored="codes"), row("alphagenome", 2.0**-3, 0.0, storage="bfloat16")]
    tau, texts = report.pooled_variant_tau(rows)
    assert tau == 2.0**-5
    assert texts == ["2^-4: alphagenome +0.0045, enformer +0.0010 (breach)",
                     "2^-5: alphagenome +0.0028, enformer -0.0020 (within target)",
                     "2^-6: enformer +0.0000 (within target, not run on every model)"]  # fmt: skip
    assert report.pooled_variant_tau([dict(r, pearson_mean_drop_pct=0.7) for r in rows[2:4]])[0] is None
    assert report.pooled_variant_tau([dict(r, auroc_drop_pooled="") for r in rows]) == (None, [])
