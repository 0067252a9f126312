"""Real data for the quality benchmark: fetched by a command, cached outside the repository, never committed.

``python -m kvbound.eval.data fetch [--cache DIR]`` fills the cache (default ``~/.cache/kvbound``, or the
directory named by the environment variable ``KVBOUND_CACHE``) from three real sources:

========================  ======================================================  ============================
what                      source                                                  licence
========================  ======================================================  ============================
human chrX, GRCh37,       Debian package ``smalt-examples`` (``apt-get download``, GPL-3 (the package)
first 70,000,000 bp       file ``hs37chrXtrunc.fa.gz``)
TF motifs (PFMs)          JASPAR 2024 CORE vertebrates, non-redundant (latest      CC BY 4.0
                          version of each matrix), through ``pyjaspar==4.0.0``
TSS positions, GRCh37     ``spliceai==1.3.1`` wheel, ``annotations/grch37.txt``    GPL-3
                          (0-based ``TX_START``, half-open ``TX_END``, strand)
human chr22, GRCh37       opt-in (``fetch --chromosomes X 22``): Debian package    CeCILL (the package)
(21.6 Mbp aligned, the    ``maffilter-examples``, the human rows (``Hsap.22``) of
rest N)                   ``Gorilla/Compara.epo_5_catarrhini_hsap-projected.chr22
                          .subset.nogap.cleaned_aln.maf.gz`` (EPO 5 catarrhini)
========================  ======================================================  ============================

Cache layout (all small, so that the cache can travel with a working tree to a machine without network)::

    <cache>/genome/chrX_GRCh37.seq.npz        2-bit packed A/C/G/T + N intervals (about 17.5 MB)
    <cache>/motifs/JASPAR2024_CORE_vertebrates_nr.jaspar   879 PFMs in JASPAR text format
    <cache>/tss/GRCh37_chrX_genes.tsv         name, strand, tss (0-based), tx_start, tx_end
    <cache>/manifest.json                     sources, versions, sizes, sha256 of every file
    <cache>/genome/chr22_GRCh37.seq.npz       opt-in second chromosome (held out entirely: a second test set),
    <cache>/tss/GRCh37_chr22_genes.tsv        described under ``"chromosomes": {"22": ...}`` in the manifest
    <cache>/sim/                              simulated tracks, keyed by the simulator's config

The same file formats are produced for the synthetic fixture (:func:`write_fixture`), which goes through the
same parsers, so the whole pipeline is tested without network.

Base codes used throughout: A=0, C=1, G=2, T=3, N (and any other IUPAC letter) = 4.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "BASES",
    "CODE_N",
    "GRCH37_CHR22_BP",
    "EvalData",
    "Gene",
    "Motif",
    "DataNotFoundError",
    "default_cache_dir",
    "chromosome_files",
    "fetch",
    "has_chromosome",
    "load_chromosome",
    "load_data",
    "pack_sequence",
    "prepare_cache",
    "prepare_maf_chromosome",
    "read_fasta",
    "read_jaspar",
    "read_maf_reference",
    "read_spliceai_annotation",
    "unpack_sequence",
    "write_fixture",
    "write_jaspar",
]

BASES = "ACGT"
CODE_N = 4

GENOME_FILE = "genome/chrX_GRCh37.seq.npz"
MOTIF_FILE = "motifs/JASPAR2024_CORE_vertebrates_nr.jaspar"
GENES_FILE = "tss/GRCh37_chrX_genes.tsv"
MANIFEST_FILE = "manifest.json"

SMALT_PACKAGE = "smalt-examples"
SMALT_FASTA = "usr/share/doc/smalt/test/data/hs37chrXtrunc.fa.gz"
SPLICEAI_REQUIREMENT = "spliceai==1.3.1"
SPLICEAI_ANNOTATION = "spliceai/annotations/grch37.txt"
PYJASPAR_REQUIREMENT = "pyjaspar==4.0.0"

# Second, held-out chromosome: human chr22 (GRCh37) from the human rows of a primate MAF alignment.
MAFFILTER_PACKAGE = "maffilter-examples"
MAFFILTER_MAF = (
    "usr/share/doc/maffilter/examples/Gorilla/"
    "Compara.epo_5_catarrhini_hsap-projected.chr22.subset.nogap.cleaned_aln.maf.gz"
)
MAF_HUMAN_SOURCE = "Hsap.22"
GRCH37_CHR22_BP = 51_304_566
EXTRA_CHROMOSOMES = ("22",)

# ASCII -> base code; everything that is not A/C/G/T (either case) is N.
_ENCODE = np.full(256, CODE_N, dtype=np.uint8)
for _code, _base in enumerate(BASES):
    _ENCODE[ord(_base)] = _code
    _ENCODE[ord(_base.lower())] = _code


class DataNotFoundError(FileNotFoundError):
    """The cache lacks a file; the message says which one and the command that makes it."""


def _file_entries(cache: Path, names) -> dict[str, dict]:
    """Manifest entries of cached files: their size and SHA-256."""
    entries = {}
    for name in names:
        content = (cache / name).read_bytes()
        entries[name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    return entries


def default_cache_dir() -> Path:
    """``$KVBOUND_CACHE`` if set, else ``~/.cache/kvbound``."""
    env = os.environ.get("KVBOUND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvbound"


# --------------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Motif:
    """A position frequency matrix: ``counts[position, base]`` with bases in A, C, G, T order."""

    matrix_id: str
    name: str
    counts: np.ndarray

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.float64)
        if counts.ndim != 2 or counts.shape[1] != 4 or counts.shape[0] < 1:
            raise ValueError(f"Motif {self.matrix_id}: counts must be [length, 4], got shape {counts.shape}")
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise ValueError(f"Motif {self.matrix_id}: counts must be finite and >= 0")
        object.__setattr__(self, "counts", counts)

    @property
    def length(self) -> int:
        return self.counts.shape[0]


@dataclass(frozen=True)
class Gene:
    """A transcript's TSS: 0-based ``tss`` (``tx_start`` on +, ``tx_end - 1`` on -)."""

    name: str
    strand: str
    tss: int
    tx_start: int
    tx_end: int


@dataclass(frozen=True)
class EvalData:
    """Everything the simulator needs: one chromosome's base codes, the motifs and the genes on it."""

    chrom: str
    codes: np.ndarray  # uint8 [length], values 0..4
    motifs: tuple[Motif, ...]
    genes: tuple[Gene, ...]
    source: str  # "GRCh37 chrX (smalt-examples)" or "fixture"

    @property
    def length(self) -> int:
        return int(self.codes.shape[0])

    def motif(self, name: str) -> Motif:
        """The motif called ``name`` (case-insensitive; the first one in file order if several share it)."""
        wanted = name.upper()
        for motif in self.motifs:
            if motif.name.upper() == wanted:
                return motif
        raise KeyError(f"motif {name!r}: not among the {len(self.motifs)} motifs of {self.source}")


# --------------------------------------------------------------------------------------------------- FASTA
def read_fasta(path: str | os.PathLike, *, progress: bool = False) -> dict[str, np.ndarray]:
    """Read a (optionally gzipped) FASTA file into ``{first word of header: uint8 codes}``.

    Letters other than A/C/G/T (any case) become N (code 4). Blank lines are ignored.
    """
    path = Path(path)
    raw = _read_bytes(path, progress=progress)
    records: dict[str, np.ndarray] = {}
    if not raw.strip():
        return records
    if not raw.lstrip().startswith(b">"):
        raise ValueError(f"{path}: expected FASTA (first non-blank character '>'), got {raw.lstrip()[:20]!r}")
    for chunk in raw.split(b"\n>"):
        chunk = chunk.lstrip(b">")
        header, _, body = chunk.partition(b"\n")
        words = header.decode("ascii", "replace").split()
        if not words:
            raise ValueError(f"{path}: a FASTA header has no name")
        letters = body.replace(b"\n", b"").replace(b"\r", b"").replace(b" ", b"")
        if words[0] in records:
            raise ValueError(f"{path}: record {words[0]!r} appears twice")
        records[words[0]] = _ENCODE[np.frombuffer(letters, dtype=np.uint8)]
    return records


def _read_bytes(path: Path, *, progress: bool) -> bytes:
    total = path.stat().st_size
    with open(path, "rb") as raw:
        handle = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
        if not progress:
            return handle.read()
        from rich.progress import Progress

        out = io.BytesIO()
        with Progress(transient=True) as bar:
            task = bar.add_task(f"reading {path.name}", total=total)
            while block := handle.read(1 << 22):
                out.write(block)
                bar.update(task, completed=raw.tell())
        return out.getvalue()


# --------------------------------------------------------------------------------------------------- MAF
_MAF_GAPS = b"-."


def read_maf_reference(
    path: str | os.PathLike, source: str, *, length: int | None = None, progress: bool = False
) -> tuple[np.ndarray, dict]:
    """One sequence of a multiple alignment (MAF, optionally gzipped) at its own coordinates.

    ``source`` is the ``src`` field of the rows to read (e.g. ``Hsap.22``: rows
    ``s Hsap.22 <start> <size> <strand> <srcSize> <text>``, ``start`` 0-based on ``strand``). Returns uint8 codes
    of length ``srcSize`` (A/C/G/T of either case as bases, every other letter N, N outside the aligned blocks;
    ``-``-strand rows are reverse-complemented to the + strand) and statistics (blocks, aligned bp, alignment
    columns dropped because the row has a gap there, rows of other sources). Gap characters (``-``, ``.``) are
    dropped: columns where this sequence has a gap insert nothing into it.

    Raises ``ValueError`` naming the file and line when no row of ``source`` exists (listing the sources seen),
    when ``srcSize`` differs between rows or from ``length``, when a row's letters (gaps dropped) are not ``size``
    long, when a block runs past ``srcSize`` or when two blocks overlap.
    """
    path = Path(path)
    raw = _read_bytes(path, progress=progress)
    wanted = source.encode()
    pieces: list[tuple[int, int, bytes, int]] = []  # (+ strand start, size, letters, line number)
    others: dict[str, int] = {}
    src_size: int | None = None
    gap_columns = 0
    blocks = 0
    for number, line in enumerate(raw.split(b"\n"), start=1):
        if line[:1] == b"a" and (len(line) == 1 or line[1:2].isspace()):
            blocks += 1
            continue
        if not line.startswith(b"s ") and not line.startswith(b"s\t"):
            continue
        fields = line.split()
        if len(fields) != 7:
            raise ValueError(f"{path}:{number}: expected 7 fields in an 's' line (s src start size strand srcSize "
                             f"text), got {len(fields)}")
        if fields[1] != wanted:
            name = fields[1].decode("ascii", "replace")
            others[name] = others.get(name, 0) + 1
            continue
        start, size, strand, row_size = int(fields[2]), int(fields[3]), fields[4], int(fields[5])
        if src_size is None:
            src_size = row_size
            if length is not None and src_size != length:
                raise ValueError(f"{path}:{number}: {source} has srcSize {src_size:,}, expected {length:,}")
        elif row_size != src_size:
            raise ValueError(f"{path}:{number}: {source} has srcSize {row_size:,}, earlier rows {src_size:,}")
        text = fields[6]
        letters = text.translate(None, _MAF_GAPS)
        if len(letters) != size:
            raise ValueError(
                f"{path}:{number}: {source} row says size {size:,}, its text holds {len(letters):,} letters "
                "(gaps dropped)"
            )
        gap_columns += len(text) - len(letters)
        if strand not in (b"+", b"-"):
            raise ValueError(f"{path}:{number}: strand must be + or -, got {strand.decode('ascii', 'replace')!r}")
        if start < 0 or start + size > row_size:
            raise ValueError(f"{path}:{number}: block {start:,}+{size:,} runs past srcSize {row_size:,}")
        if strand == b"-":
            start = row_size - start - size
            letters = letters[::-1].translate(bytes.maketrans(b"ACGTacgt", b"TGCAtgca"))
        pieces.append((start, size, letters, number))
    if src_size is None:
        seen = ", ".join(f"{name} ({count})" for name, count in sorted(others.items())) or "none"
        raise ValueError(f"{path}: no 's' row of {source!r}; rows seen: {seen}")
    codes = np.full(src_size, CODE_N, dtype=np.uint8)
    pieces.sort()
    end = 0
    previous = 0
    for start, size, letters, number in pieces:
        if start < end:
            raise ValueError(
                f"{path}:{number}: {source} block at {start:,}+{size:,} overlaps the block of line {previous} "
                f"(ends at {end:,})"
            )
        codes[start : start + size] = _ENCODE[np.frombuffer(letters, dtype=np.uint8)]
        end, previous = start + size, number
    stats = {
        "blocks": blocks,
        "rows": len(pieces),
        "aligned_bp": int(sum(size for _, size, _, _ in pieces)),
        "non_n_bp": int((codes != CODE_N).sum()),
        "gap_columns_dropped": int(gap_columns),
        "first_aligned": int(pieces[0][0]),
        "last_aligned_end": int(end),
        "other_rows": dict(sorted(others.items())),
    }
    return codes, stats


def pack_sequence(codes: np.ndarray) -> dict[str, np.ndarray]:
    """Pack base codes into 2 bits per base plus N intervals (``n_starts``, ``n_ends``, half-open)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.ndim != 1:
        raise ValueError(f"codes: expected 1 dimension, got shape {codes.shape}")
    if codes.size and codes.max() > CODE_N:
        raise ValueError(f"codes: expected values 0..4, got max {int(codes.max())}")
    is_n = codes == CODE_N
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_n.view(np.int8), [0]])))
    bases = np.where(is_n, 0, codes).astype(np.uint8)
    padded = np.zeros(-(-bases.size // 4) * 4, dtype=np.uint8)
    padded[: bases.size] = bases
    quads = padded.reshape(-1, 4)
    packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
    return {
        "packed": packed.astype(np.uint8),
        "length": np.array(codes.size, dtype=np.int64),
        "n_starts": edges[0::2].astype(np.int64),
        "n_ends": edges[1::2].astype(np.int64),
    }


def unpack_sequence(packed: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of :func:`pack_sequence`."""
    length = int(packed["length"])
    data = np.asarray(packed["packed"], dtype=np.uint8)
    codes = np.stack([(data >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1)[:length].copy()
    for start, end in zip(packed["n_starts"], packed["n_ends"], strict=True):
        codes[int(start) : int(end)] = CODE_N
    return codes


# --------------------------------------------------------------------------------------------------- motifs
def write_jaspar(motifs: list[Motif] | tuple[Motif, ...], path: str | os.PathLike) -> None:
    """Write PFMs in JASPAR's plain-text format (``>ID NAME`` then one ``B [ counts ]`` row per base)."""
    lines = []
    for motif in motifs:
        lines.append(f">{motif.matrix_id}\t{motif.name}")
        for column, base in enumerate(BASES):
            values = " ".join(f"{value:g}" for value in motif.counts[:, column])
            lines.append(f"{base}  [ {values} ]")
    Path(path).write_text("\n".join(lines) + "\n")


def read_jaspar(path: str | os.PathLike) -> tuple[Motif, ...]:
    """Read PFMs in JASPAR's plain-text format (brackets optional)."""
    path = Path(path)
    motifs: list[Motif] = []
    header: list[str] | None = None
    rows: dict[str, list[float]] = {}

    def finish() -> None:
        if header is None:
            return
        if sorted(rows) != sorted(BASES):
            raise ValueError(f"{path}: motif {header[0]} has rows {sorted(rows)}, expected A, C, G, T")
        lengths = {len(values) for values in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"{path}: motif {header[0]} has rows of different lengths {sorted(lengths)}")
        counts = np.array([rows[base] for base in BASES], dtype=np.float64).T
        motifs.append(Motif(header[0], header[1] if len(header) > 1 else header[0], counts))

    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if line.startswith(">"):
            finish()
            header = line[1:].split(None, 1)
            if not header:
                raise ValueError(f"{path}:{number}: empty motif header")
            rows = {}
            continue
        if header is None:
            raise ValueError(f"{path}:{number}: matrix row before any '>' header")
        base, _, rest = line.partition(" ")
        base = base.strip().upper()
        if base not in BASES:
            raise ValueError(f"{path}:{number}: expected a row for A, C, G or T, got {base!r}")
        rows[base] = [float(value) for value in rest.replace("[", " ").replace("]", " ").split()]
    finish()
    return tuple(motifs)


# --------------------------------------------------------------------------------------------------- genes
def read_spliceai_annotation(path: str | os.PathLike, chrom: str) -> tuple[Gene, ...]:
    """Genes of ``chrom`` from SpliceAI's annotation table.

    The table is tab-separated with the header ``#NAME CHROM STRAND TX_START TX_END EXON_START EXON_END``;
    ``TX_START`` is 0-based and ``TX_END`` exclusive (SpliceAI adds 1 to ``TX_START`` to get 1-based
    coordinates), so the TSS is ``TX_START`` on the + strand and ``TX_END - 1`` on the - strand.
    Chromosome names are compared without a ``chr`` prefix. Sorted by TSS.
    """
    path = Path(path)
    wanted = chrom.removeprefix("chr")
    genes = []
    with open(path) as handle:
        header = handle.readline().rstrip("\n").lstrip("#").split("\t")
        expected = ["NAME", "CHROM", "STRAND", "TX_START", "TX_END"]
        if header[:5] != expected:
            raise ValueError(f"{path}: expected header columns {expected}, got {header[:5]}")
        for number, line in enumerate(handle, start=2):
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 5:
                raise ValueError(f"{path}:{number}: expected >= 5 tab-separated fields, got {len(fields)}")
            if fields[1].removeprefix("chr") != wanted:
                continue
            strand, start, end = fields[2], int(fields[3]), int(fields[4])
            if strand not in "+-" or len(strand) != 1 or end <= start:
                raise ValueError(f"{path}:{number}: bad strand/interval {strand!r} {start}-{end}")
            tss = start if strand == "+" else end - 1
            genes.append(Gene(fields[0], strand, tss, start, end))
    return tuple(sorted(genes, key=lambda gene: (gene.tss, gene.name)))


def write_genes(genes: tuple[Gene, ...] | list[Gene], path: str | os.PathLike) -> None:
    lines = ["name\tstrand\ttss\ttx_start\ttx_end"]
    lines += [f"{g.name}\t{g.strand}\t{g.tss}\t{g.tx_start}\t{g.tx_end}" for g in genes]
    Path(path).write_text("\n".join(lines) + "\n")


def read_genes(path: str | os.PathLike) -> tuple[Gene, ...]:
    path = Path(path)
    rows = path.read_text().splitlines()
    if not rows or rows[0].split("\t") != ["name", "strand", "tss", "tx_start", "tx_end"]:
        raise ValueError(f"{path}: expected header 'name strand tss tx_start tx_end'")
    genes = []
    for row in rows[1:]:
        name, strand, tss, start, end = row.split("\t")
        genes.append(Gene(name, strand, int(tss), int(start), int(end)))
    return tuple(genes)


# --------------------------------------------------------------------------------------------------- cache
def prepare_cache(
    fasta: str | os.PathLike,
    motifs: tuple[Motif, ...] | list[Motif],
    annotation: str | os.PathLike,
    cache_dir: str | os.PathLike,
    *,
    chrom: str,
    source: str,
    provenance: dict | None = None,
    progress: bool = False,
) -> Path:
    """Turn raw files (FASTA, PFMs, SpliceAI-style annotation) into the cache layout and write the manifest.

    Only the FASTA record named ``chrom`` is kept; only genes of ``chrom`` whose TSS lies inside it.
    """
    cache = Path(cache_dir)
    records = read_fasta(fasta, progress=progress)
    key = chrom if chrom in records else chrom.removeprefix("chr")
    if key not in records:
        raise ValueError(f"{fasta}: no record named {chrom!r}; records: {sorted(records)[:10]}")
    codes = records[key]
    genes = tuple(g for g in read_spliceai_annotation(annotation, chrom) if 0 <= g.tss < codes.size)
    if not motifs:
        raise ValueError("motifs: expected at least one motif, got none")
    for sub in ("genome", "motifs", "tss"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    np.savez(cache / GENOME_FILE, **pack_sequence(codes))
    write_jaspar(motifs, cache / MOTIF_FILE)
    write_genes(genes, cache / GENES_FILE)
    files = _file_entries(cache, (GENOME_FILE, MOTIF_FILE, GENES_FILE))
    manifest = {
        "source": source,
        "chrom": chrom,
        "length_bp": int(codes.size),
        "non_n_bp": int((codes != CODE_N).sum()),
        "motifs": len(motifs),
        "genes": len(genes),
        "files": files,
        "provenance": provenance or {},
    }
    try:  # the opt-in extra chromosomes stay described when the first one is prepared again
        extra = json.loads((cache / MANIFEST_FILE).read_text()).get("chromosomes")
    except (OSError, ValueError):
        extra = None
    if extra:
        manifest["chromosomes"] = extra
    (cache / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return cache


def chromosome_files(chrom: str) -> tuple[str, str]:
    """Cache paths (genome, genes) of an extra chromosome, e.g. ``genome/chr22_GRCh37.seq.npz``."""
    name = chrom.removeprefix("chr")
    return f"genome/chr{name}_GRCh37.seq.npz", f"tss/GRCh37_chr{name}_genes.tsv"


def prepare_maf_chromosome(
    maf: str | os.PathLike,
    annotation: str | os.PathLike,
    cache_dir: str | os.PathLike,
    *,
    chrom: str = "22",
    maf_source: str = MAF_HUMAN_SOURCE,
    length: int | None = GRCH37_CHR22_BP,
    source: str = "GRCh37 chr22 (maffilter-examples)",
    provenance: dict | None = None,
    progress: bool = False,
) -> dict:
    """Add a second chromosome to a prepared cache from the rows ``maf_source`` of a MAF alignment.

    Writes :func:`chromosome_files` (sequence in the encoding of the first chromosome's, N outside the aligned
    blocks; the genes of ``chrom`` in ``annotation`` whose TSS lies inside the chromosome) and describes them
    under ``manifest["chromosomes"][chrom]``; the first chromosome's entries and files stay as they are. The
    motifs are the cache's. Returns that manifest entry.
    """
    cache = Path(cache_dir)
    manifest_path = cache / MANIFEST_FILE
    if not manifest_path.exists():
        raise DataNotFoundError(
            f"{manifest_path}: no prepared cache to add chr{chrom.removeprefix('chr')} to (its motifs and the "
            f"simulator's calibration come from the first chromosome); run "
            f"`python -m kvbound.eval.data fetch --cache {cache}` first"
        )
    name = chrom.removeprefix("chr")
    codes, stats = read_maf_reference(maf, maf_source, length=length, progress=progress)
    genes = tuple(g for g in read_spliceai_annotation(annotation, name) if 0 <= g.tss < codes.size)
    aligned_tss = sum(1 for g in genes if codes[g.tss] != CODE_N)
    genome_file, genes_file = chromosome_files(name)
    for sub in ("genome", "tss"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
    np.savez(cache / genome_file, **pack_sequence(codes))
    write_genes(genes, cache / genes_file)
    files = _file_entries(cache, (genome_file, genes_file))
    entry = {
        "source": source,
        "chrom": name,
        "length_bp": int(codes.size),
        "non_n_bp": int((codes != CODE_N).sum()),
        "aligned_blocks": stats["rows"],
        "gap_columns_dropped": stats["gap_columns_dropped"],
        "aligned_span": [stats["first_aligned"], stats["last_aligned_end"]],
        "genes": len(genes),
        "genes_tss_aligned": aligned_tss,
        "files": files,
        "provenance": provenance or {},
    }
    manifest = json.loads(manifest_path.read_text())
    manifest.setdefault("chromosomes", {})[name] = entry
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return entry


def has_chromosome(cache_dir: str | os.PathLike | None, chrom: str) -> bool:
    """Whether the cache holds ``chrom`` (its first chromosome, or an extra one with all its files)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        manifest = json.loads((cache / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    name = chrom.removeprefix("chr")
    if name == str(manifest.get("chrom", "")).removeprefix("chr"):
        return True
    entry = manifest.get("chromosomes", {}).get(name)
    return entry is not None and all((cache / file).exists() for file in entry["files"])


def load_chromosome(cache_dir: str | os.PathLike | None, chrom: str, first: EvalData | None = None) -> EvalData:
    """``chrom`` of a prepared cache: its first chromosome (:func:`load_data`) or an extra one (e.g. ``22``, added
    by ``fetch --chromosomes X 22``), with the cache's motifs. ``first``: the cache's first chromosome when the
    caller has it loaded already (it is not read again). Raises :class:`DataNotFoundError` naming the fix."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    data = first if first is not None else load_data(cache)
    name = chrom.removeprefix("chr")
    if name == data.chrom.removeprefix("chr"):
        return data
    manifest = json.loads((cache / MANIFEST_FILE).read_text())
    entry = manifest.get("chromosomes", {}).get(name)
    first = data.chrom.removeprefix("chr")
    fix = f"run `python -m kvbound.eval.data fetch --chromosomes {first} {name} --cache {cache}`"
    if entry is None:
        known = [data.chrom, *manifest.get("chromosomes", {})]
        raise DataNotFoundError(f"{cache / MANIFEST_FILE}: no chromosome {name!r} (has {known}); {fix}")
    genome_file, genes_file = chromosome_files(name)
    for file in (genome_file, genes_file):
        if not (cache / file).exists():
            raise DataNotFoundError(f"{cache / file}: missing; {fix}")
    codes = _read_genome(cache / genome_file, entry["length_bp"])
    return EvalData(
        chrom=name, codes=codes, motifs=data.motifs, genes=read_genes(cache / genes_file), source=entry["source"]
    )


def _read_genome(path: Path, length_bp: int) -> np.ndarray:
    """A cached packed sequence, checked against the length its manifest records."""
    with np.load(path) as packed:
        codes = unpack_sequence(dict(packed))
    if codes.size != length_bp:
        raise ValueError(f"{path}: expected {length_bp} bp, got {codes.size}")
    return codes


def load_data(cache_dir: str | os.PathLike | None = None) -> EvalData:
    """Load a prepared cache (real data or fixture). Raises :class:`DataNotFoundError` naming the fix."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    manifest_path = cache / MANIFEST_FILE
    if not manifest_path.exists():
        raise DataNotFoundError(
            f"{manifest_path}: no prepared data; run `python -m kvbound.eval.data fetch --cache {cache}` "
            "(needs network: Debian and PyPI)"
        )
    manifest = json.loads(manifest_path.read_text())
    for name in (GENOME_FILE, MOTIF_FILE, GENES_FILE):
        if not (cache / name).exists():
            raise DataNotFoundError(f"{cache / name}: missing; run `python -m kvbound.eval.data fetch` again")
    codes = _read_genome(cache / GENOME_FILE, manifest["length_bp"])
    return EvalData(
        chrom=manifest["chrom"],
        codes=codes,
        motifs=read_jaspar(cache / MOTIF_FILE),
        genes=read_genes(cache / GENES_FILE),
        source=manifest["source"],
    )


def has_real_data(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether the cache holds the fetched real data (not a fixture)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        manifest = json.loads((cache / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("source", "").startswith("GRCh37")


# --------------------------------------------------------------------------------------------------- fetch
def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def _download_deb(package: str, work: Path) -> Path:
    """``apt-get download`` (after one ``apt-get update`` if the package list does not know it)."""
    result = _run(["apt-get", "download", package], work)
    if result.returncode != 0:
        update = _run(["apt-get", "update"], work)
        if update.returncode != 0:
            raise RuntimeError(f"apt-get update failed: {update.stderr.strip()[-500:]}")
        result = _run(["apt-get", "download", package], work)
    if result.returncode != 0:
        raise RuntimeError(f"apt-get download {package} failed: {result.stderr.strip()[-500:]}")
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package}: no .deb appeared in {work}")
    return debs[-1]


def _jaspar_motifs() -> tuple[tuple[Motif, ...], str]:
    try:
        import pyjaspar
        from pyjaspar import jaspardb
    except ImportError as error:
        raise RuntimeError(f"pyjaspar is needed for the motifs: pip install {PYJASPAR_REQUIREMENT}") from error
    db = jaspardb(release="JASPAR2024")
    records = db.fetch_motifs(collection="CORE", tax_group=["vertebrates"], all_versions=False)
    motifs = tuple(
        Motif(record.matrix_id, record.name, np.array([list(record.counts[b]) for b in BASES]).T) for record in records
    )
    return motifs, getattr(pyjaspar, "__version__", "4.0.0")


def _spliceai_annotation(work: Path, spliceai_wheel: str | os.PathLike | None) -> tuple[Path, Path]:
    """SpliceAI's GRCh37 table extracted into ``work`` (the wheel downloaded there unless given)."""
    if spliceai_wheel is None:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", SPLICEAI_REQUIREMENT, "-d", "."]
        result = _run(command, work)
        if result.returncode != 0:
            raise RuntimeError(f"pip download {SPLICEAI_REQUIREMENT} failed: {result.stderr[-500:]}")
        wheels = sorted(work.glob("spliceai-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {SPLICEAI_REQUIREMENT}: no wheel in {work}")
        spliceai_wheel = wheels[-1]
    annotation = work / "grch37.txt"
    with zipfile.ZipFile(spliceai_wheel) as wheel, open(annotation, "wb") as out:
        shutil.copyfileobj(wheel.open(SPLICEAI_ANNOTATION), out)
    return annotation, Path(spliceai_wheel)


def _extract_deb(deb_path: Path, member: str, work: Path) -> Path:
    extracted = work / f"deb-{deb_path.stem}"
    result = _run(["dpkg", "-x", str(deb_path.resolve()), str(extracted.resolve())], work)
    if result.returncode != 0:
        raise RuntimeError(f"dpkg -x {deb_path} failed: {result.stderr.strip()[-500:]}")
    path = extracted / member
    if not path.exists():
        raise RuntimeError(f"{deb_path.name}: expected {member} inside, not found")
    return path


def fetch(
    cache_dir: str | os.PathLike | None = None,
    *,
    deb: str | os.PathLike | None = None,
    spliceai_wheel: str | os.PathLike | None = None,
    force: bool = False,
    chromosomes: tuple[str, ...] | list[str] = ("X",),
    maf_deb: str | os.PathLike | None = None,
) -> Path:
    """Download the real sources and prepare the cache (see the module docstring).

    ``chromosomes``: ``X`` (the default; the motifs come with it) and optionally ``22``, the second, held-out
    chromosome (needs X in the cache or in the same call). ``deb`` / ``maf_deb`` / ``spliceai_wheel``: use these
    local files (smalt-examples, maffilter-examples .deb, spliceai wheel) instead of downloading them.
    """
    from rich.console import Console

    console = Console(stderr=True)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wanted = [str(c).removeprefix("chr") for c in chromosomes]
    unknown = [c for c in wanted if c not in ("X", *EXTRA_CHROMOSOMES)]
    if unknown or not wanted:
        raise ValueError(f"chromosomes: expected X and/or {', '.join(EXTRA_CHROMOSOMES)}, got {list(chromosomes)}")
    if "X" in wanted:
        if has_real_data(cache) and not force:
            console.print(f"[green]{cache}[/] already holds the real chrX data (use --force to fetch again)")
        else:
            _fetch_chrx(cache, console, deb=deb, spliceai_wheel=spliceai_wheel)
    if "22" in wanted:
        if not has_real_data(cache):
            raise DataNotFoundError(
                f"{cache}: chr22 needs the chrX data first (motifs, and the simulator calibrated on chrX); run "
                f"`python -m kvbound.eval.data fetch --chromosomes X 22 --cache {cache}`"
            )
        if has_chromosome(cache, "22") and not force:
            console.print(f"[green]{cache}[/] already holds chr22 (use --force to fetch again)")
        else:
            _fetch_chr22(cache, console, maf_deb=maf_deb, spliceai_wheel=spliceai_wheel)
    return cache


def _fetch_chrx(cache: Path, console, *, deb, spliceai_wheel) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="fetch-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)  # apt-get downloads as the _apt user when it can
        with console.status("chrX GRCh37: apt-get download smalt-examples"):
            deb_path = Path(deb) if deb is not None else _download_deb(SMALT_PACKAGE, work)
        console.print(f"chrX: {deb_path.name} ({deb_path.stat().st_size / 1e6:.1f} MB)")
        with console.status("chrX GRCh37: dpkg -x"):
            fasta = _extract_deb(deb_path, SMALT_FASTA, work)

        with console.status(f"motifs: JASPAR2024 through {PYJASPAR_REQUIREMENT}"):
            motifs, jaspar_version = _jaspar_motifs()
        console.print(f"motifs: {len(motifs)} JASPAR2024 CORE vertebrates non-redundant PFMs")

        with console.status(f"TSS: pip download --no-deps {SPLICEAI_REQUIREMENT}"):
            annotation, spliceai_wheel = _spliceai_annotation(work, spliceai_wheel)

        prepare_cache(
            fasta,
            motifs,
            annotation,
            cache,
            chrom="X",
            source="GRCh37 chrX (smalt-examples)",
            progress=True,
            provenance={
                "genome": f"Debian {deb_path.name}: {SMALT_FASTA} (GPL-3)",
                "motifs": f"JASPAR2024 CORE vertebrates non-redundant via pyjaspar {jaspar_version} (CC BY 4.0)",
                "genes": f"{Path(spliceai_wheel).name}: {SPLICEAI_ANNOTATION} (GPL-3)",
                "downloaded_bytes": {
                    "smalt_examples_deb": deb_path.stat().st_size,
                    "spliceai_wheel": Path(spliceai_wheel).stat().st_size,
                },
            },
        )
    manifest = json.loads((cache / MANIFEST_FILE).read_text())
    total = sum(entry["bytes"] for entry in manifest["files"].values())
    console.print(
        f"[green]ready[/]: {cache} - chr{manifest['chrom']} {manifest['length_bp']:,} bp "
        f"({manifest['non_n_bp']:,} non-N), {manifest['motifs']} motifs, {manifest['genes']} genes; "
        f"{total / 1e6:.1f} MB cached"
    )


def _fetch_chr22(cache: Path, console, *, maf_deb, spliceai_wheel) -> None:
    with tempfile.TemporaryDirectory(dir=cache, prefix="fetch-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        with console.status(f"chr22 GRCh37: apt-get download {MAFFILTER_PACKAGE}"):
            deb_path = Path(maf_deb) if maf_deb is not None else _download_deb(MAFFILTER_PACKAGE, work)
        console.print(f"chr22: {deb_path.name} ({deb_path.stat().st_size / 1e6:.1f} MB)")
        with console.status("chr22 GRCh37: dpkg -x"):
            maf = _extract_deb(deb_path, MAFFILTER_MAF, work)
        with console.status(f"TSS: pip download --no-deps {SPLICEAI_REQUIREMENT}"):
            annotation, spliceai_wheel = _spliceai_annotation(work, spliceai_wheel)
        entry = prepare_maf_chromosome(
            maf,
            annotation,
            cache,
            chrom="22",
            maf_source=MAF_HUMAN_SOURCE,
            length=GRCH37_CHR22_BP,
            source="GRCh37 chr22 (maffilter-examples)",
            progress=True,
            provenance={
                "genome": f"Debian {deb_path.name}: {MAFFILTER_MAF}, rows {MAF_HUMAN_SOURCE} (CeCILL); N outside "
                "the aligned blocks, alignment columns where the human row has a gap dropped",
                "genes": f"{Path(spliceai_wheel).name}: {SPLICEAI_ANNOTATION} (GPL-3)",
                "downloaded_bytes": {
                    "maffilter_examples_deb": deb_path.stat().st_size,
                    "spliceai_wheel": Path(spliceai_wheel).stat().st_size,
                },
            },
        )
    total = sum(file["bytes"] for file in entry["files"].values())
    console.print(
        f"[green]ready[/]: {cache} - chr22 {entry['length_bp']:,} bp ({entry['non_n_bp']:,} aligned, in "
        f"{entry['aligned_blocks']:,} blocks), {entry['genes']} genes ({entry['genes_tss_aligned']} with the TSS on "
        f"an aligned base); {total / 1e6:.1f} MB cached"
    )


# --------------------------------------------------------------------------------------------------- fixture
# Fixture motifs: short, high-information PFMs named like the simulator's roles (see simulate.FIXTURE_ROLES).
_FIXTURE_CONSENSUS = {
    "FIXP1": "GGGGCGGGG",
    "FIXP2": "CCAATCAG",
    "FIXE1": "TGACTCAT",
    "FIXE2": "CATTCCTA",
    "FIXE3": "AGATAAGG",
    "FIXE4": "CAGCTGTT",
    "FIXD1": "CCGCGAGGGCG",
}


def fixture_motifs() -> tuple[Motif, ...]:
    """Seven synthetic PFMs (90% consensus base, 10% spread over the rest, 20 sites each)."""
    motifs = []
    for index, (name, consensus) in enumerate(_FIXTURE_CONSENSUS.items()):
        counts = np.full((len(consensus), 4), 2.0 / 3.0)
        for position, base in enumerate(consensus):
            counts[position, BASES.index(base)] = 18.0
        motifs.append(Motif(f"FX{index:04d}.1", name, counts))
    return tuple(motifs)


def write_fixture(directory: str | os.PathLike, *, length: int = 600_000, seed: int = 0) -> Path:
    """Write a small synthetic data set in the raw formats, then prepare it as a cache in ``directory``.

    The sequence is random (40% GC) with a stretch of N, planted motif instances (so enhancers exist) and
    CpG-rich promoters at the genes' TSS. Returns the cache directory (loadable with :func:`load_data`).
    """
    rng = np.random.default_rng(seed)
    directory = Path(directory)
    raw = directory / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    codes = rng.choice(4, size=length, p=[0.3, 0.2, 0.2, 0.3]).astype(np.uint8)
    motifs = fixture_motifs()
    consensus = {m.name: np.array([BASES.index(b) for b in _FIXTURE_CONSENSUS[m.name]], np.uint8) for m in motifs}
    # enhancers: pairs of cooperating motifs planted 20-200 bp apart, about one pair per 4 kb
    pairs = [("FIXE1", "FIXE2"), ("FIXE3", "FIXE4")]
    for start in range(2_000, length - 2_000, 4_000):
        position = start + int(rng.integers(0, 3_000))
        first, second = pairs[int(rng.integers(0, 2))]
        for name, offset in ((first, 0), (second, int(rng.integers(20, 200)))):
            site = consensus[name]
            codes[position + offset : position + offset + site.size] = site
    # lone enhancer motifs and decoy motifs (bound, but without effect on expression)
    for name in ("FIXE1", "FIXE3", "FIXD1", "FIXD1"):
        for position in rng.integers(1_000, length - 1_000, size=length // 20_000):
            site = consensus[name]
            codes[position : position + site.size] = site
    # genes every ~20 kb with CpG-rich promoters carrying the promoter motifs
    gene_lines = ["#NAME\tCHROM\tSTRAND\tTX_START\tTX_END\tEXON_START\tEXON_END"]
    tss_positions = np.arange(10_000, length - 10_000, 20_000) + rng.integers(-3_000, 3_000, size=1)
    for number, tss in enumerate(tss_positions):
        tss = int(tss)
        promoter = rng.choice(4, size=600, p=[0.15, 0.35, 0.35, 0.15]).astype(np.uint8)
        promoter[100:109] = consensus["FIXP1"]
        promoter[300:308] = consensus["FIXP2"]
        codes[tss - 300 : tss + 300] = promoter
        strand = "+" if number % 2 == 0 else "-"
        start, end = (tss, tss + 5_000) if strand == "+" else (tss - 4_999, tss + 1)
        gene_lines.append(f"FXG{number:03d}\tchrF\t{strand}\t{start}\t{end}\t{start},\t{end},")
    n_start = length // 2
    codes[n_start : n_start + 3_000] = CODE_N
    letters = np.frombuffer(b"ACGTN", dtype=np.uint8)[codes]
    fasta = raw / "fixture.fa"
    with open(fasta, "wb") as handle:
        handle.write(b">chrF synthetic fixture\n")
        for offset in range(0, length, 60):
            handle.write(letters[offset : offset + 60].tobytes() + b"\n")
    annotation = raw / "genes.txt"
    annotation.write_text("\n".join(gene_lines) + "\n")
    jaspar = raw / "motifs.jaspar"
    write_jaspar(motifs, jaspar)
    return prepare_cache(fasta, read_jaspar(jaspar), annotation, directory, chrom="chrF", source="fixture (synthetic)")


# --------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbound.eval.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch_parser = sub.add_parser("fetch", help="download and prepare the real data")
    fetch_parser.add_argument(
        "--cache", type=Path, default=None, help="cache directory (default $KVBOUND_CACHE or ~/.cache/kvbound)"
    )
    fetch_parser.add_argument("--deb", type=Path, default=None, help="use this smalt-examples .deb")
    fetch_parser.add_argument("--spliceai-wheel", type=Path, default=None, help="use this spliceai wheel")
    fetch_parser.add_argument("--force", action="store_true", help="fetch even if the cache is complete")
    fetch_parser.add_argument(
        "--chromosomes",
        nargs="+",
        default=["X"],
        metavar="CHROM",
        help="X (default) and/or 22: chr22 from maffilter-examples, the second, held-out test chromosome",
    )
    fetch_parser.add_argument("--maf-deb", type=Path, default=None, help="use this maffilter-examples .deb (chr22)")
    fixture_parser = sub.add_parser("fixture", help="write the synthetic fixture as a cache")
    fixture_parser.add_argument("directory", type=Path)
    fixture_parser.add_argument("--length", type=int, default=600_000)
    fixture_parser.add_argument("--seed", type=int, default=0)
    info_parser = sub.add_parser("info", help="print the manifest of a cache")
    info_parser.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        fetch(
            args.cache,
            deb=args.deb,
            spliceai_wheel=args.spliceai_wheel,
            force=args.force,
            chromosomes=args.chromosomes,
            maf_deb=args.maf_deb,
        )
    elif args.command == "fixture":
        print(write_fixture(args.directory, length=args.length, seed=args.seed))
    else:
        cache = args.cache if args.cache is not None else default_cache_dir()
        print((cache / MANIFEST_FILE).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
