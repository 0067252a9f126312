"""Where the host time of kvbound.attention and of a patched Enformer attention module goes (cProfile by own time,
and torch.profiler's CPU-side ops), on the GPU host."""
import sys, time, cProfile, pstats, io, warnings, torch
import kvbound
from kvbound import _checks
from torch.profiler import profile, ProfilerActivity
from kvbound.bench.ports import PORT_MODELS
dev = torch.device("cuda")
out = sys.argv[1]
def report(label, fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): fn()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50): fn()
    torch.cuda.synchronize()
    t = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    with open(out, "a") as f:
        f.write(f"===== {label}: cProfile over {n} calls\n{s.getvalue()}\n===== {label}: torch.profiler CPU ops over 50 calls\n{t}\n")
with torch.no_grad():
    n = 128
    q = torch.randn(1, 8, n, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 8, n, 192, device=dev, dtype=torch.bfloat16)
    rk = torch.randn(8, 2 * n - 1, 64, device=dev, dtype=torch.bfloat16)
    u = torch.randn(8, 64, device=dev); vb = torch.randn(8, 64, device=dev)
    call = lambda: kvbound.attention(q, k, v, scale=0.125, relative_keys=rk, relative_content_bias=u, relative_position_bias=vb)
    with _checks.deferred_checks():
        report("kvbound.attention relative N=128 (deferred)", call)
    spec = next(s for s in PORT_MODELS if s.name == "enformer")
    torch.manual_seed(0)
    model = spec.build().to(dev)
    attn_res, ff_res = model.transformer[0][0], model.transformer[0][1]
    attn = attn_res.fn[1]
    xs = torch.randn(1, 1536, 1536, device=dev, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = kvbound.patch(model, compress=False)
        with _checks.deferred_checks():
            report("enformer layer patched b1 (deferred)", lambda: ff_res(attn_res(xs)), n=100)
