"""The split launch's merge at Borzoi and Enformer shapes: one kernel against the PyTorch operations, device time
(do_bench) and host time per call, and the largest difference between the two."""
import sys, time, torch, triton.testing
from kvbound.kernels import attention_compressed as kc
dev = torch.device("cuda")
rows = []
for name, b, h, n, dv in (("borzoi", 1, 8, 4096, 192), ("borzoi", 4, 8, 4096, 192), ("enformer", 1, 8, 1536, 192), ("enformer", 8, 8, 1536, 192)):
    def q_order(t): return t.transpose(1, 2).contiguous().transpose(1, 2)
    parts = [(q_order(torch.randn(b, h, n, dv, device=dev)), torch.randn(b, h, n, device=dev) * 3) for _ in range(2)]
    out = q_order(torch.empty(b, h, n, dv, device=dev, dtype=torch.bfloat16)); lse = torch.empty(b, h, n, device=dev)
    res = {}
    for path in ("kernel", "pytorch"):
        mergeable = kc._mergeable_in_one_kernel
        if path == "pytorch":
            kc._mergeable_in_one_kernel = lambda *a: False
        fresh = lambda: [(p.clone(), l.clone()) for p, l in parts]
        work = [fresh() for _ in range(60)]
        kc.merge_partials(fresh(), out, lse); torch.cuda.synchronize()
        res[path] = (out.float().clone(), lse.clone())
        ms = triton.testing.do_bench(lambda: kc.merge_partials(parts if path == "kernel" else fresh(), out, lse), rep=100) if path == "kernel" else None
        if path == "pytorch":  # the PyTorch path overwrites its partials: time it on fresh copies, minus the copies
            copy_ms = triton.testing.do_bench(fresh, rep=100)
            ms = triton.testing.do_bench(lambda: kc.merge_partials(fresh(), out, lse), rep=100) - copy_ms
        torch.cuda.synchronize()
        t = time.perf_counter()
        for w in work[:50]: kc.merge_partials(w, out, lse)
        host_us = (time.perf_counter() - t) / 50 * 1e6
        torch.cuda.synchronize()
        kc._mergeable_in_one_kernel = mergeable
        rows.append((name, b, path, ms, host_us))
        print(f"{name} b{b} {path:8s} device {ms:.4f} ms host {host_us:.1f} us", flush=True)
    d = (res["kernel"][0] - res["pytorch"][0]).abs().max().item()
    dl = (res["kernel"][1] - res["pytorch"][1]).abs().max().item()
    print(f"{name} b{b} max |kernel - pytorch| out {d:.3e} lse {dl:.3e}", flush=True)
with open(sys.argv[1], "w") as f:
    f.write("model,batch,path,device_ms,host_us\n")
    for r in rows: f.write(f"{r[0]},{r[1]},{r[2]},{r[3]:.4f},{r[4]:.1f}\n")
