"""The dense kernel at pinned tile shapes, with the running and the bounded maximum, beside cuDNN SDPA: whether the
autotuner's list (``attention_dense.dense_configs``) holds the best tile for each variant.

    python benchmarks/dense_tiles.py OUT.csv [--dims 128] [--lengths 16384,65536] [--data random|structured]

``--data random``: q, K, V standard normal; ``structured``: ``kvbound bench``'s residual-free K/V decompressed to bf16
and its queries (``kvbound.bench.data.residual_free_case``), the data of ``bounded_sweep.py``. Each shape also gets
rows ``tile=autotuned``: ``kvbound.attention`` with ``KVBOUND_BOUNDED_MAX`` on / off, and the tile the autotuner
chose for it.

Every call's largest error against float64 on the first 128 queries is recorded next to its time (column
``err_max``, beside cuDNN's row; not judged); a tile that does not compile (shared memory, registers) is a row with
its reason."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
         (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2)]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dims", default="128")
    p.add_argument("--lengths", default="16384,65536")
    p.add_argument("--data", choices=("random", "structured"), default="random")
    args = p.parse_args()

    import os

    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kvbound
    from kvbound.bench import data as bench_data
    from kvbound.kernels import attention_dense
    from kvbound.kernels.attention_dense import attention_dense_fwd
    from kvbound.reference import reference_attention

    fields = ["d", "N", "provider", "tile", "bounded", "status", "ms_p50", "vs_cudnn", "err_max", "reason"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()

        def emit(row):
            writer.writerow({k: row.get(k, "") for k in fields})
            f.flush()
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

        for d in (int(x) for x in args.dims.split(",")):
            for n in (int(x) for x in args.lengths.split(",")):
                if args.data == "random":
                    g = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v = (torch.randn(1, 8, n, d, generator=g, device="cuda").bfloat16() for _ in range(3))
                else:
                    q, ck, cv, _ = bench_data.residual_free_case(
                        8, n, d, dtype=torch.bfloat16, device="cuda", block_size=128
                    )
                    k, v = ck.decompress().bfloat16(), cv.decompress().bfloat16()
                    del ck, cv
                ref = reference_attention(q[:, :, :128], k, v)

                def err(out, ref=ref):
                    return float((out[:, :, :128].double() - ref).abs().max())

                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = triton.testing.do_bench(
                        lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                        quantiles=[0.5],
                        rep=200,
                    )
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                emit(dict(d=d, N=n, provider="sdpa-cudnn", status="ok", ms_p50=f"{cudnn:.4f}", vs_cudnn="1.00",
                          err_max=f"{err(out):.3e}"))  # fmt: skip
                for setting in ("off", "on"):
                    os.environ["KVBOUND_BOUNDED_MAX"] = setting
                    before = set(attention_dense._TUNED)

                    def auto(q=q, k=k, v=v):
                        return kvbound.attention(q, k, v)

                    e = err(auto())
                    chosen = [attention_dense._TUNED[key] for key in set(attention_dense._TUNED) - before]
                    tile = "/".join(
                        f"{c.get('BLOCK_M')}x{c.get('BLOCK_N')}/{c.get('num_warps')}w/{c.get('num_stages')}s"
                        for c in chosen
                    ) or "cached"
                    ms = triton.testing.do_bench(auto, quantiles=[0.5], rep=200)
                    emit(dict(d=d, N=n, provider="kvbound-dense", tile=f"autotuned {tile}", bounded=setting == "on",
                              status="ok", ms_p50=f"{ms:.4f}", vs_cudnn=f"{cudnn / ms:.2f}",
                              err_max=f"{e:.3e}"))  # fmt: skip
                os.environ.pop("KVBOUND_BOUNDED_MAX", None)
                for m, bn, w, s in TILES:
                    config = {"BLOCK_M": m, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
                    for bounded in (False, True):
                        row = dict(d=d, N=n, provider="kvbound-dense", tile=f"{m}x{bn}/{w}w/{s}s", bounded=bounded)

                        def call(config=config, bounded=bounded, q=q, k=k, v=v, scale=d**-0.5):
                            return attention_dense_fwd(q, k, v, None, scale, False, None, config, bounded_max=bounded)

                        try:
                            e = err(call()[0])
                            ms = triton.testing.do_bench(call, quantiles=[0.5], rep=200)
                            row.update(status="ok", ms_p50=f"{ms:.4f}", vs_cudnn=f"{cudnn / ms:.2f}",
                                       err_max=f"{e:.3e}")  # fmt: skip
                        except Exception as exc:  # a tile that does not fit is a row
                            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                            row.update(status="failed", reason=reason)
                        emit(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
