"""norm_rope without rope at width 1536 (Enformer/Borzoi pre-attention and feed-forward norms): rows per program and
warps, against PyTorch's LayerNorm + cast and a plain cast (bandwidth floor); median of 50."""
import csv, statistics, sys
import torch
import torch.nn.functional as F
import triton
from kvbound.kernels.norm_rope import _norm_rope_kernel, _TORCH_TO_TL, norm_rope
import triton.language as tl

out, commit = sys.argv[1], sys.argv[2]
dev = "cuda"
f = open(out, "w", newline="")
w = csv.writer(f)
w.writerow(["rows", "in_dtype", "variant", "ms", "GBps", "max_abs_diff", "commit"])
C = 1536
weight = (1 + 0.1 * torch.randn(C, device=dev)).contiguous()
bias = (0.1 * torch.randn(C, device=dev)).contiguous()


def bench(fn, reps=50):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)


for n_rows in (12288, 16384, 65536):
    for in_dt in (torch.bfloat16, torch.float32):
        x = torch.randn(n_rows, C, device=dev).to(in_dt)
        nbytes = x.numel() * (x.element_size() + 2)
        ref = F.layer_norm(x.float(), (C,), weight, bias, 1e-3).to(torch.bfloat16)
        rows_list = [("torch layer_norm+cast", lambda: F.layer_norm(x.float(), (C,), weight, bias, 1e-3).to(torch.bfloat16), ref),
                     ("cast only", lambda: x.to(torch.bfloat16) if in_dt != torch.bfloat16 else x.clone(), None),
                     ("norm_rope default", lambda: norm_rope(x.view(1, -1, 1, C), weight, bias, 1e-3, rope=None,
                                                            out_dtype=torch.bfloat16, round_to_input=False), None)]
        for rows in (1, 2, 4, 8):
            for nw in (2, 4, 8, 16):
                def run(rows=rows, nw=nw):
                    o = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)
                    _norm_rope_kernel[(triton.cdiv(n_rows, rows),)](
                        x, weight, bias, weight, weight, o, n_rows, 1, n_rows, 1e-3, C=C, BLOCK_C=2048, ROWS=rows,
                        ROPE=False, IN_DT=tl.float32, NORM_DT=tl.float32, num_warps=nw, enable_fp_fusion=False)
                    return o
                rows_list.append((f"rows{rows}-w{nw}", run, None))
        for name, fn, _ in rows_list:
            try:
                o = fn()
                d = (o.float() - ref.float()).abs().max().item() if name != "cast only" else 0.0
                ms = bench(fn)
                row = [n_rows, str(in_dt).split(".")[1], name, f"{ms:.4f}", f"{nbytes / ms / 1e6:.0f}", f"{d:.2e}", commit]
            except Exception as e:
                row = [n_rows, str(in_dt), name, "", "", f"error {type(e).__name__}: {str(e)[:100]}", commit]
            w.writerow(row); f.flush(); print(*row, flush=True)
f.close()
