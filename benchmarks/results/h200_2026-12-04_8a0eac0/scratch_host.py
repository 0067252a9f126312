"""Host profile of eager forwards at batch 1: wall per forward (unpatched, patched), and cProfile of patched forwards."""
import sys, time, cProfile, pstats, io, warnings, torch, kvbound
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; batch = int(sys.argv[2]); outdir = sys.argv[3]
spec = next(s for s in PORT_MODELS if s.name == name)
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(batch, 1, torch.device("cuda"))
def fwd():
    return model(*inputs.args, **inputs.kwargs)
def wall(n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fwd(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2] * 1e3
def host(n=10):
    # host time of the forward call alone (the device may still be running when it returns)
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fwd(); ts.append(time.perf_counter() - t); torch.cuda.synchronize()
    ts.sort(); return ts[len(ts)//2] * 1e3
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for _ in range(3): fwd()
    print(f"{name} b{batch} unpatched wall {wall():.2f} ms host-call {host():.2f} ms")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = kvbound.patch(model, compress=False)
    for _ in range(3): fwd()
    print(f"{name} b{batch} patched wall {wall():.2f} ms host-call {host():.2f} ms")
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(5): fwd()
    torch.cuda.synchronize()
    pr.disable()
    for sort in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(60)
        open(f"{outdir}/host_{name}_b{batch}_{sort}.txt", "w").write(s.getvalue())
    pr.dump_stats(f"{outdir}/host_{name}_b{batch}.prof")
