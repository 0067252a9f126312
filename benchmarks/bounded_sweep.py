# Device command (one call, about 4 minutes with compiles): PYTHONPATH=src python3 benchmarks/bounded_sweep.py OUT.csv
# (or `bash benchmarks/h200.sh bounded`)
"""The bounded maximum against the running maximum, over the sequence length: where each kernel's bounded variant
wins, so that the default thresholds (``attention_compressed.BOUNDED_MIN_KEYS``, ``attention_dense.BOUNDED_MIN_KEYS``)
rest on measurements.

For each head dim and length: residual-free compressed K/V (rank 8, every block low rank only, as ``lowrank-r8``
of ``kvbound bench``: ``kvbound.bench.data``'s generator, a shared basis calibrated on another draw, tau raised
until no block keeps a residual), timed through ``kvbound.attention`` (host preparation included, as a user calls
it) with ``KVBOUND_BOUNDED_MAX=on`` and ``off``; the dense kernel on the decompressed K/V the same two ways; cuDNN
SDPA on the same decompressed K/V. Column ``launched`` says which variant the launcher actually took. Every
call's error against float64 on the decompressed K/V (first 128 queries of every head; the compressed rows against
its float32 reconstruction, the others against that rounded to bf16, the K/V each reads) is in its row, cuDNN's
beside it. CSV columns: ``d, N, provider, bounded, launched, status, ms_p20,
ms_p50, ms_p80, vs_cudnn, vs_running_max, err_max, err_cudnn, reason``; with ``--plot`` a figure of the speed-ups.

CPU check (Triton's interpreter, tiny sizes, float32, no timing)::

    python benchmarks/bounded_sweep.py --cpu-smoke /tmp/bounded_sweep.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

FIELDS = ["d", "N", "provider", "bounded", "launched", "status", "ms_p20", "ms_p50", "ms_p80", "vs_cudnn",
          "vs_running_max", "err_max", "err_cudnn", "reason"]  # fmt: skip
LENGTHS = (4096, 8192, 16384, 32768, 65536)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default=",".join(str(n) for n in LENGTHS))
    p.add_argument("--dims", default="64,128")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--plot", type=Path, default=None, help="also draw the speed-ups into this PNG")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes in Triton's interpreter, no timing")
    args = p.parse_args()
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    import torch
    import triton.testing
    from tqdm import tqdm

    import kvbound
    from kvbound.bench import data as bench_data
    from kvbound.kernels import attention_compressed, attention_dense
    from kvbound.reference import reference_attention

    # Which variant each call launched (the BOUNDED compile-time flag), so that a row never claims the bounded
    # maximum where the launcher did not take it: every compressed launch passes launch_tuned; each dense call
    # signature builds one plan (the setting is part of its key).
    launched: list[bool] = []
    launch_tuned, dense_plan = attention_compressed.launch_tuned, attention_dense._plan

    def spy_launch(kernel, tuned, grid, args_, constexprs, tune_key, config):
        launched.append(bool(constexprs.get("BOUNDED")))
        return launch_tuned(kernel, tuned, grid, args_, constexprs, tune_key, config)

    def spy_plan(*args_, **kwargs):
        plan = dense_plan(*args_, **kwargs)
        launched.append(bool(plan.constexprs.get("BOUNDED")))
        return plan

    attention_compressed.launch_tuned, attention_dense._plan = spy_launch, spy_plan

    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    # bf16 on the GPU; float32 in the interpreter (whose bf16 products are wrong; float16 never takes the bound)
    dtype = torch.float32 if smoke else torch.bfloat16
    lengths = (256, 384) if smoke else tuple(int(x) for x in args.lengths.split(","))
    dims = tuple(int(x) for x in args.dims.split(","))
    heads, block = (2 if smoke else args.heads), 128
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("KVBOUND_BOUNDED_MAX")
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()

        def emit(row):
            writer.writerow({k: row.get(k, "") for k in FIELDS})
            f.flush()
            rows.append(row)
            tqdm.write(" ".join(f"{k}={row.get(k, '')}" for k in FIELDS if row.get(k, "") != ""))

        def timed(fn):
            if smoke:
                return None
            return triton.testing.do_bench(fn, quantiles=[0.2, 0.5, 0.8], rep=300)

        for d, n in tqdm([(d, n) for d in dims for n in lengths], desc="bounded sweep", unit="shape"):
            start = time.time()
            try:
                q, ck, cv, tau = bench_data.residual_free_case(
                    heads, n, d, dtype=dtype, device=device, block_size=block
                )
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
            # The compressed kernel reads the float32 reconstruction; dense and cuDNN read it rounded to q's dtype:
            # each is checked against float64 attention on what it reads.
            k_full, v_full = ck.decompress(), cv.decompress()
            k_dec, v_dec = k_full.to(dtype), v_full.to(dtype)
            check = slice(0, min(128, n))
            references = {
                "kvbound-compressed": reference_attention(q[:, :, check], k_full, v_full),
                "dense": reference_attention(q[:, :, check], k_dec, v_dec),
            }
            tqdm.write(f"d={d} N={n}: inputs ready (tau {tau:g}) in {time.time() - start:.1f} s")

            def error(out, provider="dense", check=check, references=references):
                return (out[:, :, check].double() - references.get(provider, references["dense"])).abs().max().item()

            cudnn_ms = cudnn_err = None
            if not smoke:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def cudnn(q=q, k_dec=k_dec, v_dec=v_dec):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k_dec, v_dec)

                cudnn_err = error(cudnn())
                p20, p50, p80 = timed(cudnn)
                cudnn_ms = p50
                emit(dict(d=d, N=n, provider="sdpa-cudnn", status="ok", ms_p20=f"{p20:.4f}", ms_p50=f"{p50:.4f}",
                          ms_p80=f"{p80:.4f}", vs_cudnn="1.00", err_max=f"{cudnn_err:.3e}"))  # fmt: skip
            for provider, operands in (("kvbound-compressed", (ck, cv)), ("kvbound-dense", (k_dec, v_dec))):
                running_ms = None
                for setting in ("off", "on"):
                    os.environ["KVBOUND_BOUNDED_MAX"] = setting
                    row = dict(d=d, N=n, provider=provider, bounded=setting,
                               err_cudnn="" if cudnn_err is None else f"{cudnn_err:.3e}")  # fmt: skip

                    def call(q=q, operands=operands):
                        return kvbound.attention(q, *operands)

                    try:
                        launched.clear()
                        row.update(status="ok", err_max=f"{error(call(), provider):.3e}")
                        row["launched"] = "bounded" if launched and all(launched) else "running max"
                        result = timed(call)
                        if result is not None:
                            p20, p50, p80 = result
                            row.update(ms_p20=f"{p20:.4f}", ms_p50=f"{p50:.4f}", ms_p80=f"{p80:.4f}",
                                       vs_cudnn=f"{cudnn_ms / p50:.2f}")  # fmt: skip
                            if setting == "off":
                                running_ms = p50
                            else:
                                row["vs_running_max"] = f"{running_ms / p50:.3f}"
                    except Exception as exc:  # a call that fails is a row, not the end of the sweep
                        row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    emit(row)
    if previous is None:
        os.environ.pop("KVBOUND_BOUNDED_MAX", None)
    else:
        os.environ["KVBOUND_BOUNDED_MAX"] = previous
    if args.plot is not None and not smoke:
        plot(rows, args.plot)
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows)} rows written to {args.out}; {len(failed)} failed")
    return 0 if rows and not failed else 1


def plot(rows: list[dict], path: Path) -> None:
    """Speed-up of the bounded maximum over the running maximum against N, one panel per head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({int(r["d"]) for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(5.5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims, strict=True):
        for provider, style in (("kvbound-compressed", "o-"), ("kvbound-dense", "s--")):
            points = sorted((int(r["N"]), float(r["vs_running_max"])) for r in rows
                            if int(r["d"]) == d and r["provider"] == provider and r.get("vs_running_max"))  # fmt: skip
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], style, label=provider)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("running-max time / bounded time")
        ax.set_title(f"d = {d}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bounded maximum against the running maximum (> 1: bounded faster)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
