"""Time the public ``kvbound.attention`` (dense and compressed) against cuDNN SDPA, host overhead included.

    python benchmarks/public_api_timing.py OUT_DIR [--profile]

K/V: rank-6 structure plus noise of std 0.004 (every block certifies as low-rank at the default tau), bf16,
B=1, 8 heads, non-causal. Median of ``triton.testing.do_bench``. Prints one line per shape; with ``--profile``
also the torch profiler's top CUDA ops for three compressed calls.
"""

import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import kvbound

out = sys.argv[1]
gen = torch.Generator().manual_seed(0)
lines = []
for n, d in [(16384, 64), (16384, 128), (65536, 64), (65536, 128)]:
    heads = 8
    basis = torch.randn(heads, 6, d, generator=gen) / 6**0.5

    def activations():
        x = torch.einsum("bhnr,hrd->bhnd", torch.randn(1, heads, n, 6, generator=gen), basis)  # noqa: B023
        return (x + 0.004 * torch.randn(1, heads, n, d, generator=gen)).to(torch.bfloat16).cuda()  # noqa: B023

    q = torch.randn(1, heads, n, d, generator=gen).to(torch.bfloat16).cuda()
    k, v = activations(), activations()
    cfg = kvbound.CompressionConfig()
    ck = kvbound.compress_kv(k, cfg, kvbound.calibrate(k, cfg), impl="triton")
    cv = kvbound.compress_kv(v, cfg, kvbound.calibrate(v, cfg), impl="triton")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t_cudnn = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))  # noqa: B023
    t_comp = triton.testing.do_bench(lambda: kvbound.attention(q, ck, cv))  # noqa: B023
    t_dense = triton.testing.do_bench(lambda: kvbound.attention(q, k, v))  # noqa: B023
    lines.append(
        f"n={n} d={d} modes K {ck.mode_fractions()} V {cv.mode_fractions()} ratio {ck.compression_ratio:.2f}: "
        f"cudnn {t_cudnn:.3f} comp {t_comp:.3f} ({t_cudnn / t_comp:.2f}x) "
        f"dense {t_dense:.3f} ({t_cudnn / t_dense:.2f}x)"
    )
    print(lines[-1], flush=True)
    if "--profile" in sys.argv:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                kvbound.attention(q, ck, cv)
            torch.cuda.synchronize()
        lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        print(lines[-1], flush=True)
with open(os.path.join(out, "public_api_timing.txt"), "w") as f:
    f.write("\n".join(lines))
