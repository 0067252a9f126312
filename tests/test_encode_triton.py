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
    assert fast.nbytes == slow.nbytes
    assert (y - slow.decompress()).abs().max().item() <= 2 * tau


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
    from kvbound.codec.eager import uncertified_blocks
    from kvbound.codec.encode_triton import certify_triton

    gen = torch.Generator().manual_seed(9)
    x = _data(200, 40, torch.float16, gen)
    config = kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=32)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config))
    assert not bool(certify_triton(ckv, x).any())
    packed = (ckv.bits > 0).nonzero()[0].tolist()
    raw = (ckv.mode == 3).nonzero()[0].tolist()
    lowrank = (ckv.mode == 0).nonzero().tolist()
    ckv.scale[tuple(packed)] *= 1.3  # wrong step
    ckv.raw[3] += 1.0  # an exact value altered
    if lowrank:
        ckv.coeffs[0, lowrank[0][1], lowrank[0][2] * 32, 0] += 0.5  # a coefficient altered
    fast, slow = certify_triton(ckv, x), uncertified_blocks(ckv, x)
    assert torch.equal(fast[..., :], slow | fast & (ckv.mode == 3))  # the eager check trusts exact blocks
    assert bool(fast[tuple(packed)]) and bool(fast[tuple(raw)])


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
            return {"coefficients": (block, 4, cols), "modes": (block, 4), "write": (block, 4), "certify": (block, 4)}
        if kind == "small":
            return {"coefficients": (16, 4, cols), "modes": (16, 4), "write": (16, 4), "certify": (4, 4)}
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
