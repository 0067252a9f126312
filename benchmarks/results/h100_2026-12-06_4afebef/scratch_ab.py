"""Eager batch-1 forwards, in one process: unpatched, patched dense, and patched compressed with the kept encoder
workspaces and no encode timing (new path) against fresh workspaces and encode timing (old path), in alternating
rounds, median of 10 forwards each."""
import os, sys, time, warnings, torch, kvbound
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; batch = int(sys.argv[2]); rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
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
print("name,batch,round,variant,wall_ms,host_ms", flush=True)
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for _ in range(3): fwd()
    print(f"{name},{batch},0,unpatched,{wall():.3f},{host():.3f}", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = kvbound.patch(model, compress=False)
    for _ in range(3): fwd()
    print(f"{name},{batch},0,dense,{wall():.3f},{host():.3f}", flush=True)
    h.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = kvbound.patch(model, compress=True, calibrate_on=calibrate)
    for _ in range(3): fwd()
    for r in range(1, rounds + 1):
        for variant in ("new", "old", "new_nosplit"):
            os.environ["KVBOUND_SPLIT_LOWRANK"] = "off" if variant == "new_nosplit" else "auto"
            if variant != "old":
                h._encode_workspaces = {"k": {}, "v": {}}; h.time_encoding = False
            else:
                h._encode_workspaces = {"k": None, "v": None}; h.time_encoding = True
            for _ in range(2): fwd()
            print(f"{name},{batch},{r},compressed_{variant},{wall():.3f},{host():.3f}", flush=True)
    os.environ["KVBOUND_SPLIT_LOWRANK"] = "auto"
    h._encode_workspaces = {"k": {}, "v": {}}; h.time_encoding = False
    print(f"# retries {getattr(h, 'speculative_retries', '-')}", flush=True)
    h.undo()
