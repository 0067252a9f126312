"""The ports' feed-forward (LayerNorm, Linear, Dropout, ReLU, Linear, Dropout, plus the residual) at Enformer b8
and Borzoi b4 shapes, bf16 autocast: the module as the port runs it against the fused norm, and the fused norm
with the first Linear's ReLU in cuBLASLt's epilogue (aten._addmm_activation). Alternating, median of 30."""
import csv, statistics, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from kvbound.kernels.norm_rope import norm_rope

out, commit = sys.argv[1], sys.argv[2]
dev = "cuda"
f = open(out, "w", newline="")
w = csv.writer(f)
w.writerow(["model", "batch", "variant", "ms", "max_abs_diff", "commit"])
torch.manual_seed(0)
for name, b, n, stream_dtype, eps in [("enformer", 8, 1536, torch.float32, 1e-5), ("borzoi", 4, 4096, torch.bfloat16, 1e-3),
                                       ("borzoi", 16, 4096, torch.bfloat16, 1e-3), ("enformer", 1, 1536, torch.float32, 1e-5)]:
    dim = 1536
    seq = nn.Sequential(nn.LayerNorm(dim, eps=eps), nn.Linear(dim, 2 * dim), nn.Dropout(0.4), nn.ReLU(),
                        nn.Linear(2 * dim, dim), nn.Dropout(0.4)).to(dev).eval()
    with torch.no_grad():
        seq[0].weight.normal_(1, 0.1); seq[0].bias.normal_(0, 0.1)
    x = torch.randn(b, n, dim, device=dev).to(stream_dtype)
    ln, l1, l2 = seq[0], seq[1], seq[4]

    def norm(x):
        return norm_rope(x.contiguous().view(1, -1, 1, dim), ln.weight, ln.bias, ln.eps, rope=None,
                         out_dtype=torch.bfloat16, round_to_input=False).view(x.shape)

    def base():
        return seq(x) + x

    def fnorm():
        h = norm(x)
        return seq[4](seq[3](seq[1](h))) + x

    def frelu():
        h = norm(x).view(-1, dim)
        h = torch.ops.aten._addmm_activation(l1.bias.to(torch.bfloat16), h, l1.weight.to(torch.bfloat16).t(), use_gelu=False)
        return F.linear(h, l2.weight.to(torch.bfloat16), l2.bias.to(torch.bfloat16)).view(x.shape) + x

    def norm_only_base():
        return F.layer_norm(x, (dim,), ln.weight, ln.bias, ln.eps).to(torch.bfloat16)

    def norm_only_fused():
        return norm(x)

    variants = {"port": base, "fused-norm": fnorm, "fused-norm+relu": frelu, "norm-port": norm_only_base,
                "norm-fused": norm_only_fused}
    times = {k: [] for k in variants}
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        ref = base().float()
        nref = norm_only_base().float()
        diffs = {k: ((v().float() - (nref if k.startswith("norm") else ref)).abs().max().item()) for k, v in variants.items()}
        for _ in range(3):
            for v in variants.values():
                v()
        for _ in range(30):
            for k, v in variants.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); v(); e.record(); e.synchronize(); times[k].append(s.elapsed_time(e))
    for k in variants:
        row = [name, b, k, f"{statistics.median(times[k]):.4f}", f"{diffs[k]:.3e}", commit]
        w.writerow(row); f.flush(); print(*row, flush=True)
    del seq, x
    torch.cuda.empty_cache()
f.close()
