"""Attention shapes to benchmark, read from TOML shape lists in ``benchmarks/shapes/``.

A shape file holds an optional ``[defaults]`` table and an array of ``[[shape]]`` tables::

    [defaults]
    batch = 1
    dtype = "bfloat16"

    [[shape]]
    name = "seed-n4096-d64"
    heads = 8          # sets q_heads and kv_heads
    seq_len = 4096     # sets q_len and kv_len
    head_dim = 64      # sets head_dim_qk and head_dim_v

Every key of :class:`AttentionShape` may appear in either table; ``heads``, ``seq_len`` and ``head_dim`` are
shorthands for the pairs they set. Unknown keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

__all__ = ["AttentionShape", "BIAS_KINDS", "load_shapes", "parse_shapes", "default_shape_files", "shapes_dir"]

BIAS_KINDS = ("none", "tile", "relpos")
DTYPES = ("bfloat16", "float16", "float32")
_SHORTHANDS = {
    "heads": ("q_heads", "kv_heads"),
    "seq_len": ("q_len", "kv_len"),
    "head_dim": ("head_dim_qk", "head_dim_v"),
}


@dataclass(frozen=True)
class AttentionShape:
    """One attention problem: ``q [B, Hq, Nq, Dk]``, ``k [B, Hkv, Nk, Dk]``, ``v [B, Hkv, Nk, Dv]``.

    Args:
        name: unique label used in CSV rows and plots.
        family: ``"seed"`` (plain attention) or ``"model"`` (a genomic model's attention layer); free text.
        bias: ``"none"``; ``"tile"``, a pair bias constant over ``bias_tile x bias_tile`` token tiles
            (AlphaGenome); or ``"relpos"``, a relative-position bias that depends on ``i - j`` only.
        softcap: logits become ``softcap * tanh(logits / softcap)`` after the bias; 0 means none.
        zero_tile_share: share of K/V blocks whose generated residual is below the bound (see
            ``kvbound.bench.data``); the measured share is recorded with each row.
        eager_fp32_logits: the eager provider forms logits in float32 (as the AlphaGenome port does) instead of
            the input dtype (as the bf16-autocast ports do).
        providers: if non-empty, only these providers run on this shape.
        flex_options: FlexAttention ``kernel_options`` tried first for this shape.
    """

    name: str
    q_len: int
    kv_len: int
    head_dim_qk: int
    head_dim_v: int
    family: str = "seed"
    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 8
    causal: bool = False
    dtype: str = "bfloat16"
    bias: str = "none"
    bias_tile: int = 16
    softcap: float = 0.0
    zero_tile_share: float = 0.5
    eager_fp32_logits: bool = False
    providers: tuple[str, ...] = ()
    flex_options: tuple[tuple[str, int], ...] = field(default=())

    def __post_init__(self) -> None:
        where = f"shape {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"shape name: expected a non-empty string, got {self.name!r}")
        for key in ("q_len", "kv_len", "head_dim_qk", "head_dim_v", "batch", "q_heads", "kv_heads", "bias_tile"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {key}: expected an integer >= 1, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"{where}: q_heads: expected a multiple of kv_heads={self.kv_heads}, got {self.q_heads}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.bias not in BIAS_KINDS:
            raise ValueError(f"{where}: bias: expected one of {BIAS_KINDS}, got {self.bias!r}")
        if self.bias == "tile" and (self.q_len % self.bias_tile or self.kv_len % self.bias_tile):
            raise ValueError(
                f"{where}: bias_tile: expected a divisor of q_len={self.q_len} and kv_len={self.kv_len}, "
                f"got {self.bias_tile}"
            )
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)):
            raise ValueError(f"{where}: softcap: expected a number >= 0, got {self.softcap!r}")
        if not math.isfinite(self.softcap) or self.softcap < 0:
            raise ValueError(f"{where}: softcap: expected a finite number >= 0, got {self.softcap!r}")
        if not 0.0 <= float(self.zero_tile_share) <= 1.0:
            raise ValueError(f"{where}: zero_tile_share: expected a value in [0, 1], got {self.zero_tile_share!r}")
        object.__setattr__(self, "softcap", float(self.softcap))
        object.__setattr__(self, "zero_tile_share", float(self.zero_tile_share))
        object.__setattr__(self, "providers", tuple(self.providers))
        options = self.flex_options.items() if isinstance(self.flex_options, dict) else self.flex_options
        object.__setattr__(self, "flex_options", tuple(sorted((str(k), int(v)) for k, v in options)))

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.q_heads // self.kv_heads

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_qk)

    def describe(self) -> str:
        heads = f"H={self.q_heads}" if self.q_heads == self.kv_heads else f"Hq={self.q_heads}/Hkv={self.kv_heads}"
        dims = f"d={self.head_dim_qk}" if self.head_dim_qk == self.head_dim_v else (
            f"dk={self.head_dim_qk}/dv={self.head_dim_v}"
        )
        lens = f"N={self.q_len}" if self.q_len == self.kv_len else f"Nq={self.q_len}/Nk={self.kv_len}"
        extra = []
        if self.causal:
            extra.append("causal")
        if self.bias != "none":
            extra.append(f"{self.bias} bias")
        if self.softcap:
            extra.append(f"soft-cap {self.softcap:g}")
        return " ".join([f"B={self.batch}", heads, lens, dims, self.dtype, *extra])


_FIELD_NAMES = {f.name for f in fields(AttentionShape)}


def _expand(table: dict, where: str) -> dict:
    out: dict = {}
    for key, value in table.items():
        if key in _SHORTHANDS:
            for target in _SHORTHANDS[key]:
                out[target] = value
        elif key in _FIELD_NAMES:
            out[key] = value
        else:
            known = ", ".join(sorted(_FIELD_NAMES | set(_SHORTHANDS)))
            raise ValueError(f"{where}: unknown key {key!r}; expected one of: {known}")
    return out


def parse_shapes(text: str, source: str = "<string>") -> list[AttentionShape]:
    """Parse a TOML shape list (see the module docstring). ``source`` names the file in error messages."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{source}: not valid TOML: {err}") from err
    unknown = set(document) - {"defaults", "shape"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; expected [defaults] and [[shape]]")
    defaults = _expand(document.get("defaults", {}), f"{source} [defaults]")
    tables = document.get("shape", [])
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"{source}: expected at least one [[shape]] table")
    shapes = []
    for i, table in enumerate(tables):
        where = f"{source} [[shape]] #{i + 1} ({table.get('name', 'unnamed')})"
        merged = {**defaults, **_expand(table, where)}
        missing = [k for k in ("name", "q_len", "kv_len", "head_dim_qk", "head_dim_v") if k not in merged]
        if missing:
            raise ValueError(f"{where}: missing {missing} (seq_len and head_dim set both members of a pair)")
        shapes.append(AttentionShape(**merged))
    _check_unique(shapes, source)
    return shapes


def _check_unique(shapes: list[AttentionShape], source: str) -> None:
    seen: set[str] = set()
    for s in shapes:
        if s.name in seen:
            raise ValueError(f"{source}: shape name {s.name!r} appears twice")
        seen.add(s.name)


def load_shapes(paths: list[str | Path]) -> list[AttentionShape]:
    """Read and concatenate shape files; names must be unique across all of them."""
    shapes: list[AttentionShape] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"shape file: {path} does not exist")
        shapes.extend(parse_shapes(path.read_text(), str(path)))
    _check_unique(shapes, ", ".join(str(p) for p in paths))
    return shapes


def shapes_dir() -> Path:
    """``benchmarks/shapes`` of the repository: found from the working directory upwards, else next to the
    source tree (an editable install)."""
    for base in (Path.cwd(), *Path.cwd().parents):
        candidate = base / "benchmarks" / "shapes"
        if candidate.is_dir():
            return candidate
    return Path(__file__).resolve().parents[3] / "benchmarks" / "shapes"


def default_shape_files(cpu_smoke: bool = False) -> list[Path]:
    directory = shapes_dir()
    if cpu_smoke:
        return [directory / "smoke.toml"]
    return [directory / "seed.toml", directory / "models.toml"]
