"""Enformer's relative-keys kernel (bf16, batch 8, N 1536) at pinned tiles, with the query forms through the output
rows (the default at d906525): time and error against float32 PyTorch on sampled rows."""
import csv, statistics, sys
import torch
from kvbound.kernels.attention_dense import attention_dense_fwd

out, commit = sys.argv[1], sys.argv[2]
dev = "cuda" if torch.cuda.is_available() else "cpu"
small = dev == "cpu"
f = open(out, "w", newline="")
w = csv.writer(f)
w.writerow(["layer", "batch", "tile", "ms", "err", "commit"])
H, DK, DV = 8, 64, 192
b, n = (1, 96) if small else (8, 1536)
g = torch.Generator(device=dev).manual_seed(0)
dt = torch.float16 if small else torch.bfloat16
q, k, v = (torch.randn(b, n, H * d, device=dev, generator=g).to(dt).view(b, n, H, d).transpose(1, 2)
           for d in (DK, DK, DV))
u = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
pb = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
relk = (0.5 * torch.randn(H, 2 * n - 1, DK, device=dev, generator=g)).to(dt)
rows = torch.arange(0, n, 7, device=dev)
qs = q[0, :, rows].float() * DK**-0.5
logits = (qs + u[:, None]) @ k[0].float().transpose(-1, -2)
idx = (n - 1) + torch.arange(n, device=dev)[None, :] - rows[:, None]
logits = logits + torch.einsum("hrd,hrnd->hrn", qs + pb[:, None], relk.float()[:, idx])
ref = torch.softmax(logits, -1) @ v[0].float()


def bench(fn, reps=30):
    if small:
        fn(); return 0.0
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)


tiles = ["autotuned", "64x64x4x1", "64x64x4x2", "64x64x8x3", "64x64x8x2", "128x64x8x2", "128x64x8x1", "64x32x4x2",
         "128x32x8x2"]
for tile in tiles:
    cfg = None
    if tile != "autotuned":
        bm, bn, nw, ns = map(int, tile.split("x"))
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
    try:
        fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg, relative=(relk, u, pb))
        o = fn()[0]
        err = (o[0, :, rows].float() - ref).abs().max().item()
        row = ["enformer-keys", b, tile, f"{bench(fn):.4f}", f"{err:.3e}", commit]
    except Exception as e:  # noqa: BLE001
        row = ["enformer-keys", b, tile, "", f"error: {type(e).__name__}: {str(e)[:150]}", commit]
    w.writerow(row); f.flush(); print(*row, flush=True)
f.close()
