"""Runs kernel (RELATIVE == 2) on Borzoi's layer at pinned tiles and forced RUN_SPAN; plain attention as floor."""
import csv, os, sys, time, contextlib
import torch, triton, triton.testing
sys.path.insert(0, "benchmarks")
from kvbound.bench.relative import RelativeSpec, _inputs
from kvbound.config import CompressionConfig
from kvbound.kernels import attention_dense as ad
from kvbound.kernels.attention_dense import attention_dense_fwd
from kvbound.models.reference import relative_position_attention_reference
from kvbound.models.relative import relative_position_attention
import importlib; api = importlib.import_module("kvbound.attention")

out_path, label, batches = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
FIELDS = ["wide", "label", "gpu", "B", "variant", "tile", "span", "status", "ms_p50", "ms_graph", "compile_s", "err_max", "reason"]
f = open(out_path, "w", newline=""); w = csv.DictWriter(f, fieldnames=FIELDS); w.writeheader()
gpu = torch.cuda.get_device_name()
orig_span = ad.relative_run_span

@contextlib.contextmanager
def pinned(tile, span):
    tuner = ad._attention_dense_fwd
    saved = (tuner.configs, ad._RELATIVE_SHAPES, ad._RUNS_SHAPES, ad._RELATIVE_WINDOW, ad.MAX_RUN_SPAN, ad.relative_run_span)
    caches = (ad._TUNED, ad._PLANS, tuner.cache, api._RUNS_ON_DEVICE, api._RUN_LAYOUTS)
    if tile is not None:
        m, n, nw, ns = tile
        tuner.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=nw, num_stages=ns)]
        ad._RELATIVE_SHAPES = ad._RUNS_SHAPES = frozenset({tile})
        ad._RELATIVE_WINDOW = m + n - 1
        ad.MAX_RUN_SPAN = 32
        def forced(starts, rows, window=None, limit=None):
            if window is not None:
                return orig_span(starts, rows, window, limit)
            got = orig_span(starts, rows)
            assert 0 < got <= span, (got, span)
            return span
        ad.relative_run_span = forced
    for c in caches: c.clear()
    try:
        yield
    finally:
        (tuner.configs, ad._RELATIVE_SHAPES, ad._RUNS_SHAPES, ad._RELATIVE_WINDOW, ad.MAX_RUN_SPAN, ad.relative_run_span) = saved
        for c in caches: c.clear()

def emit(row):
    row["wide"] = os.environ.get("KVBOUND_RUNS_WIDE", "")
    w.writerow({k: row.get(k, "") for k in FIELDS}); f.flush(); print(row, flush=True)

def timeit(fn):
    t0 = time.perf_counter(); out = fn(); torch.cuda.synchronize(); comp = time.perf_counter() - t0
    ms = triton.testing.do_bench(fn, quantiles=[0.5], rep=200)
    try:
        g = triton.testing.do_bench_cudagraph(fn, rep=200)
    except Exception as e:  # noqa
        g = float("nan")
    return out, ms, g, comp

NTOK = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
spec = RelativeSpec("borzoi-layer", NTOK, tuple(batches), shift="strided")
import os
ONLY_AUTO = os.environ.get("TILES_AUTO_ONLY") == "1"
TILES = [(None, 0)] if ONLY_AUTO else [(None, 0), ((64, 64, 4, 2), 16), ((128, 64, 8, 2), 24), ((128, 64, 8, 3), 24),
         ((128, 32, 8, 2), 24), ((64, 64, 4, 2), 24), ((64, 64, 4, 1), 16), ((128, 64, 8, 2), 32),
         ((128, 32, 8, 3), 24), ((128, 128, 8, 2), 24)]
for b in batches:
    x = _inputs(spec, b, torch.device("cuda"), torch.bfloat16, CompressionConfig(), seed=0, share=0.5)
    ref = relative_position_attention_reference(x["q"][:1], x["k"][:1], x["v"][:1], x["relative_keys"], x["u"], x["w"], scale=x["scale"])
    print("runs", len(x["runs"]) if x["runs"] is not None else None, "span127", orig_span(list(x["runs"]), 2 * NTOK - 1), flush=True)
    def public():
        return relative_position_attention(x["q"], x["k"], x["v"], x["relative_keys"], x["u"][None, :, None],
                                           x["w"][None, :, None], scale=x["scale"], backend="kvbound", relative_runs=x["runs"])
    q, k, v = x["q"], x["k"], x["v"]
    if not ONLY_AUTO:
        for nm, fn in (("kvbound-plain", lambda: attention_dense_fwd(q, k, v, None, x["scale"], False, None)[0]),
                       ("sdpa-plain", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=x["scale"]))):
            try:
                o, ms, g, comp = timeit(fn)
                emit(dict(label=label, gpu=gpu, B=b, variant=nm, tile="autotuned", status="ok", ms_p50=f"{ms:.4f}", ms_graph=f"{g:.4f}", compile_s=f"{comp:.1f}"))
            except Exception as err:  # noqa
                emit(dict(label=label, gpu=gpu, B=b, variant=nm, status="error", reason=str(err)[:300]))
    for tile, span in TILES:
        name = "autotuned" if tile is None else "x".join(map(str, tile))
        try:
            with pinned(tile, span):
                o, ms, g, comp = timeit(public)
                e = (o[:1].double() - ref).abs().max().item()
                if tile is None:
                    span = ad._TUNED and list(ad._TUNED.values())
            emit(dict(label=label, gpu=gpu, B=b, variant="runs", tile=name, span=span, status="ok", ms_p50=f"{ms:.4f}",
                      ms_graph=f"{g:.4f}", compile_s=f"{comp:.1f}", err_max=f"{e:.3e}"))
        except Exception as err:  # noqa
            emit(dict(label=label, gpu=gpu, B=b, variant="runs", tile=name, span=span, status="error",
                      reason=f"{type(err).__name__}: {err}"[:300].replace("\n", " ")))
    del x, ref; torch.cuda.empty_cache()
