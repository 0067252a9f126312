"""Shape-file parsing of kvbound.bench."""

from pathlib import Path

import pytest

from kvbound.bench.shapes import AttentionShape, default_shape_files, load_shapes, parse_shapes

REPO = Path(__file__).resolve().parents[1]

TEXT = """
[defaults]
heads = 4
dtype = "float16"

[[shape]]
name = "a"
seq_len = 256
head_dim = 64

[[shape]]
name = "b"
q_heads = 8
kv_heads = 1
q_len = 128
kv_len = 512
head_dim_qk = 128
head_dim_v = 192
bias = "tile"
softcap = 5
flex_options = { BLOCK_M = 64, BLOCK_N = 32 }
"""


def test_parse_defaults_and_shorthands():
    a, b = parse_shapes(TEXT, "t.toml")
    assert (a.q_heads, a.kv_heads, a.q_len, a.kv_len, a.head_dim_qk, a.head_dim_v) == (4, 4, 256, 256, 64, 64)
    assert a.dtype == "float16" and a.batch == 1 and a.causal is False and a.bias == "none"
    assert (b.q_heads, b.kv_heads, b.group) == (8, 1, 8)
    assert (b.q_len, b.kv_len, b.head_dim_qk, b.head_dim_v) == (128, 512, 128, 192)
    assert b.softcap == 5.0 and isinstance(b.softcap, float)
    assert dict(b.flex_options) == {"BLOCK_M": 64, "BLOCK_N": 32}
    assert b.scale == pytest.approx(128**-0.5)


@pytest.mark.parametrize(
    "extra, message",
    [
        ('heds = 4', "unknown key 'heds'"),
        ('q_heads = 6\nkv_heads = 4', "multiple of kv_heads"),
        ('dtype = "int8"', "dtype"),
        ('bias = "alibi"', "bias"),
        ('bias = "tile"\nbias_tile = 48', "bias_tile"),
        ('softcap = -1', "softcap"),
        ('zero_tile_share = 1.5', "zero_tile_share"),
    ],
)
def test_invalid_shapes_name_the_key(extra, message):
    text = f'[[shape]]\nname = "x"\nseq_len = 64\nhead_dim = 32\n{extra}\n'
    with pytest.raises(ValueError, match=message):
        parse_shapes(text, "bad.toml")


def test_missing_and_duplicate_names():
    with pytest.raises(ValueError, match="missing"):
        parse_shapes('[[shape]]\nname = "x"\nseq_len = 64\n', "m.toml")
    with pytest.raises(ValueError, match="appears twice"):
        parse_shapes('[[shape]]\nname = "x"\nseq_len = 8\nhead_dim = 8\n' * 2, "d.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        parse_shapes("[[shape]\n", "broken.toml")


def test_repository_shape_files_hold_the_seed_and_model_shapes():
    shapes = {s.name: s for s in load_shapes(default_shape_files())}
    seed = [s for s in shapes.values() if s.family == "seed"]
    assert sorted((s.q_len, s.head_dim_qk) for s in seed) == sorted(
        (n, d) for n in (4096, 16384, 65536) for d in (64, 128)
    )
    assert all(s.batch == 1 and s.q_heads == s.kv_heads == 8 and not s.causal and s.dtype == "bfloat16"
               for s in seed)
    enformer, borzoi, alphagenome = shapes["enformer"], shapes["borzoi"], shapes["alphagenome"]
    assert (enformer.q_len, enformer.q_heads, enformer.head_dim_qk, enformer.head_dim_v) == (1536, 8, 64, 192)
    assert (borzoi.q_len, borzoi.q_heads, borzoi.head_dim_qk, borzoi.head_dim_v) == (4096, 8, 64, 192)
    assert (alphagenome.q_len, alphagenome.q_heads, alphagenome.kv_heads) == (8192, 8, 1)
    assert (alphagenome.head_dim_qk, alphagenome.head_dim_v) == (128, 192)
    assert (alphagenome.bias, alphagenome.bias_tile, alphagenome.softcap) == ("tile", 16, 5.0)


def test_smoke_shapes_are_small():
    for s in load_shapes(default_shape_files(cpu_smoke=True)):
        assert isinstance(s, AttentionShape)
        assert s.q_len * s.kv_len * s.q_heads <= 2 * 128 * 128
    assert (REPO / "benchmarks" / "shapes" / "smoke.toml").is_file()


def test_load_shapes_reports_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_shapes([tmp_path / "nope.toml"])


def test_every_committed_shape_file_parses():
    from kvbound.bench.providers import all_providers

    files = sorted((REPO / "benchmarks" / "shapes").glob("*.toml"))
    assert len(files) >= 4
    names = {p.name for p in all_providers()}
    for path in files:
        for s in load_shapes([path]):
            assert set(s.providers) <= names, (path.name, s.name, s.providers)
    residual_free = load_shapes([REPO / "benchmarks" / "shapes" / "residual_free.toml"])
    seed = {s.name: s for s in load_shapes([REPO / "benchmarks" / "shapes" / "seed.toml"])}
    for s in residual_free:
        twin = seed[s.name.replace("residual-free", "seed")]  # same problem as a seed shape, other name
        assert (s.q_len, s.head_dim_qk, s.q_heads, s.dtype) == (twin.q_len, twin.head_dim_qk, twin.q_heads, twin.dtype)
        assert s.zero_tile_share == 1.0 and s.family != "seed"
