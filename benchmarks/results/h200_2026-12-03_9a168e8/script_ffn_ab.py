"""Patched dense Enformer/Borzoi: each block's feed-forward fused (norm kernel, Linear with ReLU in one matmul)
against the Sequential's own forward (the fused pre-attention norm on in both), alternating in one process."""
import csv
import statistics
import sys
import time

import torch

import kvbound
import kvbound.models._ports as ports
from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward

out, commit = sys.argv[1], sys.argv[2]
plan = [(m, int(b)) for m, b in (x.split(":") for x in sys.argv[3].split(","))]
dev = torch.device("cuda")
T0 = time.time()
real = ports._fusable_feed_forward


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


f = open(out, "w", newline="")
wr = csv.writer(f)
wr.writerow(["model", "batch", "variant", "fused_feed_forward", "repeat", "forward_ms", "attention_ms",
             "max_abs_diff", "commit"])
models = {}
for name, b in plan:
    spec = next(s for s in PORT_MODELS if s.name == name)
    if name not in models:
        torch.manual_seed(0)
        models.clear()
        torch.cuda.empty_cache()
        models[name] = spec.build().to(dev)
    model = models[name]
    modules = [m for m in model.modules() if type(m) is spec.attention_class()]
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

    fw, at, ref = measure()
    wr.writerow([name, b, "unpatched", "", 1, f"{fw:.2f}", f"{at:.3f}", "", commit])
    log(name, b, "unpatched", f"{fw:.2f}", f"{at:.3f}")
    handle = kvbound.patch(model, compress=False)
    for rep in (1, 2, 3):
        for setting in ("1", "0"):
            ports._fusable_feed_forward = real if setting == "1" else (lambda seq, x: None)
            fw, at, o = measure()
            d = (o - ref).abs().max().item()
            wr.writerow([name, b, "patch-dense", setting, rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}", commit])
            log(name, b, "dense", "fused ffn" if setting == "1" else "module ffn", rep, f"{fw:.2f}", f"{at:.3f}",
                f"{d:.3e}")
            f.flush()
    ports._fusable_feed_forward = real
    handle.undo()
    del inputs
    torch.cuda.empty_cache()
log("done")
