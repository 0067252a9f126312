"""Host time per call of the pieces of a patched Enformer layer at batch 1, where the eager forward waits for the
host: torch ops, kvbound's Triton launches (through ``JITFunction.run``, through the compiled kernel, and the
argument binding alone), the finite checks, ``kvbound.attention`` and whole modules, unpatched and patched (K/V
dense, and compressed with the default configuration, calibrated, called inside a speculative block as a patched
forward calls them). Needs a CUDA GPU.

    python benchmarks/layer_host.py OUT.csv [--calls 200] [--rounds 3] [--commit C] [--cprofile DIR]

Each piece is called ``--calls`` times back to back without synchronising (the device work of every piece is far
shorter than its host path, so the time per call is the host's), in ``--rounds`` rounds that take turns; each row
holds the median over the rounds and every round's value. Host speed differs between machines and processes by
tens of per cent, so compare rows of one file, not across files. With ``--cprofile DIR`` the patched modules (dense and
compressed, inside their blocks as above) are also profiled by ``cProfile`` over ``--calls`` calls after the rounds:
``DIR/module_<variant>.txt``, the 45 functions with the most own time and the 45 with the most time inside them.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

FIELDS = ["piece", "host_us_per_call", "host_us_rounds", "calls", "gpu", "torch", "triton", "commit", "date"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--cprofile", type=Path, default=None, help="also profile the patched modules' host path here")
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        print("layer_host.py: expected --calls >= 1 and --rounds >= 1", file=sys.stderr)
        return 2

    import torch
    import triton
    from torch import nn
    from triton.runtime.jit import JITFunction

    import kvbound
    from kvbound import _checks
    from kvbound.bench.ports import PORT_MODELS
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.models import _ports

    if not torch.cuda.is_available():
        print("layer_host.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")

    # The last launch of each Triton kernel through JITFunction.run: (function, args, kwargs, grid, compiled kernel).
    launches: dict[str, tuple] = {}
    run = JITFunction.run

    def recording_run(self, *a, grid, warmup, **kw):
        kernel = run(self, *a, grid=grid, warmup=warmup, **kw)
        launches[self.fn.__name__] = (self, a, dict(kw), grid, kernel)
        return kernel

    JITFunction.run = recording_run

    def compiled_launch(name: str):
        """The recorded launch of ``name`` straight through its compiled kernel, and its argument binding alone."""
        fn, a, kw, grid, kernel = launches[name]
        binder = fn.device_caches[torch.cuda.current_device()][4]
        kw = {"debug": False, **kw}
        values = tuple(binder(*a, **kw)[0].values())
        g = (*grid, 1, 1)[:3]

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)

        return launch, lambda: binder(*a, **kw)

    pieces: dict[str, object] = {}
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    small = torch.randn(64, device=dev, dtype=bf16)
    x = torch.randn(1, 1536, 1536, device=dev, dtype=bf16)
    linear, norm = nn.Linear(1536, 512).to(dev), nn.LayerNorm(1536).to(dev)
    n = 128  # attention short enough that the device never holds the host back
    q, k = (torch.randn(1, 8, n, 64, device=dev, dtype=bf16) for _ in range(2))
    v = torch.randn(1, 8, n, 192, device=dev, dtype=bf16)
    keys = torch.randn(8, 2 * n - 1, 64, device=dev, dtype=bf16)
    u, w = torch.randn(8, 64, device=dev), torch.randn(8, 64, device=dev)
    checked = [q, k, v, keys, u, w]

    def attention():
        return kvbound.attention(q, k, v, scale=0.125, relative_keys=keys, relative_content_bias=u,
                                 relative_position_bias=w)  # fmt: skip

    pieces["torch.add (64 elements)"] = lambda: torch.add(small, small)
    pieces["nn.Linear 1536 -> 512 under autocast"] = lambda: linear(x)
    pieces["nn.LayerNorm 1536 under autocast"] = lambda: norm(x)
    pieces["kvbound LayerNorm kernel (_layer_norm_to)"] = lambda: _ports._layer_norm_to(norm, x, bf16)
    pieces["finite checks, 6 tensors: parts (a deferred block's)"] = lambda: _checks.largest_magnitude_parts(checked)
    pieces["finite checks, 6 tensors: stacked float64"] = lambda: _checks.largest_magnitudes(checked)
    pieces["kvbound.attention, relative keys, N 128 (deferred checks)"] = attention
    pieces["attention_dense_fwd, relative keys, N 128 (no checks)"] = lambda: attention_dense_fwd(
        q, k, v, None, 0.125, False, None, relative=(keys, u, w)
    )

    spec = next(s for s in PORT_MODELS if s.name == "enformer")
    model = spec.build().to(dev)
    attention_residual, feed_forward_residual = model.transformer[0][0], model.transformer[0][1]
    module = attention_residual.fn[1]

    calibration = spec.make_input(1, 2, dev)

    def calibrate(m: nn.Module) -> None:
        with torch.autocast("cuda", dtype=bf16):
            m(*calibration.args, **calibration.kwargs)

    def module_call():
        return module(x)

    def layer_call():
        return feed_forward_residual(attention_residual(x))

    with torch.no_grad(), torch.autocast("cuda", dtype=bf16), _checks.deferred_checks():
        for fn in pieces.values():  # compiles and tunes the kernels, records their launches
            fn()
        for name, label in (("_norm_rope_kernel", "LayerNorm kernel"), ("_attention_dense_fwd", "attention kernel")):
            launch, bind = compiled_launch(name)
            pieces[f"{label}: compiled kernel's run only"] = launch
            pieces[f"{label}: argument binding only"] = bind
        JITFunction.run = run
        rounds: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for variant in ("unpatched", "patched", "patched, compressed"):
                if variant != "unpatched":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        compress = variant != "patched"
                        handle = kvbound.patch(model, compress=compress, calibrate_on=calibrate if compress else None)
                calls = {**(pieces if variant == "unpatched" else {}),
                         f"Enformer attention module ({variant})": module_call,
                         f"Enformer layer: attention and feed-forward residuals ({variant})": layer_call}  # fmt: skip
                # A compressed module encodes K and V without a host read only inside a speculative block, which a
                # patched model's forward opens around its layers: the same here, around each batch of calls (its
                # read at the end, after the clock stops). A retry there (a forecast that changed) drops the round.
                speculative = variant == "patched, compressed"
                for label, fn in calls.items():
                    try:
                        with _checks._block(speculative=speculative):
                            for _ in range(5):
                                fn()
                        torch.cuda.synchronize()
                        with _checks._block(speculative=speculative):
                            start = time.perf_counter()
                            for _ in range(args.calls):
                                fn()
                            took = (time.perf_counter() - start) / args.calls * 1e6
                    except _checks.Retry as retry:
                        print(f"{label}: round {r + 1} dropped (speculative retry: {retry})", flush=True)
                    else:
                        rounds.setdefault(label, []).append(took)
                    torch.cuda.synchronize()
                if variant != "unpatched":
                    handle.undo()
            print(f"round {r + 1} of {args.rounds} done", flush=True)
        if args.cprofile is not None:
            args.cprofile.mkdir(parents=True, exist_ok=True)
            for variant in ("patched", "patched, compressed"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    compress = variant != "patched"
                    handle = kvbound.patch(model, compress=compress, calibrate_on=calibrate if compress else None)
                speculative = compress
                try:
                    with _checks._block(speculative=speculative):
                        for _ in range(5):
                            module_call()
                    torch.cuda.synchronize()
                    profiler = cProfile.Profile()
                    with _checks._block(speculative=speculative):
                        profiler.enable()
                        for _ in range(args.calls):
                            module_call()
                        profiler.disable()
                except _checks.Retry as retry:
                    print(f"cProfile of {variant}: dropped (speculative retry: {retry})", flush=True)
                else:
                    text = io.StringIO()
                    stats = pstats.Stats(profiler, stream=text)
                    print(f"{args.calls} calls of the Enformer attention module ({variant})", file=text)
                    stats.sort_stats("tottime").print_stats(45)
                    stats.sort_stats("cumulative").print_stats(45)
                    name = "module_" + variant.replace(", ", "_").replace(" ", "_") + ".txt"
                    (args.cprofile / name).write_text(text.getvalue())
                torch.cuda.synchronize()
                handle.undo()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for label, values in rounds.items():
            row = {"piece": label, "host_us_per_call": f"{statistics.median(values):.1f}",
                   "host_us_rounds": " ".join(f"{t:.1f}" for t in values), "calls": args.calls,
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "commit": args.commit, "date": time.strftime("%Y-%m-%d", time.gmtime())}  # fmt: skip
            writer.writerow(row)
            print(f"{label:66s} {row['host_us_per_call']:>9s} us  ({row['host_us_rounds']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
