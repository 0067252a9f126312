"""Patched Borzoi with compressed K/V: the runs (KVBOUND_RELATIVE_RUNS=1) against the relative keys (=0), one process."""
import csv
import os
import statistics
import sys
import time

import torch

import kvbound
from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward

out, commit = sys.argv[1], sys.argv[2]
batches = [int(b) for b in sys.argv[3].split(",")]
dev = torch.device("cuda")
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


spec = next(s for s in PORT_MODELS if s.name == "borzoi")
torch.manual_seed(0)
model = spec.build().to(dev)
modules = [m for m in model.modules() if type(m) is spec.attention_class()]
f = open(out, "w", newline="")
wr = csv.writer(f)
wr.writerow(["model", "batch", "variant", "relative_runs", "repeat", "forward_ms", "attention_ms", "max_abs_diff",
             "retries", "commit"])
for b in batches:
    inputs = spec.make_input(b, 1, dev)
    calib = spec.make_input(1, 2, dev)

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
    wr.writerow(["borzoi", b, "unpatched", "", 1, f"{fw:.2f}", f"{at:.3f}", "", "", commit])
    log(b, "unpatched", f"{fw:.2f}", f"{at:.3f}")
    handle = kvbound.patch(model, kvbound.CompressionConfig(), compress=True,
                           calibrate_on=lambda m: _forward(spec, m, calib, dev))
    for rep in (1, 2):
        for setting in ("1", "0"):
            os.environ["KVBOUND_RELATIVE_RUNS"] = setting
            fw, at, o = measure()
            d = (o - ref).abs().max().item()
            retries = getattr(handle, "speculative_retries", "")
            wr.writerow(["borzoi", b, "patch-compressed", setting, rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}",
                         retries, commit])
            log(b, "compressed", "runs" if setting == "1" else "keys", rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}",
                retries)
            f.flush()
    handle.undo()
    del inputs, calib
    torch.cuda.empty_cache()
log("done")
