"""Where the time of a small ``kvbound.attention`` call goes: device time (``do_bench``), host time per call
(calls queued back to back without synchronising, so the host is the limit when it is slower than the device),
and the kernels one call launches (``torch.profiler``), for the compressed (residual-free rank 8) and dense paths
with the running and the bounded maximum.

    python benchmarks/host_floor.py OUT.csv [--lengths 4096,8192,16384] [--dims 64,128] [--profile OUT.txt]
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--profile", type=Path, default=None, help="also write each call's kernel list here")
    args = p.parse_args()

    import torch
    import triton.testing

    import kvbound
    from kvbound.bench import data as bench_data

    fields = ["d", "N", "provider", "bounded", "device_ms_p50", "host_ms_per_call", "kernels_per_call"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile = [] if args.profile is not None else None
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for d in (int(x) for x in args.dims.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                q, ck, cv, _ = bench_data.residual_free_case(
                    8, n, d, dtype=torch.bfloat16, device="cuda", block_size=128
                )
                kd, vd = ck.decompress().to(torch.bfloat16), cv.decompress().to(torch.bfloat16)
                for provider, operands in (("kvbound-compressed", (ck, cv)), ("kvbound-dense", (kd, vd))):
                    for setting in ("off", "on"):
                        os.environ["KVBOUND_BOUNDED_MAX"] = setting

                        def call(operands=operands, q=q):
                            return kvbound.attention(q, *operands)

                        ms = triton.testing.do_bench(call, quantiles=[0.5], rep=200)
                        torch.cuda.synchronize()
                        calls = 50
                        start = time.perf_counter()
                        for _ in range(calls):
                            call()
                        host = (time.perf_counter() - start) / calls * 1e3
                        torch.cuda.synchronize()
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                            call()
                            torch.cuda.synchronize()
                        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                        row = dict(d=d, N=n, provider=provider, bounded=setting, device_ms_p50=f"{ms:.4f}",
                                   host_ms_per_call=f"{host:.4f}", kernels_per_call=len(kernels))  # fmt: skip
                        writer.writerow(row)
                        f.flush()
                        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                        if profile is not None:
                            profile.append(f"== d={d} N={n} {provider} bounded={setting}")
                            profile += [f"  {e.name[:110]:110s} {e.device_time:9.1f} us" for e in kernels]
    if profile is not None:
        args.profile.write_text("\n".join(profile) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
