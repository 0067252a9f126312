"""Parsers and cache of kvbound.eval.data (tiny hand-written files; the real data only when it is cached)."""

import gzip

import numpy as np
import pytest

from kvbound.eval import data as eval_data
from kvbound.eval.data import (
    CODE_N,
    DataNotFoundError,
    Motif,
    load_data,
    pack_sequence,
    read_fasta,
    read_jaspar,
    read_spliceai_annotation,
    unpack_sequence,
    write_fixture,
    write_jaspar,
)

TINY_FASTA = b""">chr1 first record
ACGTN
acgtRY

>chr2
GG
CC
"""


@pytest.mark.parametrize("compressed", [False, True])
def test_read_fasta_tiny(tmp_path, compressed):
    path = tmp_path / ("tiny.fa.gz" if compressed else "tiny.fa")
    path.write_bytes(gzip.compress(TINY_FASTA) if compressed else TINY_FASTA)
    records = read_fasta(path)
    assert list(records) == ["chr1", "chr2"]
    np.testing.assert_array_equal(records["chr1"], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4])
    np.testing.assert_array_equal(records["chr2"], [2, 2, 1, 1])
    assert records["chr1"].dtype == np.uint8


def test_read_fasta_rejects_non_fasta_and_duplicates(tmp_path):
    (tmp_path / "bad.fa").write_bytes(b"ACGT\n")
    with pytest.raises(ValueError, match="expected FASTA"):
        read_fasta(tmp_path / "bad.fa")
    (tmp_path / "dup.fa").write_bytes(b">a\nAC\n>a\nGT\n")
    with pytest.raises(ValueError, match="appears twice"):
        read_fasta(tmp_path / "dup.fa")


@pytest.mark.parametrize("length", [1, 3, 4, 5, 1001])
def test_pack_unpack_roundtrip(length):
    rng = np.random.default_rng(length)
    codes = rng.integers(0, 5, size=length).astype(np.uint8)
    codes[: min(2, length)] = CODE_N  # N at the very start
    packed = pack_sequence(codes)
    assert packed["packed"].size == -(-length // 4)
    np.testing.assert_array_equal(unpack_sequence(packed), codes)


def test_jaspar_roundtrip_and_real_format(tmp_path):
    (tmp_path / "m.jaspar").write_text(
        ">MA0004.1\tArnt\nA  [ 4 19 0 0 0 0 ]\nC  [16 0 20 0 0 0 ]\nG  [ 0 1 0 20 0 20 ]\nT  [ 0 0 0 0 20 0 ]\n"
    )
    (motif,) = read_jaspar(tmp_path / "m.jaspar")
    assert (motif.matrix_id, motif.name, motif.length) == ("MA0004.1", "Arnt", 6)
    np.testing.assert_array_equal(motif.counts[0], [4, 16, 0, 0])
    np.testing.assert_array_equal(motif.counts[:, 3], [0, 0, 0, 0, 20, 0])
    write_jaspar([motif, Motif("X1", "TAL1::TCF3", np.eye(4)[[0, 1]])], tmp_path / "out.jaspar")
    again = read_jaspar(tmp_path / "out.jaspar")
    assert [m.name for m in again] == ["Arnt", "TAL1::TCF3"]
    np.testing.assert_array_equal(again[0].counts, motif.counts)


def test_jaspar_rejects_missing_row(tmp_path):
    (tmp_path / "m.jaspar").write_text(">M1 x\nA [1 2]\nC [1 2]\nG [1 2]\n")
    with pytest.raises(ValueError, match="rows"):
        read_jaspar(tmp_path / "m.jaspar")


def test_spliceai_annotation_tss(tmp_path):
    path = tmp_path / "grch37.txt"
    path.write_text(
        "#NAME\tCHROM\tSTRAND\tTX_START\tTX_END\tEXON_START\tEXON_END\n"
        "PLUS\tX\t+\t1000\t2000\t1000,\t2000,\n"
        "MINUS\tX\t-\t500\t900\t500,\t900,\n"
        "OTHER\t1\t+\t10\t20\t10,\t20,\n"
    )
    genes = read_spliceai_annotation(path, "chrX")
    assert [(g.name, g.strand, g.tss) for g in genes] == [("MINUS", "-", 899), ("PLUS", "+", 1000)]


def test_missing_cache_names_the_fetch_command(tmp_path):
    with pytest.raises(DataNotFoundError, match="kvbound.eval.data fetch"):
        load_data(tmp_path / "empty")


def test_fixture_goes_through_the_parsers(tmp_path):
    cache = write_fixture(tmp_path / "fx", length=60_000, seed=3)
    data = load_data(cache)
    assert data.length == 60_000 and data.source.startswith("fixture")
    assert len(data.motifs) == 7 and data.motif("fixe1").name == "FIXE1"
    assert len(data.genes) >= 2 and all(0 <= g.tss < data.length for g in data.genes)
    assert (data.codes == CODE_N).sum() == 3_000
    # CpG-rich promoters were planted at every TSS
    tss = data.genes[0].tss
    window = data.codes[tss - 300 : tss + 300]
    assert np.isin(window, (1, 2)).mean() > 0.55


@pytest.mark.skipif(
    not eval_data.has_real_data(), reason="real data not cached: run `python -m kvbound.eval.data fetch`"
)
def test_real_chrx_cache():
    data = load_data()
    assert data.chrom == "X" and data.length == 69_999_930
    non_n = data.codes[data.codes != CODE_N]
    assert non_n.size == 66_239_930
    gc = np.isin(non_n, (1, 2)).mean()
    assert 0.37 < gc < 0.41  # human chrX is ~39% GC
    assert len(data.motifs) == 879
    names = {g.name: g for g in data.genes}
    assert len(data.genes) > 300 and names["DMD"].strand == "-"
    assert (data.motif("CTCF").matrix_id, data.motif("CTCF").length) == ("MA0139.2", 15)  # first of two CTCF PFMs
