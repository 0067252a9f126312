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

    def _record_checked(self, residual: bool, lowrank_share: float | None = None, *, held: bool = False) -> None:
        """Record that the stored tensors, as they are now, are finite and that the blocks do (``residual``) or do
        not all use low rank only, and (``lowrank_share``, when known) which share of them does. ``kvbound.attention``
        then skips both checks (the call's host synchronisation) until any stored tensor is replaced or modified in
        place (its version counter moves). ``held``: the object never leaves the code that made it (the speculative
        encoder's, read by the same forward's attention call): the record holds without version counters, which
        inference tensors do not have."""
        share = None if lowrank_share is None else float(lowrank_share)
        if held:
            self._checked = ("held", bool(residual), share)
            return
        stamps = self._stamps()
        self._checked = None if stamps is None else (stamps, bool(residual), share)

    def _record_magnitude(self, largest: float) -> None:
        """Record a bound on the largest magnitude of the decoded values, as the stored tensors are now
        (``kvbound.attention`` checks it against float32's range; see ``attention._Overflow``)."""
        stamps = self._stamps()
        self._magnitude = None if stamps is None else (stamps, float(largest))

    def _checked_magnitude(self) -> float | None:
        """What ``_record_magnitude`` recorded, if every stored tensor is unchanged since; else None."""
        record = getattr(self, "_magnitude", None)
        return record[1] if record is not None and self._stamps() == record[0] else None

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

    def _current_record(self) -> tuple[bool, float | None] | None:
        if not isinstance(self._checked, tuple) or len(self._checked) != 3:
            return None
        stamps, residual, share = self._checked
        if stamps == "held":
            return residual, share
        return (residual, share) if self._stamps() == stamps else None

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
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

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

    # --------------------------------------------------------------------------------------------- decode
    def decompress(self) -> torch.Tensor:
        """Reconstruct ``[B, H, N, D]`` in float32 on this object's device."""
        from kvbound.codec.eager import decode

        return decode(self)

    def max_abs_error(self, x: torch.Tensor) -> float:
        """Measured ``max |x - decompress()|`` in float64 against the original tensor ``x``."""
        if tuple(x.shape) != self.shape:
            raise ValueError(f"x: expected shape {self.shape}, got {tuple(x.shape)}")
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
        """Write this object to ``path`` as safetensors (bit-exact round trip with :func:`kvbound.load`)."""
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in self._tensors().items()}
        save_file(tensors, str(path), metadata=self._metadata())

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CompressedKV(shape={self.shape}, dtype={str(self.dtype).removeprefix('torch.')}, "
            f"rank={self.rank}, bits={c.bits}, block_size={c.block_size}, tau={c.tau:g}, "
            f"ratio={self.compression_ratio:.2f}x, basis={'shared' if self.shared_basis else 'per-block'})"
        )


def load(path: str, device: torch.device | str = "cpu") -> CompressedKV:
    """Read a :class:`CompressedKV` written by ``CompressedKV.save``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") != "kvbound.CompressedKV":
            raise ValueError(f"path: {path!s} is not a kvbound.CompressedKV file (format={meta.get('format')!r})")
        if meta.get("version") != str(_FORMAT_VERSION):
            raise ValueError(
                f"path: {path!s} has format version {meta.get('version')}, this kvbound reads {_FORMAT_VERSION}"
            )
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    dtype = getattr(torch, meta["dtype"])
    return CompressedKV(
        shape=tuple(json.loads(meta["shape"])),
        dtype=dtype,
        config=CompressionConfig(**json.loads(meta["config"])),
        shared_basis=meta["shared_basis"] == "1",
        **tensors,
    )
