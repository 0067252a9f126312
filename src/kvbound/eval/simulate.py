"""A documented simulator: real sequence + real motifs + real TSS -> ground-truth tracks at 128 bp bins.

The model is deliberately simple and every step is stated here, so that a reader can judge what the
benchmark measures. Constants are fields of :class:`SimulatorConfig` (defaults in brackets).

1. **Motif scan.** Each TF's PFM becomes a natural-log-odds PWM against the chromosome's own
   (strand-symmetric) base composition, pseudocount 0.8 split by composition. Every start position gets a
   score on both strands; a site touching N scores -inf.
2. **Occupancy.** ``sigmoid(beta * (score - mu_tf))`` per strand [beta = 2: sharper than kT = 1 so that the
   weak-site tail does not turn every bin into a binding site], ``1 - (1 - o_fwd)(1 - o_rev)`` per position.
   The chemical potential ``mu_tf`` is calibrated once per chromosome so that ``sites_per_kb`` [0.25] sites
   per kb are at least half occupied: it is the ``1 - sites_per_kb / 2000`` quantile of the strand scores on
   an evenly spread sample [8 Mbp]. Occupancy is summed per bin (``O_tf[b]``, the expected number of bound
   sites; a site belongs to the bin of its first base on the + strand).
3. **Local tracks** (what a convolution tower can learn): ``log1p(O_tf)`` for every TF, and accessibility
   ``1 - exp(-sum_tf O_tf)`` averaged over 3 bins.
4. **Enhancer activity** with TF cooperativity: with ``h_tf[b] = 1 - exp(-sum of O_tf over bins b-w..b+w)``
   [w = 1] (probability that a site of the TF is bound within ~400 bp), ``s[b] = sum over cooperating pairs
   (a, c) of h_a[b] * h_c[b]`` (AND logic, pairs GATA1/TAL1::TCF3, FOS::JUN/TEAD1, SOX2/POU5F1, FOXA2/CEBPB)
   and ``e[b] = s^n / (s^n + K^n)`` [n = 4]: a lone motif does nothing, co-bound partners make an enhancer.
   ``K`` is calibrated so that ``enhancer_fraction`` [0.5%] of the bins have ``e > 1/2`` (sparse, strong
   enhancers: their number within reach of a TSS varies, so the enhancer input below carries information).
5. **Promoter competence** ``p[b] = sigmoid(c0 + c_tf * sum_{promoter TFs} h_tf[b] + c_cpg * cpg[b])``
   [c0 = -4, c_tf = 1.5, c_cpg = 2.5; promoter TFs SP1, NRF1, NFYA, YY1] with ``cpg[b]`` the CpG dinucleotide
   frequency over the 3-bin neighbourhood divided by 0.05 (CpG islands reach ~0.05-0.1; bulk chrX ~0.01).
   Real TSSs are thus mostly competent promoters (on chrX: median p 0.70 at annotated TSSs, 0.04 elsewhere).
6. **Expression** (CAGE-like, defined at every bin, read at real TSSs for gene-level numbers and variants):
   ``x[b] = log1p(A * p[b] * (beta0 + D[b]))`` [A = 4, beta0 = 0.1] with the enhancer input
   ``D[b] = sum_{|b' - b| * 128 <= max_range} contact(|b' - b| * 128) * e[b']`` and the power-law contact
   ``contact(d) = (1 + d / d0) ** -gamma`` (activity-by-contact) [d0 = 5 kb, gamma = 0.75, max_range = 100 kb].
   What lies beyond the tower's receptive field (about 1 kb) reaches a bin only through attention;
   :func:`distal_variance_share` measures how much of the expression variance that is (on chrX: 59% of it
   lies beyond 2 kb, 25% beyond 10 kb, 2.5% beyond 50 kb; 65%, 24% and 2.4% at the annotated TSSs;
   ``python -m kvbound.eval.simulate`` prints these numbers).

Tracks, in order: ``tf:<NAME>`` for every TF (promoter, enhancer, decoy), ``accessibility``, ``enhancer``,
``expression``. Decoy TFs (CTCF, REST) are bound and have local tracks but no effect on expression.

Splits are by position along the chromosome (``SimulatorConfig.splits``: valid 38-44 Mbp, test 44-56 Mbp,
train the rest); windows never cross a split boundary.
"""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvbound.eval.data import CODE_N, EvalData, Motif

__all__ = [
    "SimulatorConfig",
    "Simulation",
    "Simulator",
    "distal_variance_share",
    "pwm_log_odds",
    "split_of",
]

# Part of the simulation cache key: bump when the simulator's arithmetic changes.
SIMULATOR_VERSION = 2

REAL_ROLES = {
    "promoter_tfs": ("SP1", "NRF1", "NFYA", "YY1"),
    "enhancer_pairs": (("GATA1", "TAL1::TCF3"), ("FOS::JUN", "TEAD1"), ("SOX2", "POU5F1"), ("FOXA2", "CEBPB")),
    "decoy_tfs": ("CTCF", "REST"),
}
FIXTURE_ROLES = {
    "promoter_tfs": ("FIXP1", "FIXP2"),
    "enhancer_pairs": (("FIXE1", "FIXE2"), ("FIXE3", "FIXE4")),
    "decoy_tfs": ("FIXD1",),
}


@dataclass(frozen=True)
class SimulatorConfig:
    """Every constant of the simulator (the defaults are the benchmark's)."""

    bin_size: int = 128
    promoter_tfs: tuple[str, ...] = REAL_ROLES["promoter_tfs"]
    enhancer_pairs: tuple[tuple[str, str], ...] = REAL_ROLES["enhancer_pairs"]
    decoy_tfs: tuple[str, ...] = REAL_ROLES["decoy_tfs"]
    pseudocount: float = 0.8
    sites_per_kb: float = 0.25
    binding_energy_scale: float = 2.0  # beta: occupancy = sigmoid(beta * (score - mu)); > 1 sharpens binding
    enhancer_fraction: float = 0.005  # K: the (1 - fraction) quantile of s, so this share of bins has e > 1/2
    enhancer_hill_n: float = 4.0
    neighbourhood_bins: int = 1  # w: enhancers/promoters pool occupancy over bins b-w..b+w
    promoter_bias: float = -4.0  # c0
    promoter_tf_weight: float = 1.5  # c_tf
    promoter_cpg_weight: float = 2.5  # c_cpg
    baseline_input: float = 0.1  # beta0
    expression_scale: float = 4.0  # A
    contact_scale_bp: float = 5_000.0  # d0
    contact_exponent: float = 0.75  # gamma
    max_range_bp: int = 100_000
    # [start, end) in bp; the rest of the chromosome is "train"
    splits: tuple[tuple[str, int, int], ...] = (("valid", 38_000_000, 44_000_000), ("test", 44_000_000, 56_000_000))
    calibration_sample_bp: int = 8_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.bin_size < 1:
            raise ValueError(f"SimulatorConfig.bin_size: expected >= 1, got {self.bin_size}")
        if not 0 < self.sites_per_kb < 1000:
            raise ValueError(f"SimulatorConfig.sites_per_kb: expected in (0, 1000), got {self.sites_per_kb}")
        if self.max_range_bp < self.bin_size:
            raise ValueError(f"SimulatorConfig.max_range_bp: expected >= bin_size, got {self.max_range_bp}")
        for name, start, end in self.splits:
            if name not in ("valid", "test") or end <= start:
                raise ValueError(f"SimulatorConfig.splits: bad entry {(name, start, end)}")

    @classmethod
    def fixture(cls, **changes) -> SimulatorConfig:
        """The configuration used with :func:`kvbound.eval.data.write_fixture` (600 kbp by default)."""
        values = dict(
            promoter_tfs=FIXTURE_ROLES["promoter_tfs"],
            enhancer_pairs=FIXTURE_ROLES["enhancer_pairs"],
            decoy_tfs=FIXTURE_ROLES["decoy_tfs"],
            sites_per_kb=0.3,
            enhancer_fraction=0.05,
            max_range_bp=30_000,
            contact_scale_bp=2_000.0,
            splits=(("valid", 300_000, 350_000), ("test", 350_000, 600_000)),
            calibration_sample_bp=300_000,
        )
        values.update(changes)
        return cls(**values)

    @property
    def tf_names(self) -> tuple[str, ...]:
        enhancer = tuple(dict.fromkeys(name for pair in self.enhancer_pairs for name in pair))
        return tuple(dict.fromkeys(self.promoter_tfs + enhancer + self.decoy_tfs))

    @property
    def track_names(self) -> tuple[str, ...]:
        return tuple(f"tf:{name}" for name in self.tf_names) + ("accessibility", "enhancer", "expression")

    @property
    def max_range_bins(self) -> int:
        return self.max_range_bp // self.bin_size

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def pwm_log_odds(motif: Motif, background: np.ndarray, pseudocount: float) -> np.ndarray:
    """``[length, 4]`` natural-log odds of the PFM (with pseudocount split by ``background``) vs ``background``."""
    background = np.asarray(background, dtype=np.float64)
    counts = motif.counts + pseudocount * background
    probabilities = counts / counts.sum(axis=1, keepdims=True)
    return np.log(probabilities / background)


def split_of(position: int | np.ndarray, config: SimulatorConfig) -> np.ndarray:
    """Split name (``train``, ``valid``, ``test``) of each bp position."""
    position = np.asarray(position)
    out = np.full(position.shape, "train", dtype=object)
    for name, start, end in config.splits:
        out[(position >= start) & (position < end)] = name
    return out


@dataclass
class Simulation:
    """Simulated tracks of a whole chromosome: ``tracks[track, bin]`` float32 plus the intermediates."""

    config: SimulatorConfig
    tracks: np.ndarray  # [n_tracks, n_bins]
    occupancy: np.ndarray  # [n_tfs, n_bins]: O_tf
    cpg: np.ndarray  # [n_bins]
    enhancer: np.ndarray  # [n_bins]: e
    promoter: np.ndarray  # [n_bins]: p
    enhancer_input: np.ndarray  # [n_bins]: D
    n_fraction: np.ndarray  # [n_bins]: fraction of N bases in the bin
    mu: np.ndarray  # [n_tfs]
    extra: dict = field(default_factory=dict)

    @property
    def expression(self) -> np.ndarray:
        return self.tracks[-1]

    @property
    def n_bins(self) -> int:
        return self.tracks.shape[1]


class Simulator:
    """Holds the calibrated PWMs of one chromosome and runs every step of the module docstring."""

    def __init__(self, data: EvalData, config: SimulatorConfig | None = None, calibration: dict | None = None):
        """``calibration``: ``{"mu": [...], "enhancer_k": float}`` from :meth:`calibration` of an earlier
        instance on the same data and config (skips the calibration scans)."""
        self.data = data
        self.config = config if config is not None else SimulatorConfig()
        codes = data.codes
        counts = np.bincount(codes[codes != CODE_N], minlength=4)[:4].astype(np.float64)
        if counts.sum() == 0:
            raise ValueError(f"{data.source}: the sequence has no A/C/G/T base")
        background = (counts + counts[::-1]) / (2 * counts.sum())  # strand-symmetric composition
        self.background = background
        missing = [name for name in self.config.tf_names if not _has_motif(data, name)]
        if missing:
            raise KeyError(f"SimulatorConfig names motifs absent from {data.source}: {missing}")
        self.motifs = tuple(data.motif(name) for name in self.config.tf_names)
        self.pwms = [pwm_log_odds(motif, background, self.config.pseudocount) for motif in self.motifs]
        self.max_length = max(pwm.shape[0] for pwm in self.pwms)
        self._filters = self._build_filters()
        if calibration is not None:
            self.mu = np.asarray(calibration["mu"], dtype=np.float64)
            if self.mu.shape != (len(self.pwms),):
                raise ValueError(f"calibration['mu']: expected {len(self.pwms)} values, got {self.mu.shape}")
            self.enhancer_k = float(calibration["enhancer_k"])
        else:
            self.mu = self._calibrate_binding()
            self.enhancer_k = self._calibrate_enhancers()
        distances = np.arange(self.config.max_range_bins + 1) * self.config.bin_size
        self.contact = (1.0 + distances / self.config.contact_scale_bp) ** -self.config.contact_exponent

    def fingerprint(self) -> str:
        """Identifies the simulated data: simulator version, config, data source and length (and, for a simulator
        moved to another chromosome with :meth:`on`, the chromosome it was calibrated on)."""
        return _cache_key(self.config, self.data, getattr(self, "calibrated_on", None))

    def on(self, data: EvalData) -> Simulator:
        """The same calibrated simulator (PWMs and their background, chemical potentials, enhancer threshold,
        contact kernel) on another chromosome ``data``: the ground truth of a held-out chromosome is computed by
        the very function the models learned on this one."""
        names = {motif.name.upper() for motif in data.motifs}
        missing = [motif.name for motif in self.motifs if motif.name.upper() not in names]
        if missing:
            raise KeyError(f"{data.source}: lacks the simulator's motifs {missing}")
        clone = object.__new__(Simulator)
        clone.__dict__.update(self.__dict__)
        clone.data = data
        clone.calibrated_on = getattr(self, "calibrated_on", None) or self.data.source
        return clone

    def calibration(self) -> dict:
        """The calibrated constants, to pass back as ``Simulator(..., calibration=...)``."""
        return {"mu": self.mu.tolist(), "enhancer_k": self.enhancer_k}

    def with_codes(self, codes: np.ndarray) -> Simulator:
        """The same calibrated simulator (PWMs, chemical potentials) on another sequence of the chromosome."""
        clone = object.__new__(Simulator)
        clone.__dict__.update(self.__dict__)
        clone.data = EvalData(
            self.data.chrom, np.asarray(codes, dtype=np.uint8), self.data.motifs, self.data.genes, self.data.source
        )
        return clone

    # ----------------------------------------------------------------------------------------------- scan
    def _build_filters(self) -> list[tuple[list[int], int, torch.Tensor]]:
        """Conv filters grouped by motif length rounded up to a multiple of 4 (fewer wasted taps).

        Each group is ``(tf indices, width, [2 * count, 4, width])``: forward PWMs then reverse complements,
        zero-padded on the right.
        """
        groups: dict[int, list[int]] = {}
        for index, pwm in enumerate(self.pwms):
            groups.setdefault(-(-pwm.shape[0] // 4) * 4, []).append(index)
        out = []
        for width, indices in sorted(groups.items()):
            filters = torch.zeros(2 * len(indices), 4, width, dtype=torch.float32)
            for row, index in enumerate(indices):
                pwm = self.pwms[index]
                filters[row, :, : pwm.shape[0]] = torch.from_numpy(pwm.T)
                filters[len(indices) + row, :, : pwm.shape[0]] = torch.from_numpy(pwm[::-1, ::-1].T.copy())
            out.append((indices, width, filters))
        return out

    def strand_scores(self, codes: np.ndarray) -> torch.Tensor:
        """``[2, n_tfs, n]`` float32 log-odds of the site starting at each position (forward, reverse).

        ``n = len(codes) - max_length + 1``; sites that touch N, or whose motif is shorter than
        ``max_length`` and would run past the end, are handled exactly: a motif of length ``L`` at start
        ``s`` reads ``codes[s : s + L]`` only.
        """
        codes = np.asarray(codes)
        n = codes.size - self.max_length + 1
        if n < 1:
            raise ValueError(f"codes: expected at least {self.max_length} bases, got {codes.size}")
        codes_t = torch.from_numpy(codes.astype(np.int64))
        one_hot = F.one_hot(codes_t.clamp(max=3), 4).to(torch.float32)
        is_n = codes_t == CODE_N
        one_hot[is_n] = 0.0
        signal = one_hot.T.unsqueeze(0)
        out = torch.empty(2, len(self.pwms), n, dtype=torch.float32)
        # Small pieces (SNV re-simulation) run on one thread: thread start-up costs 100x the work there.
        with _threads(1 if n < 1 << 16 else torch.get_num_threads()):
            for indices, width, filters in self._filters:
                # reads codes[s : s + width] for s < n; the tail past the sequence is zero (its taps are zero)
                scores = F.conv1d(F.pad(signal, (0, max(0, n + width - 1 - codes.size))), filters)[0, :, :n]
                out[:, indices] = scores.view(2, len(indices), n)
        n_prefix = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(is_n.to(torch.int64), 0)])
        for index, pwm in enumerate(self.pwms):
            length = pwm.shape[0]
            touches_n = (n_prefix[length : length + n] - n_prefix[:n]) > 0
            out[:, index, touches_n] = -math.inf
        return out

    def site_occupancy(self, codes: np.ndarray) -> torch.Tensor:
        """``[n_tfs, n]`` probability that a site starting at each position is bound on either strand."""
        scores = self.strand_scores(codes)
        mu = torch.from_numpy(self.mu).to(torch.float32).view(1, -1, 1)
        bound = torch.sigmoid(self.config.binding_energy_scale * (scores - mu))
        return 1.0 - (1.0 - bound[0]) * (1.0 - bound[1])

    def _calibration_pieces(self) -> list[np.ndarray]:
        """16 evenly spread, bin-aligned pieces of the chromosome, ``calibration_sample_bp`` in all."""
        codes = self.data.codes
        size = self.config.bin_size
        piece_bins = max(min(self.config.calibration_sample_bp, codes.size) // 16 // size, 8)
        last = max(codes.size // size - piece_bins, 0)
        starts = np.unique(np.linspace(0, last, 16).astype(np.int64))
        return [self.padded_codes(int(start), piece_bins) for start in starts]

    def _calibrate_binding(self) -> np.ndarray:
        """Chemical potentials ``mu_tf`` (module docstring, step 2)."""
        scores = torch.cat([self.strand_scores(piece) for piece in self._calibration_pieces()], dim=-1)
        scores = scores.permute(1, 0, 2).reshape(len(self.pwms), -1)
        quantile = 1.0 - self.config.sites_per_kb / 2000.0
        mu = np.empty(len(self.pwms))
        for index in range(len(self.pwms)):
            finite = scores[index][torch.isfinite(scores[index])].numpy().astype(np.float64)
            if finite.size == 0:
                raise ValueError(f"calibration: no N-free window for motif {self.motifs[index].name}")
            mu[index] = np.quantile(finite, quantile)
        return mu

    def _calibrate_enhancers(self) -> float:
        """Half-activation ``K`` of the enhancer Hill function (module docstring, step 4)."""
        size = self.config.bin_size
        values = []
        for piece in self._calibration_pieces():
            n_bins = (piece.size - self.max_length) // size
            occupancy, _, n_count = self.bin_features(piece, n_bins)
            w = self.config.neighbourhood_bins
            inner = slice(w, n_bins - w)
            values.append(self._cooperative(occupancy)[inner][n_count[inner] == 0])
        values = np.concatenate(values)
        if values.size == 0:
            raise ValueError("calibration: no N-free bin for the enhancer threshold")
        return float(max(np.quantile(values, 1.0 - self.config.enhancer_fraction), 1e-6))

    # ----------------------------------------------------------------------------------------------- bins
    def bin_features(self, codes: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-bin occupancy ``O [n_tfs, n_bins]``, CpG count and N count of ``codes``.

        ``codes`` must hold ``n_bins * bin_size + max_length - 1`` bases (pad with N past the chromosome end)
        plus one more base for the CpG at the last position of the last bin.
        """
        size = self.config.bin_size
        needed = n_bins * size + self.max_length
        if codes.size != needed:
            raise ValueError(f"codes: expected {needed} bases for {n_bins} bins, got {codes.size}")
        occupancy = self.site_occupancy(codes[: needed - 1])[:, : n_bins * size]
        per_bin = occupancy.reshape(len(self.pwms), n_bins, size).sum(-1, dtype=torch.float64).numpy()
        body = codes[: n_bins * size + 1]
        cpg = ((body[:-1] == 1) & (body[1:] == 2)).reshape(n_bins, size).sum(-1).astype(np.float64)
        n_count = (body[:-1] == CODE_N).reshape(n_bins, size).sum(-1).astype(np.float64)
        return per_bin, cpg, n_count

    def padded_codes(self, start_bin: int, n_bins: int, codes: np.ndarray | None = None) -> np.ndarray:
        """The bases :func:`bin_features` needs for bins ``start_bin .. start_bin + n_bins - 1`` (N-padded)."""
        codes = self.data.codes if codes is None else codes
        size = self.config.bin_size
        start = start_bin * size
        end = start + n_bins * size + self.max_length
        out = np.full(end - start, CODE_N, dtype=np.uint8)
        lo, hi = max(start, 0), min(end, codes.size)
        if hi > lo:
            out[lo - start : hi - start] = codes[lo:hi]
        return out

    def _bound(self, occupancy: np.ndarray) -> np.ndarray:
        """``h_tf``: probability that a site of the TF is bound within bins ``b - w .. b + w``."""
        return 1.0 - np.exp(-_box_sum(occupancy, self.config.neighbourhood_bins))

    def _cooperative(self, occupancy: np.ndarray, bound: np.ndarray | None = None) -> np.ndarray:
        """``s[b] = sum over cooperating pairs of h_a[b] * h_c[b]``."""
        bound = self._bound(occupancy) if bound is None else bound
        index = {name: i for i, name in enumerate(self.config.tf_names)}
        cooperative = np.zeros(occupancy.shape[1])
        for first, second in self.config.enhancer_pairs:
            cooperative += bound[index[first]] * bound[index[second]]
        return cooperative

    def local_tracks(self, occupancy: np.ndarray, cpg: np.ndarray) -> dict[str, np.ndarray]:
        """Steps 3-5 of the module docstring on consecutive bins. The outer ``neighbourhood_bins`` bins on
        each side lack context (zero padding); callers that need exact values discard them."""
        config = self.config
        w = config.neighbourhood_bins
        bound = self._bound(occupancy)
        cooperative = self._cooperative(occupancy, bound) ** config.enhancer_hill_n
        enhancer = cooperative / (cooperative + self.enhancer_k**config.enhancer_hill_n)
        index = {name: i for i, name in enumerate(config.tf_names)}
        promoter_drive = sum(bound[index[name]] for name in config.promoter_tfs)
        cpg_frequency = _box_sum(cpg[None], w)[0] / ((2 * w + 1) * config.bin_size) / 0.05
        logit = config.promoter_bias + config.promoter_tf_weight * promoter_drive
        promoter = _sigmoid(logit + config.promoter_cpg_weight * cpg_frequency)
        accessibility = 1.0 - np.exp(-_box_sum(occupancy.sum(0, keepdims=True), 1)[0] / 3.0)
        return {"enhancer": enhancer, "promoter": promoter, "accessibility": accessibility}

    def expression_from(self, promoter: np.ndarray, enhancer_input: np.ndarray) -> np.ndarray:
        config = self.config
        return np.log1p(config.expression_scale * promoter * (config.baseline_input + enhancer_input))

    def enhancer_input(self, enhancer: np.ndarray, max_range_bins: int | None = None) -> np.ndarray:
        """``D = contact * e`` (a symmetric convolution), optionally truncated at ``max_range_bins``."""
        contact = self.contact if max_range_bins is None else self.contact[: max_range_bins + 1]
        kernel = np.concatenate([contact[:0:-1], contact])
        signal = torch.from_numpy(enhancer).view(1, 1, -1)
        weight = torch.from_numpy(kernel).view(1, 1, -1)
        return F.conv1d(signal, weight, padding=contact.size - 1).view(-1).numpy()

    # ----------------------------------------------------------------------------------------------- run
    def run(self, *, progress: bool = False, chunk_bins: int = 8192) -> Simulation:
        """Simulate the whole chromosome."""
        config = self.config
        n_bins = -(-self.data.length // config.bin_size)
        occupancy = np.zeros((len(self.pwms), n_bins))
        cpg = np.zeros(n_bins)
        n_count = np.zeros(n_bins)
        chunks = range(0, n_bins, chunk_bins)
        iterator = chunks
        if progress:
            from rich.progress import track

            iterator = track(chunks, description=f"simulating {self.data.source}", transient=True)
        for start in iterator:
            count = min(chunk_bins, n_bins - start)
            o, c, nc = self.bin_features(self.padded_codes(start, count), count)
            occupancy[:, start : start + count] = o
            cpg[start : start + count] = c
            n_count[start : start + count] = nc
        return self.finish(occupancy, cpg, n_count)

    def finish(
        self, occupancy: np.ndarray, cpg: np.ndarray, n_count: np.ndarray, enhancer_input: np.ndarray | None = None
    ) -> Simulation:
        """Steps 3-6 from the per-bin scan results (occupancy, CpG and N counts) and, when given, the enhancer
        input computed from them before (the long contact convolution): under a second for a chromosome, so
        the cache keeps only these and rebuilds the rest exactly."""
        config = self.config
        local = self.local_tracks(occupancy, cpg)
        if enhancer_input is None:
            enhancer_input = self.enhancer_input(local["enhancer"])
        expression = self.expression_from(local["promoter"], enhancer_input)
        tracks = np.concatenate(
            [np.log1p(occupancy), local["accessibility"][None], local["enhancer"][None], expression[None]]
        ).astype(np.float32)
        return Simulation(
            config=config,
            tracks=tracks,
            occupancy=occupancy,
            cpg=cpg,
            enhancer=local["enhancer"],
            promoter=local["promoter"],
            enhancer_input=enhancer_input,
            n_fraction=n_count / config.bin_size,
            mu=self.mu.copy(),
        )

    # ----------------------------------------------------------------------------------------------- SNVs
    def snv_expression(
        self, simulation: Simulation, position: int, alt: int, target_bins: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Reference and alternative expression at ``target_bins`` for the SNV ``position -> alt``.

        Exact and incremental: the bins whose occupancy, CpG, enhancer activity or promoter competence can
        change (the SNV's bin +- 2 w + 1) are recomputed from sequence with and without the SNV, and the
        change in enhancer activity is propagated to the targets through the contact kernel.
        """
        config = self.config
        codes = self.data.codes
        if not 0 <= position < codes.size or codes[position] == CODE_N:
            raise ValueError(f"position: expected a non-N base inside the chromosome, got {position}")
        if alt not in (0, 1, 2, 3) or alt == codes[position]:
            raise ValueError(f"alt: expected a base code 0..3 other than the reference, got {alt}")
        target_bins = np.asarray(target_bins, dtype=np.int64)
        w = config.neighbourhood_bins
        centre = position // config.bin_size
        margin = 2 * w + 2  # changed O/CpG bins (centre-1..centre+1) widen by w twice (h, then e / p)
        lo = centre - margin - w
        count = 2 * (margin + w) + 1
        reference = self.padded_codes(lo, count)
        alternative = reference.copy()
        alternative[position - lo * config.bin_size] = alt
        changed = {}
        for name, piece in (("ref", reference), ("alt", alternative)):
            o, c, _ = self.bin_features(piece, count)
            changed[name] = self.local_tracks(o, c)
        inner = slice(w, count - w)  # bins with full context
        bins = np.arange(lo, lo + count)[inner]
        delta_enhancer = changed["alt"]["enhancer"][inner] - changed["ref"]["enhancer"][inner]
        delta_promoter = changed["alt"]["promoter"][inner] - changed["ref"]["promoter"][inner]
        valid = (bins >= 0) & (bins < simulation.n_bins)
        bins, delta_enhancer, delta_promoter = bins[valid], delta_enhancer[valid], delta_promoter[valid]
        distance = np.abs(target_bins[:, None] - bins[None, :])
        in_range = distance <= config.max_range_bins
        contact = np.where(in_range, self.contact[np.minimum(distance, config.max_range_bins)], 0.0)
        delta_input = contact @ delta_enhancer
        promoter = simulation.promoter[target_bins].copy()
        hit = np.searchsorted(bins, target_bins)
        inside = (hit < bins.size) & (bins[np.minimum(hit, bins.size - 1)] == target_bins)
        promoter_alt = promoter.copy()
        promoter_alt[inside] += delta_promoter[hit[inside]]
        enhancer_input = simulation.enhancer_input[target_bins]
        ref = self.expression_from(promoter, enhancer_input)
        alt_expression = self.expression_from(promoter_alt, enhancer_input + delta_input)
        return ref, alt_expression


def distal_variance_share(simulator: Simulator, simulation: Simulation, local_bp: int, bins=None) -> float:
    """Share of expression variance that enhancers farther than ``local_bp`` carry: ``1 - corr(x, x_local)^2``.

    ``x_local`` is the expression recomputed with the contact kernel cut at ``local_bp`` (only enhancers within
    ``local_bp`` of each bin count), so this is the variance that no model seeing only ``+-local_bp`` can
    explain linearly from the true local expression. ``bins``: evaluate on these bins only (e.g. TSS bins);
    default all N-free bins.
    """
    local_bins = local_bp // simulator.config.bin_size
    near = simulator.enhancer_input(simulation.enhancer, max_range_bins=local_bins)
    x_local = simulator.expression_from(simulation.promoter, near)
    x = simulation.expression.astype(np.float64)
    if bins is None:
        bins = np.flatnonzero(simulation.n_fraction == 0)
    correlation = np.corrcoef(x[bins], x_local[bins])[0, 1]
    return float(1.0 - correlation**2)


def _cache_key(config: SimulatorConfig, data: EvalData, calibrated_on: str | None = None) -> str:
    text = f"{SIMULATOR_VERSION}:{config.fingerprint()}:{data.source}:{data.length}"
    if calibrated_on is not None and calibrated_on != data.source:  # a held-out chromosome (Simulator.on)
        text += f":calibrated on {calibrated_on}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_simulator(data: EvalData, config: SimulatorConfig, cache_dir: str | Path | None) -> Simulator:
    """A :class:`Simulator` whose calibration is kept under ``<cache>/sim/<key>.calibration.json``."""
    if cache_dir is None:
        return Simulator(data, config)
    path = Path(cache_dir) / "sim" / f"{_cache_key(config, data)}.calibration.json"
    if path.exists():
        return Simulator(data, config, calibration=json.loads(path.read_text()))
    simulator = Simulator(data, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(simulator.calibration()) + "\n")
    return simulator


def load_or_run(simulator: Simulator, cache_dir: str | Path | None, *, progress: bool = False) -> Simulation:
    """Run the simulator, caching the scan under ``<cache>/sim/<key>.scan.npz`` when a cache is given.

    Only the motif scan's per-bin results and the enhancer input are stored (occupancy, CpG and N counts,
    ``D``; compressed: about 22 MB for chrX, small enough to travel with a working tree);
    :meth:`Simulator.finish` rebuilds every track from them, bit for bit the same as a fresh run, in about a
    second.
    """
    if cache_dir is None:
        return simulator.run(progress=progress)
    path = Path(cache_dir) / "sim" / f"{simulator.fingerprint()}.scan.npz"
    if path.exists():
        with np.load(path) as stored:
            if not np.array_equal(stored["mu"], simulator.mu):
                raise ValueError(f"{path}: scanned with other chemical potentials than this simulator's; delete it")
            return simulator.finish(
                stored["occupancy"], stored["cpg"], stored["n_count"].astype(np.float64), stored["enhancer_input"]
            )
    simulation = simulator.run(progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        temporary,
        occupancy=simulation.occupancy,
        cpg=simulation.cpg,
        n_count=np.round(simulation.n_fraction * simulator.config.bin_size).astype(np.int32),
        enhancer_input=simulation.enhancer_input,
        mu=simulator.mu,
    )
    temporary.replace(path)
    return simulation


@contextmanager
def _threads(count: int):
    previous = torch.get_num_threads()
    if count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != previous:
            torch.set_num_threads(previous)


def _has_motif(data: EvalData, name: str) -> bool:
    try:
        data.motif(name)
    except KeyError:
        return False
    return True


def _box_sum(values: np.ndarray, w: int) -> np.ndarray:
    """Sum over bins ``b - w .. b + w`` along the last axis, zero-padded."""
    if w == 0:
        return values.copy()
    padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(w + 1, w)])
    cumulative = np.cumsum(padded, axis=-1)
    return cumulative[..., 2 * w + 1 :] - cumulative[..., : -(2 * w + 1)]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def summarize(simulator: Simulator, simulation: Simulation) -> dict:
    """The numbers that describe a simulated chromosome (quoted in the module docstring for chrX)."""
    size = simulator.config.bin_size
    clean = np.flatnonzero(simulation.n_fraction == 0)
    tss_bins = np.unique([gene.tss // size for gene in simulator.data.genes])
    tss_bins = tss_bins[simulation.n_fraction[tss_bins] == 0]
    splits = split_of(np.array([gene.tss for gene in simulator.data.genes]), simulator.config)
    return {
        "source": simulator.data.source,
        "length_bp": simulator.data.length,
        "bins": simulation.n_bins,
        "n_free_bins": int(clean.size),
        "genes_by_split": {name: int((splits == name).sum()) for name in ("train", "valid", "test")},
        "enhancer_bins_share_e_gt_half": float((simulation.enhancer[clean] > 0.5).mean()),
        "enhancer_input_p5_p50_p95": np.percentile(simulation.enhancer_input[clean], [5, 50, 95]).round(3).tolist(),
        "promoter_median_at_tss": float(np.median(simulation.promoter[tss_bins])) if tss_bins.size else None,
        "promoter_median_all": float(np.median(simulation.promoter[clean])),
        "distal_variance_share": {
            f">{local // 1000}kb": {
                "all_bins": round(distal_variance_share(simulator, simulation, local), 4),
                "tss_bins": round(distal_variance_share(simulator, simulation, local, bins=tss_bins), 4)
                if tss_bins.size >= 3
                else None,
            }
            for local in (2_000, 10_000, 50_000)
        },
        "chemical_potentials": dict(zip(simulator.config.tf_names, simulation.mu.round(3).tolist(), strict=True)),
        "enhancer_half_activation_k": simulator.enhancer_k,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvbound.eval.simulate", description="simulate and summarise")
    parser.add_argument(
        "--cache", type=Path, default=None, help="real-data cache (default $KVBOUND_CACHE or ~/.cache/kvbound)"
    )
    parser.add_argument("--fixture", type=Path, default=None, help="use (and if needed write) the synthetic fixture")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary here (JSON)")
    args = parser.parse_args(argv)
    from kvbound.eval.windows import load_benchmark

    benchmark = load_benchmark(args.cache, fixture=args.fixture, progress=True)
    text = json.dumps(summarize(benchmark.simulator, benchmark.simulation), indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
