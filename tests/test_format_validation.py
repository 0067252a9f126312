"""Validation of the compressed format: ``CompressedKV.validate`` (run by ``kvbound.load``), the checks of
``decompress``, ``basis.projection`` at ``compress_kv`` and ``CompressionConfig``'s types and limits.

Each check gets a valid object (every storage mode, a ragged last block), one thing tampered with, and the exact
error type and a message naming the field."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import kvbound
from kvbound import _checks
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, check_layout

N, D, BLOCK, RANK = 75, 16, 16, 6  # five blocks, the last one ragged (11 rows)
CONFIG = kvbound.CompressionConfig(block_size=BLOCK, rank=RANK)


def structured(dtype: torch.dtype, seed: int = 0, *, spikes: bool = True) -> torch.Tensor:
    """[1, 2, 75, 16]: rank-6 rows plus small noise; at block size 16, rank 6 and the default tau, block 0 is low
    rank, block 1 needs 4-bit codes, block 2 wider codes, blocks 3 (an outlier) and 4 (wide noise) exact storage."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(2, D, 6, generator=g, dtype=torch.float64))[0].transpose(1, 2)
    x = torch.randn(1, 2, N, 6, generator=g, dtype=torch.float64) * math.sqrt(D / 6) @ basis
    x += (torch.rand(1, 2, N, D, generator=g, dtype=torch.float64) * 2 - 1) * 0.004
    if spikes:
        x[:, :, 16:32] += torch.randn(1, 2, 16, D, generator=g, dtype=torch.float64) * 0.05
        x[:, :, 32:48] += torch.randn(1, 2, 16, D, generator=g, dtype=torch.float64) * 0.4
        x[:, :, 50, 3] += 40.0
        x[:, :, 64:] += torch.randn(1, 2, N - 64, D, generator=g, dtype=torch.float64) * 8.0
    return x.to(dtype)


def every_mode(ckv: kvbound.CompressedKV) -> bool:
    return set(ckv.mode.unique().tolist()) == {MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW}


@pytest.fixture(scope="module")
def ckv() -> kvbound.CompressedKV:
    """Eager encoding, calibrated basis, float32: every mode; a promoted block at 5 bits."""
    x = structured(torch.float32)
    out = kvbound.compress_kv(x, CONFIG, kvbound.calibrate(structured(torch.float32, spikes=False), CONFIG))
    assert every_mode(out), out.mode_fractions()
    return out


def first_block(ckv: kvbound.CompressedKV, mode: int) -> tuple[int, int, int]:
    return tuple(torch.nonzero(ckv.mode == mode)[0].tolist())


def tampered(ckv: kvbound.CompressedKV, **fields) -> kvbound.CompressedKV:
    """A copy with ``fields`` replaced (the given object is never modified)."""
    return dataclasses.replace(ckv, **{name: value(getattr(ckv, name).clone()) for name, value in fields.items()})


def set_at(index, value):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[index] = value
        return t

    return edit


def at_mode(mode: int, value):
    """Set the first block of ``mode`` (of the fixture) to ``value``."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        t[first_block_of[mode]] = value
        return t

    return edit


first_block_of: dict[int, tuple[int, int, int]] = {}


@pytest.fixture(autouse=True)
def _blocks(ckv):
    for mode in (MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW):
        first_block_of[mode] = first_block(ckv, mode)


def raw_coefficient(t: torch.Tensor) -> torch.Tensor:
    b, h, k = first_block_of[MODE_RAW]
    t[b, h, k * BLOCK, 0] = 0.5
    return t


def packed_offset(step: int):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[first_block_of[MODE_PACKED]] += step
        return t

    return edit


# (case id, fields to tamper with, error type, pattern of the message after "CompressedKV: ")
TAMPERING = [
    # dtypes
    ("mode-int32", {"mode": lambda t: t.to(torch.int32)}, TypeError, r"mode: expected int8, got int32"),
    ("bits-uint8", {"bits": lambda t: t.to(torch.uint8)}, TypeError, r"bits: expected int8, got uint8"),
    ("offset-int32", {"offset": lambda t: t.to(torch.int32)}, TypeError, r"offset: expected int64, got int32"),
    ("codes-float32", {"codes": lambda t: t.float()}, TypeError, r"codes: expected int32, got float32"),
    ("raw-float16", {"raw": lambda t: t.half()}, TypeError, r"raw: expected float32 \(the dtype field\), got float16"),
    ("scale-float64", {"scale": lambda t: t.double()}, TypeError, r"scale: expected float32, got float64"),
    ("coeffs-bfloat16", {"coeffs": lambda t: t.bfloat16()}, TypeError,
     r"coeffs: expected float16 or float32, got bfloat16"),
    ("basis-float32", {"basis": lambda t: t.float()}, TypeError, r"basis: expected float16, got float32"),
    ("codes-not-a-tensor", {"codes": lambda t: t.tolist()}, TypeError, r"codes: expected a torch.Tensor, got list"),
    # shapes
    ("mode-shape", {"mode": lambda t: t[..., :-1]}, ValueError, r"mode: expected shape \[1, 2, 5\] .* got \[1, 2, 4\]"),
    ("scale-shape", {"scale": lambda t: t[None]}, ValueError, r"scale: expected shape \[1, 2, 5\]"),
    ("coeffs-rank", {"coeffs": lambda t: t[..., :-1]}, ValueError, r"coeffs: expected rank config.rank = 6 .* got 5"),
    ("coeffs-rows", {"coeffs": lambda t: t[:, :, :-1]}, ValueError, r"coeffs: expected shape \[1, 2, 75, r\]"),
    ("basis-shape", {"basis": lambda t: t[:1]}, ValueError, r"basis: expected shape \[2, 6, 16\] .* got \[1, 6, 16\]"),
    ("codes-2d", {"codes": lambda t: t.reshape(2, -1)}, ValueError, r"codes: expected a flat tensor"),
    # modes and code widths
    ("mode-4", {"mode": at_mode(MODE_PACKED, 4)}, ValueError, r"mode: expected 0..3 .* got 4 at block"),
    ("mode-negative", {"mode": at_mode(MODE_LOWRANK, -1)}, ValueError, r"mode: expected 0..3 .* got -1"),
    ("bits-on-lowrank", {"bits": at_mode(MODE_LOWRANK, 4)}, ValueError,
     r"bits: expected 0 for blocks without codes \(modes 0 and 3\), got 4 at block \(\d, \d, \d\) \(mode 0"),
    ("bits-on-raw", {"bits": at_mode(MODE_RAW, 8)}, ValueError, r"bits: expected 0 for blocks without codes .*mode 3"),
    ("bits-packed-not-config", {"bits": at_mode(MODE_PACKED, 5)}, ValueError,
     r"bits: expected config.bits = 4 for packed blocks \(mode 1\), got 5"),
    ("bits-promoted-7", {"bits": at_mode(MODE_PROMOTED, 7)}, ValueError,
     r"bits: expected one of \[5, 6, 8\] .* for promoted blocks \(mode 2\), got 7"),
    ("bits-promoted-at-config", {"bits": at_mode(MODE_PROMOTED, 4)}, ValueError, r"bits: expected one of \[5, 6, 8\]"),
    ("all-raw-no-values", {"mode": lambda t: torch.full_like(t, MODE_RAW), "bits": torch.zeros_like}, ValueError,
     r"scale: expected 0 for blocks without codes"),
    # steps
    ("scale-nan", {"scale": at_mode(MODE_PACKED, math.nan)}, ValueError, r"scale: expected a finite step, got nan"),
    ("scale-inf-on-lowrank", {"scale": at_mode(MODE_LOWRANK, math.inf)}, ValueError, r"scale: expected a finite step"),
    ("scale-x1000", {"scale": lambda t: t * 1000}, ValueError,
     r"scale: expected a step in \(0, 0.0625\] \(2 \* config.tau\) for blocks with codes, got"),
    ("scale-zero", {"scale": at_mode(MODE_PROMOTED, 0.0)}, ValueError, r"scale: expected a step in \(0, 0.0625\]"),
    ("scale-negative", {"scale": at_mode(MODE_PACKED, -0.01)}, ValueError, r"scale: expected a step in \(0"),
    ("scale-on-lowrank", {"scale": at_mode(MODE_LOWRANK, 0.25)}, ValueError,
     r"scale: expected 0 for blocks without codes \(modes 0 and 3\), got 0.25 at block \(\d, \d, \d\) \(mode 0\)"),
    # layout
    ("offset-plus-1e6", {"offset": lambda t: t + 10**6}, ValueError, r"offset: expected -?\d+ \(the packed layout"),
    ("offset-off-by-one", {"offset": packed_offset(1)}, ValueError, r"offset: expected \d+ \(the packed layout.* got"),
    ("offset-lowrank", {"offset": at_mode(MODE_LOWRANK, 0)}, ValueError, r"offset: expected -1 \(the packed layout"),
    ("codes-truncated", {"codes": lambda t: t[:5]}, ValueError,
     r"codes: expected \d+ int32 words \(what the blocks' modes and code widths need\), got 5"),
    ("codes-longer", {"codes": lambda t: torch.cat([t, t[:1]])}, ValueError, r"codes: expected \d+ int32 words"),
    ("raw-truncated", {"raw": lambda t: t[:-1]}, ValueError, r"raw: expected \d+ float32 values .* got \d+"),
    ("raw-empty", {"raw": lambda t: t[:0]}, ValueError, r"raw: expected \d+ float32 values .* got 0"),
    # values
    ("coeffs-nan", {"coeffs": set_at((0, 1, 3, 2), math.nan)}, ValueError,
     r"coeffs: expected finite values, got nan at index \(0, 1, 3, 2\)"),
    ("basis-inf", {"basis": set_at((1, 0, 5), math.inf)}, ValueError, r"basis: expected finite values, got inf"),
    ("raw-nan", {"raw": set_at(7, math.nan)}, ValueError, r"raw: expected finite values, got nan at index \(7,\)"),
    ("coeffs-in-raw-block", {"coeffs": raw_coefficient}, ValueError,
     r"coeffs: expected zero coefficients in exact blocks \(mode 3\), got 0.5"),
]


@pytest.mark.parametrize("case, fields, error, pattern", TAMPERING, ids=[c[0] for c in TAMPERING])
def test_validate_names_the_broken_field(ckv, case, fields, error, pattern):
    bad = tampered(ckv, **fields)
    with pytest.raises(error, match=r"^CompressedKV: " + pattern):
        bad.validate()
    with pytest.raises(error, match=r"^K: " + pattern):
        bad.validate("K")
    ckv.validate()  # the original is untouched


def test_validate_scalar_fields(ckv):
    with pytest.raises(TypeError, match=r"^CompressedKV: shape: expected 4 ints \[B, H, N, D\], got \(1, 2, 75\)"):
        dataclasses.replace(ckv, shape=(1, 2, 75)).validate()
    with pytest.raises(ValueError, match=r"^CompressedKV: shape: expected every dimension >= 1, got \[1, 0, 75, 16\]"):
        dataclasses.replace(ckv, shape=(1, 0, 75, 16)).validate()
    with pytest.raises(ValueError, match=r"coeffs: expected shape \[1, 2, 80, r\] \(from shape\), got \[1, 2, 75, 6\]"):
        dataclasses.replace(ckv, shape=(1, 2, 80, 16)).validate()
    with pytest.raises(TypeError, match=r"^CompressedKV: dtype: expected float16, bfloat16 or float32, got int32"):
        dataclasses.replace(ckv, dtype=torch.int32).validate()
    with pytest.raises(TypeError, match=r"^CompressedKV: config: expected kvbound.CompressionConfig, got dict"):
        dataclasses.replace(ckv, config=CONFIG.as_dict()).validate()
    with pytest.raises(TypeError, match=r"^CompressedKV: shared_basis: expected bool, got int"):
        dataclasses.replace(ckv, shared_basis=1).validate()
    with pytest.raises(ValueError, match=r"basis: expected shape \[1, 2, 5, 6, 16\] \(from shape .*shared_basis=False"):
        dataclasses.replace(ckv, shared_basis=False).validate()
    with pytest.raises(ValueError, match=r"^CompressedKV: codes: expected device cpu \(coeffs' device\), got meta"):
        dataclasses.replace(ckv, codes=ckv.codes.to("meta")).validate()
    # a config whose bits no longer match the stored widths
    with pytest.raises(ValueError, match=r"bits: expected config.bits = 8 for packed blocks \(mode 1\), got 4"):
        dataclasses.replace(ckv, config=dataclasses.replace(CONFIG, bits=8)).validate()
    # a smaller tau: the stored steps exceed 2 tau
    with pytest.raises(ValueError, match=r"scale: expected a step in \(0, 0.002\]"):
        dataclasses.replace(ckv, config=dataclasses.replace(CONFIG, tau=0.001)).validate()


# ------------------------------------------------------------------------------------------- valid objects
def _round_trip(ckv: kvbound.CompressedKV, path) -> None:
    ckv.validate()
    ckv.save(path)
    back = kvbound.load(path)
    assert (back.shape, back.dtype, back.config, back.shared_basis) == (
        ckv.shape,
        ckv.dtype,
        ckv.config,
        ckv.shared_basis,
    )
    for name, t in ckv._tensors().items():
        u = back._tensors()[name]
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), name
    assert torch.equal(back.decompress(), ckv.decompress())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("calibrated", [False, True])
def test_eager_objects_validate_and_round_trip(tmp_path, dtype, calibrated):
    x = structured(dtype, seed=1)
    basis = kvbound.calibrate(structured(dtype, seed=1, spikes=False), CONFIG) if calibrated else None
    ckv = kvbound.compress_kv(x, CONFIG, basis)
    assert every_mode(ckv), ckv.mode_fractions()
    _round_trip(ckv, tmp_path / "k.safetensors")


def blocks_of_amplitude(*amplitudes: float, n: int, seed: int = 0) -> torch.Tensor:
    """[1, 2, n, 16] uniform noise, block k of 16 rows at amplitude ``amplitudes[k]``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(amplitudes).repeat_interleave(BLOCK)[:n].reshape(1, 1, n, 1)
    return (torch.rand(1, 2, n, D, generator=g) * 2 - 1) * scale


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_eager_objects_of_every_width_validate(tmp_path, bits):
    """Rank 0: the first block fits ``bits``, the second needs wider codes (below 8 bits), the last is exact."""
    config = dataclasses.replace(CONFIG, bits=bits, rank=0)
    ckv = kvbound.compress_kv(blocks_of_amplitude(0.05, 0.5, 100.0, n=40), config)
    assert ckv.mode[0, 0].tolist() == [MODE_PACKED, MODE_PACKED if bits == 8 else MODE_PROMOTED, MODE_RAW]
    _round_trip(ckv, tmp_path / "k.safetensors")


def test_tiny_tau_steps_validate():
    """Below float32's smallest normal number, the encoders raise the step to it (2**-126 > 2 tau)."""
    signs = torch.randint(-1, 2, (1, 1, 16, 16), generator=torch.Generator().manual_seed(0)).float()
    x = signs * 2.0**-126
    ckv = kvbound.compress_kv(x, kvbound.CompressionConfig(block_size=16, rank=0, bits=2, tau=1e-40))
    assert ckv.mode.item() == MODE_PACKED and ckv.scale.item() == 2.0**-126
    ckv.validate()


def test_anchored_objects_validate():
    x = structured(torch.float32, seed=3)
    basis = kvbound.calibrate(structured(torch.float32, seed=3, spikes=False), CONFIG)
    anchor = kvbound.compress_kv(x, CONFIG, basis)
    moved = x + 0.001 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ckv = kvbound.compress_kv(moved, CONFIG, basis, anchor=anchor, anchor_source=x)
    ckv.validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_objects_validate_and_round_trip(tmp_path, dtype):
    x = structured(dtype, seed=4)
    basis = kvbound.calibrate(structured(dtype, seed=4, spikes=False), CONFIG)
    ckv = kvbound.compress_kv(x, CONFIG, basis, impl="triton")
    assert every_mode(ckv), ckv.mode_fractions()
    _round_trip(ckv, tmp_path / "k.safetensors")
    eager = kvbound.compress_kv(x, CONFIG, basis)
    for name in ("mode", "bits", "offset"):
        assert torch.equal(getattr(ckv, name), getattr(eager, name)), name


def test_speculative_workspaces_decompress_but_are_not_packed():
    """The speculative encoder's objects keep whole workspaces (fixed places per block): ``decompress`` reads them
    (every read is inside), ``validate``, which wants the packed layout, refuses them."""
    x = structured(torch.float16, seed=5)
    basis = kvbound.calibrate(structured(torch.float16, seed=5, spikes=False), CONFIG)
    sync = kvbound.compress_kv(x, CONFIG, basis, impl="triton")
    from kvbound.codec.encode_triton import encode_triton_deferred

    with _checks._block(speculative=True) as scope:
        for one_pass in (False, True):
            spec = encode_triton_deferred(x, CONFIG, basis, scope, one_pass=one_pass)
            assert torch.equal(spec.decompress(), sync.decompress())
            check_layout(spec, packed=False)
            with pytest.raises(ValueError, match=r"^CompressedKV: (codes|offset): expected"):
                spec.validate()


# ------------------------------------------------------------------------------------------------ decompress
DECODE_TAMPERING = [
    ("offset-plus-1e6", {"offset": lambda t: t + 10**6}, ValueError,
     r"offset: expected a start from which the block's \d+ words lie inside codes \(\d+ words\), got 1\d{6} "),
    ("codes-truncated", {"codes": lambda t: t[:5]}, ValueError,
     r"offset: expected a start from which the block's \d+ words lie inside codes \(5 words\)"),
    ("raw-offset-negative", {"offset": at_mode(MODE_RAW, -1)}, ValueError,
     r"offset: expected a start from which the block's \d+ values lie inside raw \(\d+ values\), got -1"),
    ("all-raw-no-values", {"mode": lambda t: torch.full_like(t, MODE_RAW), "bits": torch.zeros_like,
                           "raw": lambda t: t[:0]}, ValueError, r"offset: expected .* inside raw \(0 values\)"),
    ("bits-7", {"bits": lambda t: torch.where(t > 0, 7, 0).to(torch.int8)}, ValueError, r"bits: expected"),
    ("bits-on-lowrank", {"bits": at_mode(MODE_LOWRANK, 4)}, ValueError, r"bits: expected 0 for blocks without codes"),
    ("codes-float32", {"codes": lambda t: t.float()}, TypeError, r"codes: expected int32, got float32"),
    ("mode-shape", {"mode": lambda t: t[..., :-1]}, ValueError, r"mode: expected shape \[1, 2, 5\]"),
]


@pytest.mark.parametrize("case, fields, error, pattern", DECODE_TAMPERING, ids=[c[0] for c in DECODE_TAMPERING])
def test_decompress_refuses_what_it_cannot_read(ckv, case, fields, error, pattern):
    with pytest.raises(error, match=r"^CompressedKV: " + pattern):
        tampered(ckv, **fields).decompress()


# The cases of DECODE_TAMPERING that only the stored values tell (shapes and dtypes are refused before any check).
READ_TAMPERING = [c for c in DECODE_TAMPERING if c[0] not in ("codes-float32", "mode-shape")]


def _inference_copy(ckv: kvbound.CompressedKV) -> kvbound.CompressedKV:
    """The same object with every stored tensor an inference tensor (no version counter: no checked record)."""
    with torch.inference_mode():
        copy = dataclasses.replace(ckv, **{name: t.clone() for name, t in ckv._tensors().items()})
    assert copy._stamps() is None
    return copy


class _PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing: under it ``kvbound.attention`` dispatches its op, as under
    ``torch.compile`` or a device context, where no check record can be trusted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("context", ["eager", "profiled", "inference", "dispatched"])
@pytest.mark.parametrize("case, fields, error, pattern", READ_TAMPERING, ids=[c[0] for c in READ_TAMPERING])
def test_attention_refuses_what_it_cannot_read(ckv, case, fields, error, pattern, context):
    """``kvbound.attention`` never reads a block outside ``codes`` or ``raw``: an object's first check runs the
    layout checks (the same message as ``decompress``; under ``torch.profiler`` too, where the op is dispatched with
    the objects' records); where no record can be kept (inference tensors) or used (the op dispatched under a
    function mode), each call counts the failed block checks with its other checks, read before the kernel runs.
    The untampered object gives the same output in every context."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 8, D, generator=g)
    bad = tampered(ckv, **fields)
    good = ckv
    if context == "inference":
        bad, good = _inference_copy(bad), _inference_copy(ckv)
    reference = kvbound.attention(q, ckv, ckv, scale=0.25)

    def run(k, v):
        if context == "inference":
            with torch.inference_mode():
                return kvbound.attention(q, k, v, scale=0.25)
        if context == "profiled":
            with torch.profiler.profile():
                return kvbound.attention(q, k, v, scale=0.25)
        if context == "dispatched":
            with _PassThrough():
                return kvbound.attention(q, k, v, scale=0.25)
        return kvbound.attention(q, k, v, scale=0.25)

    if context in ("eager", "profiled"):
        with pytest.raises(error, match=r"^k: " + pattern):
            run(bad, good)
    else:
        with pytest.raises(ValueError, match=r"^k: expected the layout of kvbound.CompressedKV, got [1-9]\d* failed "
                                             r"block checks .*k.validate\(\) names the first"):
            run(bad, good)
        with pytest.raises(ValueError, match=r"^v: expected the layout of kvbound.CompressedKV, got [1-9]"):
            run(good, bad)
    torch.testing.assert_close(run(good, good), reference, rtol=0, atol=0)


def test_layout_violations_counts_each_failed_check(ckv):
    """``layout_violations`` (what attention queues) is zero for a valid object and counts failed block checks."""
    from kvbound.codec.format import layout_violations

    def count(c):
        n, d = c.shape[2], c.shape[3]
        return float(layout_violations(c.mode, c.bits, c.offset, n, d, BLOCK, CONFIG.bits, c.codes.numel(),
                                       c.raw.numel()))  # fmt: skip

    assert count(ckv) == 0
    b, h, k = first_block_of[MODE_PACKED]
    assert count(tampered(ckv, mode=set_at((b, h, k), 9))) == 1  # a mode outside 0..3
    assert count(tampered(ckv, bits=set_at((b, h, k), 7))) == 1  # a width packed blocks cannot have
    # every coded block of both heads reads outside 5 words of codes
    coded = int(((ckv.mode == MODE_PACKED) | (ckv.mode == MODE_PROMOTED)).sum())
    assert count(tampered(ckv, codes=lambda t: t[:5])) == coded
    # the exact values' reads: one block short of raw, one offset before the start, every read block moved past the end
    assert count(tampered(ckv, raw=lambda t: t[:-1])) == 1
    assert count(tampered(ckv, offset=at_mode(MODE_RAW, -1))) == 1
    reading = int((ckv.mode != MODE_LOWRANK).sum())
    assert count(tampered(ckv, offset=lambda t: t + 10**6)) == reading
    assert count(tampered(ckv, bits=at_mode(MODE_LOWRANK, 4))) == 1  # a low-rank block has no codes


# ------------------------------------------------------------------------------------------------------ load
@pytest.fixture(scope="module")
def saved(ckv, tmp_path_factory):
    """(tensors, metadata) of the fixture as ``save`` writes them."""
    path = tmp_path_factory.mktemp("saved") / "k.safetensors"
    ckv.save(path)
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    return load_file(str(path)), meta


def write(tmp_path, tensors, meta):
    path = tmp_path / "k.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def edit_config(**changes):
    return lambda meta: {**meta, "config": json.dumps({**json.loads(meta["config"]), **changes})}


def drop(key):
    return lambda meta: {k: v for k, v in meta.items() if k != key}


def put(key, value):
    return lambda meta: {**meta, key: value}


METADATA = [
    ("no-shape", drop("shape"), r"metadata: expected the key 'shape', missing"),
    ("no-dtype", drop("dtype"), r"metadata: expected the key 'dtype', missing"),
    ("no-config", drop("config"), r"metadata: expected the key 'config', missing"),
    ("no-shared-basis", drop("shared_basis"), r"metadata: expected the key 'shared_basis', missing"),
    ("shape-not-json", put("shape", "[1, 2,"), r"metadata shape: expected a JSON list of 4 ints >= 1 .* got '\[1, 2,'"),
    ("shape-3d", put("shape", "[1, 2, 75]"), r"metadata shape: expected a JSON list of 4 ints"),
    ("shape-floats", put("shape", "[1, 2, 75.0, 16]"), r"metadata shape: expected a JSON list of 4 ints"),
    ("shape-zero", put("shape", "[1, 0, 75, 16]"), r"metadata shape: expected a JSON list of 4 ints >= 1"),
    ("shape-n-48", put("shape", "[1, 2, 48, 16]"), r"coeffs: expected shape \[1, 2, 48, r\]"),
    ("dtype-nonsense", put("dtype", "nonsense"), r"metadata dtype: expected one of \['float16', 'bfloat16', "
     r"'float32'\], got 'nonsense'"),
    ("dtype-Tensor", put("dtype", "Tensor"), r"metadata dtype: expected one of .* got 'Tensor'"),
    ("dtype-int32", put("dtype", "int32"), r"metadata dtype: expected one of .* got 'int32'"),
    ("dtype-float16", put("dtype", "float16"), r"raw: expected float16 \(the dtype field\), got float32"),
    ("config-not-json", put("config", "{"), r"metadata config: expected a JSON object with the keys"),
    ("config-missing-key", lambda m: {**m, "config": json.dumps({"rank": 6, "bits": 4, "tau": 0.03125})},
     r"metadata config: expected a JSON object with the keys \['bits', 'block_size', 'rank', 'tau'\]"),
    ("config-extra-key", edit_config(extra=1), r"metadata config: expected a JSON object with the keys"),
    ("config-bits-float", edit_config(bits=4.0), r"metadata config: CompressionConfig.bits: expected int, got float"),
    ("config-bits-5", edit_config(bits=5), r"metadata config: CompressionConfig.bits: expected one of"),
    ("config-bits-8", edit_config(bits=8), r"bits: expected config.bits = 8 for packed blocks \(mode 1\), got 4"),
    ("config-block-32", edit_config(block_size=32), r"mode: expected shape \[1, 2, 3\] .*block_size 32"),
    ("config-rank-4", edit_config(rank=4), r"coeffs: expected rank config.rank = 4 .* got 6"),
    ("config-tau-smaller", edit_config(tau=0.001), r"scale: expected a step in \(0, 0.002\]"),
    ("shared-basis-2", put("shared_basis", "2"), r"metadata shared_basis: expected '0' or '1', got '2'"),
    ("shared-basis-0", put("shared_basis", "0"), r"basis: expected shape \[1, 2, 5, 6, 16\]"),
]


@pytest.mark.parametrize("case, edit, pattern", METADATA, ids=[c[0] for c in METADATA])
def test_load_names_the_file_and_the_key(tmp_path, saved, case, edit, pattern):
    tensors, meta = saved
    path = write(tmp_path, tensors, edit(meta))
    with pytest.raises((ValueError, TypeError), match=r"^" + re.escape(str(path)) + ": " + pattern) as info:
        kvbound.load(path)
    assert info.type is (TypeError if case == "dtype-float16" else ValueError)


def test_load_refuses_missing_and_unknown_tensors(tmp_path, saved):
    tensors, meta = saved
    path = write(tmp_path, {k: v for k, v in tensors.items() if k != "codes"}, meta)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": tensors: expected exactly \[.*\], got missing "
                       r"\['codes'\]$"):
        kvbound.load(path)
    path = write(tmp_path, {**tensors, "extra": torch.zeros(1)}, meta)
    with pytest.raises(ValueError, match=r"k.safetensors: tensors: expected exactly .* got unknown \['extra'\]$"):
        kvbound.load(path)


SAVABLE = [case for case in TAMPERING if case[0] != "codes-not-a-tensor"]


@pytest.mark.parametrize("case, fields, error, pattern", SAVABLE, ids=[c[0] for c in SAVABLE])
def test_save_and_load_run_the_layout_checks(tmp_path, ckv, case, fields, error, pattern):
    """``save`` refuses to write what ``load`` would refuse; a file written otherwise (an older or foreign writer)
    is refused by ``load`` with the same message, naming the file."""
    bad = tampered(ckv, **fields)
    path = tmp_path / "k.safetensors"
    with pytest.raises(error, match=r"^CompressedKV: " + pattern):
        bad.save(path)
    assert not path.exists()
    save_file({name: t.contiguous() for name, t in bad._tensors().items()}, str(path), metadata=bad._metadata())
    with pytest.raises(error, match=r"^" + re.escape(str(path)) + ": " + pattern):
        kvbound.load(path)


def test_save_and_load_name_paths_and_devices(tmp_path, ckv):
    with pytest.raises(IsADirectoryError, match=r"^path: expected a file to write, got the directory "):
        ckv.save(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^path: expected an existing directory to write k.kv in, got "):
        ckv.save(tmp_path / "missing" / "k.kv")
    path = tmp_path / "k.kv"
    ckv.save(path)
    with pytest.raises(IsADirectoryError, match=r"^path: expected a kvbound.CompressedKV file, got the directory "):
        kvbound.load(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^path: expected a kvbound.CompressedKV file, got .*none.kv, which "
                                                r"does not exist$"):
        kvbound.load(tmp_path / "none.kv")
    truncated = tmp_path / "truncated.kv"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"^path: .*truncated.kv is not a readable safetensors file \("):
        kvbound.load(truncated)
    with pytest.raises(ValueError, match=r"^device: expected a torch device, got 'gpu7'"):
        kvbound.load(path, device="gpu7")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device: expected an available device, got 'cuda': torch.cuda"):
            kvbound.load(path, device="cuda")
    back = kvbound.load(path)
    for name, t in ckv._tensors().items():
        assert torch.equal(getattr(back, name), t), name


def test_max_abs_error_and_decompress_name_what_they_cannot_use(ckv):
    x = ckv.decompress()
    assert ckv.max_abs_error(x) == 0.0
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor, got list$"):
        ckv.max_abs_error([1.0])
    assert ckv.max_abs_error(x.double()) == 0.0
    with pytest.raises(TypeError, match=r"^x: expected dtype in \(float16, bfloat16, float32, float64\), got int32$"):
        ckv.max_abs_error(x.int())
    with pytest.raises(ValueError, match=r"^x: expected finite values, found nan at index \(0, 0, 0, 0\)"):
        ckv.max_abs_error(torch.where(torch.arange(x.numel()).view(x.shape) == 0, math.nan, x))
    with pytest.raises(ValueError, match=r"^x: expected shape \(1, 2, 75, 16\) \(this CompressedKV's\), got "
                                         r"\(1, 2, 74, 16\)$"):
        ckv.max_abs_error(x[:, :, :74])
    with pytest.raises(ValueError, match=r"^CompressedKV: expected stored values to decode, got tensors on the meta "):
        ckv.to("meta").decompress()


def test_load_catches_config_bits_edited_under_stored_widths(tmp_path):
    """A file of 3-bit blocks whose config says 4 bits would drop their residuals when decoded: refused."""
    config = dataclasses.replace(CONFIG, bits=3, rank=0)
    ckv = kvbound.compress_kv(blocks_of_amplitude(0.1, 0.3, n=32), config)
    assert ckv.bits[0, 0].tolist() == [3, 4]
    path = tmp_path / "b3.safetensors"
    ckv.save(path)
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    edited = write(tmp_path, tensors, edit_config(bits=4)(meta))
    with pytest.raises(ValueError, match=r"bits: expected config.bits = 4 for packed blocks \(mode 1\), got 3"):
        kvbound.load(edited)
    assert kvbound.load(path).config.bits == 3


# --------------------------------------------------------------------------------------------------- basis
@pytest.fixture(scope="module")
def basis():
    return kvbound.calibrate(structured(torch.float32, spikes=False), CONFIG)


BAD_PROJECTIONS = [
    ("2-d", lambda p: p[0], ValueError,
     r"basis.projection: expected 3 dimensions \[H, r, D\], got 2 \(shape \[6, 16\]\)"),
    ("4-d", lambda p: p[None], ValueError, r"basis.projection: expected 3 dimensions \[H, r, D\], got 4"),
    ("float32", lambda p: p.float(), TypeError, r"basis.projection: expected float16 .* got float32"),
    ("int32", lambda p: p.to(torch.int32), TypeError, r"basis.projection: expected float16 .* got int32"),
    ("list", lambda p: p.tolist(), TypeError, r"basis.projection: expected a torch.Tensor \[H, r, D\], got list"),
    ("meta", lambda p: p.to("meta"), ValueError, r"basis.projection: expected a tensor with data .* got device meta"),
]


@pytest.mark.parametrize("case, edit, error, pattern", BAD_PROJECTIONS, ids=[c[0] for c in BAD_PROJECTIONS])
def test_basis_projection_is_checked(basis, case, edit, error, pattern):
    projection = edit(basis.projection.clone())
    with pytest.raises(error, match=pattern):
        kvbound.Basis(projection, basis.captured_energy, 0.0, 1)
    # A Basis edited after it was made: compress_kv checks again, with either encoder.
    edited = dataclasses.replace(basis)
    edited.projection = projection
    x = structured(torch.float32)
    with pytest.raises(error, match=pattern):
        kvbound.compress_kv(x, CONFIG, edited)
    with pytest.raises(error, match=pattern):
        kvbound.compress_kv(x, CONFIG, edited, impl="triton")


def test_basis_projection_must_be_finite(basis):
    projection = basis.projection.clone()
    projection[1, 2, 3] = math.nan
    with pytest.raises(ValueError, match=r"basis.projection: expected finite values, found nan at index \(1, 2, 3\)"):
        kvbound.Basis(projection, basis.captured_energy, 0.0, 1)
    edited = dataclasses.replace(basis)
    edited.projection = projection
    x = structured(torch.float32)
    with pytest.raises(ValueError, match=r"basis.projection: expected finite values"):
        kvbound.compress_kv(x, CONFIG, edited)
    # The Triton encoder reads no flag for it: its certificate fails, and the eager encoder it falls back to raises.
    with pytest.raises(ValueError, match=r"basis.projection: expected finite values"):
        kvbound.compress_kv(x, CONFIG, edited, impl="triton")


def test_basis_values_are_read_again_only_after_a_change(monkeypatch):
    """The projection's values (its largest magnitude, which also tells NaN/Inf) are read when the basis is made and
    again only once it was modified in place or replaced (the encoder without host reads reads nothing for an
    unchanged basis); ``largest_magnitude`` follows the values read."""
    import kvbound.codec.basis as module

    reads = []
    real = module._largest_magnitude
    monkeypatch.setattr(module, "_largest_magnitude", lambda t: (reads.append(t), real(t))[1])
    basis = kvbound.calibrate(structured(torch.float32, spikes=False), CONFIG)
    assert len(reads) == 1 and reads[0] is basis.projection
    assert basis.largest_magnitude() == float(basis.projection.float().abs().max()) <= 1.0
    x = structured(torch.float32)
    kvbound.compress_kv(x, CONFIG, basis)
    kvbound.compress_kv(x, CONFIG, basis, impl="triton")
    assert len(reads) == 1
    with torch.no_grad():
        basis.projection[0, 0, 0] = 0.5  # in place: its version counter moves
    assert basis.largest_magnitude() is None  # what was read no longer holds
    kvbound.compress_kv(x, CONFIG, basis)
    kvbound.compress_kv(x, CONFIG, basis)
    assert len(reads) == 2
    basis.projection = basis.projection.clone() * 2
    kvbound.compress_kv(x, CONFIG, basis)
    assert len(reads) == 3 and basis.largest_magnitude() == float(basis.projection.float().abs().max()) > 1.0


# -------------------------------------------------------------------------------------------------- config
def test_config_bits_and_block_size_limits():
    with pytest.raises(TypeError, match=r"^CompressionConfig.bits: expected int, got float$"):
        kvbound.CompressionConfig(bits=4.0)
    with pytest.raises(TypeError, match=r"^CompressionConfig.bits: expected int, got bool$"):
        kvbound.CompressionConfig(bits=True)
    with pytest.raises(ValueError, match=r"^CompressionConfig.block_size: expected at most 65536 \(2\*\*16: .*\), "
                       r"got 1048576$"):
        kvbound.CompressionConfig(block_size=2**20)
    assert kvbound.CompressionConfig(block_size=2**16).block_size == 65536
