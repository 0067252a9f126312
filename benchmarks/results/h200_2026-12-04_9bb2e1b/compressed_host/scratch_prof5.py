"""Host profile of the compressed patched Enformer at batch 1: per-forward host (cProfile, by function, cumulative and
own), torch.profiler CPU op counts per forward."""
import sys, time, cProfile, pstats, io, warnings, torch, kvbound
from torch.profiler import profile, ProfilerActivity
from kvbound.config import DEFAULT_TAU, CompressionConfig
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; out = sys.argv[2]
spec = next(s for s in PORT_MODELS if s.name == name)
torch.manual_seed(0)
dev = torch.device("cuda")
model = spec.build().to(dev)
inputs = spec.make_input(1, 1, dev)
calib = spec.make_input(1, 2, dev)
config = CompressionConfig(block_size=128, rank=8, bits=4, tau=DEFAULT_TAU)
def fwd(m=model, i=inputs):
    return m(*i.args, **i.kwargs)
def wall(n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fwd(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts) // 2] * 1e3
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for variant in ("dense", "compressed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if variant == "dense":
                h = kvbound.patch(model, compress=False)
            else:
                h = kvbound.patch(model, config, compress=True, calibrate_on=lambda m: m(*calib.args, **calib.kwargs))
        for _ in range(3): fwd()
        print(f"{name} b1 {variant} wall {wall():.2f} ms", flush=True)
        pr = cProfile.Profile(); torch.cuda.synchronize(); pr.enable()
        for _ in range(5): fwd()
        torch.cuda.synchronize(); pr.disable()
        with open(out, "a") as f:
            for sort in ("cumulative", "tottime"):
                s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(70)
                f.write(f"===== {name} b1 {variant}: cProfile over 5 forwards, by {sort}\n{s.getvalue()}\n")
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5): fwd()
                torch.cuda.synchronize()
            t = prof.key_averages().table(sort_by="count", row_limit=40, max_name_column_width=60)
            f.write(f"===== {name} b1 {variant}: torch.profiler CPU ops over 5 forwards, by count\n{t}\n")
        pr.dump_stats(out.replace(".txt", f"_{variant}.prof"))
        h.undo()
