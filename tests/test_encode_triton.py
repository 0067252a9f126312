"""The Triton encoder against the eager one (CPU: Triton interpreter; GPU: real sizes)."""

import importlib

import pytest
import torch

import kvbound


def _data(n, d, dtype, gen, device="cpu"):
    x = torch.randn(1, 2, n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
    x = x + 0.05 * torch.randn(1, 2, n, d, generator=gen)
    x[0, 1, n // 2, d // 3] = 50.0  # an outlier that forces an exact block
    return x.to(dtype).to(device)


@pytest.mark.parametrize(
    "n, d, dtype, bits, tau",
    [(300, 64, torch.float16, 4, 0.05), (37, 40, torch.float32, 3, 0.02), (129, 64, torch.bfloat16, 2, 0.1),
     (1, 16, torch.float16, 8, 0.01)],
)
def test_triton_encoder_matches_eager_within_bound(n, d, dtype, bits, tau):
    """Within tau, and storing what the eager encoder stores: the same modes, widths, offsets and exact values; the
    same coefficients and steps up to float32 rounding (the two form the projections and block maxima in another
    order); decoded values apart by at most one step, and that only where a code sits at a rounding boundary."""
    gen = torch.Generator().manual_seed(n + d)
    x = _data(n, d, dtype, gen)
    config = kvbound.CompressionConfig(rank=4, bits=bits, tau=tau, block_size=64)
    basis = kvbound.calibrate(x, config)
    fast = kvbound.compress_kv(x, config, basis, impl="triton")
    slow = kvbound.compress_kv(x, config, basis)
    y = fast.decompress()
    err = (x.double() - y.double()).abs()
    print(f"n={n} d={d} {dtype}: max error {err.max():.4g}, modes {fast.mode.flatten().tolist()}")
    assert bool((err <= tau).all())
    assert torch.equal(fast.mode, slow.mode) and torch.equal(fast.bits, slow.bits)
    assert torch.equal(fast.offset, slow.offset) and torch.equal(fast.raw, slow.raw)
    assert fast.nbytes == slow.nbytes
    # Coefficients: one float16 ulp relative; near-cancelling sums (|c| ~ 3e-4 from terms ~ 1) differ by up to
    # 4.8e-7 absolute (measured), hence the absolute floor of 2**-20.
    torch.testing.assert_close(fast.coeffs.float(), slow.coeffs.float(), rtol=2**-10, atol=2**-20)
    # Steps: float32 rounding apart (measured up to 4.5e-7) in blocks whose float16 coefficients are the same. Where
    # a coefficient rounded to the neighbouring float16 (the two sum its products in another order; seen with
    # NumPy 2.4 under Triton 3.9's interpreter), the residuals, hence the block's largest and its step, move with
    # it: there within the coefficients' own tolerance.
    block = config.block_size
    same_rows = (fast.coeffs == slow.coeffs).all(-1)
    pad = fast.scale.shape[-1] * block - n
    same = torch.nn.functional.pad(same_rows, (0, pad), value=True).unflatten(-1, (-1, block)).all(-1)
    torch.testing.assert_close(fast.scale[same], slow.scale[same], rtol=1e-6, atol=0)
    torch.testing.assert_close(fast.scale[~same], slow.scale[~same], rtol=2**-10, atol=0)
    step = fast.scale.repeat_interleave(block, -1)[..., :n, None]
    apart = (y - slow.decompress()).abs()
    assert bool((apart <= step + 1e-6).all()), float((apart - step).max())
    # one step apart where a residual lies within float32 rounding of a code boundary: rare (measured 1 element of
    # 38,400; a rounding offset of 0.15 step in the codes gives 12-14 %); counted in blocks of equal coefficients
    kept = same.repeat_interleave(block, -1)[..., :n, None].expand_as(apart)
    if kept.any():
        assert float((apart[kept] > 1e-5).double().mean()) <= 0.01


def test_triton_encoder_requires_basis():
    x = torch.randn(1, 1, 32, 16)
    with pytest.raises(ValueError, match="basis: the Triton encoder needs a calibrated basis"):
        kvbound.compress_kv(x, kvbound.CompressionConfig(rank=2), impl="triton")
    with pytest.raises(ValueError, match="impl: expected 'eager' or 'triton'"):
        kvbound.compress_kv(x, kvbound.CompressionConfig(rank=2), impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n, d", [(65536, 64), (8192, 128), (4096, 192)])
def test_triton_encoder_gpu_real_sizes(n, d):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(1, 8, n, 8, generator=gen) @ torch.randn(8, d, generator=gen) / 3
         + 0.02 * torch.randn(1, 8, n, d, generator=gen)).to(torch.bfloat16).cuda()
    config = kvbound.CompressionConfig()
    basis = kvbound.calibrate(x[:, :, :4096], config)
    fast = kvbound.compress_kv(x, config, basis, impl="triton")
    err = (x.double() - fast.decompress().double()).abs()
    assert bool((err <= config.tau).all()), err.max().item()
    slow = kvbound.compress_kv(x, config, basis)
    assert torch.equal(fast.mode, slow.mode)


def test_triton_certificate_matches_eager_certificate_on_tampering():
    """A wrong step, exact value or coefficient fails its block (and no other) in the Triton certificate, as in the
    eager one (which trusts exact blocks)."""
    from kvbound.codec.eager import uncertified_blocks
    from kvbound.codec.encode_triton import certify_triton

    # coded blocks (the noisier rows 0-65: blocks 0-2), an exact block (the outlier in row 100 of head 1: block 3),
    # low-rank-only blocks elsewhere
    x, clean = _tiled_data(1, 2, 200, 40, torch.float16, 9, exact_rows=[(0, 1, 100)])
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(clean, config))
    assert not bool(certify_triton(ckv, x).any())
    packed = (ckv.bits > 0).nonzero()[0].tolist()
    raw = (ckv.mode == 3).nonzero()[0].tolist()
    lowrank = (ckv.mode == 0).nonzero()[0].tolist()
    ckv.scale[tuple(packed)] *= 2.0  # a step twice too wide
    ckv.raw[3] += 1.0  # an exact value altered
    ckv.coeffs[lowrank[0], lowrank[1], lowrank[2] * 32, 0] += 0.5  # a coefficient altered
    fast, slow = certify_triton(ckv, x), uncertified_blocks(ckv, x)
    assert torch.equal(fast[..., :], slow | fast & (ckv.mode == 3))  # the eager check trusts exact blocks
    assert bool(fast[tuple(packed)]) and bool(fast[tuple(raw)]) and bool(fast[tuple(lowrank)])
    assert int(fast.sum()) == 3  # those three blocks only


@pytest.mark.gpu
def test_int64_offsets_beyond_2_31_elements():
    """K/V of more than 2**31 elements: dense and compressed attention must still read the last keys."""
    heads, d = 8, 64
    n = (1 << 31) // (heads * d) + 37
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1)
    v = torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    k[:, :, -1] = q[:, :, 0] * 4  # the last key dominates query 0
    v[:, :, -1] = 1.0
    assert k.numel() > 2**31
    out = kvbound.attention(q, k, v)
    ref = kvbound.reference_attention(q, k, v)
    err = (out.double() - ref).abs().max().item()
    assert err < 2e-2, err
    assert out[:, :, 0].float().mean().item() > 0.5  # the last key was read
    config = kvbound.CompressionConfig(tau=0.05)
    basis_k = kvbound.calibrate(k[:, :, :65536], config)
    basis_v = kvbound.calibrate(v[:, :, :65536], config)
    ck = kvbound.compress_kv(k, config, basis_k, impl="triton")
    cv = kvbound.compress_kv(v, config, basis_v, impl="triton")
    out_c = kvbound.attention(q, ck, cv)
    ref_c = kvbound.reference_attention(q, ck.decompress(), cv.decompress())
    err_c = (out_c.double() - ref_c).abs().max().item()
    print(f"dense error {err:.3g}, compressed error {err_c:.3g}")
    assert err_c < 2e-2, err_c


@pytest.mark.parametrize("outlier", [True, False])
def test_triton_encoder_records_its_check_and_attention_reuses_it(outlier, monkeypatch):
    """The encoder records that its output is finite and whether any block holds a residual (here: with and
    without the outlier's exact block); kvbound.attention then checks only q, and checks K/V again once a stored
    tensor is written in place."""
    attention_module = importlib.import_module("kvbound.attention")  # the module (kvbound.attention is the function)
    gen = torch.Generator().manual_seed(5)
    x = _data(64, 16, torch.float16, gen)
    if not outlier:
        x[0, 1, 32, 5] = 0.0
    config = kvbound.CompressionConfig(rank=4, bits=8, tau=0.5, block_size=16)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config), impl="triton")
    assert ckv._checked_residual() is (bool((ckv.mode != 0).any()))
    assert ckv._checked_residual() is outlier
    assert ckv._checked_lowrank_share() == pytest.approx(ckv.mode_fractions()["lowrank"], abs=1e-12)
    assert (ckv._checked_lowrank_share() < 1) is outlier
    seen = []
    original = attention_module._queue_checks

    def spy(tensors, *args, **kwargs):
        seen.append(sorted(name for name, t in dict(tensors).items() if t is not None))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(attention_module, "_queue_checks", spy)
    q = torch.randn(1, 2, 8, 16, generator=gen).to(torch.float16)
    first = kvbound.attention(q, ckv, ckv)
    assert seen == [["q"]]
    ckv.coeffs.mul_(1.0)
    second = kvbound.attention(q, ckv, ckv)
    # k and v are one object here: checked again once (as k), recorded, then reused for v.
    assert seen[1:] == [["k.basis", "k.coeffs", "k.raw", "k.scale"], ["q"]]
    torch.testing.assert_close(second, first, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- tiling
# The kernels run one program per tile of rows of a block and gather what a block needs with atomics (a max, an
# or). Whatever the tiling, every stored tensor must come out bit for bit the same: "block" is one program per
# block in every kernel (the layout of the kernels before the tiling), "small" the shortest tiles; the columns per
# step of the coefficients stay the same (the interpreter's float32 dot sums a step through the host's BLAS).
def _tiling(kind):
    from kvbound.codec import encode_triton as et

    default = _DEFAULT_TILING.setdefault("tiling", et._tiling)  # the module's own, not a patched one

    def tiling(block, d_pad):
        cols = default(block, d_pad)["coefficients"][2]
        if kind == "block":
            return {"coefficients": (block, 4, cols), "modes": (block, 4), "write": (block, 4), "certify": (block, 4),
                    "one_pass": (4,)}
        if kind == "small":
            return {"coefficients": (16, 4, cols), "modes": (16, 4), "write": (16, 4), "certify": (4, 4),
                    "one_pass": (4,)}
        return default(block, d_pad)

    return tiling


_DEFAULT_TILING = {}


def _tiled_data(b, h, n, d, dtype, seed, exact_rows=(), promoted_rows=()):
    """``x`` and the basis calibrated on it without the outliers (which a rank-4 basis of so few rows would take)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
    x = x + 0.01 * torch.randn(b, h, n, d, generator=gen)
    x[:, :, : n // 3] += 0.04 * torch.randn(b, h, n // 3, d, generator=gen)  # blocks that need codes
    clean = x.to(dtype, copy=True)
    for bi, hi, row in exact_rows:
        x[bi, hi, row, d // 3] = 60.0  # an outlier that forces an exact block
    for bi, hi, row in promoted_rows:
        x[bi, hi, row, 1] += 1.0  # a residual beyond the widest step of `bits`-bit codes
    return x.to(dtype), clean


_TILING_CASES = {
    # N not a multiple of the block, the block several tiles of every kernel; the outlier of the exact block (1, 1,
    # block 1) sits in a middle tile of its block (neither the first nor the last), and so does the promoting
    # residual (0, 1, block 2).
    "n200_d192_block64": (_tiled_data(2, 2, 200, 192, torch.float16, 1, [(1, 1, 64 + 40)], [(0, 1, 128 + 40)]),
                          kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=64)),
    # a short last block inside one tile; block 16 with d = 40 (padded to 64), float32, 3-bit codes
    "n37_d40_block16": (_tiled_data(2, 2, 37, 40, torch.float32, 2, [(0, 1, 30)], [(1, 0, 13)]),
                        kvbound.CompressionConfig(rank=4, bits=3, tau=0.02, block_size=16)),
    "n100_d64_block32_bits2": (_tiled_data(1, 2, 100, 64, torch.float16, 3, [(0, 0, 95)], [(0, 1, 45)]),
                               kvbound.CompressionConfig(rank=4, bits=2, tau=0.05, block_size=32)),
}


@pytest.mark.parametrize("name", list(_TILING_CASES))
def test_tilings_store_the_same_bits(name, monkeypatch):
    from kvbound.codec import encode_triton as et

    (x, clean), config = _TILING_CASES[name]
    basis = kvbound.calibrate(clean, config)
    out = {}
    for kind in ("block", "small", "default"):
        monkeypatch.setattr(et, "_tiling", _tiling(kind))
        out[kind] = et.encode_triton(x, config, basis)
    eager = kvbound.compress_kv(x, config, basis)
    modes = torch.bincount(eager.mode.flatten().long(), minlength=4).tolist()
    print(f"{name}: modes {modes}")
    assert all(modes[m] > 0 for m in (1, 2, 3)), modes  # packed, promoted and exact blocks all occur
    reference = out["block"]
    for kind, ckv in out.items():
        for field, tensor in ckv._tensors().items():
            expected = reference._tensors()[field]
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, (kind, field)
            assert torch.equal(tensor.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)), (kind, field)
        assert torch.equal(ckv.mode, eager.mode) and torch.equal(ckv.bits, eager.bits), kind
        assert ckv.nbytes == eager.nbytes
        assert torch.equal(ckv.offset, eager.offset) and torch.equal(ckv.raw, eager.raw)
        assert bool(((x.double() - ckv.decompress().double()).abs() <= config.tau).all()), kind


def test_certificate_flags_tampering_in_the_last_tile_of_a_block(monkeypatch):
    """A wrong code word, exact value or coefficient in the last row of a block fails its block (and no other),
    whatever the certificate's tiling."""
    from kvbound.codec import encode_triton as et
    from kvbound.codec.eager import uncertified_blocks

    (x, clean), config = _TILING_CASES["n200_d192_block64"]
    ckv = et.encode_triton(x, config, kvbound.calibrate(clean, config))
    assert not bool(et.certify_triton(ckv, x).any())
    block, d = config.block_size, x.shape[-1]
    last = block - 1
    # full blocks (not the short last one), so that row `last` exists
    packed, exact, lowrank = (next(tuple(i) for i in (ckv.mode == mode).nonzero().tolist() if i[2] < ckv.num_blocks - 1)
                              for mode in (1, 3, 0))
    per_row = -(-d // (32 // int(ckv.bits[packed])))  # words per row
    ckv.codes[int(ckv.offset[packed]) + last * per_row] = 0  # every code of the word at its most negative
    ckv.raw[int(ckv.offset[exact]) + last * d + 5] += 1.0
    ckv.coeffs[lowrank[0], lowrank[1], lowrank[2] * block + last, 0] += 0.5
    expected = torch.zeros_like(ckv.mode, dtype=torch.bool)
    for index in (packed, exact, lowrank):
        expected[index] = True
    slow = uncertified_blocks(ckv, x)
    for kind in ("block", "small", "default"):
        monkeypatch.setattr(et, "_tiling", _tiling(kind))
        fast = et.certify_triton(ckv, x)
        assert fast.dtype == torch.bool and fast.shape == ckv.mode.shape
        assert torch.equal(fast, expected), kind
        assert torch.equal(fast, slow | fast & (ckv.mode == 3)), kind  # as the eager check, exact blocks aside


# ------------------------------------------------------------------------------------------- one launch
# The deferred encoder's one-launch form (``_one_pass_kernel``: one program per block runs the five kernels' steps
# in turn) must store what the five kernels store: the same coefficients, modes, widths and steps bit for bit, each
# block's codes and exact values at the place of its rows, the same sizes read at the block's end.
def _deferred(x, config, basis, one_pass, **kwargs):
    from kvbound import _checks
    from kvbound.codec.encode_triton import encode_triton_deferred

    sizes = []
    with _checks._block(speculative=True) as scope:
        ckv = encode_triton_deferred(x, config, basis, scope, sizes=lambda *a: sizes.append(a), one_pass=one_pass,
                                     **kwargs)
        decoded = ckv.decompress()
    return ckv, sizes, decoded


def counted_one_pass_launches(monkeypatch) -> list:
    """The grids of ``_one_pass_kernel``'s launches from now on (the kernel still runs)."""
    from kvbound.codec import encode_triton as et

    launched = []
    kernel = et._one_pass_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(et, "_one_pass_kernel", Counted())
    return launched


@pytest.mark.parametrize("name, tiling", [(name, "default") for name in _TILING_CASES] + [("n200_d192_block64",
                                                                                            "small")])
def test_one_pass_stores_what_the_five_kernels_store(name, tiling, monkeypatch):
    """With the default tiles and with 16-row tiles (several tiles of each step per block, so that the program's
    reductions over its tiles run)."""
    from kvbound.codec import encode_triton as et

    (x, clean), config = _TILING_CASES[name]
    basis = kvbound.calibrate(clean, config)
    five, five_sizes, five_decoded = _deferred(x, config, basis, False)
    monkeypatch.setattr(et, "_tiling", _tiling(tiling))
    one, one_sizes, one_decoded = _deferred(x, config, basis, True)
    for field in ("coeffs", "mode", "bits", "scale"):
        a, b = getattr(five, field), getattr(one, field)
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), field
    modes = torch.bincount(one.mode.flatten().long(), minlength=4).tolist()
    assert all(modes[m] > 0 for m in (1, 2, 3)), modes  # packed, promoted and exact blocks all occur
    assert [s[:3] for s in one_sizes] == [s[:3] for s in five_sizes] and len(one_sizes) == 1
    # the blocks the attention kernel's uniform runs cannot read, as each path placed its codes
    assert one_sizes[0][3] == off_width_blocks(one, config) and five_sizes[0][3] == off_width_blocks(five, config)
    assert torch.equal(one_decoded, five_decoded)
    assert bool(((x.double() - one_decoded.double()).abs() <= config.tau).all())
    _assert_fixed_places(one, x, config)


def off_width_blocks(ckv, config) -> int:
    """Blocks with a residual that are exact, coded at another width than ``config.bits``, or whose codes start off a
    16-byte boundary: what the encoders count for the attention kernel's general loop."""
    mode, bits, offset = ckv.mode.long(), ckv.bits.long(), ckv.offset
    return int(((mode != 0) & ((mode == 3) | (bits != config.bits) | (offset % 4 != 0))).sum())


def _assert_fixed_places(one, x, config):
    """A packed block at its rows' place among ``[B, H, N, widest]`` words, an exact one among x's elements; the
    exact values' workspace holds x in exact blocks and zeros elsewhere."""
    b, h, n, d = x.shape
    rows = torch.arange(one.num_blocks, device=x.device) * config.block_size
    place = torch.arange(b * h, device=x.device).view(b, h, 1) * n + rows
    widest = one.codes.numel() // (b * h * n)
    expected = torch.where(one.mode == 3, place * d, torch.where(one.bits > 0, place * widest, -1))
    assert torch.equal(one.offset, expected)
    exact = (one.mode == 3).repeat_interleave(config.block_size, dim=-1)[..., :n, None]
    assert torch.equal(one.raw.view(x.shape), torch.where(exact, x, torch.zeros_like(x)))


def test_one_pass_raises_and_flags(monkeypatch):
    """NaN/Inf (raised by name at the block's end), coefficients beyond float16 (a retry, and ``unusable``), a
    residual where none was forecast (a retry), the summary of a clean encode equal to the five kernels', and a
    block the float64 certificate rejects: here the certificate gets a tau below what the in-kernel check was given,
    so that it reads back and rejects what was stored."""
    from kvbound import _checks
    from kvbound.codec import encode_triton as et

    (x, clean), config = _TILING_CASES["n100_d64_block32_bits2"]
    basis = kvbound.calibrate(clean, config)
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = x.clone()
        bad[0, 1, 70, 3] = value
        with pytest.raises(ValueError, match=r"V: expected finite values, found NaN or Inf"):
            _deferred(bad, config, basis, True, name="V")
    called = []
    with pytest.raises(_checks.Retry, match="coefficients beyond float16"):
        _deferred(x.float() * 1e4, config, basis, True, unusable=lambda: called.append(True))
    assert called == [True]
    with pytest.raises(_checks.Retry, match="K: a residual where none was forecast"):
        _deferred(x, config, basis, True, residual=False, lowrank_share=1.0, name="K")

    one_pass_kernel = et._one_pass_kernel
    certificate_tau = []

    class StricterCertificate:  # the launch with the certificate's tau (argument 18) divided by 4
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                certificate_tau.append(args[18] / 4)
                return one_pass_kernel[grid](*args[:18], args[18] / 4, *args[19:], **kwargs)

            return launch

    summaries = []
    for kernel in (one_pass_kernel, StricterCertificate()):
        monkeypatch.setattr(et, "_one_pass_kernel", kernel)
        _, summary = et._encode(x, config, basis, torch.float16, True, deferred=True, one_pass=True)
        summaries.append(summary.tolist())
    assert certificate_tau == [config.tau / 4]
    _, five = et._encode(x, config, basis, torch.float16, True, deferred=True)
    assert summaries[0] == five.tolist()
    assert summaries[0][et._UNCERTIFIED] == 0 and summaries[1][et._UNCERTIFIED] == 1
    assert summaries[0][: et._UNCERTIFIED] == summaries[1][: et._UNCERTIFIED]
    with pytest.raises(ValueError, match="one_pass: only for a deferred encode"):
        et._encode(x, config, basis, torch.float16, True, one_pass=True)


@pytest.mark.parametrize("below", [False, True])
def test_one_pass_switch(below, monkeypatch):
    """``KVBOUND_ONE_PASS_ENCODE`` picks the one-launch encoder for deferred encodes: on and off as told, and when
    unset or ``auto`` for tensors of at most ``ONE_PASS_AUTO_ELEMENTS`` elements (here the default, then a limit just
    below the test tensor's size); anything but the switch's words is refused by name."""
    from kvbound.codec import encode_triton as et

    launched = counted_one_pass_launches(monkeypatch)
    (x, clean), config = _TILING_CASES["n37_d40_block16"]
    if below:
        monkeypatch.setattr(et, "ONE_PASS_AUTO_ELEMENTS", x.numel() - 1)
    else:
        assert x.numel() <= et.ONE_PASS_AUTO_ELEMENTS
    auto = 0 if below else 1
    basis = kvbound.calibrate(clean, config)
    for setting, expected in ((None, auto), ("auto", auto), ("0", 0), ("off", 0), ("on", 1), ("1", 1)):
        if setting is None:
            monkeypatch.delenv("KVBOUND_ONE_PASS_ENCODE", raising=False)
        else:
            monkeypatch.setenv("KVBOUND_ONE_PASS_ENCODE", setting)
        assert et.one_pass_by_default(x) == bool(expected), setting
        launched.clear()
        _deferred(x, config, basis, None)
        assert len(launched) == expected, setting
    assert launched == [(3, 4)]  # one program per block: 3 blocks of 16 rows, B * H = 4
    monkeypatch.delenv("KVBOUND_ONE_PASS_ENCODE")
    if not below:  # the models' sizes against the default limit
        assert not et.one_pass_by_default(torch.empty(4, 8, 4096, 64, device="meta"))  # Borzoi's K, batch 4: 8 Mi
        assert et.one_pass_by_default(torch.empty(1, 8, 4096, 192, device="meta"))  # Borzoi's V, batch 1: 6 Mi
        assert et.one_pass_by_default(torch.empty(8, 8, 1536, 64, device="meta"))  # Enformer's K, batch 8: 6 Mi
        assert not et.one_pass_by_default(torch.empty(8, 8, 1536, 192, device="meta"))  # Enformer's V, batch 8
    monkeypatch.setenv("KVBOUND_ONE_PASS_ENCODE", "sometimes")
    with pytest.raises(ValueError, match="KVBOUND_ONE_PASS_ENCODE: expected one of"):
        _deferred(x, config, basis, None)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 8, 1536, 64), (1, 8, 1536, 192), (1, 8, 4096, 64), (1, 8, 4096, 192),
                                   (2, 8, 1536, 192)])
def test_gpu_one_pass_stores_what_the_five_kernels_store(shape):
    """The models' K and V shapes at small batches, bfloat16, with blocks of every mode."""
    b, h, n, d = shape
    gen = torch.Generator().manual_seed(d + n)
    x = torch.randn(b, h, n, 8, generator=gen) @ torch.randn(8, d, generator=gen) / 3
    x = x + 0.002 * torch.randn(b, h, n, d, generator=gen)
    x[:, :, : n // 4] += 0.03 * torch.randn(b, h, n // 4, d, generator=gen)  # blocks that need codes
    x[0, 1, n // 2, 5] = 40.0  # an exact block
    x[0, 2, (3 * n) // 4, 7] += 2.0  # a wider code (outside the calibration rows, which would learn the spike)
    x = x.to(torch.bfloat16).cuda()
    config = kvbound.CompressionConfig()
    basis = kvbound.calibrate(x[:, :, : n // 2], config)
    five, five_sizes, five_decoded = _deferred(x, config, basis, False)
    one, one_sizes, one_decoded = _deferred(x, config, basis, True)
    for field in ("coeffs", "mode", "bits", "scale"):
        assert torch.equal(getattr(five, field), getattr(one, field)), field
    modes = torch.bincount(one.mode.flatten().long(), minlength=4).tolist()
    print(shape, "modes", modes)
    assert all(modes[m] > 0 for m in (1, 2, 3)), modes
    assert [s[:3] for s in one_sizes] == [s[:3] for s in five_sizes]
    assert one_sizes[0][3] == off_width_blocks(one, config) and five_sizes[0][3] == off_width_blocks(five, config)
    assert torch.equal(one_decoded, five_decoded)
    assert bool(((x.double() - one_decoded.double()).abs() <= config.tau).all())
    _assert_fixed_places(one, x, config)


def test_one_pass_benchmark_script_on_the_cpu(tmp_path):
    """``benchmarks/one_pass_encode.py --cpu``: both paths per tensor, their launches counted with the kernels
    stubbed, and both paths' stored values compared in the interpreter."""
    import csv

    from benchmark_scripts import load  # tests/ is on sys.path (rootdir conftest)

    script = load("one_pass_encode")
    out = tmp_path / "one_pass.csv"
    assert script.main([str(out), "--cpu", "--calls", "3", "--rounds", "1", "--commit", "abc"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["tensor"], r["path"]) for r in rows] == [("k", "five"), ("k", "one"), ("v", "five"), ("v", "one")]
    assert [int(r["kernels"]) for r in rows] == [5, 1, 5, 1]
    assert all(r["same"] == "True" and float(r["host_us"]) > 0 and r["commit"] == "abc" for r in rows)
    assert script.main([str(out), "--cpu", "--calls", "0"]) == 2


def test_one_pass_kernel_compiles_for_sm90_without_spills(tmp_path):
    """``benchmarks/one_pass_encode.py --sm90``: both paths' kernels compiled for an H200 on this CPU machine (in a
    process of its own: TRITON_INTERPRET is decided when the kernels are wrapped); the one-launch kernel holds its
    tiles in registers (no stack, no local loads or stores) at both of the models' head dims."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "one_pass_encode.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sm90.csv"
    proc = subprocess.run([sys.executable, str(script), str(out), "--sm90", "--commit", "abc"], capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    five = ["_coefficients_kernel", "_modes_kernel", "_layout_kernel", "_write_kernel", "_certify_kernel"]
    assert [(r["head_dim"], r["kernel"]) for r in rows] == [
        (d, kernel) for d in ("64", "192") for kernel in [*five, "_one_pass_kernel"]
    ]
    for row in rows:
        assert int(row["registers"]) > 0 and row["commit"] == "abc"
        if row["path"] == "one":
            assert int(row["stack_bytes"]) == int(row["ldl"]) == int(row["stl"]) == 0, row
