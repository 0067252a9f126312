"""The deferred Triton encoder (what a patched model's compressed forward runs for each K and V) in five launches
and in one (``KVBOUND_ONE_PASS_ENCODE``), side by side on the models' K/V shapes.

    python benchmarks/one_pass_encode.py OUT.csv [--shapes enformer borzoi] [--batches 1 2 4 8] [--calls 100]
        [--rounds 3] [--commit C]
    python benchmarks/one_pass_encode.py OUT.csv --cpu [--calls 300] [--rounds 3]

Shapes: Enformer K ``[B, 8, 1536, 64]`` and V ``[B, 8, 1536, 192]``, Borzoi K ``[B, 8, 4096, 64]`` and V ``[B, 8,
4096, 192]``, bf16, drawn by ``kvbound.bench.encoder.encoder_inputs`` (the attention suite's structured K/V),
encoded with the default ``CompressionConfig()`` and a basis calibrated on another draw. Per shape, batch and path
(``five``, ``one``), the two paths taking turns in each of ``--rounds`` rounds, medians over the rounds:

- ``host_us``: ``--calls`` encodes queued back to back inside one speculative block (nothing is read from the
  device before the block ends), wall time per call: what the host spends on one encode when it does not wait;
- ``device_us``: CUDA events around the same calls, per call (the host sets the pace when ``host_us`` is larger);
- ``kernels``: device kernels one call launches (``torch.profiler``), fills and copies included;
- ``same``: both paths store the same coefficients, modes, widths and steps bit for bit, decode to the same tensor
  and report the same sizes at the block's end (checked once per shape and batch).

``--cpu``: no GPU. The Triton launches are stubbed (counted, not run), so ``host_us`` is the host's Python, checks
and allocations per encode, on small shapes (``[1, 2, 256, 64]`` and ``[1, 2, 256, 192]``); ``kernels`` is the
number of Triton launches; ``same`` is checked by running both paths in Triton's interpreter once per shape.

``--sm90``: no GPU either. Each kernel of both paths is compiled for sm_90 as an Enformer K and V encode at batch 1
would launch it (``benchmarks/static_regs.py``'s compile instead of launch), and the rows hold its registers per
thread, stack bytes and spill instructions (``LDL``/``STL``), shared memory and ``HGMMA`` count instead (columns
``kernel``, ``head_dim``, ``path``, ...). Register allocation depends on the Triton version (``triton`` column).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

FIELDS = ["shape", "batch", "tensor", "path", "host_us", "host_us_rounds", "device_us", "kernels", "same", "calls",
          "rounds", "device", "torch", "triton", "commit", "date"]  # fmt: skip
SM90_FIELDS = ["kernel", "head_dim", "path", "registers", "stack_bytes", "ldl", "stl", "shared_bytes", "hgmma",
               "sass_instructions", "triton", "commit"]  # fmt: skip
SHAPES = {"enformer": 1536, "borzoi": 4096}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--calls", type=int, default=None, help="encodes per round and path (default 100; 300 on --cpu)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--cpu", action="store_true", help="launches stubbed: the host's own cost per encode")
    p.add_argument("--sm90", action="store_true", help="compile both paths for sm_90: registers and spills")
    args = p.parse_args(argv)
    if args.sm90:
        return _sm90(args.out, args.commit)
    calls = args.calls if args.calls is not None else (300 if args.cpu else 100)
    if calls < 1 or args.rounds < 1 or min(args.batches) < 1:
        print("one_pass_encode.py: expected --calls, --rounds and --batches >= 1", file=sys.stderr)
        return 2
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    if not args.cpu and not torch.cuda.is_available():
        print("one_pass_encode.py: needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    cases = _cpu_cases() if args.cpu else _gpu_cases(args.shapes, args.batches)
    device = "cpu (launches stubbed)" if args.cpu else torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for label, batch, tensor, x, config, basis in cases:
            same = _same(x, config, basis)
            measured = _measure_cpu if args.cpu else _measure_gpu
            results = measured(x, config, basis, calls, args.rounds)
            for path, (hosts, device_us, kernels) in results.items():
                row = {"shape": label, "batch": batch, "tensor": tensor, "path": path,
                       "host_us": f"{statistics.median(hosts):.1f}",
                       "host_us_rounds": " ".join(f"{h:.1f}" for h in hosts),
                       "device_us": "" if device_us is None else f"{device_us:.1f}", "kernels": kernels,
                       "same": same, "calls": calls, "rounds": args.rounds, "device": device,
                       "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit,
                       "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
                writer.writerow(row)
                f.flush()
                print(" ".join(f"{k}={row[k]}" for k in FIELDS[:9]), flush=True)
            if not same:
                print(f"one_pass_encode.py: {label} B={batch} {tensor}: the two paths differ", file=sys.stderr)
    return 0


def _sm90(out: Path, commit: str) -> int:
    """Both paths' kernels compiled for sm_90 (Enformer's K and V at batch 1), one row per kernel."""
    os.environ.pop("TRITON_INTERPRET", None)  # before triton.jit wraps kvbound's kernels
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import static_regs  # benchmarks/static_regs.py
    import torch
    import triton

    import kvbound
    from kvbound import _checks
    from kvbound.codec.encode_triton import encode_triton_deferred

    compiled = static_regs.compile_instead_of_launch()
    config = kvbound.CompressionConfig()
    rows = []
    for d in (64, 192):
        x = torch.randn(1, 8, 1536, d, generator=torch.Generator().manual_seed(d)).to(torch.bfloat16)
        basis = kvbound.calibrate(x.float(), config)
        for one_pass in (False, True):
            compiled.clear()
            with _checks._block(speculative=True) as scope:  # nothing ran: the summary reads as zeros
                encode_triton_deferred(x, config, basis, scope, one_pass=one_pass)
            for kernel, _ in compiled:
                usage = static_regs.cubin_usage(kernel.asm["cubin"])
                row = {"kernel": kernel.name, "head_dim": d, "path": "one" if one_pass else "five", **usage,
                       "shared_bytes": kernel.metadata.shared, "triton": triton.__version__, "commit": commit}
                rows.append(row)
                print(" ".join(f"{k}={row[k]}" for k in SM90_FIELDS[:9]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SM90_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return 0


def _gpu_cases(shapes, batches):
    import torch

    import kvbound
    from kvbound.bench.encoder import encoder_inputs
    from kvbound.bench.shapes import AttentionShape

    config = kvbound.CompressionConfig()
    for name in shapes:
        for batch in batches:
            shape = AttentionShape(name=f"{name}-b{batch}", batch=batch, q_heads=8, kv_heads=8, q_len=SHAPES[name],
                                   kv_len=SHAPES[name], head_dim_qk=64, head_dim_v=192, dtype="bfloat16")
            drawn = encoder_inputs(shape, torch.device("cuda"), block_size=config.block_size)
            for tensor in ("k", "v"):
                basis = kvbound.calibrate(drawn[f"{tensor}_sample"], config)
                yield name, batch, tensor, drawn[tensor], config, basis


def _cpu_cases():
    import torch

    import kvbound

    config = kvbound.CompressionConfig(block_size=64)
    gen = torch.Generator().manual_seed(0)
    for tensor, d in (("k", 64), ("v", 192)):
        x = torch.randn(1, 2, 256, 8, generator=gen) @ torch.randn(8, d, generator=gen) / 3
        x = (x + 0.01 * torch.randn(1, 2, 256, d, generator=gen)).to(torch.float16)
        yield "small", 1, tensor, x, config, kvbound.calibrate(x, config)


def _encode(x, config, basis, one_pass, scope):
    from kvbound.codec.encode_triton import encode_triton_deferred

    return encode_triton_deferred(x, config, basis, scope, name="x", one_pass=one_pass)


def _same(x, config, basis) -> bool:
    """Both paths store the same values (the one-pass layout aside) and report the same sizes."""
    import torch

    from kvbound import _checks
    from kvbound.codec.encode_triton import encode_triton_deferred

    stored = {}
    for one_pass in (False, True):
        sizes: list[tuple] = []
        with _checks._block(speculative=True) as scope:
            ckv = encode_triton_deferred(x, config, basis, scope, sizes=lambda *a, into=sizes: into.append(a),
                                         one_pass=one_pass)
            stored[one_pass] = (ckv, sizes, ckv.decompress())
    (five, five_sizes, five_x), (one, one_sizes, one_x) = stored[False], stored[True]
    fields = all(torch.equal(getattr(five, f), getattr(one, f)) for f in ("coeffs", "mode", "bits", "scale"))
    return fields and five_sizes == one_sizes and torch.equal(five_x, one_x)


def _measure_gpu(x, config, basis, calls, rounds):
    import torch

    from kvbound import _checks

    hosts = {False: [], True: []}
    device = {False: [], True: []}
    with _checks._block(speculative=True) as scope:  # compile and warm both paths
        for one_pass in (False, True):
            for _ in range(5):
                _encode(x, config, basis, one_pass, scope)
    torch.cuda.synchronize()
    for _ in range(rounds):
        for one_pass in (False, True):
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with _checks._block(speculative=True) as scope:
                start_event.record()
                start = time.perf_counter()
                for _ in range(calls):
                    _encode(x, config, basis, one_pass, scope)
                hosts[one_pass].append((time.perf_counter() - start) / calls * 1e6)
                end_event.record()
            torch.cuda.synchronize()
            device[one_pass].append(start_event.elapsed_time(end_event) / calls * 1e3)
    kernels = {}
    for one_pass in (False, True):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            with _checks._block(speculative=True) as scope:
                _encode(x, config, basis, one_pass, scope)
            torch.cuda.synchronize()
        kernels[one_pass] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {("one" if p else "five"): (hosts[p], statistics.median(device[p]), kernels[p]) for p in (False, True)}


def _measure_cpu(x, config, basis, calls, rounds):
    from kvbound import _checks
    from kvbound.codec import encode_triton as et

    launches = [0]

    class Stub:  # counts the launch, runs nothing
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[0] += 1

            return launch

    names = ("_coefficients_kernel", "_modes_kernel", "_layout_kernel", "_write_kernel", "_certify_kernel",
             "_one_pass_kernel")  # fmt: skip
    saved = {name: getattr(et, name) for name in names}
    hosts = {False: [], True: []}
    kernels = {}
    try:
        for name in names:
            setattr(et, name, Stub())
        for _ in range(rounds):
            for one_pass in (False, True):
                with _checks._block(speculative=True) as scope:
                    for _ in range(5):
                        _encode(x, config, basis, one_pass, scope)
                    launches[0] = 0
                    start = time.perf_counter()
                    for _ in range(calls):
                        _encode(x, config, basis, one_pass, scope)
                    hosts[one_pass].append((time.perf_counter() - start) / calls * 1e6)
                    kernels[one_pass] = launches[0] // calls
    finally:
        for name, kernel in saved.items():
            setattr(et, name, kernel)
    return {("one" if p else "five"): (hosts[p], None, kernels[p]) for p in (False, True)}


if __name__ == "__main__":
    sys.exit(main())
