# Device command (one call; the evaluation data's cache carried as .cache/evaldata, the file of q, k, v is 248 MB):
# PYTHONPATH=src python3 benchmarks/trained_kv.py capture /tmp/kv.safetensors --cache .cache/evaldata --device cuda \
#   && PYTHONPATH=src python3 benchmarks/trained_kv.py time /tmp/kv.safetensors $OUT/trained_kv.csv --lengths 16384 65536
"""Attention speed on K/V from the trained evaluation models, not from a generator.

``kvbound bench`` times the seed shapes on K/V from a documented generator (``kvbound/bench/data.py``) with a set
share of residual-free blocks. This script takes the queries, keys and values that the trained compact models of
``kvbound eval`` (``eval/weights/``: the Enformer-style model, 8 heads, dk 64, dv 32; the AlphaGenome-style model,
8 query heads on one K/V head, dk 64, dv 32) compute on real human chrX sequence, and times plain softmax attention
on them: cuDNN SDPA and kvbound's dense kernel on the K/V as the model holds them (bf16), kvbound's compressed kernel
on the default configuration (block 128, rank 8, 4 bits, tau 2^-5) with a basis calibrated on other windows. Every
output is checked against the float64 reference first; the compressed row also against the original K/V, with the
element-wise bound checked on the K/V state, and the share of blocks per storage mode next to the speed.

Plain attention, not the models' own: the Enformer-style model adds a relative-position term and the
AlphaGenome-style model a pair bias and a soft-cap, which cuDNN cannot run; the speed question here is what the
compressed format costs on realistic K/V, which depends on the blocks' modes, not on those terms. Queries are the
model's (Enformer-style: already scaled by dk^-0.5; AlphaGenome-style: scaled here), K/V the model's after its
projections (and LayerNorm and RoPE for the AlphaGenome-style model).

Long sequences come from model windows (1,536 tokens of 128 bp each, 196,608 bp) laid end to end along the test split
(chrX 44-56 Mbp; a window with more than 1 % N is skipped, and the positions are recorded), concatenated along the
sequence: each K/V block of 128 tokens is exactly what the model computes
on its window, and the calibration windows come from the train split.

    python benchmarks/trained_kv.py capture KV.safetensors --tokens 65536 --device cuda   # 2.5 min on 2 CPU cores
    python benchmarks/trained_kv.py time KV.safetensors OUT.csv --lengths 16384 65536     # GPU

``capture`` needs the evaluation data (``python -m kvbound.eval.data fetch``) and the trained weights; ``--fixture
DIR`` uses the synthetic fixture and randomly initialised toy models instead (tests). ``time --cpu-smoke`` runs every
step except the timing in Triton's interpreter on CPU tensors (float32 operands: its bf16 dot products are wrong).
``--configs r8b4 r8b8 r16b8``: compressed rows for each configuration (rank and bits; the default block and tau),
with bases of each rank calibrated at capture (``--ranks``, default 8 and 16).
CSV columns: model, layer, N, heads (q/kv), dk, dv, provider, config, status, ms_p20/50/80, vs_cudnn, err_rel
(relative L2 error against float64 on the K/V the provider read, first ``--check-rows`` queries of every head),
err_vs_original_rel (compressed: against float64 on the original K/V), kv_max_err_over_tau, block shares
(lowrank / packed / promoted / raw, K then V), kv_ratio, reason.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import math
import sys
import time
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
MODELS = ("enformer", "alphagenome")
FIELDS = ["model", "layer", "N", "q_heads", "kv_heads", "dk", "dv", "provider", "config", "status", "ms_p20",
          "ms_p50", "ms_p80", "vs_cudnn", "err_rel", "err_vs_original_rel", "kv_max_err_over_tau", "k_shares",
          "v_shares", "kv_ratio", "reason", "device", "torch", "triton", "commit", "date"]  # fmt: skip


# ------------------------------------------------------------------------------------------------- capture
def _windows(codes, interval: tuple[int, int], window_bins: int, bin_size: int, count: int, max_n: float = 0.01):
    """First bins of ``count`` consecutive, non-overlapping windows inside ``interval`` (bp) holding at most
    ``max_n`` N; fewer when the interval runs out."""
    from kvbound.eval.windows import CODE_N

    first = -(-interval[0] // bin_size)
    last = interval[1] // bin_size - window_bins
    starts = []
    start = first
    while start <= last and len(starts) < count:
        window = codes[start * bin_size : (start + window_bins) * bin_size]
        if float((window == CODE_N).mean()) <= max_n:
            starts.append(start)
        start += window_bins
    return starts


@torch.no_grad()
def _record(model, batches, layer: int) -> dict[str, list[torch.Tensor]]:
    """q, k, v that attention layer ``layer`` receives for each input batch (the model's attention function is
    wrapped for the call and restored)."""
    module = model.attention[layer]
    original = module.attention_fn
    seen: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}

    def recording(q, k, v, *rest):
        for name, x in (("q", q), ("k", k), ("v", v)):
            seen[name].append(x.detach().float())
        return original(q, k, v, *rest)

    module.attention_fn = recording
    try:
        for batch in batches:
            model(batch)
    finally:
        module.attention_fn = original
    return seen


def capture(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    import kvbound
    from kvbound.eval.data import load_data, write_fixture
    from kvbound.eval.models import ModelConfig, build_model, load_model
    from kvbound.eval.simulate import SimulatorConfig
    from kvbound.eval.windows import one_hot, split_intervals

    if args.fixture is not None:
        cache = Path(args.fixture)
        if not (cache / "manifest.json").exists():
            write_fixture(cache)
        data, sim_config = load_data(cache), SimulatorConfig.fixture()
    else:
        data, sim_config = load_data(args.cache), SimulatorConfig()
    config = kvbound.CompressionConfig()
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}
    for kind in args.models:
        path = Path(args.weights_dir) / f"{kind}.safetensors"
        if args.fixture is None:
            if not path.exists():
                raise SystemExit(f"capture: {path}: no trained weights (train them with `python -m kvbound.eval.train`)")
            model, _ = load_model(str(path), args.device)
            weights = f"trained: {path.name}"
        else:
            model = build_model(ModelConfig.toy(kind, 4), seed=0).to(args.device).eval()
            weights = "random (toy, fixture)"
        mc = model.config
        layer = args.layer if args.layer >= 0 else mc.depth + args.layer
        if not 0 <= layer < mc.depth:
            raise SystemExit(f"--layer: expected -{mc.depth} .. {mc.depth - 1}, got {args.layer}")
        count = -(-args.tokens // mc.window_bins)
        test = split_intervals(sim_config, len(data.codes), "test")[0]
        train = split_intervals(sim_config, len(data.codes), "train")[0]
        starts = _windows(data.codes, test, mc.window_bins, 128, count)
        calib = _windows(data.codes, train, mc.window_bins, 128, args.calibration_windows)
        if len(starts) < count or not calib:
            raise SystemExit(f"capture: {kind}: {len(starts)} test windows of {count} needed, {len(calib)} calibration")

        def batches(first_bins):
            for s in first_bins:
                window = torch.from_numpy(data.codes[s * 128 : (s + mc.window_bins) * 128].copy())
                yield one_hot(window[None]).to(args.device)

        t0 = time.time()
        seen = _record(model, batches(starts), layer)
        calib_seen = _record(model, batches(calib), layer)
        scale = 1.0 if kind == "enformer" else mc.key_dim**-0.5  # Enformer-style queries arrive scaled
        q, k, v = (torch.cat(seen[name], dim=2)[:, :, : args.tokens] for name in ("q", "k", "v"))
        q = q * scale
        for name, x in (("q", q), ("k", k), ("v", v)):
            tensors[f"{kind}.{name}"] = x.to(torch.bfloat16).cpu().contiguous()
        for rank in args.ranks:
            ranked = dataclasses.replace(config, rank=rank)
            for name in ("k", "v"):
                basis = kvbound.calibrate(torch.cat(calib_seen[name], dim=2), ranked)
                tensors[f"{kind}.basis_{name}_r{rank}"] = basis.projection.cpu().contiguous()
                tensors[f"{kind}.energy_{name}_r{rank}"] = basis.captured_energy.cpu().contiguous()
        meta[kind] = dict(layer=layer, tokens=args.tokens, weights=weights, windows_bp=[s * 128 for s in starts],
                          calibration_bp=[s * 128 for s in calib], chrom=data.chrom, source=data.source)  # fmt: skip
        print(f"{kind}: layer {layer}, q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} from {len(starts)} "
              f"windows ({time.time() - t0:.1f} s)")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata={"trained_kv": json.dumps(meta)})
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)")
    return 0


# ---------------------------------------------------------------------------------------------------- time
def _config(label: str):
    """``rRbB`` -> the default ``CompressionConfig`` with rank R and B bits."""
    import kvbound

    match = re.fullmatch(r"r(\d+)b(\d+)", label)
    if match is None:
        raise SystemExit(f"--configs: expected labels like r8b4 (rank 8, 4 bits), got {label!r}")
    return dataclasses.replace(kvbound.CompressionConfig(), rank=int(match.group(1)), bits=int(match.group(2)))


def _basis(tensors: dict, kind: str, name: str, rank: int, device, basis_type):
    key = f"{kind}.basis_{name}_r{rank}"
    if key not in tensors:
        ranks = sorted(int(k.rsplit("_r", 1)[1]) for k in tensors if k.startswith(f"{kind}.basis_{name}_r"))
        raise SystemExit(f"--configs: no rank-{rank} basis was captured for {kind} (ranks {ranks}; capture --ranks)")
    energy = tensors[f"{kind}.energy_{name}_r{rank}"].to(device)
    return basis_type(tensors[key].to(device), energy, 0.0, 0)


def _shares(ck) -> str:
    modes = ck.mode.flatten().tolist()
    total = max(1, len(modes))
    return "/".join(f"{modes.count(m) / total:.3f}" for m in range(4))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def time_calls(args: argparse.Namespace) -> int:
    from safetensors import safe_open
    from safetensors.torch import load_file

    import kvbound
    from kvbound.codec.basis import Basis

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("trained_kv time: no CUDA device (use --cpu-smoke on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    with safe_open(str(args.input), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {})["trained_kv"])
    tensors = load_file(str(args.input))
    configs = {label: _config(label) for label in args.configs}
    env = dict(device=torch.cuda.get_device_name() if not smoke else "cpu (interpreter)", torch=torch.__version__,
               commit=args.commit, date=time.strftime("%Y-%m-%d"))  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        env["triton"] = ""
    rows = []
    dtype = torch.float32 if smoke else torch.bfloat16
    # In the order asked: every model at the first length, then the next length (rows are written as they come).
    lengths = args.lengths or [max(info["tokens"] for info in meta.values())]
    cases = [(kind, info, n) for n in lengths for kind, info in meta.items()]
    for kind, info, length in cases:
        if length > info["tokens"]:
            raise SystemExit(f"--lengths: {length} is more than the {info['tokens']} tokens captured for {kind}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sink = args.out.open("w", newline="")
    writer = csv.DictWriter(sink, fieldnames=FIELDS)
    writer.writeheader()
    for kind, info, length in cases:
        q, k, v = (tensors[f"{kind}.{n}"][:, :, :length].to(device=device, dtype=dtype).contiguous()
                   for n in ("q", "k", "v"))  # fmt: skip
        n_tok, hq, hkv, dk, dv = q.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3]
        base = dict(model=kind, layer=info["layer"], N=n_tok, q_heads=hq, kv_heads=hkv, dk=dk, dv=dv, **env)
        rows_checked = torch.linspace(0, n_tok - 1, min(args.check_rows, n_tok), device=device).long()
        q_rows = q[:, :, rows_checked]
        ref_original = kvbound.reference_attention(q_rows, k, v, scale=1.0)
        compressed = {}
        for label, config in configs.items():
            bases = {n: _basis(tensors, kind, n, config.rank, device, Basis) for n in ("k", "v")}
            ck, cv = (kvbound.compress_kv(x, config, bases[n]) for x, n in ((k, "k"), (v, "v")))
            # The values the codec returns (float32): the bound is certified on these, and the kernel reads the
            # compressed form itself, never a rounding of it to q's dtype.
            k_hat, v_hat = ck.decompress(), cv.decompress()
            kv_err = max(float((k_hat - k.float()).abs().max()), float((v_hat - v.float()).abs().max()))
            compressed[label] = dict(config=config, ck=ck, cv=cv, kv_err=kv_err,
                                     ref=kvbound.reference_attention(q_rows, k_hat, v_hat, scale=1.0))  # fmt: skip
            del k_hat, v_hat

        def expand(x):  # cuDNN gets each K/V head repeated for its query heads (the K/V as the model holds them)
            return x.repeat_interleave(hq // hkv, dim=1) if hkv != hq else x

        # name -> (call, compressed label or None)
        providers = {"kvbound-dense": (lambda: kvbound.attention(q, k, v, scale=1.0), None)}
        for label, c in compressed.items():
            providers[f"kvbound-compressed[{label}]"] = (
                lambda c=c: kvbound.attention(q, c["ck"], c["cv"], scale=1.0), label)
        if not smoke:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            k_e, v_e = expand(k).contiguous(), expand(v).contiguous()

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k_e, v_e, scale=1.0)

            providers = {"sdpa-cudnn": (cudnn, None), **providers}
        cudnn_ms = None
        for name, (call, label) in providers.items():
            c = compressed.get(label)
            row = dict(base, provider=name.split("[")[0], config=label or "")
            try:
                out = call()
                ref = ref_original if c is None else c["ref"]  # the K/V this provider read
                row["err_rel"] = _rel(out[:, :, rows_checked], ref)
                if c is not None:
                    ck, cv, tau = c["ck"], c["cv"], c["config"].tau
                    row.update(err_vs_original_rel=_rel(out[:, :, rows_checked], ref_original),
                               kv_max_err_over_tau=c["kv_err"] / tau, k_shares=_shares(ck), v_shares=_shares(cv),
                               kv_ratio=(k.numel() + v.numel()) * 2 / (ck.nbytes + cv.nbytes))  # fmt: skip
                    if c["kv_err"] > tau:
                        raise AssertionError(f"K/V error {c['kv_err']:.3e} above tau {tau:.3e}")
                if not math.isfinite(row["err_rel"]) or row["err_rel"] > args.max_rel_err:
                    row.update(status="check_failed", reason=f"relative error {row['err_rel']:.2e}")
                else:
                    row["status"] = "ok"
                if not smoke:
                    import triton.testing

                    # at least ~10 calls even when one takes over 100 ms (do_bench sizes its repeats from `rep` ms)
                    estimate = triton.testing.do_bench(call, warmup=5, rep=20)
                    rep = max(200.0, 10 * estimate)
                    p20, p50, p80 = triton.testing.do_bench(call, warmup=25, rep=rep, quantiles=[0.2, 0.5, 0.8])
                    row.update(ms_p20=p20, ms_p50=p50, ms_p80=p80)
                    if name == "sdpa-cudnn":
                        cudnn_ms = p50
                    elif cudnn_ms is not None:
                        row["vs_cudnn"] = cudnn_ms / p50
            except Exception as exc:  # noqa: BLE001 (one failing provider must not lose the other rows)
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
            writer.writerow(row)
            sink.flush()
            print(f"{kind} N={n_tok} {name}: {row.get('status')} {row.get('ms_p50', float('nan')):.3f} ms "
                  f"vs cuDNN {row.get('vs_cudnn', float('nan')):.2f}x err {row.get('err_rel', float('nan')):.2e} "
                  f"{row.get('reason', '')}")  # fmt: skip
    sink.close()
    print(f"{len(rows)} rows written to {args.out}")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capture", help="run the trained models on chrX windows and keep one layer's q, k, v")
    c.add_argument("out", type=Path)
    c.add_argument("--tokens", type=int, default=65536)
    c.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    c.add_argument("--layer", type=int, default=-1, help="attention layer (negative: from the last)")
    c.add_argument("--calibration-windows", type=int, default=4)
    c.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="bases calibrated for these ranks")
    c.add_argument("--weights-dir", default=str(REPOSITORY / "eval" / "weights"))
    c.add_argument("--cache", default=None, help="evaluation data cache (default: kvbound.eval's)")
    c.add_argument("--fixture", default=None, help="synthetic fixture directory and toy random models (tests)")
    c.add_argument("--device", default="cpu", help="where the models run (cuda: seconds instead of minutes)")
    t = sub.add_parser("time", help="time attention on a captured file")
    t.add_argument("input", type=Path)
    t.add_argument("out", type=Path)
    t.add_argument("--lengths", type=int, nargs="*", default=None, help="the first N tokens (default: all)")
    t.add_argument("--configs", nargs="+", default=["r8b4"],
                   help="compressed configurations rRbB (rank R, B bits, the default block and tau); r8b4 is the "
                        "default configuration")  # fmt: skip
    t.add_argument("--check-rows", type=int, default=256)
    t.add_argument("--max-rel-err", type=float, default=2e-2, help="relative L2 error that fails a check")
    t.add_argument("--commit", default="")
    t.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    return capture(args) if args.command == "capture" else time_calls(args)


if __name__ == "__main__":
    raise SystemExit(main())
