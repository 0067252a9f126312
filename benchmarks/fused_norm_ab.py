"""Patched AlphaGenome with and without the fused norm (``KVBOUND_FUSED_NORM``), in one process: whole forward and
attention-module time, and the output against the unpatched port.

The models suite's AlphaGenome (full size, random weights, 1 Mbp input, bf16 autocast, ``no_grad``); variants in
turn: ``unpatched``, ``patch-dense`` (LayerNorm, RoPE and cast of q, k, v fused, the default),
``patch-dense-port-norms`` (``KVBOUND_FUSED_NORM=0``: the port's LayerNorm and ``apply_rope``), then ``patch-dense``
again (``repeat`` 2), so that a drift of the machine shows. Forward: median of ``--repeats`` forwards (CUDA events)
after two warm-up forwards; attention: the attention modules' forwards summed (``AttentionTimer``, median of 3
forwards).

    python benchmarks/fused_norm_ab.py OUT.csv [--batch 1] [--repeats 5] [--commit SHA]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

FIELDS = ["model", "batch", "variant", "repeat", "forward_ms", "attention_ms", "max_abs_diff", "rel_diff", "commit"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import kvbound
    from kvbound.bench.ports import PORT_MODELS, AttentionTimer, _forward

    spec = next(s for s in PORT_MODELS if s.name == "alphagenome")
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = spec.build().to(device)
    inputs = spec.make_input(args.batch, 1, device)
    modules = [m for m in model.modules() if type(m) is spec.attention_class()]

    def measure() -> tuple[float, float, torch.Tensor]:
        for _ in range(2):
            _forward(spec, model, inputs, device)
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = _forward(spec, model, inputs, device)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        attention = []
        with AttentionTimer(modules, device) as timer:
            for _ in range(3):
                timer.reset()
                _forward(spec, model, inputs, device)
                attention.append(timer.total_ms())
        return statistics.median(times), statistics.median(attention), out.float()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        forward, attention, reference = measure()
        rows = [("unpatched", 1, forward, attention, None)]
        handle = kvbound.patch(model, compress=False)
        previous = os.environ.get("KVBOUND_FUSED_NORM")
        try:
            for variant, repeat, setting in (("patch-dense", 1, "1"), ("patch-dense-port-norms", 1, "0"),
                                             ("patch-dense", 2, "1")):  # fmt: skip
                os.environ["KVBOUND_FUSED_NORM"] = setting
                rows.append((variant, repeat, *measure()))
        finally:
            if previous is None:
                os.environ.pop("KVBOUND_FUSED_NORM", None)
            else:
                os.environ["KVBOUND_FUSED_NORM"] = previous
            handle.undo()
        for variant, repeat, forward, attention, out in rows:
            diff = {} if out is None else {
                "max_abs_diff": f"{(out - reference).abs().max().item():.3e}",
                "rel_diff": f"{((out - reference).norm() / reference.norm()).item():.3e}",
            }  # fmt: skip
            row = {"model": spec.name, "batch": args.batch, "variant": variant, "repeat": repeat,
                   "forward_ms": f"{forward:.2f}", "attention_ms": f"{attention:.3f}", **diff, "commit": args.commit}
            writer.writerow(row)
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
