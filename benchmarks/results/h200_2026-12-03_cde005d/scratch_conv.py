"""A/B in one process: patched dense forwards with the fused conv blocks on / off (KVBOUND_FUSED_CONV), replayed
from CUDA graphs and eager, alternating; plus the output difference between the two and against unpatched.
Then the attention-module ceiling: one full-size attention module unpatched, patched, and patched with the relative
term removed (plain attention of the same shapes through kvbound.attention)."""
import csv, os, statistics, sys, time, warnings
import torch
import kvbound
from kvbound.bench.ports import PORT_MODELS, _forward
import kvbound.models._ports as ports

out_dir, commit = sys.argv[1], sys.argv[2]
dev = torch.device("cuda")
T0 = time.time()
def log(*a): print(f"[{time.time()-T0:6.1f}s]", *a, flush=True)
rows = []

def timed(fn, reps):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return ts

for name, batches in (("enformer", (1, 8)), ("borzoi", (1, 4))):
    spec = next(s for s in PORT_MODELS if s.name == name)
    torch.manual_seed(0)
    model = spec.build().to(dev)
    with torch.no_grad():  # running statistics away from 0 / 1, as a trained model's
        g = torch.Generator().manual_seed(1)
        for m in model.modules():
            if type(m) is torch.nn.BatchNorm1d:
                c = m.num_features
                m.running_mean.copy_(0.3 * torch.randn(c, generator=g).to(dev))
                m.running_var.copy_((0.5 + torch.rand(c, generator=g)).to(dev))
    for batch in batches:
        inputs = spec.make_input(batch, 1, dev)
        ref = _forward(spec, model, inputs, dev).float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = kvbound.patch(model, compress=False)
        n_conv = sum(r.role == "conv" for r in h.helpers)
        caps, outs = {}, {}
        for label in ("conv-on", "conv-off"):
            os.environ["KVBOUND_FUSED_CONV"] = "1" if label == "conv-on" else "0"
            outs[label] = _forward(spec, model, inputs, dev).float()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                caps[label] = kvbound.capture(model, *inputs.args, kwargs=inputs.kwargs, warmup=2)
        d_on = (outs["conv-on"] - ref).abs().max().item(); d_off = (outs["conv-off"] - ref).abs().max().item()
        d_ab = (outs["conv-on"] - outs["conv-off"]).abs().max().item(); rmax = ref.abs().max().item()
        log(name, batch, "conv helpers", n_conv, "diff vs unpatched on/off", d_on, d_off, "on-off", d_ab, "ref max", rmax)
        times = {k: [] for k in ("graph conv-on", "graph conv-off", "eager conv-on", "eager conv-off")}
        reps = 20 if batch == 1 else 8
        for rnd in range(3):
            for label in ("conv-on", "conv-off"):
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    times["graph " + label] += timed(lambda: caps[label](*inputs.args, **inputs.kwargs), reps)
                os.environ["KVBOUND_FUSED_CONV"] = "1" if label == "conv-on" else "0"
                times["eager " + label] += timed(lambda: _forward(spec, model, inputs, dev), reps)
        os.environ.pop("KVBOUND_FUSED_CONV", None)
        for k, v in times.items():
            q = statistics.quantiles(v, n=5)
            rows.append(dict(part="ab", model=name, batch=batch, variant=k, ms_p20=q[0], ms_p50=statistics.median(v),
                             ms_p80=q[3], n=len(v), diff_vs_unpatched=d_on if "on" in k else d_off,
                             diff_on_off=d_ab, ref_max_abs=rmax, conv_blocks=n_conv, commit=commit))
            log(name, batch, k, f"{statistics.median(v):.3f} ms")
        del caps
        h.undo()
        torch.cuda.empty_cache()
    # ---- attention-module ceiling
    att_cls = spec.attention_class()
    att = next(m for m in model.modules() if type(m) is att_cls)
    dim = att.to_q.in_features
    for batch in ((8,) if name == "enformer" else (4, 16)):
        x = torch.randn(batch, spec.tokens, dim, device=dev).to(torch.bfloat16)
        res = {}
        real = ports.relative_position_attention
        def plain(q, k, v, relative_keys, content_bias, position_bias, *, scale, query_chunk=None, backend="auto",
                  relative_runs=None):
            return kvbound.attention(q, k, v, scale=scale)
        for variant in ("unpatched", "patched", "patched-relative-free"):
            hh = None
            if variant != "unpatched":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    hh = kvbound.patch(att, compress=False)
            ports.relative_position_attention = plain if variant == "patched-relative-free" else real
            try:
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for _ in range(3): att(x)
                    torch.cuda.synchronize()
                    v_ = []
                    for rnd in range(3):
                        v_ += timed(lambda: att(x), 10)
            finally:
                ports.relative_position_attention = real
                if hh is not None: hh.undo()
            res[variant] = statistics.median(v_)
            q = statistics.quantiles(v_, n=5)
            rows.append(dict(part="module", model=name, batch=batch, variant=variant, ms_p20=q[0],
                             ms_p50=res[variant], ms_p80=q[3], n=len(v_), commit=commit))
            log(name, batch, "module", variant, f"{res[variant]:.3f} ms",
                f"speed-up {res['unpatched']/res[variant]:.2f}x" if variant != "unpatched" else "")
        del x
    del model
    torch.cuda.empty_cache()

fields = ["part","model","batch","variant","ms_p20","ms_p50","ms_p80","n","diff_vs_unpatched","diff_on_off",
          "ref_max_abs","conv_blocks","commit"]
with open(os.path.join(out_dir, "conv_ab_and_module_ceiling.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields); w.writeheader(); w.writerows(rows)
log("done")
