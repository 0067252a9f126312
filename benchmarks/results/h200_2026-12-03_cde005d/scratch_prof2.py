"""Device time per kernel of the patched dense forward (graph replays), and per aten op with input shapes (eager)."""
import sys, torch, kvbound, warnings
from torch.profiler import profile, ProfilerActivity
from kvbound.bench.ports import PORT_MODELS
name = sys.argv[1]; batch = int(sys.argv[2])
spec = next(s for s in PORT_MODELS if s.name == name)
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(batch, 1, torch.device("cuda"))
key = None
def top(prof, n, label, group=False):
    global key
    ka = prof.key_averages(group_by_input_shape=group)
    key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    rows = sorted(ka, key=lambda e: -getattr(e, key))
    total = sum(getattr(e, key) for e in ka) / 5 / 1e3
    print(f"=== {name} b{batch} {label}: device time per forward {total:.3f} ms")
    for e in rows[:n]:
        t = getattr(e, key) / 5 / 1e3
        if t < 0.02: break
        shapes = f"  {str(e.input_shapes)[:140]}" if group else ""
        print(f"{t:8.3f} ms {e.count//5:5d}x  {e.key[:110]}{shapes}")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = kvbound.patch(model, compress=False)
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    cap = kvbound.capture(model, *inputs.args, kwargs=inputs.kwargs)
    for _ in range(3): cap(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5): cap(*inputs.args, **inputs.kwargs)
        torch.cuda.synchronize()
    top(prof, 40, "patch-dense graph kernels")
    del cap
    for _ in range(2): model(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(5): model(*inputs.args, **inputs.kwargs)
        torch.cuda.synchronize()
    top(prof, 30, "patch-dense eager aten ops by input shape", group=True)
