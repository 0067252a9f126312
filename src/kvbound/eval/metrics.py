"""Quality metrics: per-track Pearson on held-out bins and variant-effect AUROC, stratified by distance.

Plain numpy (float64); no scikit-learn.
"""

from __future__ import annotations

import numpy as np

__all__ = ["auroc", "auroc_drop_interval", "pearson", "pearson_per_track", "stratified_auroc"]


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two equally long vectors (NaN when either is constant)."""
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"pearson: x and y must have the same length, got {x.size} and {y.size}")
    if x.size < 2:
        raise ValueError(f"pearson: expected at least 2 values, got {x.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("pearson: x and y must be finite")
    xc, yc = x - x.mean(), y - y.mean()
    denominator = np.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float((xc * yc).sum() / denominator) if denominator > 0 else float("nan")


def pearson_per_track(prediction: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``[bins, tracks]`` prediction and target -> ``[tracks]`` Pearson over bins."""
    prediction = np.asarray(prediction)
    target = np.asarray(target)
    if prediction.shape != target.shape or prediction.ndim != 2:
        raise ValueError(
            f"pearson_per_track: expected two equal [bins, tracks] arrays, got {prediction.shape} and {target.shape}"
        )
    return np.array([pearson(prediction[:, t], target[:, t]) for t in range(target.shape[1])])


def auroc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative), ties count 1/2.

    Computed from average ranks (Mann-Whitney U). NaN when one class is absent.
    """
    labels = np.asarray(labels).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"auroc: labels and scores must have the same length, got {labels.size} and {scores.size}")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("auroc: labels must be 0 or 1")
    if not np.isfinite(scores).all():
        raise ValueError("auroc: scores must be finite")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    # 1-based ranks, averaged over each run of tied scores
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = average_rank[inverse]
    rank_sum = ranks[labels == 1].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def auroc_drop_interval(
    labels: np.ndarray,
    scores_reference: np.ndarray,
    scores_other: np.ndarray,
    *,
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Paired bootstrap interval of ``AUROC(reference) - AUROC(other)`` on the same variants.

    Positives and negatives are resampled separately (their counts stay fixed) and both score sets are read at
    the same resampled variants, so the interval reflects how much the drop depends on which variants were
    drawn, with the pairing kept. Returns the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles; NaN when a
    class is absent."""
    labels = np.asarray(labels).ravel()
    reference = np.asarray(scores_reference, dtype=np.float64).ravel()
    other = np.asarray(scores_other, dtype=np.float64).ravel()
    if not (labels.shape == reference.shape == other.shape):
        raise ValueError(
            f"auroc_drop_interval: labels and both score arrays must have one length, got {labels.size}, "
            f"{reference.size} and {other.size}"
        )
    if not 0.0 < level < 1.0:
        raise ValueError(f"auroc_drop_interval: level must be in (0, 1), got {level}")
    positives, negatives = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    if positives.size == 0 or negatives.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    # A resample's AUROC is the mean of the win matrix (1 where a positive outscores a negative, 1/2 on a tie) over
    # its drawn pairs, i.e. counts_pos @ wins @ counts_neg / (P N) with the draw's multiplicities: every resample
    # in one product instead of a rank sort each.
    pos_counts = np.zeros((resamples, positives.size))
    neg_counts = np.zeros((resamples, negatives.size))
    for i in range(resamples):
        pos_counts[i] = np.bincount(rng.integers(0, positives.size, positives.size), minlength=positives.size)
        neg_counts[i] = np.bincount(rng.integers(0, negatives.size, negatives.size), minlength=negatives.size)

    def resampled_auroc(scores: np.ndarray) -> np.ndarray:
        pos, neg = scores[positives][:, None], scores[negatives][None, :]
        wins = (pos > neg) + 0.5 * (pos == neg)
        return ((pos_counts @ wins) * neg_counts).sum(1) / (positives.size * negatives.size)

    drops = resampled_auroc(reference) - resampled_auroc(other)
    low, high = np.quantile(drops, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return float(low), float(high)


def stratified_auroc(labels: np.ndarray, scores: np.ndarray, strata: np.ndarray) -> dict[str, float]:
    """``{"all": auroc, <stratum>: auroc, ...}`` in the order strata first appear."""
    labels, scores, strata = np.asarray(labels), np.asarray(scores), np.asarray(strata)
    out = {"all": auroc(labels, scores)}
    for name in dict.fromkeys(strata.tolist()):
        mask = strata == name
        out[str(name)] = auroc(labels[mask], scores[mask])
    return out
