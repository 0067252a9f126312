"""Pre-attention LayerNorm then the cast to bf16 (what a patched Borzoi / Enformer layer does now under autocast)
against one fused kernel that writes bf16 (torch.compile of the same two ops). Appends CSV rows."""
import csv
import sys

import torch
import torch.nn.functional as F
import triton.testing

out, commit = sys.argv[1], sys.argv[2]
handle = open(out, "a", newline="")
wr = csv.writer(handle)
wr.writerow(["case", "rows", "dim", "variant", "ms", "bf16_elements_differing", "max_abs_diff", "commit"])
fused = torch.compile(lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps).to(torch.bfloat16))
for case, rows, dim, eps in (("borzoi-b16", 16 * 4096, 1536, 1e-3), ("borzoi-b4", 4 * 4096, 1536, 1e-3),
                             ("enformer-b8", 8 * 1536, 1536, 1e-5)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=g) * 3 + 0.5
    w = torch.randn(dim, device="cuda", generator=g) * 0.1 + 1
    b = torch.randn(dim, device="cuda", generator=g) * 0.1

    def eager():
        return F.layer_norm(x, (dim,), w, b, eps).to(torch.bfloat16)

    def compiled():
        return fused(x, w, b, eps)

    ref = eager()
    got = compiled()
    differ = int((ref != got).sum())
    diff = (ref.float() - got.float()).abs().max().item()
    for name, fn in (("layer_norm float32 + cast", eager), ("fused to bf16 (torch.compile)", compiled)):
        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
        wr.writerow([case, rows, dim, name, f"{ms:.4f}", differ, f"{diff:.3e}", commit])
        print(case, name, f"{ms:.4f}", differ, f"{diff:.3e}", flush=True)
        handle.flush()
