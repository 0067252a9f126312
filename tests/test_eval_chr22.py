"""The second, held-out test chromosome: MAF parser, the extra chromosome in the cache, the chr22 test set.

Everything runs on tiny generated files; the real chr22 only when it is cached (``python -m kvbound.eval.data
fetch --chromosomes X 22``).
"""

import csv
import gzip
import hashlib
import json
import shutil

import numpy as np
import pytest

from kvbound.eval import data as eval_data
from kvbound.eval.data import (
    CODE_N,
    DataNotFoundError,
    fetch,
    has_chromosome,
    load_chromosome,
    load_data,
    prepare_maf_chromosome,
    read_maf_reference,
    write_fixture,
)
from kvbound.eval.simulate import Simulator, SimulatorConfig
from kvbound.eval.variants import VariantConfig, generate_variants
from kvbound.eval.windows import load_benchmark, load_test_chromosome

# Two forward blocks (gaps in the human row, soft-masked letters, an N), one reverse-strand block, rows of other
# species before and after the human one, and a block without a human row.
TINY_MAF = """##maf version=1 program=test
# a comment
a score=1.0
s Hsap.22 5 8 + 40 ACg-TAC-GT
s Ptro.22 0 10 + 50 ACGATACAGT

a
s Ptro.22 20 6 + 50 AAAAAA
s Hsap.22 20 4 + 40 T-TN-A

a
s Ggor.22 0 6 + 60 GGGGGG

a
s Hsap.22 10 6 - 40 CCGTAA
s Ggor.22 7 6 + 60 CCGTAA
"""


def _expected_tiny() -> np.ndarray:
    codes = np.full(40, CODE_N, dtype=np.uint8)
    codes[5:13] = [0, 1, 2, 3, 0, 1, 2, 3]  # ACgTACGT
    codes[20:24] = [3, 3, CODE_N, 0]  # TTNA
    codes[24:30] = [3, 3, 0, 1, 2, 2]  # reverse complement of CCGTAA (- strand 10+6 of 40 is + 24..29)
    return codes


@pytest.mark.parametrize("compressed", [False, True])
def test_maf_reference_positions_gaps_and_n_fill(tmp_path, compressed):
    path = tmp_path / ("tiny.maf.gz" if compressed else "tiny.maf")
    path.write_bytes(gzip.compress(TINY_MAF.encode()) if compressed else TINY_MAF.encode())
    codes, stats = read_maf_reference(path, "Hsap.22", length=40)
    np.testing.assert_array_equal(codes, _expected_tiny())
    assert codes.dtype == np.uint8
    assert stats["blocks"] == 4 and stats["rows"] == 3
    assert stats["aligned_bp"] == 18 and stats["non_n_bp"] == 17
    assert stats["gap_columns_dropped"] == 4
    assert (stats["first_aligned"], stats["last_aligned_end"]) == (5, 30)
    assert stats["other_rows"] == {"Ggor.22": 2, "Ptro.22": 2}
    # another species' rows are read at their own coordinates, with their own gaps dropped
    chimp, _ = read_maf_reference(path, "Ptro.22")
    assert chimp.size == 50 and (chimp != CODE_N).sum() == 16


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        (TINY_MAF, {"source": "Hsap.X"}, r"no 's' row of 'Hsap.X'; rows seen: Ggor.22 \(2\), Hsap.22 \(3\), Ptro.22"),
        (TINY_MAF, {"length": 41}, "srcSize 40, expected 41"),
        ("a\ns Hsap.22 5 9 + 40 ACGT-ACGT\n", {}, "size 9, its text holds 8 letters"),
        ("a\ns Hsap.22 5 4 + 40 ACGT\na\ns Hsap.22 7 4 + 40 ACGT\n", {}, "overlaps the block of line 2"),
        ("a\ns Hsap.22 38 4 + 40 ACGT\n", {}, "runs past srcSize 40"),
        ("a\ns Hsap.22 0 4 + 40 ACGT\na\ns Hsap.22 9 4 + 41 ACGT\n", {}, "srcSize 41, earlier rows 40"),
        ("a\ns Hsap.22 0 4 ? 40 ACGT\n", {}, "strand must be"),
        ("a\ns Hsap.22 0 4 + 40\n", {}, "expected 7 fields"),
    ],
)
def test_maf_reference_errors(tmp_path, text, kwargs, message):
    path = tmp_path / "bad.maf"
    path.write_text(text)
    kwargs = {"source": "Hsap.22", **kwargs}
    source = kwargs.pop("source")
    with pytest.raises(ValueError, match=message) as error:
        read_maf_reference(path, source, **kwargs)
    assert str(path) in str(error.value)


def _annotation(path, rows):
    lines = ["#NAME\tCHROM\tSTRAND\tTX_START\tTX_END\tEXON_START\tEXON_END"]
    for name, chrom, strand, start, end in rows:
        lines.append(f"{name}\t{chrom}\t{strand}\t{start}\t{end}\t{start},\t{end},")
    path.write_text("\n".join(lines) + "\n")
    return path


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fixture_cache(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("fixture"))


def test_extra_chromosome_in_the_cache(tmp_path):
    cache = write_fixture(tmp_path / "cache", length=20_000)
    before = json.loads((cache / "manifest.json").read_text())
    with pytest.raises(DataNotFoundError, match="--chromosomes F 22"):
        load_chromosome(cache, "22")
    assert not has_chromosome(cache, "22") and has_chromosome(cache, "chrF")
    maf = tmp_path / "tiny.maf"
    maf.write_text(TINY_MAF)
    genes = [("G1", "chr22", "+", 6, 12), ("G2", "22", "-", 20, 35), ("OUT", "22", "+", 41, 50), ("X1", "X", "+", 6, 9)]
    annotation = _annotation(tmp_path / "genes.txt", genes)
    entry = prepare_maf_chromosome(maf, annotation, cache, chrom="22", length=40, source="tiny chr22")
    assert entry["length_bp"] == 40 and entry["non_n_bp"] == 17 and entry["aligned_blocks"] == 3
    assert entry["genes"] == 2 and entry["genes_tss_aligned"] == 1  # G2's TSS (34) is N; OUT lies past the end
    after = json.loads((cache / "manifest.json").read_text())
    assert {key: after[key] for key in before} == before  # the first chromosome's entries are untouched
    for name, described in after["chromosomes"]["22"]["files"].items():
        content = (cache / name).read_bytes()
        assert described == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    data = load_chromosome(cache, "chr22")
    np.testing.assert_array_equal(data.codes, _expected_tiny())
    assert data.chrom == "22" and data.source == "tiny chr22"
    assert [(g.name, g.tss) for g in data.genes] == [("G1", 6), ("G2", 34)]
    assert [m.matrix_id for m in data.motifs] == [m.matrix_id for m in load_data(cache).motifs]
    assert has_chromosome(cache, "22") and load_chromosome(cache, "chrF").source.startswith("fixture")
    # preparing the first chromosome again keeps the extra one described
    eval_data.prepare_cache(
        tmp_path / "cache" / "raw" / "fixture.fa", data.motifs, tmp_path / "cache" / "raw" / "genes.txt", cache,
        chrom="chrF", source="fixture (synthetic)",
    )  # fmt: skip
    assert json.loads((cache / "manifest.json").read_text())["chromosomes"] == after["chromosomes"]
    (cache / "genome" / "chr22_GRCh37.seq.npz").unlink()
    assert not has_chromosome(cache, "22")
    with pytest.raises(DataNotFoundError, match="chr22_GRCh37.seq.npz: missing"):
        load_chromosome(cache, "22")


def test_prepare_needs_a_cache_and_fetch_checks_its_arguments(tmp_path):
    maf = tmp_path / "tiny.maf"
    maf.write_text(TINY_MAF)
    annotation = _annotation(tmp_path / "genes.txt", [])
    with pytest.raises(DataNotFoundError, match="no prepared cache to add chr22"):
        prepare_maf_chromosome(maf, annotation, tmp_path / "empty", length=40)
    with pytest.raises(ValueError, match=r"chromosomes: expected X and/or 22, got \['Y'\]"):
        fetch(tmp_path / "empty", chromosomes=["Y"])
    with pytest.raises(DataNotFoundError, match="chr22 needs the chrX data first"):  # before any download
        fetch(tmp_path / "empty", chromosomes=["22"])


def _write_maf(path, codes, blocks, source="Hsap.22"):
    """``codes[start:end]`` of every block as a human row (a gap column every 50 letters) plus a chimp row."""
    letters = np.frombuffer(b"ACGTN", dtype=np.uint8)[codes].tobytes().decode()
    lines = ["##maf version=1"]
    for start, end in blocks:
        text = "-".join(letters[i : min(i + 50, end)] for i in range(start, end, 50))
        lines += ["a", f"s {source} {start} {end - start} + {codes.size} {text}",
                  f"s Ptro.22 {start} {len(text)} + {codes.size + 100} {text.replace('-', 'A')}", ""]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def chr22_cache(tmp_path_factory, fixture_cache):
    """A copy of the fixture cache plus a second synthetic chromosome "22" (200 kbp), written as MAF blocks with
    unaligned stretches between them and added through the MAF path."""
    tmp_path = tmp_path_factory.mktemp("chr22")
    other = write_fixture(tmp_path / "other", length=200_000, seed=1)
    codes = load_data(other).codes
    blocks = [(0, 70_000), (71_000, 130_000), (132_500, 200_000)]  # N at 70-71 kb, 130-132.5 kb, and the raw N
    _write_maf(tmp_path / "other.maf", codes, blocks)
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(fixture_cache / "manifest.json", cache)  # a copy of the fixture cache (not its sim/)
    for name in ("motifs", "genome", "tss"):
        shutil.copytree(fixture_cache / name, cache / name)
    annotation = tmp_path / "genes22.txt"  # the second fixture's genes, on chromosome 22
    annotation.write_text((other / "raw" / "genes.txt").read_text().replace("\tchrF\t", "\tchr22\t"))
    entry = prepare_maf_chromosome(
        tmp_path / "other.maf", annotation, cache, chrom="22", length=None, source="fixture chr22"
    )
    assert entry["genes"] == 9 and entry["non_n_bp"] == 200_000 - 3_000 - 1_000 - 2_500
    return cache


def test_held_out_test_set_has_variants(fixture_cache, chr22_cache):
    """The second chromosome becomes a held-out test set simulated by the first chromosome's calibrated simulator;
    its variants obey the generator's rules."""
    benchmark = load_benchmark(fixture=fixture_cache)
    cache = chr22_cache
    test_set = load_test_chromosome(benchmark, "22", cache)
    assert test_set.held_out and test_set.data.chrom == "22" and test_set.data.length == 200_000
    assert test_set.intervals("test") == [(0, 200_000)] and test_set.intervals("train") == []
    assert benchmark.intervals("test") == [(350_000, 600_000)]
    np.testing.assert_array_equal(test_set.simulator.mu, benchmark.simulator.mu)  # calibrated on the first
    assert test_set.simulator.enhancer_k == benchmark.simulator.enhancer_k
    assert test_set.simulator.fingerprint() != benchmark.simulator.fingerprint()
    assert test_set.simulation.n_bins == -(-200_000 // 128)
    assert test_set.simulation.n_fraction[70_000 // 128 + 1] == 1.0  # the unaligned stretch is N
    assert (cache / "sim" / f"{test_set.simulator.fingerprint()}.scan.npz").exists()
    again = load_test_chromosome(benchmark, "22", cache)  # from the cached scan, identical
    np.testing.assert_array_equal(again.simulation.tracks, test_set.simulation.tracks)
    # the first chromosome's simulator (PWMs against its composition, its calibration) run on this sequence
    same = benchmark.simulator.with_codes(test_set.data.codes).run()
    np.testing.assert_array_equal(same.tracks, test_set.simulation.tracks)
    # (a simulator built on the sequence itself takes the PWMs' background from it: other tracks)
    own = Simulator(test_set.data, SimulatorConfig.fixture(), calibration=benchmark.simulator.calibration()).run()
    assert not np.allclose(own.tracks, test_set.simulation.tracks)

    config = VariantConfig.fixture()
    variants = generate_variants(
        test_set.simulator, test_set.simulation, config, reach_bp=31 * 128, split_bounds=test_set.intervals("test")
    )
    positives = [v for v in variants if v.label == 1]
    negatives = [v for v in variants if v.label == 0]
    assert len(positives) >= 5 and len(negatives) == 2 * len(positives)
    assert all(abs(v.true_effect) >= config.threshold for v in positives)
    assert all(abs(v.true_effect) < config.threshold * config.negative_fraction for v in negatives)
    sequence = test_set.data.codes
    assert all(sequence[v.position] != CODE_N and "ACGT"[sequence[v.position]] == v.ref for v in variants)
    tss = {(g.name, g.tss) for g in test_set.data.genes}
    assert {(v.gene, v.tss) for v in variants} <= tss
    assert all(abs(v.position - v.tss) == v.distance < 31 * 128 for v in variants)


def test_same_chromosome_is_the_benchmark_itself(fixture_cache):
    benchmark = load_benchmark(fixture=fixture_cache)
    assert load_test_chromosome(benchmark, "chrF", fixture_cache) is benchmark
    with pytest.raises(DataNotFoundError, match="no chromosome '22'"):
        load_test_chromosome(benchmark, "22", fixture_cache)


@pytest.mark.skipif(
    not has_chromosome(None, "22"),
    reason="real chr22 not cached: run `python -m kvbound.eval.data fetch --chromosomes X 22` "
    "(set KVBOUND_CACHE to the cache, e.g. eval/.cache)",
)
def test_real_chr22_cache():
    cache = eval_data.default_cache_dir()
    manifest = json.loads((cache / "manifest.json").read_text())
    entry = manifest["chromosomes"]["22"]
    data = load_chromosome(None, "22")
    assert data.length == eval_data.GRCH37_CHR22_BP == 51_304_566
    aligned = int((data.codes != CODE_N).sum())
    assert aligned == entry["non_n_bp"] and 21_000_000 < aligned < 22_000_000
    assert (data.codes[: 16_000_000] == CODE_N).all()  # the short arm and the first aligned block's start
    assert entry["aligned_span"][0] > 16_000_000 and entry["aligned_span"][1] <= data.length
    assert 400 < len(data.genes) < 700 and all(0 <= g.tss < data.length for g in data.genes)
    assert entry["genes_tss_aligned"] == sum(1 for g in data.genes if data.codes[g.tss] != CODE_N)
    for name, described in entry["files"].items():
        content = (cache / name).read_bytes()
        assert described == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    assert manifest["chrom"] == "X" and manifest["length_bp"] == 69_999_930  # chrX untouched


def _quality_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_eval_cli_with_a_held_out_chromosome(chr22_cache, tmp_path, capsys):
    """``kvbound eval --test-chromosomes X 22`` on the fixture: per-chromosome and pooled columns, chrX's untouched."""
    from kvbound.eval import cli

    common = ["--fixture", str(chr22_cache), "--weights-dir", str(tmp_path / "none"), "--models", "alphagenome",
              "--windows", "1", "--max-variants", "6", "--block-size", "16", "--device", "cpu", "--scaling", "",
              "--layer-windows", "0"]  # fmt: skip
    argv = [*common, "--settings", "default", "--out", str(tmp_path / "x"), "--test-chromosomes", "X", "22"]
    assert cli.main(argv) == 0
    rows = _quality_rows(tmp_path / "x" / "quality.csv")
    assert [row["setting"] for row in rows][0] == "exact" and len(rows) == 2
    variants_22 = list(csv.DictReader(open(tmp_path / "x" / "variants_chr22.csv")))
    positives_22 = sum(int(v["label"]) for v in variants_22)
    assert positives_22 >= 1 and len(variants_22) == 3 * positives_22
    for row in rows:
        assert row["test_chromosomes"] == "X,22" and row["auroc_all_chrX"] == row["auroc_all"]
        assert int(row["variants_chr22"]) == len(variants_22) and int(row["positives_chr22"]) == positives_22
        assert int(row["variants_pooled"]) == int(row["variants"]) + len(variants_22)
        assert int(row["windows_chr22"]) >= 1
        for column in ("auroc_all_chr22", "auroc_all_pooled", "pearson_mean_chr22", "auroc_drop_pooled_low"):
            assert 0 <= abs(float(row[column])) <= 1, column
    exact = rows[0]
    assert float(exact["auroc_drop_chr22"]) == 0 and float(exact["auroc_drop_pooled"]) == 0
    effects = _quality_rows(tmp_path / "x" / "effects_chr22.csv")
    assert len(effects) == 2 * len(variants_22) and {e["setting"] for e in effects} == {r["setting"] for r in rows}
    meta = json.loads((tmp_path / "x" / "eval_run.json").read_text())
    assert meta["test_chromosomes"] == ["X", "22"] and meta["held_out"] == {"22": "fixture chr22"}

    # the default: chrX only, no new columns or files, the same chrX numbers
    assert cli.main([*common, "--settings", "exact", "--out", str(tmp_path / "plain")]) == 0
    plain = _quality_rows(tmp_path / "plain" / "quality.csv")
    assert not any(key.endswith(("_chr22", "_pooled", "_chrX")) or key == "test_chromosomes" for key in plain[0])
    assert not (tmp_path / "plain" / "effects_chr22.csv").exists()
    assert len(plain) == 1
    for key in ("auroc_all", "pearson_mean", "variants", "windows", "auroc_vs_random"):
        assert plain[0][key] == exact[key], key
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main([*common, "--out", str(tmp_path / "bad"), "--test-chromosomes", "22"])
    assert info.value.code == 2 and "--test-chromosomes: expected X first" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before anything ran
