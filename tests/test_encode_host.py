"""Host side of the Triton encoder: one host read per call, output unchanged by the host rewrite.

``tests/data/encode_triton_golden.safetensors`` holds the encoder's output on the inputs below as produced by the
previous host code (five host reads per call). The layout, modes, bit widths, offsets and exact blocks are compared
bit for bit. Coefficients and scales are float32 sums of products, which the Triton interpreter computes through the
host's BLAS; its summation order differs between CPUs, so those agree to within float32 summation error (1e-4
of the field's largest value) and a packed residual word may differ where a code sits on a rounding
tie, in at most 1% of the words.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import kvbound
from kvbound.codec import encode_triton as et

GOLDEN = Path(__file__).parent / "data" / "encode_triton_golden.safetensors"
_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}


def _cases():
    """name -> (x, config, verify); the generator order matters (it made the golden file)."""
    out = {}
    gen = torch.Generator().manual_seed(11)

    def lowrank(b, h, n, d, noise):
        x = torch.randn(b, h, n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
        return x + noise * torch.randn(b, h, n, d, generator=gen)

    x = lowrank(1, 2, 300, 64, 0.05)
    x[0, 1, 150, 21] = 50.0  # exact block
    x[0, 0, 10:20, 5] += 0.5  # promoted block
    out["outlier_fp16"] = (x.half(), kvbound.CompressionConfig(rank=4, bits=4, tau=0.05, block_size=64), True)
    out["tail_fp32_bits3"] = (lowrank(1, 2, 37, 40, 0.02),
                              kvbound.CompressionConfig(rank=4, bits=3, tau=0.02, block_size=64), True)
    x = lowrank(2, 129, 2, 64, 0.1).transpose(1, 2)  # [2, 2, 129, 64], non-contiguous
    out["strided_bf16_bits2"] = (x.bfloat16(), kvbound.CompressionConfig(rank=4, bits=2, tau=0.1, block_size=64),
                                 True)
    x = lowrank(1, 1, 70, 16, 0.002) * 3e4  # coefficients beyond float16
    x[0, 0, 40, 3] += 3000.0
    out["big_coeffs_fp32"] = (x, kvbound.CompressionConfig(rank=4, bits=4, tau=60.0, block_size=32), True)
    out["all_exact_bf16"] = (lowrank(1, 2, 200, 32, 0.3).bfloat16(),
                             kvbound.CompressionConfig(rank=2, bits=4, tau=1e-4, block_size=32), True)
    x = lowrank(1, 2, 96, 32, 0.02)
    x[0, :, ::7, 3] += 0.6
    out["promoted_unverified"] = (x.half(), kvbound.CompressionConfig(rank=4, bits=4, tau=0.02, block_size=32),
                                  False)
    return out


CASES = _cases()


class _CountReads(TorchDispatchMode):
    """Counts aten ops that read device data back to the host, outside kernel launches."""

    def __init__(self):
        super().__init__()
        self.reads, self.in_kernel = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel and func.__name__.split(".")[0] in _READ_OPS:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _count_host_reads(monkeypatch, run):
    mode = _CountReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        if not mode.in_kernel:
            mode.reads += 1
        return tolist(self)

    class Launch:  # the interpreter's own tensor handling is not the encoder's
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                mode.in_kernel = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    mode.in_kernel = False

            return launch

    for name in ("_coefficients_kernel", "_modes_kernel", "_layout_kernel", "_write_kernel", "_certify_kernel"):
        monkeypatch.setattr(et, name, Launch(getattr(et, name)))
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with mode:
        result = run()
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return result, mode.reads


@pytest.mark.parametrize("name, reads", [("outlier_fp16", 1), ("strided_bf16_bits2", 1), ("promoted_unverified", 1),
                                         ("big_coeffs_fp32", 2), ("all_exact_bf16", 2)])
def test_host_reads_per_call(monkeypatch, name, reads):
    """One read per call; a second only for float32 coefficients or exact blocks beyond the workspace."""
    x, config, verify = CASES[name]
    basis = kvbound.calibrate(x, config)
    ckv, counted = _count_host_reads(
        monkeypatch, lambda: kvbound.compress_kv(x, config, basis, impl="triton", verify=verify))
    print(f"{name}: {counted} host reads, modes {ckv.mode.flatten().tolist()}")
    assert counted == reads


def _same_bits(a, b):
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("name", list(CASES))
def test_output_matches_previous_encoder(name):
    x, config, verify = CASES[name]
    golden = load_file(str(GOLDEN))
    basis = kvbound.calibrate(x, config)
    assert torch.equal(basis.projection, golden[f"{name}.basis"])
    ckv = kvbound.compress_kv(x, config, basis, impl="triton", verify=verify)
    for field, tensor in ckv._tensors().items():
        expected = golden[f"{name}.{field}"]
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape, (name, field)
        if field in ("coeffs", "scale"):
            scale = expected.double().abs().max().clamp_min(1e-30)
            rel = ((tensor.double() - expected.double()).abs() / scale).max()
            assert rel <= 1e-4, (field, float(rel))
        elif field == "codes":
            differ = int((tensor.view(-1) != expected.view(-1)).sum())
            assert differ <= max(1, expected.numel() // 100), (field, differ, expected.numel())
        else:
            assert _same_bits(tensor, expected), field
        # the stored buffers are exact-size copies, not views into a larger workspace
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), field
    err = (x.double() - ckv.decompress().double()).abs()
    print(f"{name}: max error {err.max():.4g} (tau {config.tau:g}), {ckv.codes.numel()} words, {ckv.raw.numel()} raw")
    assert bool((err <= config.tau).all())
    eager = kvbound.compress_kv(x, config, basis)
    assert torch.equal(ckv.mode, eager.mode) and ckv.coeffs.dtype == eager.coeffs.dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises_after_the_read(bad):
    x, config, _ = CASES["outlier_fp16"]
    x = x.clone()
    x[0, 1, 77, 5] = bad
    with pytest.raises(ValueError, match=r"x: expected finite values, found .* at index \(0, 1, 77, 5\)"):
        kvbound.compress_kv(x, config, kvbound.calibrate(CASES["outlier_fp16"][0], config), impl="triton")
