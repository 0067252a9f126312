"""The largest magnitude of each of up to eight tensors of one dtype, in one launch (the NaN/Inf checks on the GPU).

``kvbound.attention`` checks its inputs for NaN and Inf by their largest magnitude (``kvbound._checks``). On CUDA
``torch._foreach_norm(..., inf)`` did that in several kernels per call at about half the memory bandwidth (0.174 ms
for the q, k and v of a Borzoi layer at batch 16 on an H200, 336 MB). :func:`largest_magnitudes` reads each tensor's
storage once, as flat blocks, and folds each block's largest magnitude into one int32 per tensor by an atomic
maximum of float32 bit patterns with the sign cleared: as integers, every finite magnitude lies below Inf's pattern
and Inf's below every NaN's, so the result is NaN exactly when a tensor holds a NaN, else Inf when it holds an Inf,
else its largest magnitude, exactly (each value widened to float32 is exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbound.kernels._common import interpreting

__all__ = ["MAX_TENSORS", "dense_flat", "largest_magnitudes"]

MAX_TENSORS = 8
# Elements per program (32 per thread on 8 warps: 128 bytes of float32, 64 of a 16-bit dtype).
_BLOCK = 8192
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _block_peak(slot, ptr, n, block, BLOCK: tl.constexpr):
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(slot, tl.max(bits, 0))


@triton.jit
def _peaks_kernel(
    out, p0, p1, p2, p3, p4, p5, p6, p7, n0, n1, n2, n3, n4, n5, n6, n7, e0, e1, e2, e3, e4, e5, e6,
    COUNT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` reduces block ``pid - e[t - 1]`` of tensor ``t``, where ``e[t]`` is the first program past
    tensor ``t``'s blocks; ``n[t]`` its elements, ``p[t]`` its flat storage."""
    pid = tl.program_id(0)
    if pid < e0:
        _block_peak(out, p0, n0, pid, BLOCK)
    if COUNT > 1:
        if (pid >= e0) & (pid < e1):
            _block_peak(out + 1, p1, n1, pid - e0, BLOCK)
    if COUNT > 2:
        if (pid >= e1) & (pid < e2):
            _block_peak(out + 2, p2, n2, pid - e1, BLOCK)
    if COUNT > 3:
        if (pid >= e2) & (pid < e3):
            _block_peak(out + 3, p3, n3, pid - e2, BLOCK)
    if COUNT > 4:
        if (pid >= e3) & (pid < e4):
            _block_peak(out + 4, p4, n4, pid - e3, BLOCK)
    if COUNT > 5:
        if (pid >= e4) & (pid < e5):
            _block_peak(out + 5, p5, n5, pid - e4, BLOCK)
    if COUNT > 6:
        if (pid >= e5) & (pid < e6):
            _block_peak(out + 6, p6, n6, pid - e5, BLOCK)
    if COUNT > 7:
        if pid >= e6:
            _block_peak(out + 7, p7, n7, pid - e6, BLOCK)


def dense_flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-d view of the storage ``t`` covers when its elements fill it without gaps or overlap in some order of
    its dimensions (a heads-split view of a projection does), else None."""
    if t.is_contiguous():
        return t.reshape(-1)
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: t.stride(d))
    step = 1
    for d in dims:
        if t.stride(d) != step:
            return None
        step *= t.shape[d]
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def largest_magnitudes(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``max |t|`` of each of ``tensors`` (one dtype among float32 / float16 / bfloat16, one CUDA device, or CPU
    tensors under ``TRITON_INTERPRET=1``; at most ``MAX_TENSORS``; each dense in some order, ``dense_flat``) as a
    float32 tensor ``[len(tensors)]``, NaN where a tensor holds NaN, else Inf where it holds Inf. None when the
    tensors do not qualify (the caller reduces them another way)."""
    if not tensors or len(tensors) > MAX_TENSORS:
        return None
    first = tensors[0]
    if first.dtype not in _DTYPES or not (first.is_cuda or interpreting()):
        return None
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    flats = [dense_flat(t) for t in tensors]
    if any(f is None for f in flats):
        return None
    out = torch.zeros(len(flats), dtype=torch.int32, device=first.device)
    sizes = [f.numel() for f in flats]
    ends, total = [], 0
    for n in sizes:
        total += triton.cdiv(n, _BLOCK)
        ends.append(total)
    if total:
        pad = MAX_TENSORS - len(flats)
        pointers = flats + [flats[0]] * pad
        counts = sizes + [0] * pad
        bounds = (ends + [total] * pad)[: MAX_TENSORS - 1]
        _peaks_kernel[(total,)](out, *pointers, *counts, *bounds, COUNT=len(flats), BLOCK=_BLOCK, num_warps=8)
    return out.view(torch.float32)
