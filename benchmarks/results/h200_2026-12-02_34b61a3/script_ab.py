"""Borzoi patched forwards (and one runs call per layer) for the source tree on PYTHONPATH; appends CSV rows."""
import csv
import statistics
import sys
import time

import torch
import triton.testing

import kvbound
from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward
from kvbound.models.reference import borzoi_positional_features_reference
from kvbound.models.relative import equal_row_runs

out, label, commit, unpatched = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
dev = torch.device("cuda")
T0 = time.time()
f = open(out, "a", newline="")
wr = csv.writer(f)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# one call per layer shape, public API, checks read at once
n, h, dk, dv = 4096, 8, 64, 192
feats = borzoi_positional_features_reference(n, 32).float()
starts = equal_row_runs(feats)
g = torch.Generator().manual_seed(0)
keys = (feats @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
per_run = keys[:, starts].to(torch.bfloat16).to(dev).contiguous()
u = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
w = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
for b in (1, 4, 16):
    x = torch.randn(b, n, h * (2 * dk + dv), generator=g).to(torch.bfloat16).to(dev)
    q = x[..., : h * dk].view(b, n, h, dk).transpose(1, 2)
    k = x[..., h * dk : 2 * h * dk].view(b, n, h, dk).transpose(1, 2)
    v = x[..., 2 * h * dk :].view(b, n, h, dv).transpose(1, 2)

    def call():
        return kvbound.attention(q, k, v, relative_keys=per_run, relative_content_bias=u, relative_position_bias=w,
                                 relative_runs=starts)
    o = call()
    ref = o.float().clone() if b == 1 else None
    ms = triton.testing.do_bench(call, warmup=25, rep=200)
    wr.writerow(["layer-call", b, label, "", f"{ms:.4f}", "", f"{o.float().abs().sum().item():.6e}", commit])
    log("layer", b, label, f"{ms:.4f}")
f.flush()

spec = next(s for s in PORT_MODELS if s.name == "borzoi")
torch.manual_seed(0)
model = spec.build().to(dev)
modules = [m for m in model.modules() if type(m) is spec.attention_class()]
for b in (1, 4, 16):
    inputs = spec.make_input(b, 1, dev)

    def measure(reps=7):
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

    fw0, at0, ref = measure()
    if unpatched:
        wr.writerow(["borzoi", b, "unpatched", "", f"{fw0:.2f}", f"{at0:.3f}", "", commit])
        log("borzoi", b, "unpatched", f"{fw0:.2f}", f"{at0:.3f}")
    handle = kvbound.patch(model, compress=False)
    fw, at, o = measure()
    d = (o - ref).abs().max().item()
    wr.writerow(["borzoi", b, label, "", f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}", commit])
    log("borzoi", b, label, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}")
    f.flush()
    handle.undo()
    del inputs
    torch.cuda.empty_cache()
log("done")
