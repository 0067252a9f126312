"""Scratch measurements (H200): runs-kernel ceilings by layout, and the attention sublayer's norm / residual pieces."""
import csv, math, os, statistics, sys, time
import torch
import torch.nn.functional as F

OUT = sys.argv[1]
COMMIT = sys.argv[2]
SMOKE = os.environ.get("SMOKE") == "1"
dev = "cuda" if torch.cuda.is_available() else "cpu"
from kvbound.kernels.attention_dense import attention_dense_fwd
from kvbound.attention import _derive_run_layout
from kvbound.kernels.norm_rope import norm_rope

rows_out = []
f = open(OUT, "w", newline="")
w = csv.writer(f)
w.writerow(["part", "case", "batch", "variant", "ms", "err", "note", "commit"])


def emit(*r):
    r = list(r) + [COMMIT]
    w.writerow(r)
    f.flush()
    print(*r, flush=True)


def bench(fn, reps=30, warm=5):
    for _ in range(warm if dev == 'cuda' else 0):
        fn()
    if dev == "cpu":
        t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


BORZOI = [-4095, -2435, -1447, -860, -511, -303, -180, -106, -63, -37, -21, -12, -7, -3, -1, 0, 1, 2, 4, 8, 13, 22,
          38, 64, 107, 181, 304, 512, 861, 1448, 2436]
FAR = [d for d in BORZOI if abs(d) >= 181 or d == 0 or d == -4095]
LAYOUTS = {"real": BORZOI, "far-only": FAR, "one-run": [-4095]}

dt = torch.bfloat16 if dev == "cuda" else torch.float16
N = 4096 if not SMOKE else 64
H, DK, DV = 8, 64, 192
g = torch.Generator(device=dev).manual_seed(0)
for batch in ([4, 16] if not SMOKE else [1]):
    qkv = torch.randn(batch, N, H * (2 * DK + DV), device=dev, generator=g, dtype=torch.float32).to(dt)
    q = qkv[..., : H * DK].view(batch, N, H, DK).transpose(1, 2)
    k = qkv[..., H * DK : 2 * H * DK].view(batch, N, H, DK).transpose(1, 2)
    v = qkv[..., 2 * H * DK :].view(batch, N, H, DV).transpose(1, 2)
    u = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    pb = (0.1 * torch.randn(H, DK, device=dev, generator=g)).contiguous()
    plain = lambda cfg=None: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg)
    for name, cfg in (("plain autotuned", None), ("plain 64x64x4x2", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))):
        if SMOKE and cfg is not None:
            cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
        emit("kernel", "borzoi-layer", batch, name, f"{bench(lambda: plain(cfg)):.4f}", "", "")
    for lname, dists in LAYOUTS.items():
        if SMOKE:
            dists = [d for d in dists if abs(d) < N] or [-(N - 1)]
            dists[0] = -(N - 1)
        starts = torch.tensor([d + N - 1 for d in dists], device=dev)
        rows = 2 * N - 1
        _, _, buf, _ = _derive_run_layout(starts, rows, N, N, 16)
        run_keys = (0.5 * torch.randn(H, len(dists), DK, device=dev, generator=g)).to(dt).contiguous()
        for cname, cfg in (("autotuned", None), ("64x64x4x2", dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2))):
            if SMOKE:
                cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
            fn = lambda: attention_dense_fwd(q, k, v, None, DK**-0.5, False, None, config=cfg,
                                             relative_runs=(run_keys, buf, u, pb), run_span=16)
            emit("kernel", "borzoi-layer", batch, f"runs {lname} {cname}", f"{bench(fn):.4f}", "", f"{len(dists)} runs")
    del qkv, q, k, v
    torch.cuda.empty_cache() if dev == "cuda" else None

# ---- the sublayer pieces: LayerNorm + cast, output projection + residual add
C = 1536
for model, batch, n in (("borzoi", 1, 4096), ("borzoi", 4, 4096), ("borzoi", 16, 4096), ("enformer", 8, 1536)):
    if SMOKE:
        n = 64
    M = batch * n
    x = torch.randn(batch, n, C, device=dev, generator=g)
    lnw = 1 + 0.1 * torch.randn(C, device=dev, generator=g)
    lnb = 0.1 * torch.randn(C, device=dev, generator=g)
    ref = F.layer_norm(x, (C,), lnw, lnb, 1e-3).to(torch.bfloat16)
    emit("norm", model, batch, "layer_norm fp32 + cast", f"{bench(lambda: F.layer_norm(x, (C,), lnw, lnb, 1e-3).to(torch.bfloat16)):.4f}", "", "")
    got = norm_rope(x.view(batch, n, 1, C), lnw, lnb, 1e-3, rope=None, out_dtype=torch.bfloat16).view(batch, n, C)
    diff = (got.float() != ref.float()).sum().item()
    emit("norm", model, batch, "norm_rope -> bf16", f"{bench(lambda: norm_rope(x.view(batch, n, 1, C), lnw, lnb, 1e-3, rope=None, out_dtype=torch.bfloat16)):.4f}",
         f"{(got.float() - ref.float()).abs().max().item():.3e}", f"{diff} of {got.numel()} differ")
    a = torch.randn(M, C, device=dev, generator=g).to(torch.bfloat16)
    W = (torch.randn(C, C, device=dev, generator=g) / math.sqrt(C))
    bias = 0.1 * torch.randn(C, device=dev, generator=g)
    x2 = x.view(M, C)

    def current():
        with torch.autocast(dev, dtype=torch.bfloat16):
            y = F.linear(a, W, bias)
        return y + x2
    r0 = current()
    emit("residual", model, batch, "linear (autocast) + add", f"{bench(current):.4f}", "", "")
    Wb = W.to(torch.bfloat16)
    bb = bias.to(torch.bfloat16)
    exact = torch.addmm(bias.double(), a.double(), W.t().to(torch.bfloat16).double()) + x2.double()
    emit("residual", model, batch, "linear (autocast) + add err", "", f"{(r0.double() - exact).abs().max().item():.3e}", "")
    try:
        fused = lambda: torch.addmm(x2, a, Wb.t(), out_dtype=torch.float32)
        r1 = fused()
        emit("residual", model, batch, "addmm(x, a, W^T, out fp32) no bias", f"{bench(fused):.4f}", "", "")
        # bias through a ones column (K + 16)
        a_aug = torch.zeros(M, C + 16, device=dev, dtype=torch.bfloat16)
        a_aug[:, :C] = a
        a_aug[:, C] = 1
        W_aug = torch.zeros(C, C + 16, device=dev, dtype=torch.bfloat16)
        W_aug[:, :C] = Wb
        W_aug[:, C] = bb
        fused_aug = lambda: torch.addmm(x2, a_aug, W_aug.t(), out_dtype=torch.float32)
        r2 = fused_aug()
        emit("residual", model, batch, "addmm(x, [a 1], [W b]^T, out fp32)", f"{bench(fused_aug):.4f}",
             f"{(r2.double() - exact).abs().max().item():.3e}", "bias in bf16")
        xb = x2 + bias
        fused_xb = lambda: torch.addmm(xb, a, Wb.t(), out_dtype=torch.float32)
        r3 = fused_xb()
        emit("residual", model, batch, "addmm(x+b, a, W^T, out fp32)", f"{bench(fused_xb):.4f}",
             f"{(r3.double() - exact).abs().max().item():.3e}", "x+b given")
        emit("residual", model, batch, "x + b alone", f"{bench(lambda: x2 + bias):.4f}", "", "")
    except Exception as e:  # noqa: BLE001
        emit("residual", model, batch, "addmm out_dtype", "", "", f"error: {type(e).__name__}: {str(e)[:200]}")
    # finite checks of q, k, v (bf16) as the module queues them
    qq = torch.randn(M, 512, device=dev, generator=g).to(torch.bfloat16)
    kk = torch.randn(M, 512, device=dev, generator=g).to(torch.bfloat16)
    vv = torch.randn(M, 1536, device=dev, generator=g).to(torch.bfloat16)
    emit("check", model, batch, "_foreach_norm q k v", f"{bench(lambda: torch._foreach_norm([qq, kk, vv], math.inf)):.4f}", "", "")
    emit("check", model, batch, "amax abs cat-free (3 x aminmax)", f"{bench(lambda: [t.abs().amax() for t in (qq, kk, vv)]):.4f}", "", "")
    del x, a, x2, qq, kk, vv
f.close()
