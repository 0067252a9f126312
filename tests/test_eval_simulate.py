"""Properties of the simulator and the variant set on the synthetic fixture."""

import numpy as np
import pytest
import torch

from kvbound.eval.data import CODE_N, load_data, write_fixture
from kvbound.eval.simulate import Simulator, SimulatorConfig, distal_variance_share, pwm_log_odds, split_of
from kvbound.eval.variants import VariantConfig, _strongest_site, generate_variants, read_variants, write_variants
from kvbound.eval.windows import split_intervals


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # small convolutions: thread start-up dominates on 2 cores
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def fixture_sim(tmp_path_factory):
    data = load_data(write_fixture(tmp_path_factory.mktemp("fixture")))
    simulator = Simulator(data, SimulatorConfig.fixture())
    return simulator, simulator.run()


def test_bins_and_track_shapes(fixture_sim):
    simulator, simulation = fixture_sim
    config = simulator.config
    assert simulation.n_bins == -(-simulator.data.length // 128)
    assert simulation.tracks.shape == (len(config.track_names), simulation.n_bins)
    assert simulation.tracks.dtype == np.float32 and np.isfinite(simulation.tracks).all()
    assert config.track_names[-1] == "expression" and config.track_names[0] == "tf:FIXP1"
    # the fixture's 3 kb of N start at 300,000; the last bin is half padding past the end
    expected = set(range(300_000 // 128, (303_000 - 1) // 128 + 1)) | {simulation.n_bins - 1}
    assert set(np.flatnonzero(simulation.n_fraction > 0)) == expected
    assert simulation.n_fraction[simulation.n_bins - 1] == pytest.approx(0.5)
    assert simulation.occupancy[:, simulation.n_fraction == 1].max() == 0.0


def test_scores_match_a_direct_pwm_sum(fixture_sim):
    simulator, _ = fixture_sim
    codes = simulator.data.codes[10_000:10_400]
    scores = simulator.strand_scores(codes).double()
    for index, pwm in enumerate(simulator.pwms):
        length = pwm.shape[0]
        for start in (0, 17, 200):
            window = codes[start : start + length]
            forward = pwm[np.arange(length), window].sum()
            reverse = pwm[::-1, ::-1][np.arange(length), window].sum()
            assert scores[0, index, start].item() == pytest.approx(forward, abs=1e-4)
            assert scores[1, index, start].item() == pytest.approx(reverse, abs=1e-4)
    with_n = codes.copy()
    with_n[5] = CODE_N
    assert torch.isinf(simulator.strand_scores(with_n)[:, :, :6]).all()


def test_pwm_log_odds_uniform_counts_are_zero():
    from kvbound.eval.data import Motif

    motif = Motif("M", "m", np.full((3, 4), 5.0))
    np.testing.assert_allclose(pwm_log_odds(motif, np.full(4, 0.25), 0.8), 0.0, atol=1e-12)


def test_calibrated_site_density(fixture_sim):
    simulator, simulation = fixture_sim
    # promoter TFs were planted at ~30 TSSs on top of the calibrated background density of 0.1 sites / kb
    expected_background = simulator.config.sites_per_kb * simulator.data.length / 1000
    bound_fixp2 = simulation.occupancy[simulator.config.tf_names.index("FIXP2")].sum()
    assert 0.5 * expected_background < bound_fixp2 < 3 * expected_background + 2 * len(simulator.data.genes)


def _distal_enhancer_site(simulator, simulation, min_distance_bp):
    """A TSS and a bound cooperating-TF site in an active enhancer at least ``min_distance_bp`` away."""
    size = simulator.config.bin_size
    rows = [simulator.config.tf_names.index(n) for pair in simulator.config.enhancer_pairs for n in pair]
    for gene in simulator.data.genes:
        tss_bin = gene.tss // size
        for offset in range(min_distance_bp // size + 1, simulator.config.max_range_bins // 2):
            for enhancer_bin in (tss_bin + offset, tss_bin - offset):
                if 0 <= enhancer_bin < simulation.n_bins and simulation.enhancer[enhancer_bin] > 0.5:
                    site = _strongest_site(simulator, enhancer_bin, rows)
                    if site is not None and abs(site[0] - gene.tss) >= min_distance_bp:
                        return gene, site
    raise AssertionError("the fixture has no distal enhancer")


def test_breaking_a_distal_enhancer_motif_changes_expression(fixture_sim):
    simulator, simulation = fixture_sim
    gene, (position, alt, tf) = _distal_enhancer_site(simulator, simulation, min_distance_bp=4_000)
    tss_bin = gene.tss // simulator.config.bin_size
    targets = np.array([tss_bin])
    ref, mutated = simulator.snv_expression(simulation, position, alt, targets)
    assert ref[0] == pytest.approx(simulation.expression[tss_bin], abs=1e-5)
    assert mutated[0] < ref[0] - 0.01  # losing an enhancer lowers expression at a TSS >= 4 kb away
    # the incremental answer equals a full re-simulation of the mutated chromosome
    codes = simulator.data.codes.copy()
    codes[position] = alt
    again = simulator.with_codes(codes).run()
    assert again.expression[tss_bin] == pytest.approx(mutated[0], abs=1e-5)
    changed = np.flatnonzero(np.abs(again.expression - simulation.expression) > 1e-5)
    reach = simulator.config.max_range_bins + 2 * simulator.config.neighbourhood_bins + 2
    assert np.abs(changed - position // 128).max() <= reach  # nothing moves beyond the contact range


def test_breaking_a_decoy_motif_leaves_expression(fixture_sim):
    simulator, simulation = fixture_sim
    decoy = simulator.config.tf_names.index("FIXD1")
    occupancy = simulation.occupancy[decoy]
    bins = np.flatnonzero(occupancy > 0.9)
    assert bins.size > 10
    site = _strongest_site(simulator, int(bins[len(bins) // 2]), [decoy])
    assert site is not None
    position, alt, _ = site
    # the SNV may change the CpG count of its own bins (promoter competence there); nothing else moves
    offsets = np.array([-40, -24, -8, 8, 24, 40])
    targets = np.clip(position // 128 + offsets, 0, simulation.n_bins - 1)
    ref, mutated = simulator.snv_expression(simulation, position, alt, targets)
    assert simulation.occupancy[decoy, position // 128 - 1 : position // 128 + 1].max() > 0.5
    np.testing.assert_allclose(mutated, ref, atol=1e-9)


def test_distal_variance_share(fixture_sim):
    simulator, simulation = fixture_sim
    shares = [distal_variance_share(simulator, simulation, local) for local in (512, 2_048, 8_192)]
    assert all(0.0 < s < 1.0 for s in shares)
    assert shares[0] > shares[1] > shares[2]  # the farther the cut, the less is left beyond it
    assert shares[1] > 0.1  # a tenth of the variance lies beyond 2 kb even in the small fixture


def test_splits_are_by_position(fixture_sim):
    simulator, _ = fixture_sim
    config = simulator.config
    length = simulator.data.length
    train = split_intervals(config, length, "train")
    test = split_intervals(config, length, "test")
    assert train == [(0, 300_000)] and test == [(350_000, 600_000)]
    assert list(split_of(np.array([0, 320_000, 599_999]), config)) == ["train", "valid", "test"]
    with pytest.raises(ValueError, match="split"):
        split_intervals(config, length, "holdout")


def test_variants_are_labelled_and_distance_matched(fixture_sim, tmp_path):
    simulator, simulation = fixture_sim
    config = VariantConfig.fixture()
    test = split_intervals(simulator.config, simulator.data.length, "test")
    variants = generate_variants(simulator, simulation, config, reach_bp=8_000, split_bounds=test)
    positives = [v for v in variants if v.label == 1]
    negatives = [v for v in variants if v.label == 0]
    assert len(positives) >= 10 and len(negatives) == 2 * len(positives)
    assert {v.stratum for v in positives} == {"0-2kb", "2-5kb", "5-8kb"}
    for v in positives:
        assert abs(v.true_effect) >= config.threshold and v.kind == "enhancer_motif"
        assert v.ref != v.alt and simulator.data.codes[v.position] == "ACGT".index(v.ref)
    by_gene_stratum = {}
    for v in variants:
        by_gene_stratum.setdefault((v.gene, v.stratum), []).append(v)
    for group in by_gene_stratum.values():
        for v in group:
            assert v.label == 1 or abs(v.true_effect) < config.threshold * config.negative_fraction
    # every negative lies within the tolerance of some positive of the same gene and stratum
    for v in negatives:
        partners = [p for p in by_gene_stratum[(v.gene, v.stratum)] if p.label == 1]
        assert min(abs(p.distance - v.distance) for p in partners) <= config.match_tolerance_bp + 200
    write_variants(variants, tmp_path / "v.csv")
    assert read_variants(tmp_path / "v.csv") == [
        type(v)(**{**v.__dict__, "true_effect": float(f"{v.true_effect:.6g}")}) for v in variants
    ]


def test_calibration_roundtrip_and_summary(fixture_sim, tmp_path):
    from kvbound.eval.simulate import cached_simulator, summarize

    simulator, simulation = fixture_sim
    again = Simulator(simulator.data, simulator.config, calibration=simulator.calibration())
    np.testing.assert_array_equal(again.mu, simulator.mu)
    np.testing.assert_array_equal(again.run().tracks, simulation.tracks)
    first = cached_simulator(simulator.data, simulator.config, tmp_path)
    second = cached_simulator(simulator.data, simulator.config, tmp_path)  # read back from the cache
    assert second.calibration() == first.calibration() == simulator.calibration()
    summary = summarize(simulator, simulation)
    assert summary["genes_by_split"]["test"] > 0 and summary["promoter_median_at_tss"] > 0.5
    assert summary["promoter_median_all"] < summary["promoter_median_at_tss"]
    shares = summary["distal_variance_share"]
    assert shares[">2kb"]["all_bins"] > shares[">10kb"]["all_bins"] > shares[">50kb"]["all_bins"] >= 0


def test_scan_cache_rebuilds_the_simulation_bit_for_bit(fixture_sim, tmp_path):
    from kvbound.eval.simulate import load_or_run

    simulator, simulation = fixture_sim
    fresh = load_or_run(simulator, tmp_path)  # runs and writes the cache
    (stored,) = (tmp_path / "sim").glob("*.scan.npz")
    with np.load(stored) as contents:
        assert set(contents.files) == {"occupancy", "cpg", "n_count", "enhancer_input", "mu"}
    cached = load_or_run(simulator, tmp_path)  # rebuilt from the cache
    for name in ("tracks", "occupancy", "cpg", "enhancer", "promoter", "enhancer_input", "n_fraction", "mu"):
        np.testing.assert_array_equal(getattr(cached, name), getattr(simulation, name), err_msg=name)
        np.testing.assert_array_equal(getattr(fresh, name), getattr(simulation, name), err_msg=name)
    other = Simulator(simulator.data, simulator.config, calibration={**simulator.calibration(), "mu": simulator.mu + 1})
    with pytest.raises(ValueError, match="chemical potentials"):
        load_or_run(other, tmp_path)
