"""The compressed kernel with and without its general-run loop, with its value columns in one padded part or in two
(``dv_parts``), on K/V whose residual blocks are all packed at the configured byte width (the uniform loop's data),
beside kvbound's dense kernel on the decompressed K/V.

    python benchmarks/general_runs_ab.py OUT.csv [--cases alphagenome-packed8 ...] [--commit SHA]
    python benchmarks/general_runs_ab.py OUT.csv --cpu-smoke      # tiny shapes in Triton's interpreter, no timing

K and V are built in the storage format (``benchmarks/residual_diag.py``'s ``build_compressed``: every block packed
at 8 or 4 bits, random codes over their whole range, coefficients on an orthonormal rank-8 basis). Providers:
``general`` (``attention_compressed_fwd`` as it compiles for any data: uniform runs, general runs, the masked
tail's general decode), ``uniform-only`` (``general_runs=False``: no general loop, the tail decodes as the uniform
runs do), each also as ``...+dv-split`` (``dv_split=True``: dv 192 as 128 + 64 columns; the others pass
``dv_split=False``, one part of 256), and ``dense`` (``attention_dense_fwd`` on ``decompress()``'d K/V, its default
value parts). Every output is compared with
``reference_attention`` (float64) on the first 128 query rows, against twice plain bf16 attention's error on the
decompressed K/V plus a floor; only then timed (``triton.testing.do_bench``, median, p20, p80). Tiles are pinned
(one per case and compiled variant) and compiled first by child processes in parallel, so the measuring process
reads them from Triton's cache.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from residual_diag import LAYOUTS, build_compressed  # noqa: E402

from kvbound import reference_attention  # noqa: E402
from kvbound.kernels.attention_compressed import CompressedOperand, attention_compressed_fwd  # noqa: E402
from kvbound.kernels.attention_dense import attention_dense_fwd  # noqa: E402

SCRIPT = Path(__file__).resolve()
# name: (layout, query heads, K/V heads, dk, dv, N, tile bias, soft-cap, compressed tiles)
CASES = {
    "alphagenome-packed8": ("packed8", 8, 1, 128, 192, 8192, 16, 5.0, ("128x64x8x3", "64x64x4x3")),
    "alphagenome-packed4": ("packed4", 8, 1, 128, 192, 8192, 16, 5.0, ("128x64x8x3",)),
    "d128-packed4": ("packed4", 8, 8, 128, 128, 16384, 0, None, ("128x64x8x3",)),
    "d64-packed4": ("packed4", 8, 8, 64, 64, 16384, 0, None, ("64x64x4x3",)),
}
SMOKE = {
    "alphagenome-packed8": ("packed8", 4, 1, 32, 48, 256, 16, 5.0, ("32x16x4x1",)),
    "d64-packed4": ("packed4", 2, 2, 32, 32, 256, 0, None, ("32x16x4x1",)),
}
DENSE_TILE = "128x64x8x3"
PROVIDERS = ("general", "uniform-only", "general+dv-split", "uniform-only+dv-split")
ROWS = 128
FLOOR = 2e-3
FIELDS = ["case", "provider", "tile", "status", "err", "tolerance", "ms_p20", "ms_p50", "ms_p80", "first_call_s",
          "device", "commit"]  # fmt: skip


def tile(text: str) -> dict:
    m, n, w, s = map(int, text.split("x"))
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}


def inputs(case: str, smoke: bool, device: str) -> dict:
    layout, hq, hkv, dk, dv, n, bias_tile, softcap, _ = (SMOKE if smoke else CASES)[case]
    block = 16 if smoke else 128
    g = torch.Generator().manual_seed(0)

    def operand(d: int, seed: int):
        basis = torch.linalg.qr(torch.randn(hkv, d, 8, generator=g))[0].transpose(1, 2).contiguous()
        return build_compressed(LAYOUTS[layout], heads=hkv, seq_len=n, head_dim=d, dtype=dtype(smoke),
                                device=device, basis=basis, value_seed=seed, block_size=block)  # fmt: skip

    ck, cv = operand(dk, 1), operand(dv, 2)
    q = torch.randn(1, hq, n, dk, generator=g).to(device=device, dtype=dtype(smoke))
    bias = None
    if bias_tile:
        bias = (torch.randn(1, hq, n // bias_tile, n // bias_tile, generator=g) * 0.5).to(device)
    return dict(q=q, ck=ck, cv=cv, bias=bias, bias_tile=bias_tile or 1, softcap=softcap, scale=dk**-0.5)


def dtype(smoke: bool) -> torch.dtype:
    # The interpreter's tl.dot on bfloat16 operands is wrong; the CPU smoke runs float16.
    return torch.float16 if smoke else torch.bfloat16


def call(provider: str, x: dict, tile_text: str):
    if provider == "dense":
        k, v = x["dense"]
        return lambda: attention_dense_fwd(x["q"], k, v, x["bias"], x["scale"], False, x["softcap"],
                                           config=tile(tile_text), bias_tile=x["bias_tile"])[0]  # fmt: skip
    k_op, v_op = CompressedOperand.from_compressed(x["ck"]), CompressedOperand.from_compressed(x["cv"])
    loop, _, parts = provider.partition("+")
    return lambda: attention_compressed_fwd(
        x["q"], k_op, v_op, x["bias"], x["scale"], False, x["softcap"], residual=(True, True),
        config=tile(tile_text), bias_tile=x["bias_tile"], split=False, general_runs=loop == "general",
        dv_split=parts == "dv-split",
    )[0]  # fmt: skip


def expanded_bias(x: dict, rows: int) -> torch.Tensor | None:
    if x["bias"] is None:
        return None
    t = x["bias_tile"]
    return x["bias"][:, :, : rows // t].repeat_interleave(t, 2).repeat_interleave(t, 3)


def plain_error(x: dict, reference: torch.Tensor, rows: int) -> float:
    """Plain attention in the input dtype on the decompressed K/V (first rows), against the float64 reference."""
    k, v = x["dense"]
    group = x["q"].shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = (x["q"][:, :, :rows] @ k.transpose(-1, -2)) * x["scale"]
    bias = expanded_bias(x, rows)
    logits = logits.float() + (bias if bias is not None else 0.0)
    if x["softcap"] is not None:
        logits = x["softcap"] * torch.tanh(logits / x["softcap"])
    out = torch.softmax(logits, -1).to(v.dtype) @ v
    return float((out.double() - reference).abs().max())


def variants(cases: list[str], smoke: bool) -> list[tuple[str, str, str]]:
    table = SMOKE if smoke else CASES
    out = []
    for case in cases:
        for t in table[case][8]:
            out += [(case, provider, t) for provider in PROVIDERS]
        out.append((case, "dense", table[case][8][0] if smoke else DENSE_TILE))
    return out


def warm(job: tuple[str, str, str], commit: str) -> None:
    """Compile one variant in a child process (Triton's cache then serves the measuring process)."""
    case, provider, t = job
    subprocess.run([sys.executable, str(SCRIPT), os.devnull, "--warm-child", case, provider, t, "--commit", commit],
                   check=False, timeout=600, capture_output=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--cases", nargs="+", default=None)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--warm-child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available():
        print("needs a CUDA device (or --cpu-smoke)", file=sys.stderr)
        return 2
    table = SMOKE if smoke else CASES
    if args.warm_child:
        case, provider, t = args.warm_child
        x = inputs(case, smoke, device)
        if provider == "dense":
            x["dense"] = (x["ck"].decompress().to(x["q"].dtype), x["cv"].decompress().to(x["q"].dtype))
        call(provider, x, t)()
        torch.cuda.synchronize()
        return 0
    cases = args.cases or list(table)
    for case in cases:
        if case not in table:
            p.error(f"--cases: expected names from {sorted(table)}, got {case!r}")
    jobs = variants(cases, smoke)
    if not smoke:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(12, len(jobs))) as pool:
            list(pool.map(lambda job: warm(job, args.commit), jobs))
        print(f"compiled {len(jobs)} variants in child processes: {time.perf_counter() - start:.1f} s", flush=True)
    name = "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name()
    failures = 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for case in cases:
            x = inputs(case, smoke, device)
            k, v = x["ck"].decompress(), x["cv"].decompress()  # the decoded values, as the compressed kernel reads them
            x["dense"] = (k.to(x["q"].dtype), v.to(x["q"].dtype))
            rows = min(ROWS, x["q"].shape[2])
            reference = reference_attention(x["q"][:, :, :rows], k, v, scale=x["scale"],
                                            bias=expanded_bias(x, rows), softcap=x["softcap"])  # fmt: skip
            tolerance = 2 * plain_error(x, reference, rows) + FLOOR
            for case_name, provider, t in (job for job in jobs if job[0] == case):
                row = {"case": case_name, "provider": provider, "tile": t, "device": name, "commit": args.commit,
                       "tolerance": f"{tolerance:.3e}"}  # fmt: skip
                fn = call(provider, x, t)
                begin = time.perf_counter()
                out = fn()
                if not smoke:
                    torch.cuda.synchronize()
                row["first_call_s"] = f"{time.perf_counter() - begin:.2f}"
                err = float((out[:, :, :rows].double() - reference).abs().max())
                row["err"] = f"{err:.3e}"
                ok = math.isfinite(err) and err <= tolerance
                row["status"] = "ok" if ok else "wrong"
                failures += not ok
                if ok and not smoke:
                    import triton.testing

                    p20, p50, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
                    row.update(ms_p20=f"{p20:.4f}", ms_p50=f"{p50:.4f}", ms_p80=f"{p80:.4f}")
                writer.writerow(row)
                f.flush()
                print(" ".join(f"{key}={value}" for key, value in row.items() if key not in ("device", "commit")),
                      flush=True)  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
