"""Kernel-only A/B of the runs' key loop (one KVBOUND_RUNS_OWN setting per process): Borzoi's runs (real layout,
one run) at batches 1, 4 and 16, pinned tiles and the autotuner's, plain attention of the same shape for reference;
each output checked against float32 torch on a slice of rows."""
import csv, statistics, sys
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
    n = k.shape[2]
    qs = q[0, :, rows].float() * DK**-0.5
    logits = (qs + u[:, None]) @ k[0].float().transpose(-1, -2)
    idx = (n - 1) + torch.arange(n, device=dev)[None, :] - rows[:, None]
    relk = rel_full.float()[:, idx]
    logits = logits + torch.einsum("hrd,hrnd->hrn", qs + pb[:, None], relk)
    return torch.softmax(logits, -1) @ v[0].float()


TILES = (("autotuned", None), ("64x64x4x2", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
         ("64x64x4x3", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)))
for b in (1, 4, 16):
    n = 4096
    q, k, v = qkv(b, n)
    u = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    pb = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    for lname, dists in (("real", BORZOI), ("one-run", [-4095])):
        starts = torch.tensor([d + n - 1 for d in dists], device=dev)
        _, run_of_row, buf, _ = _derive_run_layout(starts, 2 * n - 1, n, n, 16)
        run_keys = (0.5 * torch.randn(H, len(dists), DK, device=dev, generator=g)).to(torch.bfloat16).contiguous()
        for cname, cfg in TILES:
            fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg,
                                             relative_runs=(run_keys, buf, u, pb), run_span=16)
            o = fn()[0]
            rows = torch.cat([torch.arange(0, 192, device=dev), torch.arange(2000, 2100, device=dev),
                              torch.arange(n - 100, n, device=dev)])
            ref = reference(q, k, v, run_keys[:, run_of_row], u, pb, rows)
            err = (o[0, :, rows].float() - ref).abs().max().item()
            emit("borzoi-runs", b, lname, cname, f"{bench(fn):.4f}", f"{err:.3e}")
    fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None)
    emit("borzoi-plain", b, "", "autotuned", f"{bench(fn):.4f}", "")
    del q, k, v
    torch.cuda.empty_cache()
f.close()
