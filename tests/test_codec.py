import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbound
from kvbound.codec.format import MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW, words_per_row

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def assert_within_bound(x: torch.Tensor, ckv: kvbound.CompressedKV) -> float:
    ckv.validate()  # the packed layout, as kvbound.load checks it
    y = ckv.decompress()
    assert y.dtype == torch.float32 and tuple(y.shape) == tuple(x.shape)
    err = (x.double() - y.double()).abs()
    worst = float(err.max())
    assert bool((err <= ckv.error_bound).all()), f"bound violated: max error {worst} > tau {ckv.error_bound}"
    return worst


def make_data(kind: str, shape, dtype, gen: torch.Generator) -> torch.Tensor:
    b, h, n, d = shape
    fmax = torch.finfo(dtype).max
    if kind == "gaussian":
        x = torch.randn(shape, generator=gen)
    elif kind == "lowrank_noise":
        x = torch.randn(b, h, n, 3, generator=gen) @ torch.randn(3, d, generator=gen)
        x = x + 0.01 * torch.randn(shape, generator=gen)
    elif kind == "heavy_tail":
        x = _cauchy(shape, gen)
    elif kind == "outlier_per_block":
        x = torch.randn(shape, generator=gen)
        x[..., ::16, 0] = 1e4 if dtype != torch.float16 else 6e4
    elif kind == "constant":
        x = torch.full(shape, 1.2345)
    elif kind == "near_max":
        x = torch.randn(shape, generator=gen).clamp(-1, 1) * fmax * 0.999
    elif kind == "subnormal":
        tiny = torch.finfo(dtype).tiny
        x = torch.randn(shape, generator=gen) * tiny * 0.25
    elif kind == "mixed_scale":
        x = torch.randn(shape, generator=gen) * torch.logspace(-6, 4, n).reshape(1, 1, n, 1)
    else:
        raise AssertionError(kind)
    x = x.clamp(-fmax, fmax).to(dtype)
    return x


def _cauchy(shape, gen):
    u = torch.rand(shape, generator=gen).clamp(1e-6, 1 - 1e-6)
    return torch.tan(math.pi * (u - 0.5))


KINDS = ["gaussian", "lowrank_noise", "heavy_tail", "outlier_per_block", "constant", "near_max", "subnormal",
         "mixed_scale"]


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    b=st.integers(1, 2),
    h=st.integers(1, 2),
    n=st.integers(1, 150),
    d=st.sampled_from([16, 24, 40, 64]),
    rank=st.integers(0, 12),
    bits=st.sampled_from([2, 3, 4, 8]),
    block=st.sampled_from([16, 32, 64]),
    log2_tau=st.floats(-30, 6),
    use_basis=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bound_holds_everywhere(kind, dtype, b, h, n, d, rank, bits, block, log2_tau, use_basis, seed):
    gen = torch.Generator().manual_seed(seed)
    x = make_data(kind, (b, h, n, d), dtype, gen)
    config = kvbound.CompressionConfig(block_size=block, rank=min(rank, d - 1), bits=bits, tau=2.0**log2_tau)
    basis = kvbound.calibrate(x, config) if use_basis else None
    ckv = kvbound.compress_kv(x, config, basis)
    assert_within_bound(x, ckv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 37, 1000])
@pytest.mark.parametrize("d", [40, 64, 128, 192])
def test_awkward_shapes_and_dtypes(dtype, n, d):
    gen = torch.Generator().manual_seed(n * d)
    x = (torch.randn(1, 2, n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
         + 0.05 * torch.randn(1, 2, n, d, generator=gen)).to(dtype)
    ckv = kvbound.compress_kv(x, kvbound.CompressionConfig(rank=4))
    err = assert_within_bound(x, ckv)
    print(f"{dtype} n={n} d={d}: max error {err:.4g}, ratio {ckv.compression_ratio:.2f}x, {ckv.mode_fractions()}")


def test_every_mode_is_exercised_and_bounded():
    gen = torch.Generator().manual_seed(0)
    n, d, block = 4 * 32, 32, 32
    x = torch.randn(1, 1, 2, d, generator=gen).repeat_interleave(n // 2, dim=2)  # rank <= 2
    x[..., 32:64, :] += 0.08 * torch.randn(32, d, generator=gen)  # residual fits 4 bits
    x[..., 64:96, :] += 3.0 * torch.randn(32, d, generator=gen)  # needs 8 bits
    config = kvbound.CompressionConfig(block_size=block, rank=2, bits=4, tau=0.05)
    basis = kvbound.calibrate(x[..., :32, :], config)
    x[..., 100, 3] = 500.0  # beyond 127 steps of the shared basis' residual: exact block
    ckv = kvbound.compress_kv(x, config, basis)
    assert ckv.mode.reshape(-1).tolist() == [MODE_LOWRANK, MODE_PACKED, MODE_PROMOTED, MODE_RAW]
    assert ckv.bits.reshape(-1).tolist() == [0, 4, 8, 0]
    assert_within_bound(x, ckv)
    y = ckv.decompress()
    assert y[0, 0, 100, 3].item() == 500.0  # kept exactly


def test_tau_below_dtype_resolution_is_exact_not_violated():
    x = (torch.randn(1, 2, 100, 64) * 100).to(torch.bfloat16)
    ckv = kvbound.compress_kv(x, kvbound.CompressionConfig(tau=1e-9))
    assert ckv.mode_fractions()["raw"] == 1.0
    assert torch.equal(ckv.decompress(), x.float())
    assert ckv.compression_ratio < 1.0  # the cost is visible


def _expected_nbytes(ckv: kvbound.CompressedKV) -> int:
    b, h, n, d = ckv.shape
    c = ckv.config
    nb = -(-n // c.block_size)
    rows = [min(c.block_size, n - k * c.block_size) for k in range(nb)]
    total = b * h * n * c.rank * ckv.coeffs.element_size() + ckv.basis.numel() * 2 + b * h * nb * (1 + 1 + 4 + 8)
    elem = ckv.raw.element_size()
    modes, widths = ckv.mode.reshape(-1).tolist(), ckv.bits.reshape(-1).tolist()
    for m, w, k in zip(modes, widths, list(range(nb)) * (b * h), strict=True):
        if m == MODE_PACKED:
            total += rows[k] * words_per_row(c.bits, d) * 4
        elif m == MODE_PROMOTED:
            total += rows[k] * words_per_row(int(w), d) * 4
        elif m == MODE_RAW:
            total += rows[k] * d * elem
    return total


@pytest.mark.parametrize("noise", [0.004, 0.05, 0.5])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_ratio_matches_format_on_lowrank_plus_noise(noise, bits):
    gen = torch.Generator().manual_seed(bits)
    b, h, n, d = 1, 4, 1000, 64
    # unit-scale values: bf16 itself rounds |x| < 2 by at most 2**-8, well under tau
    x = (torch.randn(b, h, n, 6, generator=gen) @ torch.randn(h, 6, d, generator=gen) / 5
         + noise * torch.randn(b, h, n, d, generator=gen)).to(torch.bfloat16)
    config = kvbound.CompressionConfig(rank=8, bits=bits)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config))
    assert_within_bound(x, ckv)
    metadata = ckv.nbytes - sum(t.numel() * t.element_size() for t in ckv._tensors().values())
    assert 0 < metadata < 512
    assert ckv.nbytes - metadata == _expected_nbytes(ckv)
    assert ckv.dense_nbytes == x.numel() * 2
    assert ckv.compression_ratio == pytest.approx(ckv.dense_nbytes / ckv.nbytes)
    if noise < config.tau / 4:  # the rank-8 part alone certifies: only coefficients are stored
        assert ckv.mode_fractions()["lowrank"] == 1.0
        assert ckv.compression_ratio > 7.0
    print(f"noise {noise} bits {bits}: ratio {ckv.compression_ratio:.2f}x {ckv.mode_fractions()}")


@pytest.mark.parametrize("use_basis", [False, True])
def test_save_load_bit_exact(tmp_path, use_basis):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2, 333, 40, generator=gen) * torch.rand(1, 1, 333, 1, generator=gen) * 4).to(torch.float16)
    x[0, 1, 5, 7] = 6e4
    config = kvbound.CompressionConfig(rank=4, bits=3, block_size=64, tau=0.01)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config) if use_basis else None)
    path = tmp_path / "kv.safetensors"
    ckv.save(path)
    back = kvbound.load(path)
    assert back.shape == ckv.shape and back.dtype == ckv.dtype and back.config == ckv.config
    assert back.shared_basis == ckv.shared_basis
    for name, t in ckv._tensors().items():
        u = back._tensors()[name]
        assert u.dtype == t.dtype and torch.equal(u, t), name
    assert torch.equal(back.decompress(), ckv.decompress())
    assert back.nbytes == ckv.nbytes
    back.validate()


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a kvbound.CompressedKV"):
        kvbound.load(tmp_path / "x.safetensors")


def test_non_contiguous_input_and_no_mutation():
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, 200, 3, 64, generator=gen).to(torch.bfloat16)
    x = base.transpose(1, 2)  # [1, 3, 200, 64], non-contiguous
    before = x.clone()
    ckv = kvbound.compress_kv(x)
    assert torch.equal(x, before)
    ref = kvbound.compress_kv(x.contiguous())
    assert torch.equal(ckv.decompress(), ref.decompress())
    assert_within_bound(x, ckv)


def test_calibrated_basis_shared_and_timed():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 256, 5, generator=gen) @ torch.randn(3, 5, 64, generator=gen)
    basis = kvbound.calibrate([x[:1], x[1:]], kvbound.CompressionConfig(rank=8))
    assert basis.projection.shape == (3, 8, 64) and basis.projection.dtype == torch.float16
    assert basis.calibration_seconds > 0
    assert torch.all(basis.captured_energy > 0.999)  # rank-5 data, rank-8 basis
    p = basis.projection.double()
    assert torch.allclose(p @ p.transpose(1, 2), torch.eye(8, dtype=torch.float64).expand(3, 8, 8), atol=2e-3)


class TestBadInput:
    def test_nan_names_tensor_and_index(self):
        x = torch.randn(1, 2, 10, 16)
        x[0, 1, 4, 3] = float("nan")
        with pytest.raises(ValueError, match=r"x: expected finite values, found nan at index \(0, 1, 4, 3\)"):
            kvbound.compress_kv(x)

    def test_inf(self):
        x = torch.randn(1, 1, 10, 16, dtype=torch.float16)
        x[0, 0, 9, 15] = float("-inf")
        with pytest.raises(ValueError, match=r"index \(0, 0, 9, 15\)"):
            kvbound.compress_kv(x)

    def test_ndim(self):
        with pytest.raises(ValueError, match="x: expected 4 dimensions, got 3"):
            kvbound.compress_kv(torch.randn(2, 10, 16))

    def test_dtype(self):
        with pytest.raises(TypeError, match="x: expected dtype in .* got int32"):
            kvbound.compress_kv(torch.ones(1, 1, 4, 16, dtype=torch.int32))
        with pytest.raises(TypeError, match="got float64"):
            kvbound.compress_kv(torch.ones(1, 1, 4, 16, dtype=torch.float64))

    def test_empty(self):
        with pytest.raises(ValueError, match="x: expected a non-empty tensor"):
            kvbound.compress_kv(torch.ones(1, 1, 0, 16))

    def test_rank_too_large(self):
        with pytest.raises(ValueError, match="rank must be < head dim; got rank 8 for head dim 8"):
            kvbound.compress_kv(torch.randn(1, 1, 4, 8))

    def test_rank_above_block_size_without_a_basis(self):
        config = kvbound.CompressionConfig(block_size=16, rank=17)
        x = torch.randn(1, 1, 20, 32, generator=torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match=r"^config: without a basis .* at most CompressionConfig.block_size = 16 "
                                             r"of them; got rank 17 \(lower the rank"):
            kvbound.compress_kv(x, config)
        ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config))  # a calibrated basis has no such limit
        assert float((ckv.decompress().double() - x.double()).abs().max()) <= config.tau

    def test_basis_mismatch(self):
        basis = kvbound.calibrate(torch.randn(1, 2, 64, 32), kvbound.CompressionConfig())
        with pytest.raises(ValueError, match="basis: expected head dim 64 .* got a basis of head dim 32"):
            kvbound.compress_kv(torch.randn(1, 2, 64, 64), basis=basis)
        with pytest.raises(ValueError, match="basis: expected 3 heads"):
            kvbound.compress_kv(torch.randn(1, 3, 64, 32), basis=basis)
        with pytest.raises(ValueError, match="basis: expected rank 4"):
            kvbound.compress_kv(torch.randn(1, 2, 64, 32), kvbound.CompressionConfig(rank=4), basis)
        with pytest.raises(ValueError, match=r"basis.projection: expected 3 dimensions \[H, r, D\], got 2"):
            kvbound.Basis(basis.projection[0], basis.captured_energy, 0.0, 1)
        with pytest.raises(TypeError, match=r"basis.projection: expected float16 .*, got float32"):
            kvbound.Basis(basis.projection.float(), basis.captured_energy, 0.0, 1)

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"tau": 0.0}, "tau: expected a finite value > 0"),
            ({"tau": -1.0}, "tau: expected a finite value > 0"),
            ({"tau": float("nan")}, "tau: expected a finite value > 0"),
            ({"tau": float("inf")}, "tau: expected a finite value > 0"),
            ({"bits": 5}, "bits: expected one of"),
            ({"rank": -1}, "rank: expected >= 0"),
            ({"block_size": 100}, "block_size: expected a power of two >= 16"),
            ({"block_size": 8}, "block_size: expected a power of two >= 16"),
            ({"block_size": 2**17}, r"block_size: expected at most 65536 \(2\*\*16"),
        ],
    )
    def test_config_validation(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            kvbound.CompressionConfig(**kwargs)

    def test_config_types(self):
        with pytest.raises(TypeError, match="rank: expected int"):
            kvbound.CompressionConfig(rank=2.0)
        with pytest.raises(TypeError, match="^CompressionConfig.bits: expected int, got float$"):
            kvbound.CompressionConfig(bits=4.0)
        with pytest.raises(TypeError, match="config: expected kvbound.CompressionConfig"):
            kvbound.compress_kv(torch.randn(1, 1, 4, 16), {"rank": 2})


def test_uncertified_blocks_flags_tampering():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 2, 300, 64, generator=gen).to(torch.bfloat16)
    config = kvbound.CompressionConfig(rank=4, tau=0.05)
    ckv = kvbound.compress_kv(x, config, kvbound.calibrate(x, config))
    from kvbound.codec.eager import uncertified_blocks

    assert not bool(uncertified_blocks(ckv, x).any())
    ckv.scale[0, 1, 2] *= 1.5  # a wrong step breaks the bound of that block only
    bad = uncertified_blocks(ckv, x)
    assert bad.reshape(-1).tolist() == [False] * 5 + [True]


def test_uncertified_blocks_passes_exact_blocks_of_large_values():
    """An exact block holds x itself: certified, even where float32's spacing at |x| exceeds tau."""
    from kvbound.codec.eager import uncertified_blocks

    x = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 1e4
    ckv = kvbound.compress_kv(x, kvbound.CompressionConfig(block_size=16, rank=0, bits=2, tau=2.0**-12))
    assert ckv.mode.tolist() == [[[MODE_RAW]]] and float((ckv.decompress() - x).abs().max()) == 0.0
    assert not bool(uncertified_blocks(ckv, x).any())
    tampered = ckv.raw.clone()
    tampered[0] += 1.0
    ckv.raw.copy_(tampered)
    assert bool(uncertified_blocks(ckv, x).all())
