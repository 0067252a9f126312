"""A/B for the source tree on PYTHONPATH: (1) kernel-only Borzoi runs layer (attention_dense_fwd, with and without
the in-kernel checks), (2) patched Borzoi / Enformer forwards and attention modules. Appends CSV rows."""
import csv
import os
import statistics
import sys
import time

import torch
import triton.testing

import kvbound
from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward
from kvbound.models.reference import borzoi_positional_features_reference
from kvbound.models.relative import equal_row_runs

out, label, commit, parts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
dev = torch.device("cuda")
T0 = time.time()
f = open(out, "a", newline="")
wr = csv.writer(f)
onehot = os.environ.get("KVBOUND_RUNS_ONEHOT", "default")


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


if "layer" in parts:
    from kvbound.attention import _run_operands
    from kvbound.kernels.attention_dense import attention_dense_fwd, relative_run_span
    import inspect
    has_peaks = "peaks" in inspect.signature(attention_dense_fwd).parameters
    n, h, dk, dv = 4096, 8, 64, 192
    feats = borzoi_positional_features_reference(n, 32).float()
    starts = equal_row_runs(feats)
    span = relative_run_span(starts, 2 * n - 1)
    g = torch.Generator().manual_seed(0)
    keys = (feats @ (torch.randn(32, h * dk, generator=g) * 0.2)).reshape(2 * n - 1, h, dk).transpose(0, 1)
    per_run = keys[:, starts].to(torch.bfloat16).to(dev).contiguous()
    u = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
    w = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
    for b in (4, 16):
        x = torch.randn(b, n, h * (2 * dk + dv), generator=g).to(torch.bfloat16).to(dev)
        q = x[..., : h * dk].view(b, n, h, dk).transpose(1, 2)
        k = x[..., h * dk : 2 * h * dk].view(b, n, h, dk).transpose(1, 2)
        v = x[..., 2 * h * dk :].view(b, n, h, dv).transpose(1, 2)
        (run_keys, buffer), _ = _run_operands(q, per_run, torch.tensor(starts, device=dev), n, n, span)
        runs = (run_keys, buffer, u, w)
        ref = None
        for check in ([False, True] if has_peaks else [False]):
            def call():
                extra = {"peaks": torch.zeros(3, dtype=torch.int32, device=dev)} if check else {}
                return attention_dense_fwd(q, k, v, None, dk**-0.5, False, None, relative_runs=runs, run_span=span,
                                           **extra)[0]
            o = call()
            if ref is None:
                ref = o
            same = torch.equal(o, ref)
            ms = triton.testing.do_bench(call, warmup=50, rep=400)
            wr.writerow(["borzoi-layer-kernel", b, label, onehot, int(check), f"{ms:.4f}", "",
                         f"{o.float().abs().sum().item():.6e}", int(same), commit])
            log("layer", b, label, onehot, "check" if check else "-", f"{ms:.4f}", same)
    f.flush()

if "enflayer" in parts:
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.models.reference import relative_position_attention_reference
    bf16 = os.environ.get("KVBOUND_RELATIVE_BF16", "0")
    n, h, dk, dv, b = 1536, 8, 64, 192, 8
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(b, h, n, dk, generator=g).to(torch.bfloat16).to(dev) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=g).to(torch.bfloat16).to(dev)
    keys = (torch.randn(h, 2 * n - 1, dk, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    u = (torch.randn(h, dk, generator=g) * 0.3).to(dev)
    w = (torch.randn(h, dk, generator=g) * 0.3).to(dev)

    def call():
        return attention_dense_fwd(q, k, v, None, dk**-0.5, False, None, relative=(keys, u, w))[0]

    o = call()
    exp = relative_position_attention_reference(q[:1, :, :].double(), k[:1].double(), v[:1].double(), keys.double(),
                                                u.double().reshape(1, h, 1, dk), w.double().reshape(1, h, 1, dk),
                                                scale=dk**-0.5)
    err = (o[:1].double() - exp).abs().max().item()
    ms = triton.testing.do_bench(call, warmup=50, rep=400)
    wr.writerow(["enformer-layer-kernel", b, label, f"bf16={bf16}", "", f"{ms:.4f}", "", f"{err:.3e}", "", commit])
    log("enformer layer", b, label, f"bf16={bf16}", f"{ms:.4f}", f"err {err:.3e}")
    f.flush()

for model_name, batches in (("borzoi", (4, 16)), ("enformer", (8,))):
    if model_name not in parts:
        continue
    spec = next(s for s in PORT_MODELS if s.name == model_name)
    torch.manual_seed(0)
    model = spec.build().to(dev)
    modules = [m for m in model.modules() if type(m) is spec.attention_class()]
    for b in batches:
        inputs = spec.make_input(b, 1, dev)

        def measure(reps=9):
            for _ in range(3):
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
            return statistics.median(times), min(times), statistics.median(att), o.float()

        fw0, fmin0, at0, ref = measure()
        wr.writerow([model_name, b, "unpatched", onehot, "", f"{fw0:.2f}", f"{fmin0:.2f}", f"{at0:.3f}", "", commit])
        log(model_name, b, "unpatched", f"{fw0:.2f}", f"{at0:.3f}")
        handle = kvbound.patch(model, compress=False)
        fw, fmin, at, o = measure()
        d = (o - ref).abs().max().item()
        wr.writerow([model_name, b, label, onehot, "", f"{fw:.2f}", f"{fmin:.2f}", f"{at:.3f}", f"{d:.3e}", commit])
        log(model_name, b, label, f"{fw:.2f}", f"{at:.3f}", f"x{fw0 / fw:.3f}", f"{d:.3e}")
        f.flush()
        handle.undo()
        del inputs
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
log("done")
