"""The feed-forward's first Linear (bf16, 1536 -> 3072) with the ReLU in cuBLASLt's epilogue
(aten._addmm_activation) against F.linear and an in-place ReLU, by rows; alternating, median of 50."""
import csv, statistics, sys
import torch
import torch.nn.functional as F

out, commit = sys.argv[1], sys.argv[2]
f = open(out, "w", newline="")
w = csv.writer(f)
w.writerow(["rows", "epilogue_ms", "linear_relu_ms", "equal", "max_abs_diff", "commit"])
g = torch.Generator(device="cuda").manual_seed(0)
W = (torch.randn(3072, 1536, device="cuda", generator=g) / 40).to(torch.bfloat16)
b = (0.1 * torch.randn(3072, device="cuda", generator=g)).to(torch.bfloat16)
for rows in (1536, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 65536):
    x = torch.randn(rows, 1536, device="cuda", generator=g).to(torch.bfloat16)
    fns = {"epi": lambda: torch.ops.aten._addmm_activation(b, x, W.t(), use_gelu=False),
           "lin": lambda: torch.relu_(F.linear(x, W, b))}
    a, c = fns["epi"](), fns["lin"]()
    ts = {k: [] for k in fns}
    for _ in range(5):
        for fn in fns.values():
            fn()
    for _ in range(50):
        for k, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize(); ts[k].append(s.elapsed_time(e))
    row = [rows, f"{statistics.median(ts['epi']):.4f}", f"{statistics.median(ts['lin']):.4f}", bool(torch.equal(a, c)),
           f"{(a.float() - c.float()).abs().max().item():.3e}", commit]
    w.writerow(row); f.flush(); print(*row, flush=True)
f.close()
