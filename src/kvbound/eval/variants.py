"""Labelled SNVs from the simulator's ground truth.

For every gene whose TSS (and the model window centred on it) lies in the evaluation split:

* **positives**: SNVs that break a bound site of a cooperating enhancer TF inside an active enhancer bin
  (``e > 0.5``) within reach of the TSS, and change the true expression at the TSS bin by at least
  ``threshold`` (in ``log1p`` expression units, i.e. about ``threshold * 100`` percent). The broken base is
  the site's position with the largest PWM drop, mutated to the least favoured base.
* **negatives**, one of each kind per positive, at a matched distance (within ``match_tolerance_bp`` of the
  positive's distance, either side of the TSS) and with a true change below ``threshold * negative_fraction``:
  ``random`` (a random base substitution) and ``motif`` (breaking the strongest site of any TF in a bin at
  that distance: promoter, enhancer or decoy TF, but one whose loss does not move expression, for example a
  lone enhancer motif without its partner).

Distances are ``|position - tss|``; strata default to 0-10, 10-50 and 50-100 kb, limited by the model window
(a variant must lie inside a window centred on its TSS).
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvbound.eval.data import BASES, CODE_N
from kvbound.eval.simulate import Simulation, Simulator

__all__ = [
    "Variant",
    "VariantConfig",
    "generate_variants",
    "load_or_generate",
    "read_variants",
    "stratum_name",
    "write_variants",
]

# Part of the variant cache key: bump when the selection rules change.
VARIANTS_VERSION = 1


@dataclass(frozen=True)
class VariantConfig:
    threshold: float = 0.02
    negative_fraction: float = 0.1
    strata_bp: tuple[tuple[int, int], ...] = ((0, 10_000), (10_000, 50_000), (50_000, 100_000))
    positives_per_stratum: int = 4  # per gene
    match_tolerance_bp: int = 2_000
    split: str = "test"
    seed: int = 0

    @classmethod
    def fixture(cls, **changes) -> VariantConfig:
        values = dict(strata_bp=((0, 2_000), (2_000, 5_000), (5_000, 8_000)), match_tolerance_bp=500)
        values.update(changes)
        return cls(**values)


@dataclass(frozen=True)
class Variant:
    gene: str
    tss: int
    position: int
    ref: str
    alt: str
    distance: int
    stratum: str
    label: int  # 1 positive, 0 negative
    kind: str  # enhancer_motif | random | motif
    tf: str
    true_effect: float  # alt - ref expression at the TSS bin

    @property
    def alt_code(self) -> int:
        return BASES.index(self.alt)


def stratum_name(low: int, high: int) -> str:
    return f"{low // 1000}-{high // 1000}kb"


def generate_variants(
    simulator: Simulator,
    simulation: Simulation,
    config: VariantConfig,
    *,
    reach_bp: int,
    split_bounds: list[tuple[int, int]],
    progress: bool = False,
) -> list[Variant]:
    """Positives and matched negatives for the genes whose window ``[tss - reach_bp, tss + reach_bp]`` lies
    inside one of ``split_bounds`` (the evaluation split's intervals)."""
    rng = np.random.default_rng(config.seed)
    codes = simulator.data.codes
    size = simulator.config.bin_size
    strata = [(low, min(high, reach_bp)) for low, high in config.strata_bp if low < reach_bp]
    genes = [
        gene
        for gene in simulator.data.genes
        if any(start + reach_bp <= gene.tss < end - reach_bp for start, end in split_bounds)
        and simulation.n_fraction[gene.tss // size] == 0
    ]
    enhancer_tfs = [name for pair in simulator.config.enhancer_pairs for name in pair]
    tf_index = {name: i for i, name in enumerate(simulator.config.tf_names)}
    variants: list[Variant] = []
    iterator = genes
    if progress:
        from rich.progress import track

        iterator = track(genes, description="variants", transient=True)
    for gene in iterator:
        tss_bin = gene.tss // size
        target = np.array([tss_bin])

        def effect(position: int, alt: int, target: np.ndarray = target) -> float:
            ref_x, alt_x = simulator.snv_expression(simulation, position, alt, target)
            return float(alt_x[0] - ref_x[0])

        for low, high in strata:
            # enhancer bins whose centre lies in the stratum, strongest contribution first
            centre_bp = np.arange(tss_bin - high // size - 1, tss_bin + high // size + 2) * size + size // 2
            bins = centre_bp // size
            distance = np.abs(centre_bp - gene.tss)
            keep = (distance >= low) & (distance < high) & (bins >= 0) & (bins < simulation.n_bins)
            bins = bins[keep]
            bins = bins[simulation.enhancer[bins] > 0.5]
            contact = simulator.contact[np.minimum(np.abs(bins - tss_bin), simulator.config.max_range_bins)]
            bins = bins[np.argsort(-(simulation.enhancer[bins] * contact), kind="stable")]
            found = 0
            used: set[int] = set()
            for enhancer_bin in bins:
                if found >= config.positives_per_stratum:
                    break
                site = _strongest_site(simulator, int(enhancer_bin), [tf_index[n] for n in enhancer_tfs])
                if site is None:
                    continue
                position, alt, tf = site
                distance_bp = abs(position - gene.tss)
                if not low <= distance_bp < high or position in used:
                    continue
                used.add(position)
                delta = effect(position, alt)
                if abs(delta) < config.threshold:
                    continue
                stratum = stratum_name(low, high)
                positive = Variant(
                    gene.name,
                    gene.tss,
                    position,
                    BASES[codes[position]],
                    BASES[alt],
                    distance_bp,
                    stratum,
                    1,
                    "enhancer_motif",
                    simulator.config.tf_names[tf],
                    delta,
                )
                negatives = _matched_negatives(simulator, simulation, positive, config, rng, effect, (low, high))
                if len(negatives) < 2:
                    continue
                variants.append(positive)
                variants.extend(negatives)
                found += 1
    return variants


def _strongest_site(simulator: Simulator, centre_bin: int, tf_rows: list[int]) -> tuple[int, int, int] | None:
    """The most occupied site of the TFs ``tf_rows`` starting in bins ``centre_bin - w .. centre_bin + w``,
    and the SNV (position, alt code) that lowers its score the most. ``None`` if nothing is bound."""
    size = simulator.config.bin_size
    w = simulator.config.neighbourhood_bins
    first_bin = centre_bin - w
    n_bins = 2 * w + 1
    piece = simulator.padded_codes(first_bin, n_bins)
    occupancy = simulator.site_occupancy(piece[:-1])[:, : n_bins * size]
    scores = simulator.strand_scores(piece[:-1])[:, :, : n_bins * size]
    rows = np.asarray(tf_rows)
    best = occupancy[rows].reshape(-1).argmax().item()
    row, offset = divmod(best, n_bins * size)
    if occupancy[rows[row], offset] < 0.5:
        return None
    tf = int(rows[row])
    pwm = simulator.pwms[tf]
    forward = bool(scores[0, tf, offset] >= scores[1, tf, offset])
    matrix = pwm if forward else pwm[::-1, ::-1]  # as read along the + strand
    start = first_bin * size + offset
    bases = simulator.data.codes[start : start + matrix.shape[0]]
    if (bases == CODE_N).any():
        return None
    drops = matrix[np.arange(matrix.shape[0]), bases] - matrix.min(axis=1)
    position_in_site = int(np.argmax(drops))
    alt = int(np.argmin(matrix[position_in_site]))
    if alt == bases[position_in_site]:
        return None
    return start + position_in_site, alt, tf


def _matched_negatives(simulator, simulation, positive, config, rng, effect, bounds) -> list[Variant]:
    codes = simulator.data.codes
    size = simulator.config.bin_size
    low, high = bounds
    ceiling = config.threshold * config.negative_fraction
    out = []
    all_tfs = list(range(len(simulator.config.tf_names)))
    for kind in ("random", "motif"):
        for _ in range(40):
            distance = int(
                rng.integers(
                    max(low, positive.distance - config.match_tolerance_bp),
                    min(high, positive.distance + config.match_tolerance_bp + 1),
                )
            )
            position = positive.tss + distance * (1 if rng.random() < 0.5 else -1)
            if not 0 <= position < codes.size or codes[position] == CODE_N or position == positive.position:
                continue
            tf_name = ""
            if kind == "random":
                alt = int((codes[position] + rng.integers(1, 4)) % 4)
            else:
                site = _strongest_site(simulator, position // size, all_tfs)
                if site is None:
                    continue
                position, alt, tf = site
                tf_name = simulator.config.tf_names[tf]
                distance = abs(position - positive.tss)
                if not low <= distance < high or position == positive.position:
                    continue
            delta = effect(position, alt)
            if abs(delta) >= ceiling:
                continue
            out.append(
                Variant(
                    positive.gene,
                    positive.tss,
                    position,
                    BASES[codes[position]],
                    BASES[alt],
                    abs(position - positive.tss),
                    positive.stratum,
                    0,
                    kind,
                    tf_name,
                    delta,
                )
            )
            break
    return out


_FIELDS = ("gene", "tss", "position", "ref", "alt", "distance", "stratum", "label", "kind", "tf", "true_effect")


def write_variants(variants: list[Variant], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(_FIELDS)
        for v in variants:
            writer.writerow([getattr(v, name) if name != "true_effect" else f"{v.true_effect:.6g}" for name in _FIELDS])


def read_variants(path: str | Path) -> list[Variant]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return [
            Variant(
                row["gene"],
                int(row["tss"]),
                int(row["position"]),
                row["ref"],
                row["alt"],
                int(row["distance"]),
                row["stratum"],
                int(row["label"]),
                row["kind"],
                row["tf"],
                float(row["true_effect"]),
            )
            for row in reader
        ]


def load_or_generate(
    simulator: Simulator,
    simulation: Simulation,
    config: VariantConfig,
    *,
    reach_bp: int,
    split_bounds: list[tuple[int, int]],
    cache_dir: str | Path | None,
    progress: bool = False,
) -> list[Variant]:
    """:func:`generate_variants`, cached as ``<cache>/variants/<key>.csv`` when a cache is given."""
    if cache_dir is None:
        return generate_variants(
            simulator, simulation, config, reach_bp=reach_bp, split_bounds=split_bounds, progress=progress
        )
    text = json.dumps([VARIANTS_VERSION, simulator.fingerprint(), asdict(config), reach_bp, split_bounds])
    path = Path(cache_dir) / "variants" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.csv"
    if path.exists():
        return read_variants(path)
    variants = generate_variants(
        simulator, simulation, config, reach_bp=reach_bp, split_bounds=split_bounds, progress=progress
    )
    write_variants(variants, path)
    return variants
