"""Patched dense Enformer/Borzoi: the fused pre-attention LayerNorm (KVBOUND_FUSED_NORM=1) against the module's
own LayerNorm (=0), alternating in one process; and the norm alone at each layer's shape."""
import csv
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kvbound
from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward

out, commit = sys.argv[1], sys.argv[2]
plan = [(m, int(b)) for m, b in (x.split(":") for x in sys.argv[3].split(","))]
dev = torch.device("cuda")
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


f = open(out, "w", newline="")
wr = csv.writer(f)
wr.writerow(["model", "batch", "variant", "fused_norm", "repeat", "forward_ms", "attention_ms", "max_abs_diff",
             "commit"])
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
    for rep in (1, 2):
        for setting in ("1", "0"):
            os.environ["KVBOUND_FUSED_NORM"] = setting
            fw, at, o = measure()
            d = (o - ref).abs().max().item()
            wr.writerow([name, b, "patch-dense", setting, rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}", commit])
            log(name, b, "dense", "fused" if setting == "1" else "module", rep, f"{fw:.2f}", f"{at:.3f}", f"{d:.3e}")
            f.flush()
    # the norm alone on the layer's bf16 input, as autocast runs it, against the helper's kernel
    norm = next(r.module for r in handle.helpers if r.role == "norm")
    seen = {}
    def grab(m, a):
        seen.setdefault("x", a[0])

    hook = norm.register_forward_pre_hook(grab)
    os.environ["KVBOUND_FUSED_NORM"] = "0"
    _forward(spec, model, inputs, dev)
    hook.remove()
    x = seen["x"]
    from kvbound.kernels.norm_rope import norm_rope

    def module_way():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps).to(torch.bfloat16)

    def fused_way():
        return norm_rope(x.contiguous().view(1, -1, 1, x.shape[-1]), norm.weight, norm.bias, norm.eps, rope=None,
                         out_dtype=torch.bfloat16, round_to_input=False)

    a, c = module_way(), fused_way().view(x.shape)
    for label, fn in (("norm module + cast", module_way), ("norm fused", fused_way)):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize()
            ts.append(s.elapsed_time(e))
        wr.writerow([name, b, label, str(x.dtype), "", f"{statistics.median(ts):.4f}", "",
                     f"{(a.float() - c.float()).abs().max().item():.3e}; {int((a != c).sum())} of {a.numel()} differ",
                     commit])
        log(name, b, label, x.dtype, f"{statistics.median(ts):.4f}")
    f.flush()
    os.environ["KVBOUND_FUSED_NORM"] = "1"
    handle.undo()
    del inputs
    torch.cuda.empty_cache()
log("done")

# the finite checks of a layer's q, k, v (bf16 heads-split views of projections) and its small tensors
from kvbound import _checks  # noqa: E402
from kvbound.kernels import peaks  # noqa: E402

for b, n in ((1, 4096), (4, 4096), (16, 4096), (8, 1536)):
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(b, n, 8 * d, device=dev, generator=g).to(torch.bfloat16).view(b, n, 8, d).transpose(1, 2)
               for d in (64, 64, 192))
    rel = torch.randn(8, 31, 64, device=dev).to(torch.bfloat16)
    small = [torch.randn(8, 64, device=dev), torch.randn(8, 64, device=dev)]
    ts = [q, k, v, rel, *small]
    want = torch.stack([t.abs().max().double() for t in ts])
    got = _checks.largest_magnitudes(ts)
    for label, fn in (("foreach_norm", lambda: [torch._foreach_norm([q, k, v, rel], float("inf")),
                                                torch._foreach_norm(small, float("inf"))]),
                      ("peaks kernel", lambda: _checks.largest_magnitudes(ts))):
        for _ in range(3):
            fn()
        tt = []
        for _ in range(30):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize()
            tt.append(s.elapsed_time(e))
        wr.writerow([f"checks N={n}", b, label, "", "", f"{statistics.median(tt):.4f}", "",
                     f"equal: {bool(torch.equal(got, want))}", commit])
        log("checks", b, n, label, f"{statistics.median(tt):.4f}", bool(torch.equal(got, want)))
    f.flush()
