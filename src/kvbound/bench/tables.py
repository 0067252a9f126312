"""Tables derived from result rows: data movement, ablation, (rank, bits) sweep, reconstruction overhead and
calibration time. Each returns ``(headers, rows)`` of strings; ``to_markdown`` renders one.

``python -m kvbound.bench.tables RESULTS.csv ...`` prints them all.

What the ratios count (also printed under each table by the report):

* K/V storage ratio: ``kv_dense_bytes / kv_bytes`` = dense K and V in their dtype over
  ``CompressedKV.nbytes`` of K plus V (factors, codes, scales, offsets, modes, exact blocks, metadata).
* formula traffic ratio: ``bytes_moved`` of cuDNN SDPA over ``bytes_moved`` of kvbound: Q, K, V read once and
  O written once, with K and V as stored (``kvbound.bench.formulas``).
* measured DRAM ratio: Nsight Compute ``dram__bytes_read.sum + dram__bytes_write.sum`` of every kernel of
  one cuDNN SDPA call over the same for one ``kvbound.attention`` call on compressed K/V (cold L2).
"""

from __future__ import annotations

import sys

from kvbound.bench.formulas import attention_flops, rank_space_flops, reconstruction_overhead
from kvbound.bench.summary import format_bytes

__all__ = [
    "index_rows",
    "data_movement_table",
    "ablation_table",
    "sweep_table",
    "overhead_table",
    "calibration_table",
    "encoder_table",
    "encoder_calibration_table",
    "models_table",
    "ring_table",
    "legacy_encoder_table",
    "legacy_public_api_table",
    "latest_rows",
    "to_markdown",
    "DEFAULT_CONFIG",
    "ABLATION_CONFIGS",
    "SWEEP_ORDER",
]

DEFAULT_CONFIG = "r8b4"
ABLATION_CONFIGS = (("lowrank-r8", "low-rank only"), ("quant-r0b4", "quantisation only"), ("r8b4", "fused (default)"))
SWEEP_ORDER = ("r16b8", "r16b4", "r8b4", "r8b2", "r4b2", "r8b4-perblock")
COMPRESSED = "kvbound-compressed"


def index_rows(rows: list[dict], mode: str) -> dict[tuple[str, str, str], dict]:
    """``(provider, config, shape) -> row`` for rows of ``mode``; the latest date wins on duplicates."""
    out: dict[tuple[str, str, str], dict] = {}
    for r in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r.get("date") or ""):
        out[(r["provider"], r.get("config") or "", r["shape"])] = r
    return out


def _shapes(rows: list[dict], family: str | None = None) -> list[dict]:
    """One representative row per shape, in first-seen order."""
    seen: dict[str, dict] = {}
    for r in rows:
        if r["mode"] in ("time", "ncu") and (family is None or r.get("family") == family):
            seen.setdefault(r["shape"], r)
    return list(seen.values())


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _dram(row: dict | None) -> float | None:
    if row is None or row.get("dram_read_bytes") is None:
        return None
    return row["dram_read_bytes"] + (row.get("dram_write_bytes") or 0.0)


def _ok(row: dict | None) -> dict | None:
    return row if row is not None and row["status"] == "ok" else None


def data_movement_table(rows: list[dict], config: str = DEFAULT_CONFIG) -> tuple[list[str], list[list[str]]]:
    """Attention data movement, dense vs compressed, per seed shape (N = 4096, 16384, 65536 and both d)."""
    timed, profiled = index_rows(rows, "time"), index_rows(rows, "ncu")
    headers = ["N", "d", "K+V dense", "K+V kvbound", "K+V ratio", "Q+K+V+O cuDNN", "Q+K+V+O kvbound",
               "formula ratio", "DRAM cuDNN (ncu)", "DRAM kvbound (ncu)", "measured ratio"]
    table = []
    for shape in _shapes(rows, "seed"):
        name = shape["shape"]
        comp = _ok(timed.get((COMPRESSED, config, name))) or _ok(profiled.get((COMPRESSED, config, name)))
        cudnn = _ok(timed.get(("sdpa-cudnn", "", name))) or _ok(profiled.get(("sdpa-cudnn", "", name)))
        comp_ncu, cudnn_ncu = _ok(profiled.get((COMPRESSED, config, name))), _ok(profiled.get(("sdpa-cudnn", "", name)))
        if comp is None and cudnn is None:
            continue
        kv_dense = comp["kv_dense_bytes"] if comp else None
        kv_comp = comp["kv_bytes"] if comp else None
        table.append([
            str(shape["q_len"]), str(shape["head_dim_qk"]), format_bytes(kv_dense), format_bytes(kv_comp),
            _ratio(kv_dense, kv_comp), format_bytes(cudnn["bytes_moved"] if cudnn else None),
            format_bytes(comp["bytes_moved"] if comp else None),
            _ratio(cudnn["bytes_moved"] if cudnn else None, comp["bytes_moved"] if comp else None),
            format_bytes(_dram(cudnn_ncu)), format_bytes(_dram(comp_ncu)), _ratio(_dram(cudnn_ncu), _dram(comp_ncu)),
        ])
    return headers, table


def _config_rows(rows: list[dict], configs, family: str = "seed") -> tuple[list[str], list[list[str]]]:
    timed, profiled = index_rows(rows, "time"), index_rows(rows, "ncu")
    headers = ["shape", "config", "rank", "bits", "tau", "K/V ratio", "zero tiles", "err vs dense ref",
               "p50 ms", "vs kvbound-dense", "vs cuDNN", "DRAM (ncu)"]
    table = []
    for shape in _shapes(rows, family):
        name = shape["shape"]
        dense = _ok(timed.get(("kvbound-dense", "", name)))
        cudnn = _ok(timed.get(("sdpa-cudnn", "", name)))
        for label, title in configs:
            r = timed.get((COMPRESSED, label, name)) or profiled.get((COMPRESSED, label, name))
            if r is None:
                continue
            if r["status"] not in ("ok", "check_failed"):
                table.append([name, title, str(r.get("rank") or "-"), str(r.get("bits") or "-"), "-", "-", "-", "-",
                              r["status"], (r.get("reason") or "")[:60], "-", "-"])
                continue
            ms = r.get("ms_p50")
            table.append([
                name, title, str(r["rank"]), str(r["bits"]), f"{r['tau']:g}",
                "-" if r.get("compression_ratio") is None else f"{r['compression_ratio']:.2f}x",
                "-" if r.get("zero_residual_share") is None else f"{r['zero_residual_share']:.0%}",
                "-" if r.get("err_vs_dense_rel") is None else f"{r['err_vs_dense_rel']:.2e}",
                "-" if ms is None else f"{ms:.4g}" + ("" if r["status"] == "ok" else " (check failed)"),
                _ratio(dense["ms_p50"] if dense else None, ms), _ratio(cudnn["ms_p50"] if cudnn else None, ms),
                format_bytes(_dram(profiled.get((COMPRESSED, label, name)))),
            ])
    return headers, table


def ablation_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Low-rank only vs quantisation only vs fused, per seed shape."""
    return _config_rows(rows, ABLATION_CONFIGS)


def sweep_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The (rank, bits) sweep, per seed shape."""
    return _config_rows(rows, [(c, c) for c in SWEEP_ORDER])


def overhead_table(rows: list[dict], config: str = DEFAULT_CONFIG, block_m: int = 128
                   ) -> tuple[list[str], list[list[str]]]:
    """Reconstruction FLOP beyond dense attention, counted from the format (``formulas``), per shape."""
    headers = ["shape", "rank", "K coded tiles", "V coded tiles", f"rebuild per head (BM={block_m})",
               "rebuild shared by GQA group", "rank-space FLOP / dense FLOP (residual-free tiles)"]
    table = []
    seen = set()
    for r in rows:
        if r["provider"] != COMPRESSED or (r.get("config") or "") != config or r["status"] != "ok":
            continue
        if r["shape"] in seen or r.get("k_share_lowrank") is None:
            continue
        seen.add(r["shape"])
        k_coded = (r.get("k_share_packed") or 0.0) + (r.get("k_share_promoted") or 0.0)
        v_coded = (r.get("v_share_packed") or 0.0) + (r.get("v_share_promoted") or 0.0)
        dk, dv, group = r["head_dim_qk"], r["head_dim_v"], r["q_heads"] // r["kv_heads"]
        per_head = reconstruction_overhead(r["rank"], dk, dv, block_m=block_m, k_coded_share=k_coded,
                                           v_coded_share=v_coded)
        shared = reconstruction_overhead(r["rank"], dk, dv, block_m=block_m, heads_per_program=group,
                                         k_coded_share=k_coded, v_coded_share=v_coded)
        dense = attention_flops(r["batch"], r["q_heads"], r["q_len"], r["kv_len"], dk, dv, bool(r["causal"]))
        rank_space = rank_space_flops(r["batch"], r["q_heads"], r["q_len"], r["kv_len"], dk, dv, r["rank"],
                                      bool(r["causal"]), block_m=block_m)
        table.append([r["shape"], str(r["rank"]), f"{k_coded:.0%}", f"{v_coded:.0%}", f"{per_head:.2%}",
                      f"{shared:.2%} (G={group})", f"{rank_space / dense:.1%}"])
    return headers, table


def calibration_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``kvbound.calibrate`` over all layers of one model (the attention suite's ``calibrate`` rows)."""
    headers = ["model", "seconds per model load", "what was calibrated", "device"]
    table = [[r["shape"], f"{r['ms_p50'] / 1e3:.3f}", r.get("note") or "", r.get("gpu") or ""]
             for r in rows if r["mode"] == "calibrate" and r["status"] == "ok" and r.get("suite") != "encoder"]
    return headers, table


def latest_rows(rows: list[dict], mode: str, key: tuple[str, ...]) -> list[dict]:
    """Rows of ``mode``, one per distinct ``key`` columns (the latest ``date`` wins), in first-seen order."""
    order: dict[tuple, None] = {}
    latest: dict[tuple, dict] = {}
    for r in rows:
        if r["mode"] == mode:
            order.setdefault(tuple(r.get(k) for k in key))
    for r in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r.get("date") or ""):
        latest[tuple(r.get(k) for k in key)] = r
    return [latest[k] for k in order]


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _spread(r: dict, low: str = "ms_p20", high: str = "ms_p80") -> str:
    return "-" if r.get(low) is None or r.get(high) is None else f"{r[low]:.4g}-{r[high]:.4g}"


def _modes(r: dict, which: str) -> str:
    shares = [r.get(f"{which}_share_{m}") for m in ("lowrank", "packed", "promoted", "raw")]
    if any(x is None for x in shares):
        return "-"
    return "/".join(f"{x:.0%}" for x in shares)


def _why(r: dict, width: int = 120) -> str:
    text = (r.get("note") or "") if r["status"] == "ok" else (r.get("reason") or "")
    return text.replace("\n", " ")[:width]


ENCODER_ORDER = ("encoder-triton", "encoder-triton-noverify", "encoder-eager", "device-copy")


def encoder_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite encoder``: one layer's K and V per shape, each encoder and the device copy."""
    headers = ["shape", "K / V", "provider", "config", "status", "p50 ms", "p20-p80 ms", "input GB/s",
               "time / copy", "K+V ratio", "K modes lr/pk/pr/raw", "V modes", "max err / tau", "note / reason"]
    latest = latest_rows(rows, "encode", ("provider", "config", "shape"))
    table = []
    for shape in dict.fromkeys(r["shape"] for r in latest):
        mine = sorted((r for r in latest if r["shape"] == shape),
                      key=lambda r: ENCODER_ORDER.index(r["provider"]) if r["provider"] in ENCODER_ORDER else 99)
        copy = next((r for r in mine if r["provider"] == "device-copy" and r["status"] == "ok"), None)
        for r in mine:
            kv = (f"[{r.get('batch')}, {r.get('kv_heads')}, {r.get('kv_len')}, {r.get('head_dim_qk')} / "
                  f"{r.get('head_dim_v')}] {r.get('dtype') or ''}")
            ratio = "-" if not copy or not r.get("ms_p50") else f"{r['ms_p50'] / copy['ms_p50']:.1f}x"
            table.append([shape, kv, r["provider"], r.get("config") or "", r["status"], _f(r.get("ms_p50"), ".4g"),
                          _spread(r), _f(r.get("gbps"), ".3g"), ratio, _f(r.get("compression_ratio"), ".2f"),
                          _modes(r, "k"), _modes(r, "v"), _f(r.get("max_err_over_tau"), ".3f"), _why(r)])
    return headers, table


def encoder_calibration_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite encoder``'s ``calibrate`` rows: one K and one V sample of a shape."""
    headers = ["shape", "sample", "p50 ms", "p20-p80 ms", "device"]
    latest = latest_rows([r for r in rows if r.get("suite") == "encoder"], "calibrate", ("shape", "config"))
    table = [[r["shape"], r.get("note") or "", _f(r.get("ms_p50"), ".4g"), _spread(r), r.get("gpu") or ""]
             for r in latest if r["status"] == "ok"]
    return headers, table


MODEL_VARIANTS = ("unpatched", "patch-dense", "patch-compressed")


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def models_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite models``: whole forwards per (model, batch, variant)."""
    headers = ["model", "batch", "variant", "status", "forward p50 ms", "p20-p80 ms", "vs unpatched",
               "attention p50 ms", "attention share", "peak GiB", "peak above baseline GiB", "K+V ratio",
               "max abs diff", "rel diff", "calibration s", "encode ms / forward", "note / reason"]
    latest = latest_rows(rows, "model", ("provider", "shape", "batch"))
    table = []
    for model, batch in dict.fromkeys((r["shape"], r["batch"]) for r in latest):
        mine = sorted((r for r in latest if r["shape"] == model and r["batch"] == batch),
                      key=lambda r: MODEL_VARIANTS.index(r["provider"]) if r["provider"] in MODEL_VARIANTS else 9)
        base = next((r for r in mine if r["provider"] == "unpatched" and r.get("ms_p50")), None)
        for r in mine:
            ms, att = r.get("ms_p50"), r.get("attention_ms_p50")
            above = (None if r.get("peak_bytes") is None or r.get("baseline_bytes") is None
                     else r["peak_bytes"] - r["baseline_bytes"])
            table.append([
                model, str(batch), r["provider"], r["status"], _f(ms, ".4g"), _spread(r),
                "-" if not base or not ms else f"{base['ms_p50'] / ms:.2f}x", _f(att, ".4g"),
                "-" if not ms or att is None else f"{att / ms:.0%}", _gib(r.get("peak_bytes")), _gib(above),
                _f(r.get("compression_ratio"), ".2f"), _f(r.get("diff_max_abs"), ".2e"), _f(r.get("diff_rel"), ".2e"),
                "-" if r.get("calibration_ms") is None else f"{r['calibration_ms'] / 1e3:.3f}",
                _f(r.get("compress_ms"), ".3g"), _why(r, 90)])
    return headers, table


RING_ORDER = ("ring-compressed", "ring-dense", "allgather-dense")


def ring_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite ring``: one attention layer per (N, processes, provider)."""
    headers = ["N", "d", "processes", "provider", "status", "p50 ms", "p20-p80 ms", "TFLOP/s", "sent per rank",
               "dense per rank", "dense / sent", "encode ms", "K+V ratio", "zero tiles", "max err", "rel err",
               "err vs dense ref", "note / reason"]
    latest = latest_rows(rows, "ring", ("provider", "shape", "world_size"))
    latest.sort(key=lambda r: (r.get("head_dim_qk") or 0, r.get("q_len") or 0, r.get("world_size") or 0,
                               RING_ORDER.index(r["provider"]) if r["provider"] in RING_ORDER else 9))
    table = []
    for r in latest:
        sent, dense = r.get("bytes_sent"), r.get("dense_bytes_sent")
        table.append([
            str(r.get("q_len")), str(r.get("head_dim_qk")), str(r.get("world_size")), r["provider"], r["status"],
            _f(r.get("ms_p50"), ".4g"), _spread(r), _f(r.get("tflops"), ".1f"), format_bytes(sent),
            format_bytes(dense), "-" if not sent or not dense else f"{dense / sent:.2f}x",
            _f(r.get("compress_ms"), ".3g"), _f(r.get("compression_ratio"), ".2f"),
            _f(r.get("zero_residual_share"), ".0%"), _f(r.get("err_max"), ".2e"), _f(r.get("err_rel"), ".2e"),
            _f(r.get("err_vs_dense_rel"), ".2e"), _why(r, 90)])
    return headers, table


# ------------------------------------------------------------------------------------------- older schemas
LEGACY_ENCODER_COLUMNS = ("encoder", "shape", "ms", "input_GBps", "copy_ms", "ratio", "max_err_over_tau")
LEGACY_PUBLIC_API_COLUMNS = ("N", "heads", "d", "cudnn_ms", "kvbound_compressed_ms", "kvbound_dense_ms")


def legacy_encoder_table(raw: list[dict[str, str]]) -> tuple[list[str], list[list[str]]]:
    """Rows of the former ``benchmarks/encoder_speed.py`` (one tensor per row, median only), as recorded."""
    headers = ["tensor [B, H, N, D]", "encoder", "median ms", "input GB/s", "copy ms", "ratio",
               "lowrank/packed/promoted/raw", "max err / tau", "device", "commit"]
    table = []
    for r in raw:
        modes = "/".join(r.get(m) or "-" for m in ("lowrank", "packed", "promoted", "raw"))
        table.append([r["shape"], r["encoder"], r["ms"], r["input_GBps"], r["copy_ms"], r["ratio"], modes,
                      r["max_err_over_tau"], r.get("gpu") or "", r.get("commit") or ""])
    return headers, table


def legacy_public_api_table(raw: list[dict[str, str]]) -> tuple[list[str], list[list[str]]]:
    """Rows of the former ``benchmarks/public_api_timing.py`` (median of do_bench), as recorded."""
    headers = ["N", "heads", "d", "K/V blocks", "K/V ratio", "cuDNN ms", "kvbound compressed ms", "vs cuDNN",
               "kvbound dense ms", "vs cuDNN", "device", "commit"]
    table = [[r["N"], r["heads"], r["d"], r.get("kv_modes") or "", r.get("kv_ratio") or "", r["cudnn_ms"],
              r["kvbound_compressed_ms"], (r.get("compressed_vs_cudnn") or "") + "x", r["kvbound_dense_ms"],
              (r.get("dense_vs_cudnn") or "") + "x", r.get("device") or "", r.get("commit") or ""] for r in raw]
    return headers, table


def to_markdown(headers: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return "_(no rows in the results)_\n"
    escape = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in escape]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rich.console import Console
    from rich.table import Table

    from kvbound.bench.records import read_rows

    parser = argparse.ArgumentParser(prog="python -m kvbound.bench.tables", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+")
    args = parser.parse_args(argv)
    rows = [r for path in args.csv for r in read_rows(path)]
    console = Console(width=None if sys.stdout.isatty() else 200)
    for title, (headers, body) in (
        ("attention data movement", data_movement_table(rows)),
        ("ablation", ablation_table(rows)),
        ("(rank, bits) sweep", sweep_table(rows)),
        ("reconstruction overhead", overhead_table(rows)),
        ("calibration per model load", calibration_table(rows)),
        ("encoder (--suite encoder)", encoder_table(rows)),
        ("calibration per sample (--suite encoder)", encoder_calibration_table(rows)),
        ("models end to end (--suite models)", models_table(rows)),
        ("context-parallel ring (--suite ring)", ring_table(rows)),
    ):
        table = Table(title=title)
        for h in headers:
            table.add_column(h)
        for row in body:
            table.add_row(*row)
        console.print(table)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
