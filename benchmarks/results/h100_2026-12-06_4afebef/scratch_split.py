"""The split launch of compressed attention (KVBOUND_SPLIT_LOWRANK auto against off) inside the patched models:
eager forwards (wall, median of 10) and CUDA-graph replays (median of 20), side by side in one process, two rounds."""
import os, sys, time, warnings, torch, kvbound
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; batch = int(sys.argv[2])
spec = next(s for s in PORT_MODELS if s.name == name)
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(batch, 1, torch.device("cuda"))
calib = spec.make_input(batch, 2, torch.device("cuda"))
def med(fn, n):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2] * 1e3
def fwd():
    return model(*inputs.args, **inputs.kwargs)
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = kvbound.patch(model, compress=True, calibrate_on=lambda m: m(*calib.args, **calib.kwargs))
    for _ in range(3): fwd()
    for r in (1, 2):
        for setting in ("auto", "off"):
            os.environ["KVBOUND_SPLIT_LOWRANK"] = setting
            for _ in range(2): fwd()
            eager = med(fwd, 10)
            g = kvbound.capture(model, *inputs.args, kwargs=inputs.kwargs, warmup=2)
            replay = med(lambda: g(*inputs.args, **inputs.kwargs), 20)
            print(f"{name},{batch},{r},{setting},{eager:.3f},{replay:.3f},{g.fallbacks}", flush=True)
            del g
    os.environ["KVBOUND_SPLIT_LOWRANK"] = "auto"
    h.undo()
