"""Host cost per call of the pieces of a patched Enformer layer at batch 1 (H200 host): torch ops, Triton launches
through JITFunction.run and straight through the compiled kernel, the finite checks, kvbound.attention, modules."""
import sys, time, math, warnings, torch, triton, triton.language as tl
import torch.nn as nn, torch.nn.functional as F
from triton.runtime.jit import JITFunction
import kvbound
from kvbound import _checks
from kvbound.models import _ports
from kvbound.bench.ports import PORT_MODELS
dev = torch.device("cuda")
rows = []
def per_call(label, fn, n=300):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n * 1e6
    rows.append((label, host, wall)); print(f"{label:58s} host {host:8.1f} us  wall {wall:8.1f} us", flush=True)

captured = {}
_orig = JITFunction.run
def spy(self, *args, grid, warmup, **kwargs):
    k = _orig(self, *args, grid=grid, warmup=warmup, **kwargs)
    captured[self.fn.__name__] = (self, args, dict(kwargs), grid, k)
    return k
JITFunction.run = spy

def direct(name):
    jit, args, kwargs, grid, kernel = captured[name]
    binder = jit.device_caches[torch.cuda.current_device()][4]
    kw = dict(kwargs); kw.setdefault("debug", False)
    bound, spec, opts = binder(*args, **kw)
    vals = tuple(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))
    def go():
        s = torch.cuda.current_stream().cuda_stream
        kernel.run(g[0], g[1], g[2], s, kernel.function, kernel.packed_metadata, None, None, None, *vals)
    def bind():
        return binder(*args, **kw)
    return go, bind, len(vals)

@triton.jit
def _copy(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)

with torch.no_grad():
    a = torch.randn(64, device=dev, dtype=torch.bfloat16)
    per_call("torch.add small", lambda: torch.add(a, a))
    per_call("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
    per_call("a.data_ptr()", lambda: a.data_ptr())
    b = torch.empty_like(a)
    per_call("triton copy kernel fn[grid]", lambda: _copy[(1,)](a, b, 64, BLOCK=64))
    go, bind, nargs = direct("_copy")
    per_call(f"triton copy kernel compiled.run ({nargs} args)", go)
    per_call("triton copy kernel binder only", bind)
    x = torch.randn(1, 1536, 1536, device=dev, dtype=torch.bfloat16)
    lin = nn.Linear(1536, 512).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        per_call("nn.Linear 1536->512 under autocast (fp32 weight)", lambda: lin(x))
    wb = lin.weight.to(torch.bfloat16); bb = lin.bias.to(torch.bfloat16)
    per_call("F.linear bf16 weight", lambda: F.linear(x, wb, bb))
    ln = nn.LayerNorm(1536).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        per_call("nn.LayerNorm under autocast", lambda: ln(x))
        per_call("kvbound _layer_norm_to (Triton)", lambda: _ports._layer_norm_to(ln, x, torch.bfloat16))
    go, bind, nargs = direct("_norm_rope_kernel")
    per_call(f"norm_rope compiled.run ({nargs} args)", go)
    per_call("norm_rope binder only", bind)
    # attention at batch 1, Enformer heads, short length so the device is not the limit
    n = 128
    q = torch.randn(1, 8, n, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, n, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 8, n, 192, device=dev, dtype=torch.bfloat16)
    rk = torch.randn(8, 2 * n - 1, 64, device=dev, dtype=torch.bfloat16)
    u = torch.randn(8, 64, device=dev); vb = torch.randn(8, 64, device=dev)
    call = lambda: kvbound.attention(q, k, v, scale=0.125, relative_keys=rk, relative_content_bias=u, relative_position_bias=vb)
    with _checks.deferred_checks():
        per_call("kvbound.attention relative (deferred checks)", call)
    from kvbound.kernels.attention_dense import attention_dense_fwd
    rel = (rk, u.contiguous(), vb.contiguous())
    per_call("attention_dense_fwd relative", lambda: attention_dense_fwd(q, k, v, None, 0.125, False, None, relative=rel))
    go, bind, nargs = direct("_attention_dense_fwd")
    per_call(f"attention kernel compiled.run ({nargs} args)", go)
    per_call("attention kernel binder only", bind)
    ts = [q, k, v, rk, u, vb]
    per_call("largest_magnitudes(6 tensors)", lambda: _checks.largest_magnitudes(ts))
    per_call("_foreach_norm(4 bf16) only", lambda: torch._foreach_norm(ts[:4], math.inf))
    per_call("_foreach_norm(2 fp32) only", lambda: torch._foreach_norm(ts[4:], math.inf))
    # a real Enformer layer at batch 1
    spec = next(s for s in PORT_MODELS if s.name == "enformer")
    torch.manual_seed(0)
    model = spec.build().to(dev)
    layer = model.transformer[0]
    attn_res, ff_res = layer[0], layer[1]
    attn = attn_res.fn[1]
    xs = torch.randn(1, 1536, 1536, device=dev, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        per_call("enformer attention module, unpatched", lambda: attn(xs), n=100)
        per_call("enformer layer (attn + ff residuals), unpatched", lambda: ff_res(attn_res(xs)), n=100)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = kvbound.patch(model, compress=False)
        with _checks.deferred_checks():
            per_call("enformer attention module, patched (deferred)", lambda: attn(xs), n=100)
            per_call("enformer layer, patched (deferred)", lambda: ff_res(attn_res(xs)), n=100)
            per_call("enformer ff residual, patched (deferred)", lambda: ff_res(xs), n=100)
out = sys.argv[1]
with open(out, "w") as f:
    f.write("label,host_us,wall_us\n")
    for r in rows: f.write(f"\"{r[0]}\",{r[1]:.2f},{r[2]:.2f}\n")
