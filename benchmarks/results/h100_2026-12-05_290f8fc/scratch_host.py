"""Host profile of eager forwards at batch 1: wall and host-call per forward (unpatched, patched dense, patched
compressed), and cProfile of five patched forwards of each patched variant."""
import sys, time, cProfile, pstats, io, warnings, torch, kvbound
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; batch = int(sys.argv[2]); outdir = sys.argv[3]
spec = next(s for s in PORT_MODELS if s.name == name)
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(batch, 1, torch.device("cuda"))
calib = spec.make_input(batch, 2, torch.device("cuda"))
def fwd():
    return model(*inputs.args, **inputs.kwargs)
def wall(n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fwd(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2] * 1e3
def host(n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fwd(); ts.append(time.perf_counter() - t); torch.cuda.synchronize()
    ts.sort(); return ts[len(ts)//2] * 1e3
def calibrate(m):
    m(*calib.args, **calib.kwargs)
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for _ in range(3): fwd()
    print(f"{name} b{batch} unpatched wall {wall():.2f} ms host-call {host():.2f} ms", flush=True)
    for variant in ("dense", "compressed"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = kvbound.patch(model, compress=variant == "compressed", calibrate_on=calibrate if variant == "compressed" else None)
        for _ in range(3): fwd()
        print(f"{name} b{batch} patched {variant} wall {wall():.2f} ms host-call {host():.2f} ms retries {getattr(h, 'speculative_retries', '-')}", flush=True)
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        for _ in range(5): fwd()
        torch.cuda.synchronize()
        pr.disable()
        for sort in ("tottime", "cumulative"):
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(70)
            open(f"{outdir}/host_{name}_b{batch}_{variant}_{sort}.txt", "w").write(s.getvalue())
        pr.dump_stats(f"{outdir}/host_{name}_b{batch}_{variant}.prof")
        h.undo()
