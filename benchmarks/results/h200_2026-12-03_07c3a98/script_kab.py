"""Kernel-only A/B of the relative variants (one setting of KVBOUND_Q_SCRATCH / KVBOUND_RUNS_ADD per process):
Borzoi runs (real layout, one run), Enformer relative keys, each checked against float32 torch on a slice of rows."""
import csv, os, statistics, sys
import torch
from kvbound.kernels.attention_dense import attention_dense_fwd
from kvbound.attention import _derive_run_layout

out, commit, label = sys.argv[1], sys.argv[2], sys.argv[3]
dev = "cuda"
f = open(out, "a", newline="")
w = csv.writer(f)


def emit(*r):
    w.writerow(list(r) + [label, commit]); f.flush(); print(label, *r, flush=True)


def bench(fn, reps=30):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)


BORZOI = [-4095, -2435, -1447, -860, -511, -303, -180, -106, -63, -37, -21, -12, -7, -3, -1, 0, 1, 2, 4, 8, 13, 22,
          38, 64, 107, 181, 304, 512, 861, 1448, 2436]
H, DK, DV = 8, 64, 192
g = torch.Generator(device=dev).manual_seed(0)


def qkv(b, n):
    return [torch.randn(b, n, H * d, device=dev, generator=g).to(torch.bfloat16).view(b, n, H, d).transpose(1, 2)
            for d in (DK, DK, DV)]


def reference(q, k, v, rel_full, u, pb, rows):
    # float32 torch on batch 0, the given query rows; rel_full [H, 2N - 1, DK]
    n = k.shape[2]
    qs = q[0, :, rows].float() * DK**-0.5
    logits = (qs + u[:, None]) @ k[0].float().transpose(-1, -2)
    idx = (n - 1) + torch.arange(n, device=dev)[None, :] - rows[:, None]
    relk = rel_full.float()[:, idx]  # [H, R, N, DK]
    logits = logits + torch.einsum("hrd,hrnd->hrn", qs + pb[:, None], relk)
    return torch.softmax(logits, -1) @ v[0].float()


PIN = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
for b in (4, 16):
    n = 4096
    q, k, v = qkv(b, n)
    u = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    pb = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    for lname, dists in (("real", BORZOI), ("one-run", [-4095])):
        starts = torch.tensor([d + n - 1 for d in dists], device=dev)
        _, run_of_row, buf, _ = _derive_run_layout(starts, 2 * n - 1, n, n, 16)
        run_keys = (0.5 * torch.randn(H, len(dists), DK, device=dev, generator=g)).to(torch.bfloat16).contiguous()
        for cname, cfg in (("autotuned", None), ("64x64x4x2", PIN)):
            fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg,
                                             relative_runs=(run_keys, buf, u, pb), run_span=16)
            o = fn()[0]
            rows = torch.cat([torch.arange(0, 192, device=dev), torch.arange(2000, 2100, device=dev)])
            ref = reference(q, k, v, run_keys[:, run_of_row], u, pb, rows)
            err = (o[0, :, rows].float() - ref).abs().max().item()
            emit("borzoi-runs", b, lname, cname, f"{bench(fn):.4f}", f"{err:.3e}")
    del q, k, v
    torch.cuda.empty_cache()
for b in (8,):
    n = 1536
    q, k, v = qkv(b, n)
    u = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    pb = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    relk = (0.5 * torch.randn(H, 2 * n - 1, DK, device=dev, generator=g)).to(torch.bfloat16)
    for cname, cfg in (("autotuned", None), ("64x64x4x1", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)),
                       ("64x64x4x2", PIN)):
        fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg, relative=(relk, u, pb))
        o = fn()[0]
        rows = torch.cat([torch.arange(0, 128, device=dev), torch.arange(1400, 1536, device=dev)])
        ref = reference(q, k, v, relk, u, pb, rows)
        err = (o[0, :, rows].float() - ref).abs().max().item()
        emit("enformer-keys", b, "", cname, f"{bench(fn):.4f}", f"{err:.3e}")
    fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None)
    emit("enformer-plain", b, "", "autotuned", f"{bench(fn):.4f}", "")
f.close()
