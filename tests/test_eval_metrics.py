"""Metrics against values computed by hand."""

import math

import numpy as np
import pytest

from kvbound.eval.metrics import auroc, pearson, pearson_per_track, stratified_auroc


def test_auroc_hand_computed():
    # positives 0.35, 0.8 vs negatives 0.1, 0.4: pairs won 1 + 0 + 1 + 1 = 3 of 4
    assert auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)
    # ties count 1/2: positives {1, 2}, negatives {1, 0} -> (0.5 + 1 + 1 + 1) / 4
    assert auroc([1, 0, 1, 0], [1, 1, 2, 0]) == pytest.approx(0.875)
    assert auroc([1, 1, 0], [5.0, 5.0, 5.0]) == pytest.approx(0.5)


def test_auroc_extremes_and_brute_force():
    assert auroc([0, 0, 1, 1], [1, 2, 3, 4]) == 1.0
    assert auroc([0, 0, 1, 1], [4, 3, 2, 1]) == 0.0
    assert math.isnan(auroc([1, 1], [0.2, 0.3]))
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    scores = rng.integers(0, 10, 200).astype(float)  # many ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (pos.size * neg.size)
    assert auroc(labels, scores) == pytest.approx(brute, abs=1e-12)


def test_auroc_rejects_bad_input():
    with pytest.raises(ValueError, match="0 or 1"):
        auroc([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="finite"):
        auroc([0, 1], [0.1, float("nan")])


def test_stratified_auroc():
    out = stratified_auroc([1, 0, 1, 0], [0.9, 0.1, 0.2, 0.3], ["near", "near", "far", "far"])
    assert out == {"all": pytest.approx(0.75), "near": 1.0, "far": 0.0}


def test_pearson_hand_computed():
    # x = [1, 2, 3], y = [1, 3, 2]: centred (-1, 0, 1) . (-1, 1, 0) = 1; norms sqrt(2) * sqrt(2)
    assert pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert pearson([1, 2, 3], [-2, -4, -6]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="finite"):
        pearson([1, 2, float("inf")], [1, 2, 3])


def test_pearson_per_track():
    prediction = np.array([[1.0, 1.0], [2.0, 3.0], [3.0, 2.0]])
    target = np.array([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]])
    np.testing.assert_allclose(pearson_per_track(prediction, target), [1.0, 0.5])
    with pytest.raises(ValueError, match="bins, tracks"):
        pearson_per_track(prediction, target[:, :1])


def test_auroc_drop_interval_is_paired_and_covers_the_drop():
    """Identical scores give a zero-width interval at 0 (the pairing: both settings are read at the same
    resampled variants); a setting that adds noise to the scores gives an interval around the observed drop."""
    from kvbound.eval.metrics import auroc_drop_interval

    rng = np.random.default_rng(3)
    labels = np.array([1] * 60 + [0] * 120)
    exact = np.where(labels == 1, rng.normal(2.0, 1.0, labels.size), rng.normal(0.0, 1.0, labels.size))
    assert auroc_drop_interval(labels, exact, exact) == (0.0, 0.0)
    noisy = exact + rng.normal(0.0, 1.5, labels.size)
    low, high = auroc_drop_interval(labels, exact, noisy, resamples=800)
    drop = auroc(labels, exact) - auroc(labels, noisy)
    assert low < drop < high and low > 0.0  # this much noise is a resolved loss
    assert np.isnan(auroc_drop_interval(np.zeros(5), exact[:5], noisy[:5])[0])
    with pytest.raises(ValueError, match="one length"):
        auroc_drop_interval(labels, exact, noisy[:-1])
