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
    headers = ["model", "seconds per model load", "what was calibrated", "device"]
    table = [[r["shape"], f"{r['ms_p50'] / 1e3:.3f}", r.get("note") or "", r.get("gpu") or ""]
             for r in rows if r["mode"] == "calibrate" and r["status"] == "ok"]
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
