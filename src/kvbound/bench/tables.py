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

import re
import sys

from kvbound.bench.formulas import attention_flops, rank_space_flops, reconstruction_overhead
from kvbound.bench.records import default_settings, row_settings
from kvbound.bench.summary import format_bytes

__all__ = [
    "index_rows",
    "cudnn_ratios",
    "target_for",
    "targets_table",
    "targets_summary",
    "traffic_table",
    "data_movement_table",
    "ablation_table",
    "sweep_table",
    "overhead_table",
    "calibration_table",
    "encoder_table",
    "encoder_calibration_table",
    "models_table",
    "ring_table",
    "relative_table",
    "share_points",
    "share_table",
    "legacy_encoder_table",
    "legacy_public_api_table",
    "latest_rows",
    "to_markdown",
    "DEFAULT_CONFIG",
    "ABLATION_CONFIGS",
    "SWEEP_ORDER",
    "DESIGN_TRAFFIC_FIGURES",
    "DESIGN_CONFIG_FIGURES",
    "DESIGN_OVERHEAD",
    "DESIGN_CALIBRATION_S",
]

DEFAULT_CONFIG = "r8b4"
ABLATION_CONFIGS = (("lowrank-r8", "low-rank only"), ("quant-r0b4", "quantisation only"), ("r8b4", "fused (default)"))
SWEEP_ORDER = ("r8b8", "r16b8", "r16b4", "r8b4", "r8b2", "r4b2", "r8b4-perblock")
COMPRESSED = "kvbound-compressed"


def index_rows(rows: list[dict], mode: str) -> dict[tuple[str, str, str], dict]:
    """``(provider, config, shape) -> row`` for rows of ``mode``; the latest date wins on duplicates."""
    out: dict[tuple[str, str, str], dict] = {}
    for r in sorted((r for r in rows if r["mode"] == mode), key=lambda r: r.get("date") or ""):
        out[(r["provider"], r.get("config") or "", r["shape"])] = r
    return out


# The design's figures (attention data movement reduction; overhead; calibration), shown beside the measurements.
DESIGN_TRAFFIC_FIGURES = {4096: 2.6, 65536: 4.1}
DESIGN_CONFIG_FIGURES = {"lowrank-r8": 3.6, "quant-r0b4": 2.4, "r8b4": 4.1, "r16b8": 2.1, "r16b4": 3.0, "r8b2": 5.2,
                      "r4b2": 6.0}
DESIGN_OVERHEAD = 0.062
DESIGN_CALIBRATION_S = 0.8


def _run_key(r: dict) -> tuple:
    """Rows of one process share these provenance columns (``records.environment`` is read once per run)."""
    return (r.get("commit"), r.get("date"), r.get("gpu"))


def cudnn_ratios(rows: list[dict]) -> dict[int, tuple[float, dict, bool]]:
    """``id(row) -> (cuDNN p50 / row p50, the cuDNN row, same run)`` for timed rows with an ok cuDNN row.

    The cuDNN row of the same run (same commit, date and device: measured in the same process, side by side) is
    preferred; failing that, the latest cuDNN row of the shape, and ``same run`` is False. Pass every timed row,
    not only the latest per provider: a newer run's cuDNN row must not hide the one measured beside an older row."""
    cudnn_rows = [r for r in rows if r["mode"] == "time" and r["provider"] == "sdpa-cudnn" and r["status"] == "ok"
                  and r.get("ms_p50")]
    same: dict[tuple, dict] = {}
    latest: dict[str, dict] = {}
    for r in sorted(cudnn_rows, key=lambda r: r.get("date") or ""):
        same[(r["shape"], *_run_key(r))] = r
        latest[r["shape"]] = r
    out = {}
    for r in rows:
        if r["mode"] != "time" or not r.get("ms_p50"):
            continue
        ref = same.get((r["shape"], *_run_key(r)))
        if ref is not None:
            out[id(r)] = (ref["ms_p50"] / r["ms_p50"], ref, True)
        elif r["shape"] in latest:
            ref = latest[r["shape"]]
            out[id(r)] = (ref["ms_p50"] / r["ms_p50"], ref, False)
    return out


def target_for(row: dict) -> tuple[float, str] | None:
    """The speed target vs cuDNN SDPA that applies to a timed seed-shape row: ``(minimum ratio, why)``.

    * kvbound compressed, default config (r8b4), N = 65536: >= 1.3x;
    * residual-free low rank (lowrank-r8), N = 65536: >= 1.5x at d = 64, >= 2.0x at d = 128;
    * kvbound dense, and both of the above, N >= 16384: >= 1.0x (no regression against cuDNN).

    Other rows (N = 4096, the quantisation-only ablation, sweep configs, model shapes) have none."""
    if row.get("family") != "seed" or row["mode"] != "time":
        return None
    n, d = row.get("q_len") or 0, row.get("head_dim_qk") or 0
    provider, config = row["provider"], row.get("config") or ""
    if provider == COMPRESSED and config == DEFAULT_CONFIG and n == 65536:
        return 1.3, "compressed default >= 1.3x at N = 65536"
    if provider == COMPRESSED and config == "lowrank-r8" and n == 65536:
        need = 1.5 if d <= 64 else 2.0
        return need, f"residual-free low rank >= {need:.1f}x at N = 65536, d = {d}"
    if n >= 16384 and (provider == "kvbound-dense" or (provider == COMPRESSED and config in (DEFAULT_CONFIG,
                                                                                                "lowrank-r8"))):
        return 1.0, "no regression: >= 1.0x at N >= 16384"
    return None


TARGET_PROVIDERS = ((COMPRESSED, "r8b4"), (COMPRESSED, "lowrank-r8"), (COMPRESSED, "quant-r0b4"),
                    ("kvbound-dense", ""))


def _verdict(r: dict, ratio: float | None, target: tuple[float, str] | None) -> str:
    if r["status"] != "ok":
        return f"{r['status']}" + (" (target not shown to be met)" if target else "")
    if target is None:
        return "-"
    if ratio is None:
        return "no cuDNN row"
    return "met" if ratio >= target[0] else _missed_by(ratio, target[0])


def targets_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Every kvbound row on the seed shapes (default configs and dense) against cuDNN SDPA of the same run, with
    its error next to its speed, the target that applies and the commit it was measured at (the latest row of each
    shape and provider: rows of one table can come from different runs)."""
    headers = ["shape", "provider", "config", "status", "p50 ms", "cuDNN p50 ms", "vs cuDNN", "vs cuDNN (p80..p20)",
               "rel err", "err vs dense ref", "zero tiles", "target", "verdict", "commit"]
    timed = list(index_rows(rows, "time").values())
    ratios = cudnn_ratios(rows)
    table = []
    order = {key: i for i, key in enumerate(TARGET_PROVIDERS)}
    mine = [r for r in timed if r.get("family") == "seed" and (r["provider"], r.get("config") or "") in order]
    mine.sort(key=lambda r: (r.get("head_dim_qk") or 0, r.get("q_len") or 0,
                             order[(r["provider"], r.get("config") or "")]))
    for r in mine:
        found = ratios.get(id(r))
        ratio = found[0] if found else None
        cudnn_ms = found[1]["ms_p50"] if found else None
        spread = "-"
        if found and r.get("ms_p20") and r.get("ms_p80"):
            spread = f"{cudnn_ms / r['ms_p80']:.2f}..{cudnn_ms / r['ms_p20']:.2f}"
        target = target_for(r)
        table.append([
            r["shape"], r["provider"], r.get("config") or "", r["status"], _f(r.get("ms_p50"), ".4g"),
            _f(cudnn_ms, ".4g") + ("" if not found or found[2] else " (other run)"),
            "-" if ratio is None else f"{ratio:.2f}x", spread, _f(r.get("err_rel"), ".2e"),
            _f(r.get("err_vs_dense_rel"), ".2e"), _f(r.get("zero_residual_share"), ".0%"),
            "-" if target is None else f">= {target[0]:.1f}x ({target[1]})", _verdict(r, ratio, target),
            r.get("commit") or "-"])
    return headers, table


def targets_summary(rows: list[dict]) -> str:
    """One sentence: how many targets were met, and which were missed or not measured."""
    timed = list(index_rows(rows, "time").values())
    ratios = cudnn_ratios(rows)
    met, missed = [], []
    for r in timed:
        target = target_for(r)
        if target is None:
            continue
        found = ratios.get(id(r))
        label = f"{r['shape']} {r['provider']}{'[' + r['config'] + ']' if r.get('config') else ''}"
        if r["status"] == "ok" and found and found[0] >= target[0]:
            met.append(label)
        else:
            have = f"{found[0]:.2f}x" if found else "no ratio"
            missed.append(f"{label}: {have} < {target[0]:.1f}x" if r["status"] == "ok"
                          else f"{label}: {r['status']}")
    present = {(r["shape"], r["provider"], r.get("config") or "") for r in timed}
    absent = []
    for r in _shapes(timed, "seed"):
        if (r.get("q_len") or 0) < 16384:
            continue
        for provider, config in ((COMPRESSED, DEFAULT_CONFIG), (COMPRESSED, "lowrank-r8"), ("kvbound-dense", "")):
            if (r["shape"], provider, config) not in present:
                absent.append(f"{r['shape']} {provider}{'[' + config + ']' if config else ''}")
    if not met and not missed and not absent:
        return "No timed seed-shape rows: no target can be judged.\n"
    text = f"**{len(met)} of {len(met) + len(missed) + len(absent)} speed targets met.**"
    if missed:
        text += " Missed: " + "; ".join(missed) + "."
    if absent:
        text += " Not measured (counted as not met): " + "; ".join(absent) + "."
    return text + "\n"


def traffic_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Nsight Compute bytes of every profiled provider call (``mode = ncu``), beside the formula's bytes."""
    headers = ["shape", "provider", "config", "status", "DRAM read", "DRAM write", "DRAM total", "L2->SM read",
               "SM->L2 write", "formula bytes", "DRAM / formula", "kernels"]
    latest = latest_rows(rows, "ncu", ("provider", "config", "shape"))
    latest.sort(key=lambda r: (r.get("family") or "", r.get("head_dim_qk") or 0, r.get("q_len") or 0))
    table = []
    for r in latest:
        dram = _dram(r)
        formula = r.get("bytes_moved")
        table.append([
            r["shape"], r["provider"], r.get("config") or "", r["status"], format_bytes(r.get("dram_read_bytes")),
            format_bytes(r.get("dram_write_bytes")), format_bytes(dram), format_bytes(r.get("l2_read_bytes")),
            format_bytes(r.get("l2_write_bytes")), format_bytes(formula),
            "-" if not dram or not formula else f"{dram / formula:.2f}", _f(r.get("ncu_kernels"), ".0f")])
    return headers, table


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
               "formula ratio", "DRAM cuDNN (ncu)", "DRAM kvbound (ncu)", "measured ratio", "design figure"]
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
            f"{DESIGN_TRAFFIC_FIGURES[shape['q_len']]:.1f}x" if shape["q_len"] in DESIGN_TRAFFIC_FIGURES else "-",
        ])
    return headers, table


def _config_rows(rows: list[dict], configs, family: str = "seed") -> tuple[list[str], list[list[str]]]:
    timed, profiled = index_rows(rows, "time"), index_rows(rows, "ncu")
    headers = ["shape", "config", "rank", "bits", "tau", "K/V ratio", "zero tiles", "err vs dense ref",
               "p50 ms", "vs kvbound-dense", "vs cuDNN", "DRAM (ncu)", "traffic ratio (formula)",
               "design figure"]
    table = []
    same_run = cudnn_ratios(rows)
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
                              r["status"], (r.get("reason") or "")[:60], "-", "-", "-", _claim(label)])
                continue
            ms = r.get("ms_p50")
            table.append([
                name, title, str(r["rank"]), str(r["bits"]), f"{r['tau']:g}",
                "-" if r.get("compression_ratio") is None else f"{r['compression_ratio']:.2f}x",
                "-" if r.get("zero_residual_share") is None else f"{r['zero_residual_share']:.0%}",
                "-" if r.get("err_vs_dense_rel") is None else f"{r['err_vs_dense_rel']:.2e}",
                "-" if ms is None else f"{ms:.4g}" + ("" if r["status"] == "ok" else " (check failed)"),
                _ratio(dense["ms_p50"] if dense else None, ms),
                "-" if id(r) not in same_run else f"{same_run[id(r)][0]:.2f}x",
                format_bytes(_dram(profiled.get((COMPRESSED, label, name)))),
                _ratio(cudnn["bytes_moved"] if cudnn else None, r.get("bytes_moved")), _claim(label),
            ])
    return headers, table


def _claim(label: str) -> str:
    return f"{DESIGN_CONFIG_FIGURES[label]:.1f}x" if label in DESIGN_CONFIG_FIGURES else "-"


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
    """``kvbound.calibrate`` over all layers of one model (the attention suite's ``calibrate`` rows): the latest
    run per model, with the range over every run recorded."""
    headers = ["model", "seconds per model load", "range over runs (runs)", "what was calibrated", "device",
               "commit", "design figure"]
    ok = [r for r in rows if r["mode"] == "calibrate" and r["status"] == "ok" and r.get("suite") != "encoder"]
    table = []
    for r in latest_rows(ok, "calibrate", ("shape",)):
        seconds = [x["ms_p50"] / 1e3 for x in ok if x["shape"] == r["shape"]]
        table.append([r["shape"], f"{r['ms_p50'] / 1e3:.3f}", f"{min(seconds):.3f}-{max(seconds):.3f} ({len(seconds)})",
                      r.get("note") or "", r.get("gpu") or "", r.get("commit") or "", f"{DESIGN_CALIBRATION_S:g} s"])
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


def latest_model_rows(rows: list[dict]) -> list[dict]:
    """``--suite models`` rows, the latest of each (variant, model, batch) among the runs without ``KVBOUND_*``
    switches (``records.default_settings``)."""
    return latest_rows([r for r in rows if default_settings(r)], "model", ("provider", "shape", "batch"))


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


MODEL_VARIANTS = ("unpatched", "patch-dense", "patch-compressed", "unpatched-graph", "patch-dense-graph",
                  "patch-compressed-graph")


# Whole-forward speed-up over the unpatched port, per full-size port; attention modules against the port's own.
MODEL_FORWARD_TARGETS = {"enformer": 1.3, "borzoi": 1.8, "alphagenome": 1.3}
MODEL_MODULE_TARGET = 10.0
# The stock alternatives of kvbound.bench.alternatives (named here: this module imports no torch).
RELATIVE_ALTERNATIVES = ("sdpa-built-bias", "flex-built-table")
MODEL_ALTERNATIVES = (*RELATIVE_ALTERNATIVES, "flex-tile-bias")


def _ok_ms(r: dict | None, column: str = "ms_p50") -> float | None:
    return r.get(column) if r is not None and r["status"] == "ok" and r.get(column) else None


def _x(ratio: float, target: float) -> str:
    """``ratio`` as ``1.23x``, with a third decimal where two would round it onto the other side of ``target``
    (1.796 against 1.8 reads 1.796x, not 1.80x)."""
    text = f"{ratio:.2f}x"
    return text if (round(ratio, 2) >= target) == (ratio >= target) else f"{ratio:.3f}x"


def _missed_by(ratio: float, target: float) -> str:
    """``MISSED (92% of the target)``, with a decimal where a whole percent would round a miss up to 100%."""
    share = ratio / target
    return f"MISSED ({share:.0%} of the target)" if round(share, 2) < 1 else f"MISSED ({share:.1%} of the target)"


def _met(ratio: float | None, target: float) -> str:
    if ratio is None:
        return "not measured"
    return "met" if ratio >= target else _missed_by(ratio, target)


def _latest_run_with(runs: list[dict[str, dict]], needed: tuple[str, ...],
                     any_of: tuple[str, ...] = ()) -> dict[str, dict] | None:  # fmt: skip
    """The latest of ``runs`` (one model and batch, oldest first) whose ok rows include every variant of ``needed``
    and, when ``any_of`` is given, at least one of those."""
    for variants in reversed(runs):
        ok = {name for name, r in variants.items() if _ok_ms(r) is not None}
        if set(needed) <= ok and (not any_of or ok & set(any_of)):
            return variants
    return None


def model_targets(rows: list[dict]) -> list[dict]:
    """Per full-size port and batch, the targets of the models suite, each judged within one run (one process,
    side by side): the whole forward patched with dense K/V against the unpatched port (eager, and in CUDA graphs
    where the run has both graph variants), the attention modules against the port's own (10x), and the patched
    forward against the fastest stock alternative of the latest run that has one. Each entry keeps the rows it used."""
    every = [r for r in rows if r["mode"] == "model" and default_settings(r) and r.get("shape") in
             MODEL_FORWARD_TARGETS]  # fmt: skip
    by_run: dict[tuple, dict[str, dict]] = {}
    for r in every:
        by_run.setdefault((r["shape"], r["batch"], _run_key(r)), {})[r["provider"]] = r
    runs: dict[tuple, list[dict[str, dict]]] = {}  # (model, batch) -> its runs, oldest first
    for (model, batch, _), variants in sorted(by_run.items(), key=lambda kv: kv[0][2][1] or ""):
        runs.setdefault((model, batch), []).append(variants)
    out = []
    for key in dict.fromkeys((m, b) for m, b, _ in by_run):
        base = _latest_run_with(runs[key], ("unpatched", "patch-dense"))
        graphs = _latest_run_with(runs[key], ("unpatched-graph", "patch-dense-graph"))
        compressed = _latest_run_with(runs[key], ("unpatched", "patch-compressed"))
        compressed_graphs = _latest_run_with(runs[key], ("unpatched-graph", "patch-compressed-graph"))
        versus = _latest_run_with(runs[key], ("patch-dense",), MODEL_ALTERNATIVES)
        if base is None and versus is None:
            continue
        entry: dict = {"model": key[0], "batch": key[1], "forward_target": MODEL_FORWARD_TARGETS[key[0]]}
        if base is not None:
            unpatched, patched = base["unpatched"], base["patch-dense"]
            entry.update(unpatched=unpatched, patched=patched,
                         forward=unpatched["ms_p50"] / patched["ms_p50"])  # fmt: skip
            attention = _ok_ms(unpatched, "attention_ms_p50"), _ok_ms(patched, "attention_ms_p50")
            entry["modules"] = attention[0] / attention[1] if None not in attention else None
        if graphs is not None:
            entry["graph"] = graphs["unpatched-graph"]["ms_p50"] / graphs["patch-dense-graph"]["ms_p50"]
            entry["graph_rows"] = graphs
        if compressed is not None:
            entry["compressed"] = compressed["unpatched"]["ms_p50"] / compressed["patch-compressed"]["ms_p50"]
            entry["compressed_row"] = compressed["patch-compressed"]
        if compressed_graphs is not None:
            entry["compressed_graph"] = (compressed_graphs["unpatched-graph"]["ms_p50"]
                                         / compressed_graphs["patch-compressed-graph"]["ms_p50"])  # fmt: skip
        if versus is not None:
            alternatives = [versus[a] for a in MODEL_ALTERNATIVES if _ok_ms(versus.get(a)) is not None]
            best = min(alternatives, key=lambda r: r["ms_p50"])
            entry.update(alternative=best, alternative_patched=versus["patch-dense"],
                         versus=best["ms_p50"] / versus["patch-dense"]["ms_p50"])  # fmt: skip
        entry["date"] = max(r.get("date") or "" for r in (entry.get("unpatched"), entry.get("alternative")) if r)
        out.append(entry)
    order = list(MODEL_FORWARD_TARGETS)
    newest = {m: max(e["date"] for e in out if e["model"] == m) for m in {e["model"] for e in out}}
    for e in out:  # measured at an older date than the model's newest run: listed, not counted
        day = newest[e["model"]][:10]
        e["older"] = e["date"][:10] < day
        # Within a counted entry, a judgment whose own run is older (e.g. the unpatched port ran out of memory in
        # the newest run, which still timed the alternatives) is shown with its day and not counted either.
        if "unpatched" in e:
            e["forward_older"] = (e["unpatched"].get("date") or "")[:10] < day
        if "compressed_row" in e:
            e["compressed_older"] = (e["compressed_row"].get("date") or "")[:10] < day
    return sorted(out, key=lambda e: (order.index(e["model"]), e["older"], e["batch"]))


def gpu_label(name: str | None) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``: the model of a device name, else the name (``-`` when unknown)."""
    found = re.search(r"\b[A-Z]{1,2}\d{2,4}\b", name or "")
    return found.group(0) if found else (name or "-")


def model_targets_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``model_targets`` as a table: each speed-up with its target, its verdict and the commit and GPU of its
    runs (a model's batches may come from different machines; each target is judged within one run)."""
    headers = ["model", "batch", "day", "forward ms: unpatched / patched", "forward speed-up", "verdict",
               "in CUDA graphs", "compressed K/V", "attention modules ms", "modules speed-up", "verdict (10x)",
               "best alternative (ms)", "patched vs it", "verdict", "peak GiB: unpatched / patched / alternative",
               "commits (GPU)"]  # fmt: skip
    table = []
    for e in model_targets(rows):
        target = e["forward_target"]
        u, p, alt = e.get("unpatched"), e.get("patched"), e.get("alternative")
        peaks = [_gib(r.get("peak_bytes")) if r is not None else "-" for r in (u, p, alt)]
        graph = e.get("graph")
        rows_used = (u, alt, e.get("compressed_row"), *(e.get("graph_rows") or {}).values())
        commits = dict.fromkeys(f"{r.get('commit') or '-'} ({gpu_label(r.get('gpu'))})" for r in rows_used
                                if r is not None)  # fmt: skip
        squeezed = "-"
        if "compressed" in e:
            squeezed = f"{_x(e['compressed'], target)} ({_met(e['compressed'], target)})"
            if e["compressed_older"]:
                squeezed += f", {(e['compressed_row'].get('date') or '')[:10]}, not counted"
        if "compressed_graph" in e:
            squeezed += f"; in CUDA graphs {_x(e['compressed_graph'], target)} ({_met(e['compressed_graph'], target)})"
        # an older forward judgment inside a counted entry: its day, not counted (model_targets)
        stale = "" if u is None or e["older"] or not e["forward_older"] else \
            f", {(u.get('date') or '')[:10]}, not counted"
        table.append([
            e["model"], str(e["batch"]), e["date"][:10] + (" (older)" if e["older"] else ""),
            "-" if u is None else f"{u['ms_p50']:.4g} / {p['ms_p50']:.4g}",
            "-" if u is None else f"{_x(e['forward'], target)} (>= {target}x)",
            "-" if u is None else _met(e["forward"], target) + stale,
            "-" if graph is None else f"{_x(graph, target)} ({_met(graph, target)})", squeezed,
            "-" if u is None or e["modules"] is None else
            f"{u['attention_ms_p50']:.4g} / {p['attention_ms_p50']:.4g}",
            "-" if e.get("modules") is None else f"{e['modules']:.1f}x",
            "-" if u is None else _met(e.get("modules"), MODEL_MODULE_TARGET) + stale,
            "-" if alt is None else f"{alt['provider']} ({alt['ms_p50']:.4g})",
            "-" if alt is None else _x(e["versus"], 1.0),
            "-" if alt is None else _met(e["versus"], 1.0),
            " / ".join(peaks), ", ".join(commits),
        ])  # fmt: skip
    return headers, table


def model_targets_summary(rows: list[dict]) -> str:
    """One sentence: how many of the models' targets (forward, modules, against the best alternative) are met."""
    met, missed, older, older_met, older_total = 0, [], [], 0, 0
    for e in model_targets(rows):
        where = f"{e['model']} batch {e['batch']}"
        checks = []
        if e.get("unpatched") is not None:
            forward = [("forward", e["forward"], e["forward_target"]), ("modules", e["modules"], MODEL_MODULE_TARGET)]
            if e["older"] or not e["forward_older"]:
                checks += forward
            else:  # this batch's newest run has no unpatched forward: the older one is listed, not counted
                older.append(f"{where} forward and modules")
                older_total += len(forward)
                older_met += sum(ratio is not None and ratio >= target for _, ratio, target in forward)
        if e.get("alternative") is not None:
            checks.append(("vs best alternative", e["versus"], 1.0))
        if "compressed" in e and (e["older"] or not e["compressed_older"]):
            checks.append(("compressed forward", e["compressed"], e["forward_target"]))
        if e["older"]:
            older.append(where)
            older_total += len(checks)
            older_met += sum(ratio is not None and ratio >= target for _, ratio, target in checks)
            continue
        for what, ratio, target in checks:
            if ratio is not None and ratio >= target:
                met += 1
            else:
                shown = "not measured" if ratio is None else f"{_x(ratio, target)} < {target}x"
                missed.append(f"{where} {what}: {shown}")
    total = met + len(missed)
    text = f"**{met} of {total} model targets met** (each model's batches measured on its newest day of runs)."
    text += f" Missed: {'; '.join(missed)}." if missed else ""
    return text + (f" Measured only on earlier days, listed below and not counted: {', '.join(older)} "
                   f"({older_met} of {older_total} of their targets met there)." if older else "")  # fmt: skip


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def models_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite models``: whole forwards per (model, batch, variant), the latest run of each variant measured without
    ``KVBOUND_*`` switches (a run with them is listed with the others of its commit, its switches in the note).
    Where the newest commit of a (model, batch) was measured more than once (repeated runs, each its own process),
    every run of that commit is listed, one row per variant and run: a model forward at batch 1 waits on the host,
    and its time can vary between runs far beyond one run's p20-p80. ``vs unpatched`` divides by the unpatched
    forward of the same run (same commit and command line) where that run has one, else by the latest unpatched
    row, marked ``*``."""
    headers = ["model", "batch", "variant", "status", "forward p50 ms", "p20-p80 ms", "vs unpatched",
               "attention p50 ms", "attention share", "peak GiB", "peak above baseline GiB", "K+V ratio",
               "max abs diff", "rel diff", "calibration s", "encode ms / forward", "commit", "note / reason"]
    every = [r for r in rows if r["mode"] == "model"]
    latest = latest_model_rows(rows)
    unpatched = {(r["shape"], r["batch"], r.get("commit"), r.get("command")): r for r in every
                 if r["provider"] == "unpatched" and r.get("ms_p50")}

    def order(r: dict) -> int:
        return MODEL_VARIANTS.index(r["provider"]) if r["provider"] in MODEL_VARIANTS else 9

    table = []
    for model, batch in dict.fromkeys((r["shape"], r["batch"]) for r in latest):
        mine = sorted((r for r in latest if r["shape"] == model and r["batch"] == batch), key=order)
        base = next((r for r in mine if r["provider"] == "unpatched" and r.get("ms_p50")), None)
        shown = list(mine)
        if base is not None:  # the newest commit's other runs of this (model, batch), run by run in the order read
            shown_ids = {id(r) for r in mine}
            extra = [r for r in every if r["shape"] == model and r["batch"] == batch and id(r) not in shown_ids
                     and r.get("commit") == base.get("commit") and r.get("command") != base.get("command")]
            commands = list(dict.fromkeys(r.get("command") for r in extra))
            shown += sorted(extra, key=lambda r: (commands.index(r.get("command")), order(r)))
        for r in shown:
            ms, att = r.get("ms_p50"), r.get("attention_ms_p50")
            own = unpatched.get((model, batch, r.get("commit"), r.get("command")))
            ref, mark = (own, "") if own is not None else (base, "*")
            above = (None if r.get("peak_bytes") is None or r.get("baseline_bytes") is None
                     else r["peak_bytes"] - r["baseline_bytes"])
            table.append([
                model, str(batch), r["provider"], r["status"], _f(ms, ".4g"), _spread(r),
                "-" if not ref or not ms else f"{ref['ms_p50'] / ms:.2f}x{mark}", _f(att, ".4g"),
                "-" if not ms or att is None else f"{att / ms:.0%}", _gib(r.get("peak_bytes")), _gib(above),
                _f(r.get("compression_ratio"), ".2f"), _f(r.get("diff_max_abs"), ".2e"), _f(r.get("diff_rel"), ".2e"),
                "-" if r.get("calibration_ms") is None else f"{r['calibration_ms'] / 1e3:.3f}",
                _f(r.get("compress_ms"), ".3g"), r.get("commit") or "-",
                "; ".join(x for x in (" ".join(row_settings(r)), _why(r, 90)) if x)])
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


RING_TIME_TARGET = 0.6  # 2-GPU time per layer at most 0.6x the 1-GPU time ...
RING_TIME_TARGET_MIN_N = 131_072  # ... at N >= 131,072
RING_BYTES_TARGET = 3.5  # compressed ring: at least 3.5x fewer bytes on the wire than dense


def ring_scaling_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite ring``: 2-process time over 1-process time per (N, provider), and bytes on the wire, with targets."""
    headers = ["N", "d", "provider", "1 process p50 ms", "2 processes p50 ms", "2 / 1", "time target",
               "dense / sent", "bytes target"]
    latest = [r for r in latest_rows(rows, "ring", ("provider", "shape", "world_size")) if r["status"] == "ok"]
    by_key = {(r.get("q_len"), r.get("head_dim_qk"), r["provider"], r.get("world_size")): r for r in latest}
    table = []
    for (n, d, provider, world), two in sorted(by_key.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0] or 0,
                                                                                  str(kv[0][2]))):
        if world != 2:
            continue
        one = by_key.get((n, d, provider, 1))
        ratio = two["ms_p50"] / one["ms_p50"] if one and one.get("ms_p50") and two.get("ms_p50") else None
        if ratio is None:
            time_verdict = "no 1-process row"
        elif (n or 0) < RING_TIME_TARGET_MIN_N:
            time_verdict = "- (below the target's N)"
        else:
            time_verdict = "met" if ratio <= RING_TIME_TARGET else "MISSED"
        sent, dense = two.get("bytes_sent"), two.get("dense_bytes_sent")
        reduction = dense / sent if sent and dense else None
        if provider != "ring-compressed" or reduction is None:
            bytes_verdict = "-"
        else:
            bytes_verdict = "met" if reduction >= RING_BYTES_TARGET else "MISSED"
        table.append([str(n), str(d), provider, _f(one.get("ms_p50") if one else None, ".4g"),
                      _f(two.get("ms_p50"), ".4g"), "-" if ratio is None else f"{ratio:.2f}x",
                      f"{time_verdict} (<= {RING_TIME_TARGET}x at N >= {RING_TIME_TARGET_MIN_N})"
                      if ratio is not None and (n or 0) >= RING_TIME_TARGET_MIN_N else time_verdict,
                      "-" if reduction is None else f"{reduction:.2f}x",
                      f"{bytes_verdict} (>= {RING_BYTES_TARGET}x)" if bytes_verdict != "-" else "-"])
    return headers, table


# ------------------------------------------------------------------------------------------- older schemas
LEGACY_ENCODER_COLUMNS = ("encoder", "shape", "ms", "input_GBps", "copy_ms", "ratio", "max_err_over_tau")
LEGACY_PUBLIC_API_COLUMNS = ("N", "heads", "d", "cudnn_ms", "kvbound_compressed_ms", "kvbound_dense_ms")


def relative_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """``--suite relative``: each provider's time on one relative-position attention layer, against the ports'
    math and against the faster of the alternatives a user could assemble (SDPA or FlexAttention with the
    position term built for them), with the allocator's peak."""
    headers = ["layer", "B", "provider", "config", "status", "p50 ms", "vs port-eager", "vs best alternative",
               "peak GiB", "rel err", "K/V ratio", "compress ms", "reason"]
    # one row per layer, batch and provider (and codec config): the latest run's, whatever its other columns
    # (a FlexAttention row records the kernel_options that compiled in its config)
    latest = latest_rows([r for r in rows if r.get("family") == "relative"], "time",
                         ("shape", "provider", "rank", "bits", "tau"))
    by_shape: dict[str, list[dict]] = {}
    for r in latest:
        by_shape.setdefault(r["shape"], []).append(r)
    table = []
    order = {"port-eager": 0, "sdpa-built-bias": 1, "flex-built-table": 2, "kvbound-relative": 3,
             "kvbound-relative-runs": 4, "kvbound-relative-deferred": 5, "kvbound-relative-runs-deferred": 6,
             "kvbound-relative-compressed": 7}
    for shape, group in by_shape.items():
        ok = {r["provider"]: r["ms_p50"] for r in group if r["status"] == "ok" and r.get("ms_p50")}
        port = ok.get("port-eager")
        alternatives = [ok[name] for name in RELATIVE_ALTERNATIVES if name in ok]
        best = min(alternatives) if alternatives else None
        for r in sorted(group, key=lambda r: order.get(r["provider"], 9)):
            ms = r.get("ms_p50") if r["status"] == "ok" else None
            table.append([
                shape.rsplit("-b", 1)[0], str(r["batch"]), r["provider"], r.get("config") or "", r["status"],
                _f(r.get("ms_p50"), ".4g"), _ratio(port, ms), _ratio(best, ms),
                _f(r["peak_bytes"] / 2**30 if r.get("peak_bytes") is not None else None, ".2f"),
                _f(r.get("err_rel"), ".2e"), _f(r.get("compression_ratio"), ".2f"), _f(r.get("compress_ms"), ".3g"),
                _why(r, 80),
            ])
    return headers, table


def share_points(rows: list[dict], provider_name: str = COMPRESSED) -> list[dict]:
    """The residual-free share sweep (shapes of family ``share``): per head dim and measured share, the latest
    ok row of ``provider_name`` (kvbound-compressed, or its ``-split`` variant) of the default config with its
    same-run cuDNN ratio, sorted by (d, share)."""
    ratios = cudnn_ratios(rows)
    latest = index_rows([r for r in rows if r.get("family") == "share"], "time")
    points = []
    for (provider, config, _), r in latest.items():
        if provider != provider_name or config != DEFAULT_CONFIG or r["status"] != "ok" or not r.get("ms_p50"):
            continue
        found = ratios.get(id(r))
        points.append({"row": r, "d": r["head_dim_qk"], "share": r.get("zero_residual_share"),
                       "ratio": found[0] if found else None, "cudnn": found[1] if found else None,
                       "same_run": bool(found and found[2])})
    return sorted(points, key=lambda p: (p["d"], -1.0 if p["share"] is None else p["share"]))


def share_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """How the default config's speed against cuDNN depends on the share of residual-free K/V blocks, with the
    one-launch and split-launch variants (``-one``, ``-split``) in their own columns where the run has them."""
    variants = (("one launch", COMPRESSED + "-one"), ("split launch", COMPRESSED + "-split"))
    headers = ["N", "d", "residual-free blocks", "kvbound p50 ms", "cuDNN p50 ms", "vs cuDNN", "K/V ratio",
               "rel err", "err vs dense ref"]
    for label, _ in variants:
        headers += [f"{label} p50 ms", f"{label.split()[0]} vs cuDNN"]
    headers.append("split rel err")
    found = {name: {p["row"]["shape"]: p for p in share_points(rows, name)} for _, name in variants}
    table = []
    for p in share_points(rows):
        r = p["row"]
        cudnn = p["cudnn"]["ms_p50"] if p["cudnn"] else None
        line = [str(r["q_len"]), str(p["d"]), _f(p["share"], ".1%"), _f(r["ms_p50"], ".4g"),
                _f(cudnn, ".4g") + ("" if p["same_run"] or cudnn is None else " (other run)"),
                _f(p["ratio"], ".2f") + ("x" if p["ratio"] is not None else ""),
                _f(r.get("compression_ratio"), ".2f"), _f(r.get("err_rel"), ".2e"),
                _f(r.get("err_vs_dense_rel"), ".2e")]
        for _, name in variants:
            other = found[name].get(r["shape"])
            ms = "-" if other is None else _f(other["row"]["ms_p50"], ".4g")
            if other is not None and _run_key(other["row"]) != _run_key(r):
                ms += " (other run)"
            line += [ms, "-" if other is None or other["ratio"] is None else f"{other['ratio']:.2f}x"]
        split = found[COMPRESSED + "-split"].get(r["shape"])
        line.append("-" if split is None else _f(split["row"].get("err_rel"), ".2e"))
        table.append(line)
    return headers, table


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
        ("speed targets vs cuDNN SDPA", targets_table(rows)),
        ("measured traffic (Nsight Compute)", traffic_table(rows)),
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
