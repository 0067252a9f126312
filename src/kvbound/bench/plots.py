"""PNG plots drawn from result CSVs (never from a live run): speed vs N, bytes vs (rank, bits), roofline, model
forwards per variant (``--suite models``) and the context-parallel ring vs N (``--suite ring``).

    python -m kvbound.bench.plots benchmarks/results/*.csv --out-dir benchmarks/plots
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "speed_vs_n",
    "speed_vs_share",
    "bytes_vs_rank_bits",
    "draw_roofline",
    "model_forwards",
    "model_speedups",
    "ring_vs_n",
    "main",
    "provider_label",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def provider_label(row: dict) -> str:
    config = row.get("config") or ""
    if row["provider"] == "kvbound-compressed":
        return f"kvbound[{config}]"
    if row["provider"] == "kvbound-compressed-deferred":
        return f"kvbound[{config}] deferred"
    return row["provider"]


def _footer(rows: list[dict]) -> str:
    gpus = sorted({r.get("gpu") or "?" for r in rows})
    commits = sorted({(r.get("commit") or "?")[:12] for r in rows})
    dates = sorted({(r.get("date") or "?")[:10] for r in rows})
    return f"{', '.join(gpus)} | commit {', '.join(commits)} | {', '.join(dates)}"


def speed_vs_n(rows: list[dict], path: str | Path, family: str = "seed") -> Path | None:
    """TFLOP/s (median) vs sequence length, one line per provider/config, one panel per head dim."""
    from kvbound.bench.tables import index_rows

    timed = [
        r
        for r in index_rows(rows, "time").values()
        if r["status"] == "ok" and r.get("family") == family and r.get("tflops")
    ]
    if not timed:
        return None
    plt = _pyplot()
    dims = sorted({r["head_dim_qk"] for r in timed})
    fig, axes = plt.subplots(1, len(dims), figsize=(6 * len(dims) + 2.5, 4.5), squeeze=False)
    # One style per series across both panels: the fused baselines black/grey and dashed, kvbound's in distinct
    # colours (tab20 holds 20: no two series share a colour, as they did with the default 10-colour cycle).
    labels = sorted({provider_label(r) for r in timed})
    kvbound = [label for label in labels if label.startswith("kvbound")]
    others = [label for label in labels if not label.startswith("kvbound")]
    cmap = plt.get_cmap("tab20")
    greys = ["black", "dimgrey", "darkgrey", "silver", "lightgrey"]
    markers = ["o", "s", "^", "v", "D", "P", "X", "<", ">"]
    style = {label: dict(color=cmap(i % 20), marker=markers[i % len(markers)], linestyle=":" if "deferred" in label
                         else "-") for i, label in enumerate(kvbound)}  # fmt: skip
    style.update(
        {label: dict(color=greys[i % len(greys)], marker="s", linestyle="--") for i, label in enumerate(others)}
    )
    for ax, d in zip(axes[0], dims, strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in timed:
            if r["head_dim_qk"] == d:
                series.setdefault(provider_label(r), []).append((r["q_len"], r["tflops"]))
        for label, points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style[label])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s (2·B·H·N²·(Dk+Dv) / median time)")
        ax.set_title(f"d = {d}")
        ax.grid(True, alpha=0.3)
    handles, names = axes[0][-1].get_legend_handles_labels()
    for ax in axes[0][:-1]:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            if name not in names:
                handles.append(handle)
                names.append(name)
    fig.legend(handles, names, loc="center right", fontsize=7)
    fig.suptitle("attention speed vs N\n" + _footer(timed), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (6 * len(dims) + 2.5), 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speed_vs_share(rows: list[dict], path: str | Path) -> Path | None:
    """Compressed attention (default config) against cuDNN vs the share of residual-free K/V blocks, per d."""
    from kvbound.bench.tables import share_points

    def plotted(provider: str) -> list[dict]:
        return [p for p in share_points(rows, provider) if p["ratio"] is not None and p["share"] is not None]

    points = plotted("kvbound-compressed")
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    variants = (
        ("kvbound-compressed-one", "one launch", "v", "--"),
        ("kvbound-compressed-split", "split launch", "s", ":"),
    )
    for d in sorted({p["d"] for p in points}):
        mine = [p for p in points if p["d"] == d]
        line = ax.plot([100 * p["share"] for p in mine], [p["ratio"] for p in mine], marker="o", label=f"d = {d}")
        for provider, label, marker, style in variants:
            theirs = [p for p in plotted(provider) if p["d"] == d]
            if theirs:
                ax.plot(
                    [100 * p["share"] for p in theirs],
                    [p["ratio"] for p in theirs],
                    marker=marker,
                    linestyle=style,
                    color=line[0].get_color(),
                    alpha=0.6,
                    label=f"d = {d}, {label}",
                )
    for level, text in ((1.0, "cuDNN"), (1.3, "target 1.3x")):
        ax.axhline(level, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(text, (0, level), xytext=(2, 2), textcoords="offset points", fontsize=7, color="grey")
    ax.set_xlabel("K/V blocks whose residual is below tau (%)")
    ax.set_ylabel("speed vs cuDNN SDPA (cuDNN time / kvbound time)")
    ax.set_title("kvbound compressed attention (r8b4), N = 65536, 8 heads, bf16")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_footer([p["row"] for p in points]), fontsize=8, y=0.995)
    fig.tight_layout()
    return _save(fig, path)


def bytes_vs_rank_bits(rows: list[dict], path: str | Path) -> Path | None:
    """K/V storage ratio (dense bytes / CompressedKV.nbytes) per config, grouped by shape."""
    comp = [
        r
        for r in rows
        if r["provider"] == "kvbound-compressed"
        and r["status"] in ("ok", "check_failed")
        and r.get("compression_ratio")
        and r["mode"] in ("time", "ncu")
    ]
    if not comp:
        return None
    plt = _pyplot()
    latest: dict[tuple[str, str], dict] = {}
    for r in sorted(comp, key=lambda r: r.get("date") or ""):
        latest[(r["shape"], r["config"])] = r
    shapes = list(dict.fromkeys(r["shape"] for r in comp))
    configs = list(dict.fromkeys(r["config"] for r in comp))
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(shapes) + 5), 4.5))
    for j, config in enumerate(configs):
        xs, ys = [], []
        for i, shape in enumerate(shapes):
            r = latest.get((shape, config))
            if r is not None:
                xs.append(i + (j - (len(configs) - 1) / 2) * width)
                ys.append(r["compression_ratio"])
        sample = next(r for r in comp if r["config"] == config)
        ax.bar(xs, ys, width=width, label=f"{config} (r={sample['rank']}, {sample['bits']} bit)")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("K+V dense bytes / CompressedKV.nbytes")
    ax.set_title("K/V bytes vs (rank, bits)\n" + _footer(comp), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _save(fig, path: str | Path) -> Path:
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def model_forwards(rows: list[dict], path: str | Path) -> Path | None:
    """Whole-forward time per (model, batch) and variant, attention modules' share hatched; and, when measured,
    the allocator's peak above the baseline (CUDA)."""
    from kvbound.bench.tables import MODEL_VARIANTS, latest_model_rows

    timed = [r for r in latest_model_rows(rows) if r["status"] == "ok" and r.get("ms_p50")]
    if not timed:
        return None
    plt = _pyplot()
    groups = list(dict.fromkeys((r["shape"], r["batch"]) for r in timed))
    variants = [v for v in MODEL_VARIANTS if any(r["provider"] == v for r in timed)]
    variants += sorted({r["provider"] for r in timed} - set(variants))
    peaks = {id(r) for r in timed if r.get("peak_bytes") is not None and r.get("baseline_bytes") is not None}
    panels = 2 if peaks else 1
    fig, axes = plt.subplots(1, panels, figsize=(max(7, 1.6 * len(groups) + 4) * panels * 0.75 + 2, 4.8), squeeze=False)
    width = 0.8 / len(variants)
    by = {(r["shape"], r["batch"], r["provider"]): r for r in timed}
    for j, variant in enumerate(variants):
        offset = (j - (len(variants) - 1) / 2) * width
        xs = [i + offset for i, g in enumerate(groups) if (*g, variant) in by]
        mine = [by[(*g, variant)] for g in groups if (*g, variant) in by]
        axes[0][0].bar(xs, [r["ms_p50"] for r in mine], width=width, color=f"C{j}", label=f"{variant}: forward")
        axes[0][0].bar(
            xs,
            [r.get("attention_ms_p50") or 0.0 for r in mine],
            width=width * 0.6,
            color="none",
            edgecolor="black",
            hatch="//",
            label="attention modules" if j == 0 else None,
        )
        if peaks:
            mine_peak = [r for r in mine if id(r) in peaks]
            axes[0][1].bar(
                [x for x, r in zip(xs, mine, strict=True) if id(r) in peaks],
                [(r["peak_bytes"] - r["baseline_bytes"]) / 2**30 for r in mine_peak],
                width=width,
                color=f"C{j}",
                label=variant,
            )
    labels = [f"{name}\nB={batch}" for name, batch in groups]
    axes[0][0].set_yscale("log")
    axes[0][0].set_ylabel("ms per forward (median; hatched: attention modules)")
    axes[0][0].set_title("whole forward, bf16 autocast")
    if peaks:
        axes[0][1].set_ylabel("GiB allocated above the baseline during one forward")
        axes[0][1].set_title("peak memory (torch.cuda.max_memory_allocated)")
    for ax in axes[0]:
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("genomic ports: unpatched vs kvbound.patch\n" + _footer(timed), fontsize=9)
    return _save(fig, path)


# The whole-forward targets of kvbound.patch (issue text; benchmarks, not tests).
MODEL_TARGETS = {"enformer": 1.3, "borzoi": 1.8, "alphagenome": 1.3}


def model_speedups(rows: list[dict], path: str | Path) -> Path | None:
    """Whole-forward speed-up over the unpatched port of the same run (same commit and command line), per (model,
    batch), for the patched variants, and for the graph-replayed patched forward against both the eager and the
    graph-replayed unpatched one; the target of each model drawn over its groups. The latest run of each (model,
    batch) measured without ``KVBOUND_*`` switches, its commit under the group's label."""
    from kvbound.bench.tables import latest_model_rows

    timed = [r for r in latest_model_rows(rows)
             if r["status"] == "ok" and r.get("ms_p50") and r["shape"] in MODEL_TARGETS]  # fmt: skip
    own = {(r["shape"], r["batch"], r.get("commit"), r.get("command"), r["provider"]): r["ms_p50"] for r in timed}
    bars = (("patch-dense", "unpatched", "patched dense"),
            ("patch-compressed", "unpatched", "patched compressed"),
            ("patch-dense-graph", "unpatched", "patched dense, CUDA graph / unpatched eager"),
            ("patch-dense-graph", "unpatched-graph", "patched dense / unpatched, both CUDA graphs"))  # fmt: skip
    values: dict[tuple, float] = {}
    for r in timed:
        for variant, base, label in bars:
            ref = own.get((r["shape"], r["batch"], r.get("commit"), r.get("command"), base))
            if r["provider"] == variant and ref:
                values[(r["shape"], int(r["batch"]), label)] = ref / r["ms_p50"]
    if not values:
        return None
    # Batches with a speed-up to show (not those whose unpatched forward failed, e.g. out of memory).
    order = list(MODEL_TARGETS)
    groups = sorted({key[:2] for key in values}, key=lambda g: (order.index(g[0]), g[1]))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(groups) + 3), 4.6))
    width = 0.8 / len(bars)
    for j, (_, _, label) in enumerate(bars):
        xs = [i + (j - (len(bars) - 1) / 2) * width for i, g in enumerate(groups) if (*g, label) in values]
        ys = [values[(*g, label)] for g in groups if (*g, label) in values]
        if xs:
            ax.bar(xs, ys, width=width, color=f"C{j}", label=label)
            for x, y in zip(xs, ys, strict=True):
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
    for i, (model, _) in enumerate(groups):
        ax.hlines(MODEL_TARGETS[model], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                  label="target" if i == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    from kvbound.bench.tables import gpu_label

    commit_of = {(r["shape"], int(r["batch"])): f"{(r.get('commit') or '?')[:7]} {gpu_label(r.get('gpu'))}"
                 for r in timed if r["provider"] == "unpatched"}  # the eager bars' run  # fmt: skip
    ax.set_xticklabels([f"{model}\nB={batch}\n{commit_of.get((model, batch), '?')}" for model, batch in groups],
                       fontsize=8)
    ax.set_ylabel("whole-forward speed-up over the unpatched port (median times)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    commits = {r.get("commit") for r in timed}
    ax.set_title("kvbound.patch, whole forward, bf16 autocast" + ("" if len(commits) == 1 else " (latest run of each)"))
    fig.suptitle(_footer(timed), fontsize=8)
    return _save(fig, path)


def ring_vs_n(rows: list[dict], path: str | Path) -> Path | None:
    """Context-parallel attention: ms per layer and bytes sent per rank vs N, one line per (provider, processes)."""
    from kvbound.bench.tables import latest_rows

    timed = [
        r
        for r in latest_rows(rows, "ring", ("provider", "shape", "world_size"))
        if r["status"] == "ok" and r.get("ms_p50")
    ]
    if not timed:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), squeeze=False)
    series: dict[str, list[dict]] = {}
    for r in timed:
        series.setdefault(f"{r['provider']}, {r['world_size']} proc.", []).append(r)
    for i, (label, mine) in enumerate(sorted(series.items())):
        mine.sort(key=lambda r: r["q_len"])
        style = "-" if mine[0]["world_size"] > 1 else "--"
        axes[0][0].plot(
            [r["q_len"] for r in mine], [r["ms_p50"] for r in mine], style, marker="o", color=f"C{i}", label=label
        )
        sent = [r for r in mine if r.get("bytes_sent")]
        if sent:
            axes[0][1].plot(
                [r["q_len"] for r in sent],
                [r["bytes_sent"] / 1e6 for r in sent],
                style,
                marker="o",
                color=f"C{i}",
                label=label,
            )
    axes[0][0].set_ylabel("ms per layer (median of the slowest rank)")
    axes[0][1].set_ylabel("MB sent per rank per layer")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (whole sequence)")
        ax.grid(True, which="both", alpha=0.2)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.suptitle("context-parallel attention (kvbound.distributed)\n" + _footer(timed), fontsize=9)
    return _save(fig, path)


def draw_roofline(points: list[dict], ceilings: dict, path: str | Path, title: str = "") -> Path:
    """Two panels (DRAM, L2): achieved TFLOP/s against FLOP per byte, with ``min(peak, bandwidth * x)``.

    ``points``: dicts with ``label``, ``tflops``, ``dram_intensity`` and ``l2_intensity`` (None to skip) and
    ``measured`` (False when the bytes are the formula's, drawn hollow). ``ceilings``: ``matmul_tflops``,
    ``copy_tbps`` and optionally ``l2_tbps``."""
    plt = _pyplot()
    import math

    peak = ceilings["matmul_tflops"]
    panels = [("dram_intensity", "FLOP per DRAM byte (hollow: formula bytes)", ceilings["copy_tbps"], "HBM copy")]
    if ceilings.get("l2_tbps") and any(p.get("l2_intensity") for p in points):
        panels.append(
            ("l2_intensity", "FLOP per L2-to-SM byte (Nsight Compute)", ceilings["l2_tbps"], "L2-resident copy")
        )
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    markers = "os^vDP*Xh<>"
    labels = sorted({p["label"] for p in points})
    for ax, (key, xlabel, bandwidth, bw_name) in zip(axes[0], panels, strict=True):
        xs = [p[key] for p in points if p.get(key)]
        lo = min([1.0, *xs]) / 2
        hi = max([10 * peak / bandwidth, *xs]) * 2
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(grid, [min(peak, bandwidth * x) for x in grid], color="black", lw=1.5)
        ridge = peak / bandwidth
        ax.axvline(ridge, color="grey", ls=":", lw=1)
        ax.text(ridge, peak * 1.05, f"ridge {ridge:.0f} FLOP/B", fontsize=7, ha="center")
        ax.text(lo * 1.2, bandwidth * lo * 1.6, f"{bw_name} {bandwidth:.2f} TB/s", fontsize=7, rotation=0)
        ax.text(hi / 1.2, peak * 0.9, f"bf16 matmul {peak:.0f} TFLOP/s", fontsize=7, ha="right", va="top")
        for i, label in enumerate(labels):
            mine = [p for p in points if p["label"] == label and p.get(key)]
            for p in mine:
                ax.scatter(
                    [p[key]],
                    [p["tflops"]],
                    marker=markers[i % len(markers)],
                    facecolors=f"C{i % 10}" if p.get("measured", True) else "none",
                    edgecolors=f"C{i % 10}",
                    s=36,
                    label=label if p is mine[0] else None,
                )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(max(1e-3, min([peak / 1e3, *[p["tflops"] for p in points]]) / 2), peak * 2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("achieved TFLOP/s")
        ax.grid(True, which="both", alpha=0.2)
        ax.legend(fontsize=7)
        if not math.isfinite(ridge):  # pragma: no cover - ceilings are validated by the caller
            raise ValueError("ceilings: bandwidth must be > 0")
    fig.suptitle(title or "roofline", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from kvbound.bench.records import read_rows

    parser = argparse.ArgumentParser(
        prog="python -m kvbound.bench.plots", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("csv", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/plots"))
    args = parser.parse_args(argv)
    rows = [r for path in args.csv for r in read_rows(path)]
    written = [
        speed_vs_n(rows, args.out_dir / "speed_vs_n.png"),
        bytes_vs_rank_bits(rows, args.out_dir / "bytes_vs_rank_bits.png"),
        model_forwards(rows, args.out_dir / "model_forwards.png"),
        model_speedups(rows, args.out_dir / "model_speedups.png"),
        ring_vs_n(rows, args.out_dir / "ring_vs_n.png"),
    ]
    from kvbound.bench.roofline import roofline_from_rows

    written.append(roofline_from_rows(rows, args.out_dir / "roofline.png"))
    for path in written:
        if path is not None:
            print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
