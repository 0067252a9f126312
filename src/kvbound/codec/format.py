"""The compressed K/V container and its storage layout.

A tensor ``x`` of shape ``[B, H, N, D]`` is cut along N into ``NB = ceil(N / block_size)`` blocks. Block ``k``
of head ``(b, h)`` holds rows ``k * block_size .. min(N, (k + 1) * block_size) - 1`` and is stored in one of
four modes (``mode[b, h, k]``):

``MODE_LOWRANK`` (0)
    ``x_hat = C @ P``: the low-rank part alone is within tau; there is no residual (the fused kernel skips
    the residual work for such tiles).
``MODE_PACKED`` (1)
    ``x_hat = C @ P + q * scale`` with integer codes ``q`` of ``config.bits`` bits.
``MODE_PROMOTED`` (2)
    as ``MODE_PACKED`` with wider codes (``bits[b, h, k]`` in 4, 5, 6, 8): the block's residual did not fit
    ``config.bits`` at a step <= 2 tau; the narrowest width that certifies it is used.
``MODE_RAW`` (3)
    the block is kept exactly, in the input dtype, because no code above certifies the bound for it
    (outliers beyond 127 steps, magnitudes where float32 rounding alone approaches tau, tau below what the
    dtype resolves). Its coefficients are stored as zeros.

Tensors (all on one device):

``coeffs``  ``[B, H, N, r]`` float16 (float32 when a coefficient exceeds 2**15): ``C``.
``basis``   ``[H, r, D]`` float16, one projection per head (calibrated, shared by all blocks), or
            ``[B, H, NB, r, D]`` float16, one per block (exact per-block truncated SVD). Rows of ``P``.
``mode``    ``[B, H, NB]`` int8, as above.
``scale``   ``[B, H, NB]`` float32: the quantisation step of modes 1 and 2 (0 otherwise).
``bits``    ``[B, H, NB]`` int8: the code width of modes 1 and 2 (``config.bits`` for mode 1; 0 otherwise).
``offset``  ``[B, H, NB]`` int64: modes 1/2: index of the block's first word in ``codes``;
            mode 3: index of its first element in ``raw``; -1 otherwise.
``codes``   flat int32 words. A block of ``b``-bit codes (``b = bits[b, h, k]``)
            stores ``rows`` rows of ``words_per_row(b, D)`` words each; row ``n`` (block-local), column ``d``
            is ``u = (codes[offset + n * wpr + d // per_word] >> ((d % per_word) * b)) & (2**b - 1)`` with
            ``per_word = 32 // b``, and the code is ``q = u - 2**(b - 1)``.
``raw``     flat, input dtype: mode-3 blocks row-major, ``rows * D`` elements each.

Only the rows that exist are stored: the last block of a sequence whose N is not a multiple of the block
size stores ``N - k * block_size`` rows of codes or raw values.

``CompressedKV.validate`` (``check_layout``) checks every rule above; :func:`load` runs it on every file it reads,
and ``decompress`` checks what decoding relies on (dtypes, shapes, modes and code widths, reads in range).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field

import torch

from kvbound.config import CompressionConfig

__all__ = [
    "CompressedKV",
    "check_layout",
    "packed_layout",
    "promotion_widths",
    "MODE_LOWRANK",
    "MODE_PACKED",
    "MODE_PROMOTED",
    "MODE_RAW",
    "words_per_row",
    "codes_per_word",
]

MODE_LOWRANK = 0
MODE_PACKED = 1
MODE_PROMOTED = 2
MODE_RAW = 3

_FORMAT_VERSION = 2


def codes_per_word(bits: int) -> int:
    """How many ``bits``-bit codes one int32 word holds (2 -> 16, 3 -> 10, 4 -> 8, 8 -> 4)."""
    return 32 // bits


def words_per_row(bits: int, head_dim: int) -> int:
    """int32 words that one row of ``head_dim`` codes of ``bits`` bits occupies."""
    return -(-head_dim // codes_per_word(bits))


def promotion_widths(bits: int) -> list[int]:
    """Code widths tried in order for a block: ``bits`` first, then the wider ones that pack without waste."""
    return [bits] + [w for w in (4, 5, 6, 8) if w > bits]


def _block_rows_and_words(n: int, d: int, block: int, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of each block ``[NB]`` and each block's code words at its width (``width`` ``[..., NB]``, 0 to 8)."""
    device = width.device
    rows = (n - torch.arange(width.shape[-1], device=device, dtype=torch.int64) * block).clamp(max=block)
    wpr_of = torch.tensor([0] + [words_per_row(w, d) for w in range(1, 9)], dtype=torch.int64, device=device)
    return rows, rows * wpr_of[width.long().clamp(0, 8)]


def packed_layout(n: int, d: int, block: int, mode: torch.Tensor, width: torch.Tensor):
    """Where each block's codes or exact values start when every stored row is packed in block order (b, h, k).

    ``mode``/``width`` ``[..., NB]`` (widths 0 to 8). Returns ``(offset, code_words, raw_elements)``: ``offset`` int64
    of ``mode``'s shape (the index of the block's first word in ``codes`` where it has codes, of its first element in
    ``raw`` where it is exact, -1 otherwise), and the int64 0-d totals that ``codes`` and ``raw`` hold."""
    rows, words = _block_rows_and_words(n, d, block, width)
    code_words = words.reshape(-1)
    raw_elems = torch.where(mode == MODE_RAW, rows * d, 0).reshape(-1)
    code_offset = torch.cumsum(code_words, 0) - code_words
    raw_offset = torch.cumsum(raw_elems, 0) - raw_elems
    offset = torch.where(width.reshape(-1) > 0, code_offset, -1)
    offset = torch.where(mode.reshape(-1) == MODE_RAW, raw_offset, offset).reshape(mode.shape)
    return offset, code_words.sum(), raw_elems.sum()


def decoded_magnitude(rank: int, coeffs: float, basis: float, step: float, raw: float) -> float:
    """A bound on the largest magnitude of compressed values from those of their stored tensors: a decoded element
    is a sum of ``rank`` products of a coefficient and a basis element, plus a residual code (below 2**8 steps at
    the widest width, 8 bits) times its block's step, or a value stored exactly."""
    return rank * coeffs * basis + 2.0**8 * step + raw


def _metadata(shape: tuple[int, ...], dtype: torch.dtype, config: CompressionConfig, shared_basis: bool) -> dict:
    """The scalar metadata ``save`` writes beside the tensors."""
    return {
        "format": "kvbound.CompressedKV",
        "version": str(_FORMAT_VERSION),
        "shape": json.dumps(list(shape)),
        "dtype": str(dtype).removeprefix("torch."),
        "config": json.dumps(config.as_dict()),
        "shared_basis": "1" if shared_basis else "0",
    }


@functools.lru_cache(maxsize=256)
def _metadata_bytes(shape: tuple[int, ...], dtype: torch.dtype, config: CompressionConfig, shared_basis: bool) -> int:
    """Length of the serialised metadata: ``nbytes`` is asked for on every patched layer's encoding, and the JSON
    serialisation was most of its cost (the config is frozen, so the length depends on these values only)."""
    return len(json.dumps(_metadata(shape, dtype, config, shared_basis)))


@dataclass(eq=False)
class CompressedKV:
    """K or V in kvbound's compressed form, with a certified element-wise bound.

    Build one with :func:`kvbound.compress_kv`. ``decompress()`` returns float32 values ``x_hat`` with
    ``|x - x_hat| <= config.tau`` for every element, by construction and checked on the returned values.
    The module docstring of ``kvbound.codec.format`` gives the exact layout.
    """

    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    config: CompressionConfig
    coeffs: torch.Tensor
    basis: torch.Tensor
    mode: torch.Tensor
    scale: torch.Tensor
    bits: torch.Tensor
    offset: torch.Tensor
    codes: torch.Tensor
    raw: torch.Tensor
    shared_basis: bool
    encode_seconds: float = field(default=0.0, compare=False)
    # What the last complete check of the stored tensors found (see ``_record_checked``); not part of the data.
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)

    # ----------------------------------------------------------------------------------------------- shape
    @property
    def batch(self) -> int:
        return self.shape[0]

    @property
    def num_heads(self) -> int:
        return self.shape[1]

    @property
    def seq_len(self) -> int:
        return self.shape[2]

    @property
    def head_dim(self) -> int:
        return self.shape[3]

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.config.block_size)

    @property
    def rank(self) -> int:
        return self.coeffs.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.coeffs.device

    # ------------------------------------------------------------------------------------------ check record
    def _stamps(self) -> tuple | None:
        """``(data pointer, version counter)`` of every stored tensor; None where that cannot be read (inference
        tensors track no version, fake tensors have no storage)."""
        try:
            return tuple((t.data_ptr(), t._version) for t in self._tensors().values())
        except (RuntimeError, NotImplementedError):
            return None

    def _record_checked(
        self, residual: bool, lowrank_share: float | None = None, *, held: bool = False, general: bool | None = None
    ) -> None:
        """Record that the stored tensors, as they are now, are finite and that the blocks do (``residual``) or do
        not all use low rank only, and (``lowrank_share``, when known) which share of them does, and (``general``,
        when known) whether some block needs the compressed kernel's general loop
        (``kernels.attention_compressed.general_blocks``). ``kvbound.attention`` then skips these checks (the call's
        host synchronisation) until any stored tensor is replaced or modified in place (its version counter moves).
        ``held``: the object never leaves the code that made it (the speculative encoder's, read by the same
        forward's attention call): the record holds without version counters, which inference tensors do not
        have."""
        share = None if lowrank_share is None else float(lowrank_share)
        general = None if general is None else bool(general)
        if held:
            self._checked = ("held", bool(residual), share, general)
            return
        stamps = self._stamps()
        self._checked = None if stamps is None else (stamps, bool(residual), share, general)

    def _record_magnitude(self, largest: float) -> None:
        """Record a bound on the largest magnitude of the decoded values, as the stored tensors are now
        (``kvbound.attention`` checks it against float32's range; see ``attention._Overflow``)."""
        stamps = self._stamps()
        self._magnitude = None if stamps is None else (stamps, float(largest))

    def _checked_magnitude(self) -> float | None:
        """What ``_record_magnitude`` recorded, if every stored tensor is unchanged since; else None."""
        record = getattr(self, "_magnitude", None)
        if record is None or record[0] == "held":
            return None
        return record[1] if self._stamps() == record[0] else None

    def _record_magnitude_but_raw(self, largest: float) -> None:
        """Record a bound on the largest magnitude of the decoded values that come from the low-rank part and the
        codes, for an object that never leaves the code that made it (the speculative encoder's): the exact values
        in ``raw`` are not covered, and ``kvbound.attention`` reads their largest magnitude with its other checks."""
        self._magnitude = ("held", float(largest))

    def _magnitude_but_raw(self) -> float | None:
        """What ``_record_magnitude_but_raw`` recorded, else None."""
        record = getattr(self, "_magnitude", None)
        return record[1] if record is not None and record[0] == "held" else None

    def __getstate__(self) -> dict:
        # A check record names this process's storages (data pointers): a copy or another process must check again.
        state = dict(self.__dict__)
        state["_checked"] = None
        state.pop("_magnitude", None)
        return state

    def _checked_residual(self) -> bool | None:
        """What ``_record_checked`` recorded, if every stored tensor is unchanged since; else None."""
        record = self._current_record()
        return None if record is None else record[0]

    def _checked_lowrank_share(self) -> float | None:
        """The share of low-rank-only blocks ``_record_checked`` recorded, if recorded and every stored tensor is
        unchanged since; else None."""
        record = self._current_record()
        return None if record is None else record[1]

    def _checked_general(self) -> bool | None:
        """Whether some block needs the general loop, as ``_record_checked`` recorded it, if recorded and every
        stored tensor is unchanged since; else None."""
        record = self._current_record()
        return None if record is None else record[2]

    def _current_record(self) -> tuple[bool, float | None, bool | None] | None:
        if not isinstance(self._checked, tuple) or len(self._checked) != 4:
            return None
        stamps, residual, share, general = self._checked
        if stamps == "held":
            return residual, share, general
        return (residual, share, general) if self._stamps() == stamps else None

    # ----------------------------------------------------------------------------------------------- bytes
    def _metadata(self) -> dict[str, str]:
        return _metadata(tuple(self.shape), self.dtype, self.config, self.shared_basis)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "coeffs": self.coeffs,
            "basis": self.basis,
            "mode": self.mode,
            "scale": self.scale,
            "bits": self.bits,
            "offset": self.offset,
            "codes": self.codes,
            "raw": self.raw,
        }

    @property
    def nbytes(self) -> int:
        """Every byte this object stores: factors, packed residual, scales, offsets, modes, exact blocks, and
        the scalar metadata (shape, dtype, config) as serialised by ``save``."""
        tensor_bytes = sum(t.numel() * t.element_size() for t in self._tensors().values())
        return tensor_bytes + _metadata_bytes(tuple(self.shape), self.dtype, self.config, self.shared_basis)

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the input tensor in its own dtype."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def compression_ratio(self) -> float:
        return self.dense_nbytes / self.nbytes

    @property
    def error_bound(self) -> float:
        """The certified absolute bound tau."""
        return self.config.tau

    def mode_fractions(self) -> dict[str, float]:
        """Share of blocks in each storage mode."""
        total = max(1, self.mode.numel())
        counts = torch.bincount(self.mode.reshape(-1).long().cpu(), minlength=4).tolist()
        names = ("lowrank", "packed", "promoted", "raw")
        return {name: counts[i] / total for i, name in enumerate(names)}

    # ------------------------------------------------------------------------------------------- validation
    def validate(self, name: str = "CompressedKV") -> None:
        """Raise ``TypeError``/``ValueError`` naming ``name`` and the field (``"{name}: offset: expected ..., got
        ..."``) unless this object holds the packed layout of ``kvbound.codec.format`` (``check_layout``): dtypes,
        shapes and devices of the stored tensors, modes, code widths against the modes and ``config.bits``, steps
        in ``(0, 2 tau]`` where there are codes, finite values, and offsets and lengths of ``codes``/``raw`` exactly
        as the blocks' modes and widths lay them out. :func:`kvbound.load` runs it on every file it reads."""
        check_layout(self, name, packed=True)

    # --------------------------------------------------------------------------------------------- decode
    def decompress(self) -> torch.Tensor:
        """Reconstruct ``[B, H, N, D]`` in float32 on this object's device."""
        from kvbound.codec.eager import decode

        if self.device.type == "meta":
            raise ValueError("CompressedKV: expected stored values to decode, got tensors on the meta device, "
                             "which hold shapes only")  # fmt: skip
        return decode(self)

    def max_abs_error(self, x: torch.Tensor) -> float:
        """Measured ``max |x - decompress()|`` in float64 against the original tensor ``x`` (float16, bfloat16,
        float32 or float64, finite, of this object's shape)."""
        from kvbound._validate import FLOAT_DTYPES_AND_64, check_tensor

        check_tensor(x, "x", ndim=4, dtypes=FLOAT_DTYPES_AND_64)
        if tuple(x.shape) != tuple(self.shape):
            raise ValueError(f"x: expected shape {tuple(self.shape)} (this CompressedKV's), got {tuple(x.shape)}")
        x_hat = self.decompress().to(device=x.device, dtype=torch.float64)
        return float((x.to(torch.float64) - x_hat).abs().max().item())

    def to(self, device: torch.device | str) -> CompressedKV:
        """A copy on ``device``."""
        moved = {name: t.to(device) for name, t in self._tensors().items()}
        return CompressedKV(
            shape=self.shape,
            dtype=self.dtype,
            config=self.config,
            shared_basis=self.shared_basis,
            encode_seconds=self.encode_seconds,
            **moved,
        )

    # ------------------------------------------------------------------------------------------ save/load
    def save(self, path: str) -> None:
        """Write this object to ``path`` as safetensors (bit-exact round trip with :func:`kvbound.load`). Runs
        :meth:`validate` first: a file that :func:`kvbound.load` would refuse is never written."""
        from pathlib import Path

        from safetensors.torch import save_file

        target = Path(path)
        if target.is_dir():
            raise IsADirectoryError(f"path: expected a file to write, got the directory {path!s}")
        if not target.parent.is_dir():
            raise FileNotFoundError(f"path: expected an existing directory to write {target.name} in, got {path!s}")
        self.validate()
        tensors = {name: t.detach().contiguous().cpu() for name, t in self._tensors().items()}
        save_file(tensors, str(path), metadata=self._metadata())

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CompressedKV(shape={self.shape}, dtype={str(self.dtype).removeprefix('torch.')}, "
            f"rank={self.rank}, bits={c.bits}, block_size={c.block_size}, tau={c.tau:g}, "
            f"ratio={self.compression_ratio:.2f}x, basis={'shared' if self.shared_basis else 'per-block'})"
        )


# ------------------------------------------------------------------------------------------------ validation
_FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_TENSOR_NAMES = ("coeffs", "basis", "mode", "scale", "bits", "offset", "codes", "raw")
_FIXED_DTYPES = {
    "basis": torch.float16,
    "mode": torch.int8,
    "scale": torch.float32,
    "bits": torch.int8,
    "offset": torch.int64,
    "codes": torch.int32,
}
_FLOAT32_TINY = 2.0**-126  # the encoders' smallest step (a smaller one is raised to it)


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _at(index: list[int]) -> str:
    return str(tuple(index))


def stored_shapes(shape: tuple[int, int, int, int], nb: int, r: int, shared_basis: bool) -> dict[str, tuple]:
    """The shapes of the stored tensors of a CompressedKV of ``shape`` ``[B, H, N, D]`` with ``nb`` blocks per
    head and rank ``r`` (``codes`` and ``raw`` are flat, of the layout's lengths)."""
    b, h, n, d = shape
    return {
        "coeffs": (b, h, n, r),
        "basis": (h, r, d) if shared_basis else (b, h, nb, r, d),
        "mode": (b, h, nb),
        "scale": (b, h, nb),
        "bits": (b, h, nb),
        "offset": (b, h, nb),
    }


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def block_layout_masks(
    mode: torch.Tensor, bits: torch.Tensor, offset: torch.Tensor, n: int, d: int, block: int, packed_bits: int,
    codes_len: int, raw_len: int,
) -> dict[str, torch.Tensor]:
    """Per block ``[B, H, NB]``, on the device, where the stored ``mode``, ``bits`` (code width) and ``offset`` break
    the layout whatever the packing: ``mode`` outside 0..3; ``bits_without_codes``, ``bits_packed``,
    ``bits_promoted`` (a width that does not fit the mode); ``codes_reads`` / ``raw_reads`` (a coded / exact block
    whose reads from its offset do not lie inside ``codes`` / ``raw``). Also ``rows`` (of each block) and ``words``
    (each block's code words at its width)."""
    device = mode.device
    mode, width, offset = mode.to(torch.int64), bits.to(torch.int64), offset.to(torch.int64)
    coded = (mode == MODE_PACKED) | (mode == MODE_PROMOTED)
    exact = mode == MODE_RAW
    rows, words = _block_rows_and_words(n, d, block, width)
    allowed = torch.tensor(promotion_widths(packed_bits)[1:], dtype=torch.int64, device=device)
    return {
        "mode": (mode < 0) | (mode > 3),
        "bits_without_codes": ((mode == MODE_LOWRANK) | exact) & (width != 0),
        "bits_packed": (mode == MODE_PACKED) & (width != packed_bits),
        "bits_promoted": (mode == MODE_PROMOTED) & ~torch.isin(width, allowed),
        "codes_reads": coded & ((offset < 0) | (offset > codes_len - words)),
        "raw_reads": exact & ((offset < 0) | (offset > raw_len - rows * d)),
        "rows": rows,
        "words": words,
    }


def layout_violations(
    mode: torch.Tensor, bits: torch.Tensor, offset: torch.Tensor, n: int, d: int, block: int, packed_bits: int,
    codes_len: int, raw_len: int,
) -> torch.Tensor:
    """How many blocks break :func:`block_layout_masks`'s checks, counted once per check (a float64 scalar on the
    device, nothing read): what ``kvbound.attention`` queues with a call's other checks for compressed K/V on which
    no checked record can be kept, so that the kernels never read outside ``codes`` or ``raw``."""
    masks = block_layout_masks(mode, bits, offset, n, d, block, packed_bits, codes_len, raw_len)
    return sum(masks[key].sum() for key in ("mode", "bits_without_codes", "bits_packed", "bits_promoted",
                                            "codes_reads", "raw_reads")).to(torch.float64)  # fmt: skip


def check_layout(ckv: CompressedKV, where: str = "CompressedKV", *, packed: bool = True, values: bool = True) -> None:
    """Raise ``TypeError`` (a type or dtype) or ``ValueError`` (anything else), as ``"{where}: {field}: expected
    ..., got ..."``, when ``ckv`` breaks the layout of this module's docstring.

    Always checked: ``shape`` (4 ints >= 1), ``dtype`` (float16, bfloat16 or float32), ``config``,
    ``shared_basis``; the dtype, shape and device of every stored tensor (``coeffs`` ``[B, H, N, r]`` float16 or
    float32, ``basis`` ``[H, r, D]`` or ``[B, H, NB, r, D]`` float16, ``mode``/``bits``/``scale``/``offset``
    ``[B, H, NB]`` int8/int8/float32/int64, flat int32 ``codes``, flat ``raw`` in ``dtype``); modes in 0..3; each
    block's code width against its mode (0 for modes 0 and 3, ``config.bits`` for mode 1, one of the wider
    ``promotion_widths(config.bits)`` for mode 2); every block's reads inside ``codes`` or ``raw``.

    ``packed`` (what the encoders write and :func:`load` reads) adds: the rank is ``config.rank`` (below D); finite
    ``coeffs``, ``basis``, ``scale`` and ``raw``; steps in ``(0, 2 tau]`` for blocks with codes (``(0, 2**-126]``
    when ``2 tau`` is below float32's smallest normal number, to which the encoders raise smaller steps) and 0 for
    the others; zero coefficients in exact blocks; offsets equal to :func:`packed_layout`'s, and ``codes``/``raw``
    exactly as long as it needs. Without ``packed`` (what ``decompress`` checks) a block may sit anywhere inside
    ``codes`` and ``raw`` (the speculative encoder's workspaces keep fixed places per block) and values are not
    read: such an object may hold NaN/Inf from its input until the deferred-check block that made it reports them.

    One host read for all the value checks (plus the reads that locate a failure). ``values=False``: only the
    checks above that read nothing from the device (types, dtypes, devices, shapes), for a caller that queues
    :func:`layout_violations` with its own read.
    """

    def error(key: str, text: str, kind: type[Exception] = ValueError) -> Exception:
        return kind(f"{where}: {key}: {text}")

    # ---- scalar fields
    shape = ckv.shape
    if (
        not isinstance(shape, (tuple, list))
        or len(shape) != 4
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
    ):
        raise error("shape", f"expected 4 ints [B, H, N, D], got {shape!r}", TypeError)
    if min(shape) < 1:
        raise error("shape", f"expected every dimension >= 1, got {list(shape)}")
    if ckv.dtype not in _FLOAT_DTYPES.values():
        raise error("dtype", f"expected float16, bfloat16 or float32, got {_name(ckv.dtype)}", TypeError)
    config = ckv.config
    if not isinstance(config, CompressionConfig):
        raise error("config", f"expected kvbound.CompressionConfig, got {type(config).__name__}", TypeError)
    if not isinstance(ckv.shared_basis, bool):
        raise error("shared_basis", f"expected bool, got {type(ckv.shared_basis).__name__}", TypeError)

    # ---- stored tensors: type, dtype, device, shape
    tensors = {}
    for key in _TENSOR_NAMES:
        t = getattr(ckv, key)
        if not isinstance(t, torch.Tensor):
            raise error(key, f"expected a torch.Tensor, got {type(t).__name__}", TypeError)
        tensors[key] = t
    expected_dtype = {**_FIXED_DTYPES, "raw": ckv.dtype}
    for key, t in tensors.items():
        if key == "coeffs":
            if t.dtype not in (torch.float16, torch.float32):
                raise error(key, f"expected float16 or float32, got {_name(t.dtype)}", TypeError)
        elif t.dtype != expected_dtype[key]:
            what = " (the dtype field)" if key == "raw" else ""
            raise error(key, f"expected {_name(expected_dtype[key])}{what}, got {_name(t.dtype)}", TypeError)
    device = tensors["coeffs"].device
    for key, t in tensors.items():
        if t.device != device:
            raise error(key, f"expected device {device} (coeffs' device), got {t.device}")
    b, h, n, d = shape
    block = config.block_size
    nb = -(-n // block)
    coeffs = tensors["coeffs"]
    if coeffs.dim() != 4 or tuple(coeffs.shape[:3]) != (b, h, n):
        raise error("coeffs", f"expected shape [{b}, {h}, {n}, r] (from shape), got {list(coeffs.shape)}")
    r = coeffs.shape[3]
    if packed and r != config.rank:
        raise error("coeffs", f"expected rank config.rank = {config.rank} (its last dimension), got {r}")
    if packed and r >= d:
        raise error("coeffs", f"expected a rank below the head dim {d}, got {r}")
    expected_shape = stored_shapes((b, h, n, d), nb, r, ckv.shared_basis)
    del expected_shape["coeffs"]  # (its rank is what the others are checked against)
    for key, want in expected_shape.items():
        got = tuple(tensors[key].shape)
        if got != want:
            how = f"shared_basis={ckv.shared_basis}, rank {r}" if key == "basis" else f"block_size {block}"
            raise error(key, f"expected shape {list(want)} (from shape {list(shape)}, {how}), got {list(got)}")
    for key in ("codes", "raw"):
        if tensors[key].dim() != 1:
            raise error(key, f"expected a flat tensor (1 dimension), got shape {list(tensors[key].shape)}")
    if not values:
        return

    # ---- values: every mask is computed on the device, and the verdicts are read back together
    mode, width = ckv.mode.to(torch.int64), ckv.bits.to(torch.int64)
    step, offset = ckv.scale, ckv.offset
    codes_len, raw_len = ckv.codes.numel(), ckv.raw.numel()
    wider = promotion_widths(config.bits)[1:]
    coded = (mode == MODE_PACKED) | (mode == MODE_PROMOTED)
    exact = mode == MODE_RAW
    layout, code_total, raw_total = packed_layout(n, d, block, mode, width)
    masks = block_layout_masks(ckv.mode, ckv.bits, offset, n, d, block, config.bits, codes_len, raw_len)
    rows, words = masks.pop("rows"), masks.pop("words")
    limit = max(2.0 * config.tau, _FLOAT32_TINY)

    def per_block(key: str, values: torch.Tensor, expected):
        """The message of a block check: ``expected(index)`` says what the first failing block should hold."""

        def message(mask: torch.Tensor) -> tuple[str, str]:
            index = torch.nonzero(mask)[0].tolist()
            count = int(mask.sum())
            more = f"; {count} blocks in all" if count > 1 else ""
            value = values[tuple(index)].item()
            return key, (
                f"expected {expected(index)}, got {value!r} at block {_at(index)} "
                f"(mode {int(mode[tuple(index)])}{more})"
            )

        return message

    def finite(key: str):
        def message(_: torch.Tensor) -> tuple[str, str]:
            mask = ~torch.isfinite(tensors[key])
            index = torch.nonzero(mask)[0].tolist()
            value = tensors[key][tuple(index)].item()
            return key, f"expected finite values, got {value} at index {_at(index)} ({int(mask.sum())} in all)"

        return message

    def largest(t: torch.Tensor) -> torch.Tensor:
        """The largest magnitude in float32 (NaN when there is a NaN); a float32 reduction, much faster on the CPU
        than ``isfinite`` on 16-bit values."""
        return t.float().abs().amax() if t.numel() else torch.zeros((), device=device)

    def length(key: str, total: torch.Tensor, got: int, unit: str):
        def message(mask: torch.Tensor) -> tuple[str, str]:
            return key, f"expected {int(total)} {unit} (what the blocks' modes and code widths need), got {got}"

        return message

    def raw_coefficients(_: torch.Tensor) -> tuple[str, str]:
        mask = exact_rows[..., None] & (coeffs != 0)
        index = torch.nonzero(mask)[0].tolist()
        return "coeffs", (
            f"expected zero coefficients in exact blocks (mode 3), got {coeffs[tuple(index)].item()} at index "
            f"{_at(index)} (block {_at([index[0], index[1], index[2] // block])})"
        )

    checks = [
        (masks["mode"], per_block("mode", mode, lambda i: "0..3 (low rank, packed, promoted, exact)")),
        (masks["bits_without_codes"], per_block("bits", width, lambda i: "0 for blocks without codes (modes 0 and 3)")),
        (
            masks["bits_packed"],
            per_block("bits", width, lambda i: f"config.bits = {config.bits} for packed blocks (mode 1)"),
        ),
        (
            masks["bits_promoted"],
            per_block(
                "bits", width, lambda i: f"one of {wider} (the promotion widths above config.bits = {config.bits}) "
                "for promoted blocks (mode 2)"
            ),
        ),
    ]
    if packed:
        checks += [
            (~torch.isfinite(step), per_block("scale", step, lambda i: "a finite step")),
            (
                coded & ~((step > 0) & (step.to(torch.float64) <= limit)),
                per_block("scale", step, lambda i: f"a step in (0, {limit!r}] (2 * config.tau) for blocks with codes"),
            ),
            (~coded & (step != 0), per_block("scale", step, lambda i: "0 for blocks without codes (modes 0 and 3)")),
            (
                offset != layout,
                per_block(
                    "offset", offset, lambda i: f"{int(layout[tuple(i)])} (the packed layout: blocks in order "
                    "(b, h, k), each after the codes or exact values of those before it; -1 without either)"
                ),
            ),
            (code_total != codes_len, length("codes", code_total, codes_len, "int32 words")),
            (raw_total != raw_len, length("raw", raw_total, raw_len, f"{_name(ckv.dtype)} values")),
        ]
    else:
        checks += [
            (
                masks["codes_reads"],
                per_block(
                    "offset", offset, lambda i: f"a start from which the block's {int(words[tuple(i)])} words lie "
                    f"inside codes ({codes_len} words)"
                ),
            ),
            (
                masks["raw_reads"],
                per_block(
                    "offset", offset, lambda i: f"a start from which the block's {int(rows[i[2]]) * d} values lie "
                    f"inside raw ({raw_len} values)"
                ),
            ),
        ]
    if packed:
        for key in ("coeffs", "basis", "raw"):
            checks.append((~torch.isfinite(largest(tensors[key])), finite(key)))
    if packed and r > 0:
        exact_rows = exact.repeat_interleave(block, dim=-1)[..., :n]  # [B, H, N]
        checks.append((exact_rows & (coeffs.float().abs().amax(-1) != 0), raw_coefficients))
    verdicts = torch.stack([mask.any() for mask, _ in checks]).tolist()
    for (mask, message), bad in zip(checks, verdicts, strict=True):
        if bad:
            key, text = message(mask)
            raise error(key, text)


def load(path: str, device: torch.device | str = "cpu") -> CompressedKV:
    """Read a :class:`CompressedKV` written by ``CompressedKV.save``.

    Raises ``ValueError`` naming the file and the key when the metadata is missing a key or holds a value this
    format does not allow, or when a tensor is missing or unknown; then runs ``CompressedKV.validate`` on the stored
    tensors (the layout, ``TypeError``/``ValueError`` naming the file and the field)."""
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    source = Path(path)
    if source.is_dir():
        raise IsADirectoryError(f"path: expected a kvbound.CompressedKV file, got the directory {path!s}")
    if not source.is_file():
        raise FileNotFoundError(f"path: expected a kvbound.CompressedKV file, got {path!s}, which does not exist")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected a torch device, got {device!r} ({err})") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: expected an available device, got {device!r}: torch.cuda.is_available() is False")
    try:
        opened = safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as err:
        raise ValueError(f"path: {path!s} is not a readable safetensors file ({err})") from None
    with opened as f:
        meta = f.metadata() or {}
        if meta.get("format") != "kvbound.CompressedKV":
            raise ValueError(f"path: {path!s} is not a kvbound.CompressedKV file (format={meta.get('format')!r})")
        if meta.get("version") != str(_FORMAT_VERSION):
            raise ValueError(
                f"path: {path!s} has format version {meta.get('version')}, this kvbound reads {_FORMAT_VERSION}"
            )
        names = list(f.keys())
        missing = [name for name in _TENSOR_NAMES if name not in names]
        extra = [name for name in names if name not in _TENSOR_NAMES]
        if missing or extra:
            got = "; ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {extra}"] if extra else []))
            raise ValueError(f"{path!s}: tensors: expected exactly {list(_TENSOR_NAMES)}, got {got}")
        fields = _read_metadata(meta, str(path))
        tensors = {name: f.get_tensor(name) for name in _TENSOR_NAMES}
    ckv = CompressedKV(**fields, **tensors)
    check_layout(ckv, str(path), packed=True)
    return ckv


def _read_metadata(meta: dict[str, str], where: str) -> dict:
    """``shape``, ``dtype``, ``config`` and ``shared_basis`` from a file's metadata, each checked."""
    for key in ("shape", "dtype", "config", "shared_basis"):
        if key not in meta:
            raise ValueError(f"{where}: metadata: expected the key {key!r}, missing (keys: {sorted(meta)})")
    text = meta["shape"]
    shape = _json_or_none(text)
    if (
        not isinstance(shape, list)
        or len(shape) != 4
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
    ):
        raise ValueError(f"{where}: metadata shape: expected a JSON list of 4 ints >= 1 [B, H, N, D], got {text!r}")
    if meta["dtype"] not in _FLOAT_DTYPES:
        raise ValueError(f"{where}: metadata dtype: expected one of {list(_FLOAT_DTYPES)}, got {meta['dtype']!r}")
    text = meta["config"]
    settings = _json_or_none(text)
    keys = sorted(CompressionConfig().as_dict())
    if not isinstance(settings, dict) or sorted(settings) != keys:
        raise ValueError(f"{where}: metadata config: expected a JSON object with the keys {keys}, got {text!r}")
    try:
        config = CompressionConfig(**settings)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: metadata config: {e}") from e
    if meta["shared_basis"] not in ("0", "1"):
        raise ValueError(f"{where}: metadata shared_basis: expected '0' or '1', got {meta['shared_basis']!r}")
    return {
        "shape": tuple(shape),
        "dtype": _FLOAT_DTYPES[meta["dtype"]],
        "config": config,
        "shared_basis": meta["shared_basis"] == "1",
    }
