"""Borzoi at full size: the models suite's order (unpatched under bf16 autocast first), then patched."""
import torch, kvbound, warnings
from kvbound.bench.ports import PORT_MODELS
spec = next(s for s in PORT_MODELS if s.name == "borzoi")
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(1, 1, torch.device("cuda"))
att = [m for m in model.modules() if type(m).__name__ == "Attention"]
def run():
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return spec.output(model(*inputs.args, **inputs.kwargs)).double()
def rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
A16 = run()
pos = getattr(att[0], "positions", None)
print("port positions:", None if pos is None else (pos.dtype, tuple(pos.shape)), "same object in all layers:", len({id(getattr(m, "positions", None)) for m in att}))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = kvbound.patch(model, compress=False)
P16 = run()
print("runs:", [len(v[1]) if v[1] is not None else None for v in h._features_runs.values()])
print("rel patched vs unpatched (suite order)", rel(P16, A16), "max abs", (P16 - A16).abs().max().item())
h.undo()
import os
os.environ["KVBOUND_RELATIVE_RUNS"] = "0"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = kvbound.patch(model, compress=False)
R16 = run()
print("rel patched without runs vs unpatched", rel(R16, A16))
h.undo()
# the features computed without autocast, as the patch would compute them itself
port = __import__("sys").modules[type(att[0]).__module__]
f32 = port.get_positional_embed(4096, 4096, att[0].num_rel_pos_features, torch.device("cuda"))
with torch.autocast("cuda", dtype=torch.bfloat16):
    fac = port.get_positional_embed(4096, 4096, att[0].num_rel_pos_features, torch.device("cuda"))
print("features fp32 vs under autocast: dtypes", f32.dtype, fac.dtype, "max diff", (f32.double() - fac.double()).abs().max().item(), "cached vs fp32", None if pos is None else (pos.double() - f32.double()).abs().max().item())
