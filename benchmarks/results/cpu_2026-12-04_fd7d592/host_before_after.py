"""Host time per speculative encode with every Triton launch stubbed, for the source tree on PYTHONPATH: the
five-kernel path (any commit) and, where the tree has it, the one-launch path. Prints one line per path and shape.

    PYTHONPATH=<tree>/src python host_before_after.py LABEL
"""
import inspect
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

import kvbound  # noqa: E402
from kvbound import _checks  # noqa: E402
from kvbound.codec import encode_triton as et  # noqa: E402


class Stub:
    def __getitem__(self, grid):
        return lambda *a, **k: None


for name in ("_coefficients_kernel", "_modes_kernel", "_layout_kernel", "_write_kernel", "_certify_kernel",
             "_one_pass_kernel"):
    if hasattr(et, name):
        setattr(et, name, Stub())
paths = [False, True] if "one_pass" in inspect.signature(et.encode_triton_deferred).parameters else [False]
config = kvbound.CompressionConfig(block_size=64)
gen = torch.Generator().manual_seed(0)
for d in (64, 192):
    x = torch.randn(1, 2, 256, d, generator=gen).half()
    basis = kvbound.calibrate(x, config)
    for one_pass in paths:
        kwargs = {"one_pass": one_pass} if len(paths) == 2 else {}
        rounds = []
        for _ in range(5):
            with _checks._block(speculative=True) as scope:
                for _ in range(20):
                    et.encode_triton_deferred(x, config, basis, scope, **kwargs)
                start = time.perf_counter()
                for _ in range(500):
                    et.encode_triton_deferred(x, config, basis, scope, **kwargs)
                rounds.append((time.perf_counter() - start) / 500 * 1e6)
        print(f"{sys.argv[1]} d={d} path={'one' if one_pass else 'five'} host_us_median={statistics.median(rounds):.1f} "
              f"rounds={' '.join(f'{r:.1f}' for r in rounds)}", flush=True)
