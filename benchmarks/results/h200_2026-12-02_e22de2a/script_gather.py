"""Runs variant: unrolled fill vs gathered multi-run tiles, kernel-only and whole Borzoi forwards."""
import csv
import os
import statistics
import sys
import time

import torch
import triton
import triton.testing

from kvbound.attention import _run_layout, _run_table
from kvbound.kernels import attention_dense as ad
from kvbound.models.reference import borzoi_positional_features_reference
from kvbound.models.relative import equal_row_runs

out_dir, commit, part = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(out_dir, exist_ok=True)
dev = torch.device("cuda")
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


if part in ("kernel", "both"):
    n, h, dk, dv = 4096, 8, 64, 192
    scale = dk**-0.5
    feats = borzoi_positional_features_reference(n, 32).float()
    starts = equal_row_runs(feats)
    g = torch.Generator().manual_seed(0)
    keys = (feats @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
    keys = keys.to(torch.bfloat16).to(dev).contiguous()
    st = torch.tensor(starts, device=dev)
    first = keys[:, st]
    u = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
    w = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
    span = ad.relative_run_span(starts, 2 * n - 1)
    _, _, buffer, _ = _run_layout(st, 2 * n - 1, n, n, span)
    rows = []
    f = open(f"{out_dir}/gather_kernel.csv", "w", newline="")
    wr = csv.writer(f)
    wr.writerow(["B", "variant", "gather", "tile", "tile_used", "ms", "diff_vs_legacy", "err_vs_f64", "commit"])
    tiles = [None, (64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 3)]
    for b in (1, 4, 16):
        x = torch.randn(b, n, h * (2 * dk + dv), generator=g).to(torch.bfloat16).to(dev)
        q = x[..., : h * dk].view(b, n, h, dk).transpose(1, 2)
        k = x[..., h * dk : 2 * h * dk].view(b, n, h, dk).transpose(1, 2)
        v = x[..., 2 * h * dk :].view(b, n, h, dv).transpose(1, 2)
        table = _run_table(q, first, w, scale)
        runs = (table, buffer, u.float().contiguous())
        # float64 reference, batch item 0, first 128 queries
        qs = q[:1, :, :128].double() * scale
        logits = (qs + u.double()[None, :, None]) @ k[:1].double().transpose(-1, -2)
        run_of = torch.searchsorted(st, torch.arange(2 * n - 1, device=dev), right=True) - 1
        T = (qs + w.double()[None, :, None]) @ first.double().transpose(-1, -2)  # [1,h,128,R]
        ii = torch.arange(128, device=dev)[:, None]
        jj = torch.arange(n, device=dev)[None, :]
        idx = run_of[n - 1 + jj - ii]  # [128, n]
        logits = logits + torch.gather(T, 3, idx[None, None].expand(1, h, 128, n))
        ref = torch.softmax(logits, -1) @ v[:1].double()
        del logits, T, idx
        legacy = None
        for gather in (0, 1, 2, 3):
            for tile in tiles:
                if gather == 0 and tile is not None and tile[0] + tile[1] - 1 > 127:
                    continue
                cfg = None if tile is None else dict(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
                name = "autotuned" if tile is None else "x".join(map(str, tile))

                def call():
                    return ad.attention_dense_fwd(q, k, v, None, scale, False, None, config=cfg, relative_runs=runs,
                                                  run_span=span, runs_gather=gather)[0]
                try:
                    o = call()
                    torch.cuda.synchronize()
                    if legacy is None:
                        legacy = o.clone()
                    used = ""
                    diff = (o.float() - legacy.float()).abs().max().item()
                    err = (o[:1, :, :128].double() - ref).abs().max().item()
                    ms = triton.testing.do_bench(call, warmup=25, rep=100)
                    wr.writerow([b, "runs", gather, name, used, f"{ms:.4f}", f"{diff:.3e}", f"{err:.3e}", commit])
                    log(b, "runs", gather, name, f"{ms:.4f}", f"{diff:.3e}", f"{err:.3e}")
                except Exception as e:  # noqa: BLE001
                    wr.writerow([b, "runs", gather, name, "", "error", str(e)[:200].replace("\n", " "), "", commit])
                    log(b, "runs", gather, name, "ERROR", str(e)[:300])
                f.flush()
        # plain attention at the same shape (no relative term), autotuned
        def plain():
            return ad.attention_dense_fwd(q, k, v, None, scale, False, None)[0]
        plain()
        ms = triton.testing.do_bench(plain, warmup=25, rep=100)
        wr.writerow([b, "plain", "", "autotuned", "", f"{ms:.4f}", "", "", commit])
        log(b, "plain", f"{ms:.4f}")
        f.flush()
        for key, best in ad._TUNED.items():
            log("tuned", key[:4], key[-6:], best)
        del x, q, k, v, table, ref
        torch.cuda.empty_cache()
    f.close()

if part in ("model", "both"):
    import kvbound
    from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward

    settings = sys.argv[4].split(",")
    for name, batches in (("borzoi", (4, 16)),):
        spec = next(s for s in PORT_MODELS if s.name == name)
        torch.manual_seed(0)
        model = spec.build().to(dev)
        modules = [m for m in model.modules() if type(m) is spec.attention_class()]
        for b in batches:
            inputs = spec.make_input(b, 1, dev)

            def measure(reps=5):
                for _ in range(2):
                    _forward(spec, model, inputs, dev)
                times = []
                for _ in range(reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    o = _forward(spec, model, inputs, dev)
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                att = []
                with AttentionTimer(modules, dev) as timer:
                    for _ in range(3):
                        timer.reset()
                        _forward(spec, model, inputs, dev)
                        att.append(timer.total_ms())
                return statistics.median(times), statistics.median(att), o.float()

            fw, at, ref = measure()
            log(name, b, "unpatched", f"{fw:.2f}", f"{at:.3f}")
            with open(f"{out_dir}/gather_model.csv", "a", newline="") as f:
                wr = csv.writer(f)
                wr.writerow([name, b, "unpatched", "", f"{fw:.2f}", f"{at:.3f}", "", commit])
                handle = kvbound.patch(model, compress=False)
                for rep in (1, 2):
                    for sval in settings:
                        os.environ["KVBOUND_RUNS_GATHER"] = sval
                        fw, at, o = measure()
                        d = (o - ref).abs().max().item()
                        wr.writerow([name, b, "patch-dense", sval, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}", commit])
                        log(name, b, "patch", sval, rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}")
                        f.flush()
                handle.undo()
            del inputs
            torch.cuda.empty_cache()
log("done")
