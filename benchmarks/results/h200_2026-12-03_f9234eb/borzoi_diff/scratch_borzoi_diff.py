"""Borzoi at full size, random weights: where does the patched output part from the unpatched one?"""
import sys, torch, kvbound, warnings
from kvbound.bench.ports import PORT_MODELS
spec = next(s for s in PORT_MODELS if s.name == "borzoi")
torch.manual_seed(0)
model = spec.build().cuda()
inputs = spec.make_input(1, 1, torch.device("cuda"))
blocks = list(model.transformer)
def run(autocast):
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, o: seen.append(o.detach().double().clone())) for b in blocks]
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = spec.output(model(*inputs.args, **inputs.kwargs)).double()
    finally:
        for h in hooks: h.remove()
    return out, seen
def rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
A32, a32 = run(False)
A16, a16 = run(True)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = kvbound.patch(model, compress=False)
P16, p16 = run(True)
P32, p32 = run(False)
h.undo()
import os
os.environ["KVBOUND_FUSED_NORM"] = "0"; os.environ["KVBOUND_FUSED_POOL"] = "0"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = kvbound.patch(model, compress=False)
Q16, q16 = run(True)
h.undo()
print("output |ref|max", A32.abs().max().item())
print("rel: unpatched bf16 vs fp32", rel(A16, A32))
print("rel: patched bf16 vs unpatched fp32", rel(P16, A32), " vs unpatched bf16", rel(P16, A16))
print("rel: patched fp32 vs unpatched fp32", rel(P32, A32))
print("rel: patched bf16 (no fused norm/pool) vs unpatched bf16", rel(Q16, A16))
for i in range(len(blocks)):
    print(f"block {i}: A16/A32 {rel(a16[i], a32[i]):.3e}  P16/A32 {rel(p16[i], a32[i]):.3e}  P32/A32 {rel(p32[i], a32[i]):.3e}  P16/A16 {rel(p16[i], a16[i]):.3e}  Q16/A16 {rel(q16[i], a16[i]):.3e}  |A32| {a32[i].abs().max().item():.3g}")
