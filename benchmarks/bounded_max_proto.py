# Device command (one call, about 20 s): PYTHONPATH=src python3 benchmarks/bounded_max_proto.py 65536
# (PEAK=4 for sharper attention and larger value coefficients). CPU: TRITON_INTERPRET=1 ... 256 (bf16 products are
# wrong in the interpreter: only mode 0 is meaningful there).
"""A stand-alone model of the compressed kernel's residual-free loop (rank-space logits through a shared basis,
values accumulated in rank space), to measure one change before it goes into the kernel: the running row maximum
(mode 0, the loop as it was) against a fixed per-row upper bound on the logits (no maximum tracked, nothing
rescaled) with P in bfloat16, whose range holds the gap between the bound and the true maximum (mode 2: V
coefficients in bfloat16; 3: V coefficients as a bfloat16 pair hi + lo in two tiles; 4: the pair side by side in
one tile). Prints each mode's largest error against float64 on the first 128 queries of every head and the time of
every mode and tile shape beside cuDNN. Results: benchmarks/results/kernel_dev/bounded_max/."""

import math
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _loop(
    QH,
    QL,
    QM,
    CK,
    CV,
    CV2,
    M0,
    OUT,
    L,
    N,
    stride_qh,
    stride_ch,
    RK: tl.constexpr,
    RV: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MODE: tl.constexpr,
    TMA: tl.constexpr,
):
    # MODE 0: running max, fp16 P (today's loop). 2: fixed bound, bf16 P, bf16 C_v. 3: as 2 with C_v = hi + lo.
    # 4: as 3 with hi and lo packed side by side in one [N, 2 RV] tensor (CV), one load and one product.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    rk = tl.arange(0, RK)
    rv = tl.arange(0, RV)
    qh = tl.load(QH + head * stride_qh + rows[:, None] * RK + rk[None, :])
    ql = tl.load(QL + head * stride_qh + rows[:, None] * RK + rk[None, :])
    row_mult = tl.load(QM + head * N + rows)
    if TMA:
        ck_desc = tl.make_tensor_descriptor(CK + head * stride_ch, shape=[N, RK], strides=[RK, 1], block_shape=[BN, RK])
        cv_desc = tl.make_tensor_descriptor(CV + head * (N * RV), shape=[N, RV], strides=[RV, 1], block_shape=[BN, RV])
        cv2_desc = tl.make_tensor_descriptor(
            CV2 + head * (N * RV), shape=[N, RV], strides=[RV, 1], block_shape=[BN, RV]
        )
    RA: tl.constexpr = 2 * RV if MODE == 4 else RV
    ra = tl.arange(0, RA)
    if TMA:
        cva_desc = tl.make_tensor_descriptor(CV + head * (N * RA), shape=[N, RA], strides=[RA, 1], block_shape=[BN, RA])
    acc = tl.zeros([BM, RA], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    if MODE == 0:
        m_i = tl.zeros([BM], dtype=tl.float32) - float("inf")
    else:
        m_i = tl.load(M0 + head * N + rows)
    offs_n = tl.arange(0, BN)
    for start in range(0, N, BN):
        keys = start + offs_n
        if TMA:
            ck = ck_desc.load([start, 0])
            if MODE == 4:
                cv = cva_desc.load([start, 0])
            else:
                cv = cv_desc.load([start, 0])
        else:
            ck = tl.load(CK + head * stride_ch + keys[:, None] * RK + rk[None, :])
            cv = tl.load(CV + head * (N * RA) + keys[:, None] * RA + ra[None, :])
        c = tl.trans(ck)
        x = tl.dot(qh, c)
        x = tl.dot(ql, c, x)
        if MODE == 0:
            m_new = tl.maximum(m_i, tl.max(x, 1) * row_mult)
            p = tl.math.exp2(x * row_mult[:, None] - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(tl.float16), cv, acc)
            m_i = m_new
        else:
            p = tl.math.exp2(x * row_mult[:, None] - m_i[:, None])
            l_i += tl.sum(p, 1)
            pb = p.to(tl.bfloat16)
            acc = tl.dot(pb, cv, acc)
            if MODE == 3:
                if TMA:
                    cv2 = cv2_desc.load([start, 0])
                else:
                    cv2 = tl.load(CV2 + head * (N * RV) + keys[:, None] * RV + rv[None, :])
                acc = tl.dot(pb, cv2, acc)
    out = acc / l_i[:, None]
    tl.store(OUT + head * (N * RA) + rows[:, None] * RA + ra[None, :], out)
    tl.store(L + head * N + rows, l_i)


def inputs(h, n, r, device, seed=0):
    """Rank-space query and coefficients with the spread of the bench's low-rank K/V (d=64, scale 1/8)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    d = 64
    basis = torch.linalg.qr(torch.randn(d, r, generator=g))[0]  # orthonormal [d, r]
    q = torch.randn(h, n, d, generator=g)
    coeff_k = torch.randn(h, n, r, generator=g) * 1.5
    coeff_v = torch.randn(h, n, r, generator=g)
    peak = float(os.environ.get("PEAK", "1"))
    qr = (q @ basis) * (d**-0.5) * 1.4426950408889634 * peak  # log2 units
    coeff_v = coeff_v * peak
    rk = 16
    qr_pad = torch.zeros(h, n, rk)
    qr_pad[..., :r] = qr
    ck = torch.zeros(h, n, rk)
    ck[..., :r] = coeff_k
    cv = torch.zeros(h, n, rk)
    cv[..., :r] = coeff_v
    mult = qr_pad.abs().amax(-1).clamp_min(1e-30)
    qn = qr_pad / mult[..., None]
    qh = qn.half()
    ql = (qn - qh.float()).half()
    cmax, cmin = ck.half().float().amax(1), ck.half().float().amin(1)  # [h, rk]
    bound = (torch.maximum(qr_pad * cmax[:, None, :], qr_pad * cmin[:, None, :])).sum(-1) + 1.0
    rows = min(n, 128)
    exact = qr_pad[:, :rows].double() @ ck.half().double().transpose(-1, -2)
    true_max = exact.amax(-1)
    ref = torch.softmax(exact * math.log(2), -1) @ cv.half().double()
    bound = bound
    t = lambda x, dt: x.to(device=device, dtype=dt).contiguous()
    return dict(
        qh=t(qh, torch.float16),
        ql=t(ql, torch.float16),
        mult=t(mult, torch.float32),
        ck=t(ck, torch.float16),
        cv16=t(cv, torch.float16),
        cv32=t(cv.half().float(), torch.float32),
        cvb=t(cv.half().float(), torch.bfloat16),
        cvb_lo=t(cv.half().float() - cv.half().float().bfloat16().float(), torch.bfloat16),
        cv_packed=t(
            torch.cat([cv.half().float(), cv.half().float() - cv.half().float().bfloat16().float()], -1), torch.bfloat16
        ),
        bound=t(bound, torch.float32),
        ref=ref,
        gap=(bound[:, :rows].double() - true_max),
        rows=rows,
    )


def launch(d, mode, bm=64, bn=64, warps=4, stages=3, tma=True):
    h, n, rk = d["qh"].shape
    out = torch.empty(h, n, rk, device=d["qh"].device, dtype=torch.float32)
    l = torch.empty(h, n, device=d["qh"].device, dtype=torch.float32)
    cv = d["cv16"] if mode == 0 else d["cvb"]
    cv2 = d["cvb_lo"] if mode == 3 else cv
    if mode == 4:
        cv = d["cv_packed"]
        out = torch.empty(h, n, 2 * rk, device=d["qh"].device, dtype=torch.float32)
    _loop[(n // bm, h)](
        d["qh"],
        d["ql"],
        d["mult"],
        d["ck"],
        cv,
        cv2,
        d["bound"],
        out,
        l,
        n,
        n * rk,
        n * rk,
        RK=rk,
        RV=rk,
        BM=bm,
        BN=bn,
        MODE=mode,
        TMA=tma,
        num_warps=warps,
        num_stages=stages,
    )
    if mode == 4:
        out = out[..., :rk] + out[..., rk:]
    return out, l


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = int(sys.argv[1]) if len(sys.argv) > 1 else (65536 if device == "cuda" else 256)
    h = 8 if device == "cuda" else 2
    d = inputs(h, n, 8, device)
    gap = d["gap"]
    print(
        f"N={n} H={h}: bound - true max (log2 units): median {gap.median():.1f} max {gap.max():.1f} min {gap.min():.2f}"
    )
    if device == "cuda":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    tma = device == "cuda"
    for mode in (0, 2, 3, 4):
        out, l = launch(d, mode, tma=tma)
        err = (out[:, : d["rows"]].double().cpu() - d["ref"]).abs().max().item()
        print(f"mode {mode}: max err vs float64 {err:.3e}, min row sum {l.min().item():.3e}", flush=True)
    if device == "cuda":
        from triton.testing import do_bench

        q = torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=50, rep=300)
        print(f"cuDNN SDPA bf16 [1, 8, {n}, 64]: {cudnn:.3f} ms", flush=True)
        for bm, bn, w, s in [(64, 64, 4, 3), (64, 64, 4, 4)]:
            row = []
            for mode in (0, 2, 4):
                try:
                    ms = do_bench(lambda m=mode, t=(bm, bn, w, s): launch(d, m, *t), warmup=50, rep=300)
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    print(type(e).__name__, str(e)[:200])
                row.append(ms)
            ratios = (
                f"bound bf16 {row[1]:.3f} ({row[0] / row[1]:.3f}x) | "
                f"packed hi/lo C_v {row[2]:.3f} ({row[0] / row[2]:.3f}x)"
            )
            print(f"tile {bm}x{bn} w{w} s{s}: running max {row[0]:.3f} ms | {ratios}", flush=True)
