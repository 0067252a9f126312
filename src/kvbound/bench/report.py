"""``python -m kvbound.bench.report``: write BENCHMARKS.md from the CSV files under ``benchmarks/results/``.

Every number in the generated file comes from a committed CSV row; the file names each CSV with its device,
dates, commit, library versions and the exact command that produced it, and redraws the plots from the same
rows into ``benchmarks/plots/``. Every CSV under the results folder (subfolders included) is listed: files in
the ``kvbound bench`` schema feed the tables; files in the two schemas of the former side scripts
(``benchmarks/encoder_speed.py``, ``benchmarks/public_api_timing.py``) are shown as recorded in their own
section; any other CSV is listed as not read, with its columns. CSVs under a ``kernel_dev/`` folder are
development measurements (trials, some of code that was then reverted): they are listed and never read, whatever
their schema.

    python -m kvbound.bench.report --results benchmarks/results --out BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvbound.bench import tables
from kvbound.bench.records import read_rows

__all__ = ["main", "render", "ResultFile", "read_results"]

_METHOD = """\
How the numbers are made:

- **Time**: `triton.testing.do_bench` (CUDA events, L2 cleared before every call, warm-up first), quantiles
  0.2 / 0.5 / 0.8 of one forward call; all providers of a shape in one process, side by side. When one input set
  fits in L2, calls rotate over up to 4 sets (`input_sets`).
- **FLOP**: `2 * B * Hq * Nq * Nk * (Dk + Dv)`, halved for causal, for every provider (softmax and reconstruction
  not counted). TFLOP/s = FLOP / median time.
- **Bytes moved (formula)**: Q, K, V read once and O written once in their dtype (K/V at the heads the provider
  reads); for compressed K/V, `CompressedKV.nbytes` of K and of V; plus the bias tensor where the provider reads
  one (dense `[B, Hq, N, N]` or compact).
- **Check**: before timing, each output is compared on a subsample of query rows (`check_rows`, evenly spaced)
  with the float64 reference (`kvbound.reference_attention`); for compressed providers on the *decompressed*
  K/V (`err_rel`), and also on the original K/V (`err vs dense ref`: what compression costs the output).
  `check_failed` rows are still timed and shown, flagged.
- **K/V inputs** have low-rank structure plus a block-structured residual with a set share of residual-free
  blocks (`kvbound/bench/data.py`); each row records the share the codec found (`zero tiles`).
- **vs cuDNN** = cuDNN SDPA median / provider median on the same shape (> 1 is faster). On the models' shapes the
  stock SDPA backends run plain attention without bias or soft-cap: a floor that does less work than the model.
"""


_ENCODER_METHOD = """\
`python -m kvbound.bench --suite encoder`: one layer's K and V of each shape (the attention suite's inputs),
compressed by the Triton encoder with the float64 certificate (`encoder-triton`), without it
(`encoder-triton-noverify`: the in-kernel check only), by the eager float64 encoder, and copied on the device
(`device-copy`: the floor). Time: K then V, `do_bench` quantiles. Input GB/s: K + V bytes over the median. Before
timing, every element of `decompress()` is checked against its input: max err / tau <= 1 or the row is
`check_failed`. Modes: share of blocks stored low-rank only / with `bits`-bit codes / promoted to wider codes /
exactly. The basis comes from `kvbound.calibrate` on another draw of the same layer; that calibration is timed in
the second table.
"""

_MODEL_TARGETS_METHOD = """\
The models' targets at their full sizes, each judged within one run (one process, side by side), from the latest run
of each model and batch that has what the target compares: the whole forward patched with dense K/V against the
unpatched port (>= 1.3x Enformer, >= 1.8x Borzoi, >= 1.3x AlphaGenome at 1 Mbp; eager, and in CUDA graphs where a
run has both graph variants, `kvbound.capture`), the same with compressed K/V (default `CompressionConfig()`,
calibrated; `compressed K/V`), the attention modules against the port's own (>= 10x; summed by
forward hooks, so at batch 1 they include the modules' host path), and the patched forward against the fastest
stock alternative a user could assemble (`--alternatives`: SDPA with a built bias or FlexAttention with a built
table for Enformer and Borzoi, FlexAttention with the compact pair bias for AlphaGenome), with each forward's peak
memory. Batches measured only on days before a model's newest runs are listed (`older`) but not counted: the
code has changed since. So is a judgment of a counted batch whose own run is older (shown with its day, `not
counted`), e.g. where the newest run's unpatched forward ran out of memory and only its patched forward and the
alternatives were timed.
"""

_MODELS_METHOD = """\
`python -m kvbound.bench --suite models`: each port at its full size with random weights (Enformer's
zero-initialised `to_out` re-randomised), bf16 autocast, `no_grad`, one-hot random DNA. `unpatched`: the port as
published; `patch-dense`: `kvbound.patch(model, compress=False)`; `patch-compressed`:
`kvbound.patch(model, compress=True)` calibrated on a forward over another input. With `--alternatives`, the ports'
layers with their attention core replaced by what a user could assemble from stock kernels
(`kvbound/bench/alternatives.py`): Enformer and Borzoi `sdpa-built-bias` (SDPA with a built `[B, H, N, N]` position
bias) and `flex-built-table` (compiled FlexAttention over a built `[B, H, N, 2N - 1]` table); AlphaGenome (since
2026-12-04) `flex-tile-bias` (compiled FlexAttention with one K/V head for the 8 query heads and a `score_mod` that
adds the pair bias from its compact `[B, 8, S/16, S/16]` form and applies the soft-cap; SDPA cannot apply a soft-cap
after a bias). `--variants` times a subset. With `--graphs`: `unpatched-graph`,
`patch-dense-graph` and (since 2026-12-04) `patch-compressed-graph`, the same forwards captured once in a CUDA graph
(`kvbound.capture`, NaN/Inf checks and the compressed encoder's retry flags read after each replay; a call whose
retry flag is set runs the eager forward, which the note counts) and replayed per call; their peak is the
allocator's peak while capturing and replaying once, and their attention modules are not timed (hooks do not run in
a replay). Since 82f1383 `patch-dense` and
`patch-compressed` also run Enformer's `AttentionPool` and Borzoi's `MaxPool1d(2)` in one kernel each
(`kvbound/models/README.md`, "Pools"). Forward: median of timed calls
(CUDA events) after warm-up. Attention: the attention modules' forwards summed, timed by forward hooks in separate
calls. Peak: `torch.cuda.max_memory_allocated` during one forward; "above baseline" subtracts what was allocated
before it (weights, inputs, the reference output). Diff: the output against the unpatched output on the same input
(max abs; rel = L2 norm of the difference over the L2 norm of the reference). Encode ms:
the patched modules' `encode_seconds` per forward (device time between CUDA events around the encoder calls;
rows measured up to commit 363ab4c summed the encoders' host time, which includes waiting for the GPU work queued before
each call, and overstate it). Since ff4bade (the handle's `time_encoding`, off by default) the timed forwards run
without those events and the encode time comes from forwards of its own after them; before it, the events were
recorded in the timed forwards too (about 20 us of host time per layer).
"""

_RING_DESIGN = """\
**Beyond two GPUs.** Each rank sends its compressed shard to the next rank and receives the previous one, W - 1
times, while the kernel works on the shard in hand; partial results merge by log-sum-exp, so the result does not
depend on W and every rank sends `(W - 1) x` its compressed shard (bytes per rank constant in W for a fixed N / W,
total traffic growing as W - 1). Compute per step shrinks as 1 / W^2 of the whole while the bytes per step shrink
as 1 / W, so the ring stays hidden behind the kernel while one shard's attention takes longer than moving one
compressed shard: on NVLink-class links with compressed K/V that holds down to shards of a few thousand tokens.
Across hosts (InfiniBand or Ethernet, 10-50x slower than NVLink) the same ring applies unchanged through NCCL, and
there the 4x fewer bytes decide whether the transfer hides: a two-level ring (shards exchanged inside a host first,
then one compressed stream per host pair) keeps the slow link busy with compressed bytes only. Measured here: 1 and 2
GPUs of one host; more GPUs and hosts are not measured.

"""

_RING_METHOD = """\
`python -m kvbound.bench --suite ring`: one attention layer (B = 1, 8 heads, non-causal, bf16) over the whole
sequence N, sharded over one process per GPU (NCCL). `ring-compressed`:
`kvbound.distributed.context_parallel_attention` with K/V shards compressed once (Triton encoder, inside the timed
layer) and passed around the ring; `ring-dense`: the same ring with dense K/V; `allgather-dense`: all-gather the
dense shards, then `kvbound.attention`. Time: the slowest rank per call, quantiles over calls. Sent per rank: bytes
each rank put on the link (largest over ranks); dense per rank: `(W - 1)` dense K + V shards. Errors: checked query
rows against the float64 reference over the K/V the provider computes on (compressed: the decompressed shards), and
against the original K/V (`err vs dense ref`).
"""


_TARGETS_METHOD = """\
Every kvbound row on the seed shapes (plain attention, B = 1, 8 heads, bf16) against cuDNN SDPA timed in the same
process (same run); p50 over p50, and the range cuDNN p50 over the row's p80 .. p20. The error columns sit next to
the speed: `rel err` against the float64 reference on the K/V the kernel read (for compressed rows the decompressed
K/V), `err vs dense ref` against the original K/V (what compression costs the output). Targets: compressed default
(r8b4) >= 1.3x at N = 65536; residual-free low rank (lowrank-r8, tau raised until no block keeps a residual)
>= 1.5x at d = 64 and >= 2.0x at d = 128, N = 65536; kvbound dense and both configs above >= 1.0x at N >= 16384
(no regression). quant-r0b4 (quantisation only) is an ablation and has no target. A row that is not `ok` never
counts as met.
"""

_MOVEMENT_TEXT = """\
Which bytes each ratio counts: **K/V ratio**: dense K and V bytes over `CompressedKV.nbytes` of K plus V (default
config r8b4: factors, packed codes, scales, offsets, modes, exact blocks, metadata). **Formula ratio**: Q + K + V + O
bytes of cuDNN SDPA over Q + K.nbytes + V.nbytes + O of kvbound (each tensor read or written once). **Measured
ratio**: Nsight Compute DRAM bytes read + written by every kernel of one cuDNN SDPA call over the same for one
`kvbound.attention` call on compressed K/V, L2 flushed before each kernel. **Design figure**: the format's quoted
"attention data movement" reduction (2.6x at N = 4096 rising to 4.1x at N = 65536), which does not say which bytes
it counts; Q and O are the same for both kernels, so a whole-attention ratio (formula or measured) stays well below
the K/V ratio, and only the K/V ratio is comparable in size with those figures.
"""

_TRAFFIC_METHOD = """\
`python -m kvbound.bench --ncu`: each provider prepared and checked as in a timed run, then one call profiled by
`ncu --clock-control none` (clocks as found; L2 flushed before each kernel, so DRAM bytes are cold-cache bytes),
all kernels of the call summed. DRAM: `dram__bytes_read.sum` / `dram__bytes_write.sum`. L2->SM read and SM->L2
write: 32 bytes x `lts__t_sectors_srcunit_tex_op_read.sum` / `_op_write.sum`. Formula bytes: Q, K, V read once and
O written once (compressed K/V at `nbytes`). Writes that stay in L2 until after the kernel do not reach DRAM while
it is profiled, so DRAM writes can be far below O's size.
"""

_REPRODUCE = """\
Each part of `benchmarks/h200.sh` is one command of at most 10 minutes on the GPU machine (its estimated time and
steps: `bash benchmarks/h200.sh list`); the ring part needs two GPUs. From the repository root, with the commit
recorded in every row:

    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh verify      # GPU-only tests, byte decode at every tile shape
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh attention   # ceilings, seed shapes x 3 configs, calibration, encoder
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh traffic     # Nsight Compute DRAM / L2 bytes per provider
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh sweep       # (rank, bits) sweep, d = 64
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh sweep-d128  # (rank, bits) sweep, d = 128
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh models      # model shapes (all providers), Enformer / Borzoi forwards
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh models2     # AlphaGenome forwards, larger batches
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh timeline    # whole forwards traced: device busy / idle, attention
    KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh ring        # context-parallel ring, 1 and 2 GPUs

`models`, `models2` and `timeline` install the ports' wheels from `.whl/` (`benchmarks/wheels.sh`). Each part writes
`PART_<sha>.tar.gz` holding `benchmarks/results/h200_<date>_<sha>/PART/*.csv`; unpacked at the repository root,
`python -m kvbound.bench.report` rebuilds this file and the plots from every CSV present.
`KVBOUND_SMOKE=1 bash benchmarks/h200.sh PART` runs the same steps at tiny sizes on the CPU.
"""


@dataclass
class ResultFile:
    """One CSV under the results folder: ``kind`` is ``bench`` (``rows`` typed by ``records.read_rows``), one of
    the side scripts' schemas (``trained-kv``, ``largest-batch``, ``relative-ncu``, ``forward-timeline``,
    ``fused-norm``; ``raw`` string rows), ``legacy-encoder`` or ``legacy-public-api`` (a former side script's),
    ``development`` (under ``kernel_dev/``: listed, never read) or ``unknown``."""

    path: Path
    kind: str
    rows: list[dict] = field(default_factory=list)
    raw: list[dict] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)


# Development measurements (kernel trials, some of reverted code): listed in BENCHMARKS.md, never read into it.
DEVELOPMENT_FOLDER = "kernel_dev"


def _files(results: Path) -> list[Path]:
    return sorted(p for p in results.rglob("*.csv") if p.is_file())


def read_results(results: Path) -> list[ResultFile]:
    """Every CSV under ``results`` (recursively), classified by its header."""
    out = []
    for path in _files(results):
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            raw = list(reader)
        if DEVELOPMENT_FOLDER in path.relative_to(results).parts[:-1]:
            out.append(ResultFile(path, "development", raw=raw, columns=columns))
        elif {"mode", "provider", "shape", "status"} <= set(columns):
            out.append(ResultFile(path, "bench", rows=read_rows(path), columns=columns))
        elif set(TRAINED_KV_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "trained-kv", raw=raw, columns=columns))
        elif set(LARGEST_BATCH_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "largest-batch", raw=raw, columns=columns))
        elif set(RELATIVE_NCU_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "relative-ncu", raw=raw, columns=columns))
        elif set(FORWARD_TIMELINE_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "forward-timeline", raw=raw, columns=columns))
        elif set(FUSED_NORM_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "fused-norm", raw=raw, columns=columns))
        elif set(tables.LEGACY_ENCODER_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "legacy-encoder", raw=raw, columns=columns))
        elif set(tables.LEGACY_PUBLIC_API_COLUMNS) <= set(columns):
            out.append(ResultFile(path, "legacy-public-api", raw=raw, columns=columns))
        else:
            out.append(ResultFile(path, "unknown", raw=raw, columns=columns))
    return out


def _raw_values(raw: list[dict], *keys: str) -> str:
    """The distinct non-empty values of ``keys`` over string rows, sorted and joined; ``-`` if none."""
    return ", ".join(sorted({r[k] for k in keys for r in raw if r.get(k)})) or "-"


def _legacy_provenance(item: ResultFile, root: Path) -> str:
    script = {"legacy-encoder": "benchmarks/encoder_speed.py", "legacy-public-api": "benchmarks/public_api_timing.py"}
    raw = item.raw

    def values(*keys: str) -> str:
        return _raw_values(raw, *keys)

    versions = "".join(f"; {label} {values(key)}" for label, key in (("torch", "torch"), ("Triton", "triton"))
                       if values(key) != "-")
    return "\n".join([
        f"- `{_relative(item.path, root)}` ({len(raw)} rows in the schema of the former `{script[item.kind]}`; "
        "shown as recorded under \"Earlier measurements\")",
        f"  - device: {values('gpu', 'device')}; date: {values('date')}; commit: `{values('commit')}`{versions}",
    ] + [f"  - command: `{c}`" for c in sorted({r['command'] for r in raw if r.get('command')})])


# benchmarks/trained_kv.py's CSV (attention on q, k, v of the trained evaluation models)
TRAINED_KV_COLUMNS = ("model", "N", "provider", "status", "ms_p50", "vs_cudnn", "err_rel", "kv_max_err_over_tau",
                      "k_shares", "v_shares")  # fmt: skip


def _trained_kv_section(files: list[ResultFile]) -> str:
    """Every row of every trained_kv CSV, files in path order."""
    headers = ["model", "N", "heads q/kv", "dk / dv", "provider", "config", "status", "p50 ms", "vs cuDNN",
               "rel err", "err vs original", "K/V max err / tau", "K blocks L/P/Pr/R", "V blocks L/P/Pr/R",
               "K/V ratio", "commit"]  # fmt: skip
    body = []
    for item in files:
        for r in item.raw:
            body.append([
                r["model"], r["N"], f"{r.get('q_heads')}/{r.get('kv_heads')}", f"{r.get('dk')} / {r.get('dv')}",
                r["provider"], r.get("config") or "", r["status"], _fmt_text(r.get("ms_p50"), ".4g"),
                (f"{float(r['vs_cudnn']):.2f}x" if r.get("vs_cudnn") else "-"), _fmt_text(r.get("err_rel"), ".2e"),
                _fmt_text(r.get("err_vs_original_rel"), ".2e"), _fmt_text(r.get("kv_max_err_over_tau"), ".4f"),
                r.get("k_shares") or "-", r.get("v_shares") or "-", _fmt_text(r.get("kv_ratio"), ".2f"),
                r.get("commit") or "-",
            ])  # fmt: skip
    return tables.to_markdown(headers, body) if body else "_(none)_\n"


# benchmarks/largest_batch.py's CSV (the largest batch of each port's forward that fits in device memory)
LARGEST_BATCH_COLUMNS = ("model", "variant", "status", "largest_batch", "first_out_of_memory", "peak_gib", "probes")


def _largest_batch_section(files: list[ResultFile]) -> str:
    """Every row of every largest_batch CSV, files in path order."""
    headers = ["model", "variant", "status", "largest batch", "first out of memory", "first without answer",
               "peak GiB", "probes", "input bp", "search s", "GPU", "commit", "reason"]  # fmt: skip
    body = [[r["model"], r["variant"], r["status"], r.get("largest_batch") or "-", r.get("first_out_of_memory") or "-",
             r.get("first_timeout") or "-", _fmt_text(r.get("peak_gib"), ".2f"), r.get("probes") or "-",
             r.get("input_len") or "-", r.get("seconds") or "-", tables.gpu_label(r.get("device")),
             r.get("commit") or "-", (r.get("reason") or "")[:120]]
            for item in files for r in item.raw]  # fmt: skip
    return tables.to_markdown(headers, body) if body else "_(none)_\n"


# benchmarks/relative_ncu.py's CSV (the dense kernel with and without the relative term, under Nsight Compute)
RELATIVE_NCU_COLUMNS = ("case", "variant", "tile", "duration_ms", "tensor_pipe_pct", "local_load_bytes", "stall_1")


def _relative_ncu_section(files: list[ResultFile]) -> str:
    """Every row of every relative_ncu CSV, files in path order."""
    headers = ["case", "variant", "tile", "tile used", "status", "call ms", "kernel ms (ncu)", "useful TFLOP/s",
               "registers", "spill loads MB", "occupancy %", "issue active %", "tensor pipe %", "instructions (M)",
               "top stalls", "err max", "commit", "reason"]  # fmt: skip

    def mega(text: str | None) -> str:
        return "-" if not text else f"{float(text) / 1e6:.1f}"

    body = [[r["case"], r["variant"], r["tile"], r.get("ncu_tile_used") or r.get("tile_used") or "-", r["status"],
             _fmt_text(r.get("call_ms_p50"), ".3f"),
             _fmt_text(r.get("duration_ms"), ".3f"), _fmt_text(r.get("useful_tflops"), ".0f"),
             _fmt_text(r.get("registers_per_thread"), ".0f"), mega(r.get("local_load_bytes")),
             _fmt_text(r.get("achieved_occupancy_pct"), ".1f"), _fmt_text(r.get("issue_active_pct"), ".1f"),
             _fmt_text(r.get("tensor_pipe_pct"), ".1f"), mega(r.get("instructions")),
             ", ".join(r[k] for k in ("stall_1", "stall_2", "stall_3") if r.get(k)) or "-",
             r.get("err_max") or "-", r.get("commit") or "-", (r.get("reason") or "")[:120]]
            for item in files for r in item.raw]  # fmt: skip
    return tables.to_markdown(headers, body) if body else "_(none)_\n"


# benchmarks/forward_timeline.py's CSV (where a whole forward's device time goes)
FORWARD_TIMELINE_COLUMNS = ("model", "batch", "variant", "row", "name", "calls", "ms", "commit")


def _forward_timeline_section(files: list[ResultFile]) -> str:
    """One row per (file, model, batch, variant) of every forward_timeline CSV, from its ``timeline`` rows; a patched
    row also gets its speed-up over the file's unpatched forward and the speed-up it would have if its attention
    modules took no device time."""
    headers = ["model", "batch", "variant", "forward ms", "vs unpatched", "bound without attention", "device busy ms",
               "device idle ms", "attention modules ms", "transformer busy / idle ms", "commit"]  # fmt: skip
    body = []
    for item in files:
        runs: dict[tuple, dict[str, str]] = {}
        for r in item.raw:
            if r.get("row") == "timeline":
                runs.setdefault((r["model"], r["batch"], r["variant"]), {"commit": r.get("commit") or "-"})[
                    r["name"]
                ] = r.get("ms") or ""
        for (model, batch, variant), v in runs.items():
            base = runs.get((model, batch, "unpatched"), {}).get("forward_ms")
            forward, attention = v.get("forward_ms"), v.get("attention_launched_ms")
            ratio = bound = "-"
            if base and forward and variant != "unpatched":
                ratio = f"{float(base) / float(forward):.2f}x"
                if attention and float(forward) > float(attention):
                    bound = f"{float(base) / (float(forward) - float(attention)):.2f}x"
            tower = f"{_fmt_text(v.get('tower_busy_ms'), '.1f')} / {_fmt_text(v.get('tower_idle_ms'), '.1f')}"
            body.append([model, batch, variant, _fmt_text(forward, ".2f"), ratio, bound,
                         _fmt_text(v.get("busy_ms"), ".1f"), _fmt_text(v.get("idle_ms"), ".1f"),
                         _fmt_text(attention, ".2f"), tower, v["commit"]])  # fmt: skip
    if not body:
        return "_(none)_\n"
    return tables.to_markdown(headers, body) + _forward_timeline_modules(files)


def _forward_timeline_modules(files: list[ResultFile], top: int = 6) -> str:
    """The ``module`` rows of the forward_timeline CSVs that have them: per (model, batch, variant), the ``top``
    kernels launched inside the attention modules, with their share of the modules' device time."""
    groups: dict[tuple, list[dict]] = {}
    for item in files:
        for r in item.raw:
            if r.get("row") == "module":
                groups.setdefault((r["model"], r["batch"], r["variant"], r.get("commit") or "-"), []).append(r)
    if not groups:
        return ""
    headers = ["model", "batch", "variant", "kernel", "calls", "ms", "share of the modules", "commit"]
    body = []
    for (model, batch, variant, commit), rows in groups.items():
        total = sum(float(r["ms"] or 0) for r in rows)
        for r in rows[:top]:
            share = f"{float(r['ms']) / total:.0%}" if total > 0 and r["ms"] else "-"
            body.append([model, batch, variant, f"`{r['name']}`", r.get("calls") or "-", _fmt_text(r["ms"], ".3f"),
                         share, commit])  # fmt: skip
    return (
        "\nInside the attention modules (`module` rows, from files recorded since they exist): the device time of "
        f"each kernel launched there, the {top} longest per forward.\n\n" + tables.to_markdown(headers, body)
    )


# benchmarks/fused_norm_ab.py's CSV (patched AlphaGenome with and without the fused norm, one process)
FUSED_NORM_COLUMNS = ("model", "batch", "variant", "repeat", "forward_ms", "attention_ms", "max_abs_diff", "rel_diff",
                      "commit")  # fmt: skip


def _fused_norm_section(files: list[ResultFile]) -> str:
    """Every row of every fused_norm_ab CSV, with the forward's and the attention modules' speed-up over the same
    file's unpatched row."""
    headers = ["model", "batch", "variant", "repeat", "forward ms", "vs unpatched", "attention modules ms",
               "attention vs unpatched", "max abs diff", "rel diff", "commit"]  # fmt: skip
    body = []
    for item in files:
        base = next((r for r in item.raw if r.get("variant") == "unpatched"), None)
        for r in item.raw:
            ratio = attention = "-"
            if base is not None and r is not base and r.get("forward_ms") and r.get("attention_ms"):
                ratio = f"{float(base['forward_ms']) / float(r['forward_ms']):.3f}x"
                attention = f"{float(base['attention_ms']) / float(r['attention_ms']):.1f}x"
            body.append([r["model"], r["batch"], r["variant"], r["repeat"], _fmt_text(r.get("forward_ms"), ".1f"),
                         ratio, _fmt_text(r.get("attention_ms"), ".2f"), attention, r.get("max_abs_diff") or "-",
                         r.get("rel_diff") or "-", r.get("commit") or "-"])  # fmt: skip
    return tables.to_markdown(headers, body) if body else "_(none)_\n"


_FUSED_NORM_METHOD = """`python benchmarks/fused_norm_ab.py OUT.csv` (part of `bash benchmarks/h200.sh timeline`):
AlphaGenome at full size (1 Mbp, random weights, bf16 autocast, `no_grad`) in one process, unpatched, then patched
with dense K/V: with the q, k, v LayerNorm, RoPE and cast fused in one kernel each (`patch-dense`, the default),
with the port's own LayerNorm and `apply_rope` (`patch-dense-port-norms`, `KVBOUND_FUSED_NORM=0`), and fused again
(repeat 2). Forward: median of 5 (CUDA events); attention modules: their forwards summed by hooks (median of 3);
diff: the output against the unpatched one.
"""


# Side scripts whose CSVs the report reads: kind -> (script, whether their rows record a date, and a Triton version)
_SCRIPT_OF_KIND = {
    "trained-kv": ("benchmarks/trained_kv.py", True, True),
    "largest-batch": ("benchmarks/largest_batch.py", False, False),
    "relative-ncu": ("benchmarks/relative_ncu.py", False, True),
    "forward-timeline": ("benchmarks/forward_timeline.py", False, False),
    "fused-norm": ("benchmarks/fused_norm_ab.py", False, False),
}


def _script_provenance(item: ResultFile, root: Path) -> str:
    """Where a side script's CSV comes from: its path and rows, then device, date, commit and versions."""
    script, dated, with_triton = _SCRIPT_OF_KIND[item.kind]

    def values(key: str) -> str:
        return _raw_values(item.raw, key)

    date = f"date: {values('date')}; " if dated else ""
    triton = f", Triton {values('triton')}" if with_triton else ""
    return "\n".join([
        f"- `{_relative(item.path, root)}` ({len(item.raw)} rows of `{script}`)",
        f"  - device: {values('device')}; {date}commit: `{values('commit')}`; torch {values('torch')}{triton}",
    ])  # fmt: skip


def _fmt_text(text: str | None, spec: str) -> str:
    try:
        return format(float(text), spec)
    except (TypeError, ValueError):
        return "-"


def _unknown_provenance(item: ResultFile, root: Path) -> str:
    shown = ", ".join(item.columns[:12]) + (", ..." if len(item.columns) > 12 else "")
    if item.kind == "development":
        return (f"- `{_relative(item.path, root)}` ({len(item.raw)} rows): not read by this report (a development "
                f"measurement under `{DEVELOPMENT_FOLDER}/`, described in kernels/README.md or its folder's README)")
    return (f"- `{_relative(item.path, root)}` ({len(item.raw)} rows): not read by this report (not the `kvbound "
            f"bench` schema nor a former side script's; columns: {shown})")


def _legacy_section(files: list[ResultFile], root: Path) -> str:
    parts = []
    for item in files:
        if item.kind == "legacy-encoder":
            parts.append(f"From `{_relative(item.path, root)}` (former `benchmarks/encoder_speed.py`: one tensor per "
                         "row, median of `do_bench` only; K/V of rank-6 structure plus noise of std 0.02, calibrated "
                         "on the first 4096 tokens of the same tensor; now `--suite encoder`):\n")
            parts.append(tables.to_markdown(*tables.legacy_encoder_table(item.raw)))
        elif item.kind == "legacy-public-api":
            parts.append(f"From `{_relative(item.path, root)}` (former `benchmarks/public_api_timing.py`: median of "
                         "`do_bench`, K/V of rank-6 structure plus noise of std 0.004 so that every block certifies "
                         "low-rank at the default tau; now the attention suite on "
                         "`benchmarks/shapes/residual_free.toml`):\n")
            parts.append(tables.to_markdown(*tables.legacy_public_api_table(item.raw)))
    return "\n".join(parts) if parts else "_(none)_\n"


def _unique(rows: list[dict], key: str) -> str:
    values = sorted({str(r.get(key)) for r in rows if r.get(key) not in (None, "")})
    return ", ".join(values) if values else "-"


def _provenance(path: Path, rows: list[dict], root: Path) -> str:
    modes = sorted({r["mode"] for r in rows})
    dates = sorted({r.get("date") or "" for r in rows} - {""})
    when = dates[0] if len(dates) == 1 else (f"{dates[0]} .. {dates[-1]}" if dates else "-")
    commands = sorted({r.get("command") or "" for r in rows} - {""})
    lines = [
        f"- `{_relative(path, root)}` ({len(rows)} rows: {', '.join(modes)})",
        f"  - device: {_unique(rows, 'gpu')}; date: {when}; commit: `{_unique(rows, 'commit')}`",
        f"  - torch {_unique(rows, 'torch')}, Triton {_unique(rows, 'triton')}, CUDA {_unique(rows, 'cuda')}, "
        f"cuDNN {_unique(rows, 'cudnn')}",
    ]
    lines += [f"  - command: `{c}`" for c in commands]
    return "\n".join(lines)


def _relative(path: Path, root: Path) -> str:
    try:
        return os.path.relpath(path, root)
    except ValueError:  # pragma: no cover - different drives on Windows
        return str(path)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _speed_tables(rows: list[dict]) -> str:
    timed = [r for r in rows if r["mode"] == "time"]
    ratios = tables.cudnn_ratios(timed)  # every run's rows: each row is compared with the cuDNN of its own run
    latest = tables.index_rows(timed, "time")
    timed = [r for r in latest.values() if r.get("family") not in ("share", "relative")]  # their own tables
    out = []
    shapes = list(dict.fromkeys(r["shape"] for r in timed))
    headers = ["provider", "config", "status", "p50 ms", "p20-p80 ms", "TFLOP/s", "vs cuDNN", "rel err",
               "err vs dense ref", "K/V ratio", "zero tiles", "computes / reason", "commit, day"]
    for shape in shapes:
        mine = [r for r in timed if r["shape"] == shape]
        first = mine[0]
        desc = (f"B={first['batch']}, Hq={first['q_heads']}, Hkv={first['kv_heads']}, Nq={first['q_len']}, "
                f"Nk={first['kv_len']}, dk={first['head_dim_qk']}, dv={first['head_dim_v']}, {first['dtype']}"
                + (", causal" if first["causal"] else "") + (f", {first['bias']} bias" if first["bias"] != "none"
                                                              else "")
                + (f", soft-cap {first['softcap']:g}" if first.get("softcap") else ""))
        body = []
        for r in mine:
            spread = "-" if r.get("ms_p20") is None else f"{r['ms_p20']:.4g}-{r['ms_p80']:.4g}"
            found = ratios.get(id(r))
            ratio = None if found is None else found[0]
            what = (r.get("semantics") or "") if r["status"] == "ok" else (r.get("reason") or "")[:140]
            if r["status"] == "ok" and r.get("note"):
                what = (what + "; " if what else "") + r["note"]
            body.append([r["provider"], r.get("config") or "", r["status"], _fmt(r.get("ms_p50"), ".4g"), spread,
                         _fmt(r.get("tflops"), ".1f"),
                         "-" if ratio is None else f"{ratio:.2f}x" + ("" if found[2] else " (cuDNN of another run)"),
                         _fmt(r.get("err_rel"), ".2e"), _fmt(r.get("err_vs_dense_rel"), ".2e"),
                         _fmt(r.get("compression_ratio"), ".2f"), _fmt(r.get("zero_residual_share"), ".0%"),
                         what.replace("\n", " "), f"{r.get('commit') or '-'}, {str(r.get('date') or '-')[:10]}"])
        out.append(f"#### {shape} ({first.get('family')}): {desc}\n\n" + tables.to_markdown(headers, body))
    return "\n".join(out) if out else "_(no timed rows)_\n"


def _ceilings(rows: list[dict]) -> str:
    from kvbound.bench.roofline import ceilings_from_rows

    c = ceilings_from_rows(rows)
    if c is None:
        return "_(no ceiling rows: run `kvbound roofline --out benchmarks/results/...`)_\n"
    text = (f"{c['gpu']}: device-to-device copy **{c['copy_tbps']:.2f} TB/s** (read + write), bf16 8192^3 matmul "
            f"**{c['matmul_tflops']:.0f} TFLOP/s**, ridge {c['matmul_tflops'] / c['copy_tbps']:.0f} FLOP per DRAM "
            f"byte")
    if "l2_tbps" in c:
        text += f"; L2-resident copy {c['l2_tbps']:.2f} TB/s"
    return text + ".\n"


def render(rows_by_file: dict[Path, list[dict]], root: Path, plots: dict[str, Path | None],
           other_files: list[ResultFile] | None = None) -> str:
    """The whole BENCHMARKS.md text. ``other_files``: CSVs not in the bench schema (legacy or unknown)."""
    rows = [r for file_rows in rows_by_file.values() for r in file_rows]
    other_files = other_files or []
    sources = [_provenance(p, r, root) for p, r in rows_by_file.items()]
    sources += [_legacy_provenance(f, root) for f in other_files if f.kind.startswith("legacy")]
    sources += [_script_provenance(f, root) for f in other_files if f.kind in _SCRIPT_OF_KIND]
    sources += [_unknown_provenance(f, root) for f in other_files if f.kind in ("unknown", "development")]
    parts = [
        "# kvbound benchmarks\n",
        "Generated by `python -m kvbound.bench.report` from the CSV files listed under \"Where these numbers come "
        "from\" (each with its device, date, commit and command); do not edit by hand (rerun the commands, commit "
        "the CSVs, regenerate).\n",
        _METHOD,
        "## Speed targets against cuDNN SDPA\n",
        _TARGETS_METHOD,
        tables.targets_summary(rows),
        tables.to_markdown(*tables.targets_table(rows)),
        "## Ceilings\n",
        _ceilings(rows),
        "## Attention data movement\n",
        tables.to_markdown(*tables.data_movement_table(rows)),
        _MOVEMENT_TEXT,
        "## Measured traffic per provider (Nsight Compute)\n",
        _TRAFFIC_METHOD,
        tables.to_markdown(*tables.traffic_table(rows)),
        "## Speed against the share of residual-free blocks\n",
        _SHARE_METHOD,
        tables.to_markdown(*tables.share_table(rows)),
        "## Speed on K/V of the trained evaluation models\n",
        _TRAINED_KV_METHOD,
        _trained_kv_section([f for f in other_files if f.kind == "trained-kv"]),
        "## Speed\n",
        "The newest row of each provider, config and shape, with the commit and day that measured it. Rows of the "
        "model shapes (`enformer`, `borzoi`, `alphagenome (model)`) measured before the kernels computed the relative "
        "term in the tile and read AlphaGenome's pair bias in its compact form say so (`bias read as a dense [B, Hq, "
        "Nq, Nk] tensor`); the models' attention as it runs now is timed under \"Models end to end\" and "
        "\"Relative-position attention against what a user could build\".\n",
        _speed_tables(rows),
        "## Ablation: low-rank only, quantisation only, fused\n",
        tables.to_markdown(*tables.ablation_table(rows)),
        "Low-rank only raises tau until every block needs no residual, so its bound is that larger tau (column "
        "tau), not the default.\n",
        "## (rank, bits) sweep\n",
        tables.to_markdown(*tables.sweep_table(rows)),
        "Every config keeps the certified bound tau: blocks whose residual does not fit the bits are promoted "
        "to wider codes (4 to 8 bits) or stored exactly, which shows up as a lower K/V ratio, never as a larger "
        "error.\n",
        "## Reconstruction overhead (counted from the format)\n",
        tables.to_markdown(*tables.overhead_table(rows)),
        "Rebuild: FLOP to rebuild each K/V tile once per query tile (`2 n r D` for `C @ P`, `2 n D` for "
        "`codes * scale + add` on coded tiles) over dense attention FLOP; shared: the rebuild reused by the query "
        "heads of one K/V head. Rank space: FLOP of attention computed as `(Q P^T) C^T` with values accumulated "
        "in rank space (residual-free tiles) over dense FLOP. See `kvbound/bench/formulas.py`.\n",
        f"The design estimate of the reconstruction overhead is {tables.DESIGN_OVERHEAD:.1%} of attention FLOPs; "
        "the columns above count it for each shape from the measured mode shares (the fused kernel's real cost is "
        "in the speed tables, not here).\n",
        "## Calibration time per model load\n",
        tables.to_markdown(*tables.calibration_table(rows)),
        "## Encoder\n",
        _ENCODER_METHOD,
        tables.to_markdown(*tables.encoder_table(rows)),
        "Calibration (`kvbound.calibrate`) of one model-sized sample:\n",
        tables.to_markdown(*tables.encoder_calibration_table(rows)),
        "## Models end to end\n",
        _MODELS_METHOD,
        "### Targets\n",
        _MODEL_TARGETS_METHOD,
        tables.model_targets_summary(rows),
        tables.to_markdown(*tables.model_targets_table(rows)),
        "### Every variant\n",
        tables.to_markdown(*tables.models_table(rows)),
        "### The largest batch that fits\n",
        _LARGEST_BATCH_METHOD,
        _largest_batch_section([f for f in other_files if f.kind == "largest-batch"]),
        "### Where a whole forward's device time goes\n",
        _FORWARD_TIMELINE_METHOD,
        _forward_timeline_section([f for f in other_files if f.kind == "forward-timeline"]),
        "### AlphaGenome's q, k, v norms fused\n",
        _FUSED_NORM_METHOD,
        _fused_norm_section([f for f in other_files if f.kind == "fused-norm"]),
        "## Relative-position attention against what a user could build\n",
        _RELATIVE_METHOD,
        tables.to_markdown(*tables.relative_table(rows)),
        "### The relative term inside the dense kernel (Nsight Compute)\n",
        _RELATIVE_NCU_METHOD,
        _relative_ncu_section([f for f in other_files if f.kind == "relative-ncu"]),
        "## Context-parallel ring\n",
        _RING_METHOD,
        tables.to_markdown(*tables.ring_table(rows)),
        "Scaling from 1 to 2 processes and bytes on the wire, against the targets (2-process time per layer at "
        "most 0.6x the 1-process time at N >= 131,072; the compressed ring sending at least 3.5x fewer bytes than "
        "dense):\n",
        tables.to_markdown(*tables.ring_scaling_table(rows)),
        _RING_DESIGN,
        "## Earlier measurements (schemas of removed scripts)\n",
        _legacy_section(other_files, root),
        "## Where these numbers come from\n",
        "\n".join(sources) or "_(no CSV files)_",
        "",
    ]
    parts += ["## Reproduce\n", _REPRODUCE]
    shown = {name: path for name, path in plots.items() if path is not None}
    if shown:
        parts.append("## Plots\n")
        for name, path in shown.items():
            parts.append(f"![{name}]({_relative(path, root)})\n")
            if name == "roofline":
                parts.append(_ROOFLINE_NOTE)
    return "\n".join(parts) + "\n"


_RELATIVE_METHOD = """One Enformer / Borzoi attention core (Transformer-XL relative positions: a position term that
depends on the query, so no stock fused kernel runs it), 8 heads, dk 64, dv 192, bf16, as `kvbound bench --suite
relative` times it (`kvbound/bench/relative.py`): the ports' eager math; SDPA and FlexAttention with the position
term built for them in each call (a `[B, H, N, N]` bias, or a `[B, H, N, 2N - 1]` table read in `score_mod`); kvbound's
fused call on exact K/V, and on compressed K/V with this forward's encoding included (`compress ms`: the encoding
alone). `vs best alternative` is against the faster of SDPA and FlexAttention. `bash benchmarks/h200.sh relative`.
"""

_FORWARD_TIMELINE_METHOD = """\
`python benchmarks/forward_timeline.py OUT.csv` (full configs, random weights, the models suite's inputs, bf16
autocast, `no_grad`; unpatched and `kvbound.patch(model, compress=False)`): `forward ms` is the median of 5 untraced
forwards (CUDA events); the other columns come from one forward traced by `torch.profiler`. Device busy: the union of
kernel and copy intervals; idle: the traced span less that. Attention modules: the device time of the work launched
inside the attention modules (found by `record_function` marks around each module's call). `bound without
attention`: the unpatched forward over the patched forward less its attention modules, the speed-up if they took no
device time at all (the ceiling the attention-only targets can reach). Transformer: from the first to the last
kernel launched in an attention module. Each CSV has a plot of the same next to it (`.png`). Files recorded before
9567d8e counted the marks' device-side ranges as device work (their READMEs say so): their busy time cannot show
gaps inside a module. In the `patch-compressed` rows recorded before 86b408c, the traced forward is not the timed
one: under the profiler the compressed attention op ignored its operands' check records and checked each K and V
again before its kernel (a host read each: 70 syncs in Enformer's forward, some 150 small check kernels per layer),
so their busy, idle and attention-module columns overstate that variant's work; their `forward ms` (untraced) does
not.
"""

_RELATIVE_NCU_METHOD = """`python benchmarks/relative_ncu.py OUT.csv` (`bash benchmarks/h200.sh relative-ncu`): one
Enformer layer (N = 1536, batch 8) and one Borzoi layer (N = 4096, batch 4), bf16, dense K/V, through kvbound's dense
kernel without the relative term (`plain`: the content logits alone), with all `2N - 1` relative keys (`keys`) and
with one key per run (`runs`, Borzoi), at the autotuner's tile and at pinned tiles (`BMxBNxWARPSxSTAGES`). `call ms`:
the public call with its checks deferred (`do_bench` median); then one call per row under `ncu --clock-control none`:
the kernel's duration, `useful TFLOP/s` (the content and value products, `2 B H N^2 (dk + dv)`, over that duration:
the same work in every variant), registers per thread, local-memory loads (register spills), achieved occupancy,
issue-slot and tensor-pipe utilisation (averages over the SMs), instructions and the three largest stall reasons
(warps per issue-active cycle). `err max`: batch item 0 against float64.
"""

_SHARE_METHOD = """How the speed depends on the data. The default config (rank 8, 4 bits, tau 2^-5) on K/V generated
with a set share of blocks whose residual stays below tau (`benchmarks/shapes/share.toml`, `kvbound/bench/data.py`);
the other blocks carry 4-bit codes read by the byte-decode loop. The share column is what the codec found. On the
trained evaluation models at the default tau no block is residual-free and every block is promoted to wider codes
(next section), which is slower than any row here. The split launch columns (`kvbound-compressed-split`,
`KVBOUND_SPLIT_LOWRANK=1`) run the low-rank runs in a second kernel compiled without residual code and merge the two
partial results (`kernels/README.md`); the one launch columns (`kvbound-compressed-one`, `KVBOUND_SPLIT_LOWRANK=0`)
never split. The kvbound columns are the default, which splits when at least 40 % of the super-blocks are
proven low-rank only (at 1aa065a: half); in runs at b979f83 and before, the default was one launch. `-` where the
run predates a variant. `bash benchmarks/h200.sh share`.
"""

_LARGEST_BATCH_METHOD = """`python benchmarks/largest_batch.py OUT.csv` (`bash benchmarks/h200.sh largest`): per port
and variant, one full-size forward (bf16 autocast, `no_grad`, the models suite's inputs) per probed batch, the batch
doubled until a forward runs out of memory, then bisected. A probe without an answer within the probe limit counts as
not fitting (`first without answer`) and the search resumes below it. Peak: `torch.cuda.max_memory_allocated` of the
forward at the largest batch. The models suite's own timing loop holds more than one forward, so it may not fit at
that batch.
"""

_TRAINED_KV_METHOD = """Plain softmax attention on the queries, keys and values that the trained compact models of
`kvbound eval` compute in their last attention layer on real human chrX sequence (test split, model windows of
1,536 tokens laid end to end, skipping any with more than 1 % N, concatenated along the sequence; the
Enformer-style model with 8 K/V heads, the
AlphaGenome-style model with one K/V head for 8 query heads; dk 64, dv 32), bf16, B = 1: cuDNN SDPA and kvbound's
dense kernel on the K/V as the model holds them, kvbound's compressed kernel at the default configuration (block 128,
rank 8, 4 bits, tau 2^-5) with a basis calibrated on train-split windows. `rel err`: relative L2 error against
float64 on the K/V each provider read (the codec's float32 values for the compressed row), over 256 evenly spaced
query rows of every head; `err vs original`: the compressed row against float64 on the original K/V; `K/V max err /
tau`: the largest element error of the codec's values over the bound. Block shares: low rank / packed at the
configured width / promoted to a wider width / stored exactly. These are the models' K/V, not the models'
attention: their relative-position term, pair bias and soft-cap are left out so that cuDNN can run the same call.
`python benchmarks/trained_kv.py` (capture, then time).
"""

_ROOFLINE_NOTE = """Every provider's FLOP count is that of dense attention at its shape (the `flops` column), so a
point's TFLOP/s is the rate at which it delivers dense-attention work. Compressed rows that skip work (rank-space logits
and values on residual-free tiles) therefore sit above the bf16 matmul roof: that is work not done, not a faster
tensor core. Their FLOP per byte uses the same count over the bytes each one moved.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbound.bench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"))
    parser.add_argument("--plots-dir", type=Path, default=Path("benchmarks/plots"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    files = read_results(args.results)
    if not files:
        print(f"kvbound.bench.report: no CSV files under {args.results}", file=sys.stderr)
        return 2
    rows_by_file = {f.path: f.rows for f in files if f.kind == "bench"}
    rows = [r for file_rows in rows_by_file.values() for r in file_rows]
    plots: dict[str, Path | None] = {}
    if not args.no_plots:
        from kvbound.bench.plots import (
            bytes_vs_rank_bits,
            model_forwards,
            model_speedups,
            ring_vs_n,
            speed_vs_n,
            speed_vs_share,
        )
        from kvbound.bench.roofline import roofline_from_rows

        plots["speed vs N"] = speed_vs_n(rows, args.plots_dir / "speed_vs_n.png")
        plots["speed vs residual-free share"] = speed_vs_share(rows, args.plots_dir / "speed_vs_share.png")
        plots["roofline"] = roofline_from_rows(rows, args.plots_dir / "roofline.png")
        plots["bytes vs (rank, bits)"] = bytes_vs_rank_bits(rows, args.plots_dir / "bytes_vs_rank_bits.png")
        plots["model forwards"] = model_forwards(rows, args.plots_dir / "model_forwards.png")
        plots["model speed-ups"] = model_speedups(rows, args.plots_dir / "model_speedups.png")
        plots["ring vs N"] = ring_vs_n(rows, args.plots_dir / "ring_vs_n.png")
    root = args.out.resolve().parent
    others = [f for f in files if f.kind != "bench"]
    args.out.write_text(render(rows_by_file, root, plots, others))
    read = sum(1 for f in files if f.kind not in ("unknown", "development"))
    print(f"wrote {args.out} from {read} of {len(files)} CSV files ({len(rows)} bench rows)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
