#!/usr/bin/env bash
# Every number in BENCHMARKS.md, measured on one H200 (two for `ring`), one PART per command of at most 10 minutes.
#
#   KVBOUND_COMMIT=<sha> bash benchmarks/h200.sh PART          # on the GPU machine, from the repository root
#   KVBOUND_SMOKE=1 bash benchmarks/h200.sh PART               # the same steps at tiny sizes on the CPU
#   bash benchmarks/h200.sh list                               # the parts, their steps and estimated times
#
# What comes back (at most 4 files under $OUT, none in subfolders):
#   $OUT/PART.log                       everything printed, as it happens (also inside the archive)
#   $OUT/PART_<commit>.tar.gz           benchmarks/results/h200_<date>_<commit>/PART/*.csv + PART.log: unpack it
#                                       at the repository root (tar -xzf FILE -C .), then
#                                       `python -m kvbound.bench.report` rebuilds BENCHMARKS.md and the plots
#   $OUT/status.txt                     one line per step: name, exit status, seconds, rows written
#   $OUT/triton_cache.tar.gz            compiled Triton kernels (only when under 12 MiB): unpack it at the
#                                       repository root and carry `.cache/triton` in the next call so that the
#                                       next part skips the compiles it shares with this one
#
# Every step runs under its own time limit (and the whole part under KVBOUND_DEADLINE_S, default 560 s), writes
# its rows as they are measured, and is packed whatever happens: a step that fails, times out or crashes is
# reported as FAILED in the log and status.txt, the remaining steps still run, and the script exits non-zero.
#
# Estimated times (wall clock on the H200, fresh machine, empty Triton cache). What they rest on: the run at
# 96bd3af (55 attention rows: 4 seed shapes + 3 model shapes, configs r8b4 and lowrank-r8) took about 6 minutes
# including compiles; a residual-capable compressed kernel variant takes tens of seconds to compile per tile
# config (kernels/README.md), 3 tile configs at d = 64 and 2 at d = 128 survive the autotuner's pruning, and
# rank, head dims, residual on/off, bias and soft-cap are compile-time constants (bits are not). do_bench runs
# about 125 ms per measurement plus about 5 calls to estimate, so the slow rows (r8b4 at N = 65536: 90-210 ms
# a call at 96bd3af) cost a few seconds each. With a carried .cache/triton the compile share mostly disappears.
#
#   verify      ~10 min   `pytest -m gpu` (30 tests, compiles included; up to 7) | benchmarks/byte_decode_tiles.py: the
#                         byte decode at every tile shape, one process per case, outputs against float64 (4)
#   attention   ~7.5 min  roofline ceilings (0.3) | seed shapes N = 4096, 16384, 65536 x d = 64, 128, every
#                         provider (kvbound also with deferred checks), configs r8b4, quant-r0b4, lowrank-r8,
#                         + kvbound.calibrate per model load
#                         (48 + 3 rows, 5.5: about 3 of them compiling 3 compressed variants x 5 tile configs)
#                         | encoder suite on the seed and model shapes (1.5)
#   traffic     ~7 min    Nsight Compute (--clock-control none) DRAM and L2->SM bytes on the seed shapes:
#                         kvbound (3 configs) + dense + cuDNN/flash/efficient SDPA, d = 64 then d = 128 (3.5 each;
#                         each call profiled once, every kernel of it summed; compiles as in `attention`)
#   sweep       ~6 min    (rank, bits) sweep r16b8 r16b4 r8b2 r4b2 + per-block basis, N = 16384 and 65536, d = 64,
#                         beside kvbound-dense and cuDNN (3 new compressed variants x 3 tile configs: ~4 of it)
#   sweep-d128  ~5 min    the same at d = 128 (2 tile configs)
#   models      ~7 min    attention suite on the models' shapes (Enformer, Borzoi, AlphaGenome: every provider
#                         incl. eager and SDPA + materialised bias, FlexAttention compiles, 3 configs; 4) | whole
#                         forwards of Enformer and Borzoi at batch 1, unpatched / patch-dense / patch-compressed,
#                         and unpatched / patch-dense / patch-compressed replayed from CUDA graphs (3.5)
#   models2     ~7 min    whole forwards of AlphaGenome (1 Mb input) at batch 1 and 2 (4.5) | Enformer and Borzoi
#                         at their larger batches 8 and 4 (2.5)
#   ring        ~6 min    context-parallel attention N = 65536 .. 524288, d = 64: 1 GPU (2.5), then 2 GPUs (3.5);
#                         ring-compressed vs ring-dense vs all-gather of dense K/V, bytes on the wire per rank.
#                         Needs the 2-GPU machine (nvidia-h200-x2); on one GPU the 2-GPU rows are `unsupported`.
#
#   share       ~2 min    the default config (r8b4) at N = 65536, d = 64 and 128, with 0 .. 100 % of the K/V blocks
#                         residual-free (benchmarks/shapes/share.toml), beside cuDNN: how speed depends on the data;
#                         the default launch, one launch (kvbound-compressed-one) and the split launch
#                         (kvbound-compressed-split: low-rank runs in a kernel without residual code, merged by
#                         log-sum-exp) side by side
#   bounded     ~5 min    benchmarks/bounded_sweep.py: the bounded maximum against the running maximum
#                         (KVBOUND_BOUNDED_MAX=on / off), compressed (residual-free rank 8) and dense, N = 4096 ..
#                         65536 x d = 64, 128, beside cuDNN; bounded.png draws the speed-ups
#   relative    ~4 min    Enformer / Borzoi attention cores (relative positions) at batch 1 and 8 / 4: the ports' math,
#                         SDPA and FlexAttention with the position term built for them, kvbound fused (exact and
#                         compressed K/V), time and peak memory (kvbound/bench/relative.py)
#   asm         ~4 min    the PTX byte decode (default) against the compiler's (KVBOUND_ASM_DECODE=0): the byte-decode
#                         GPU checks with the compiler's (2.5), then benchmarks/residual_diag.py's uniform loop timed
#                         with each (0.5 each)
#   alphagenome ~9 min    AlphaGenome alone (1 Mb input, batch 1), unpatched / patch-dense / patch-compressed, with
#                         the whole part's time for the compressed variant's first compiles (one step, 540 s)
#   halves      ~3 min    the dense relative kernel with half windows carried between tiles (relative_halves, off:
#                         slower at b07ccf7): its GPU tests and the other relative tiles' tests, benchmarks/relative_tiles.py
#                         (rows keys and keys-halves, default skew), then Enformer forwards at batch 1 and 8 with
#                         KVBOUND_RELATIVE_HALVES=1 (compare with the models part's rows)
#   largest     ~7 min    benchmarks/largest_batch.py: the largest batch of Enformer's and Borzoi's forwards that fits
#                         in device memory, unpatched / patch-dense / patch-compressed, with its peak memory; a
#                         probe without an answer after 90 s counts as not fitting and the search resumes below it
#                         in a new worker (first_timeout: Borzoi stalled at batch 32 on 2026-12-02, so its searches
#                         may take several 90 s waits each). Enformer took 50 s at b07ccf7
#   largest-alphagenome   the same for AlphaGenome (1 Mb input): 122 s at ce507a3 with a carried Triton cache (without
#                         one its compressed variant compiled for about 9 min in the alphagenome part)
#   relative-ncu ~2 min   benchmarks/relative_ncu.py: one Enformer layer (batch 8) and one Borzoi layer (batch 4)
#                         through the dense kernel without the relative term, with the relative keys and (Borzoi)
#                         with one key per run, at the autotuner's tile and pinned at 64x64x4x2, 64x64x8x3 and three
#                         4-warp tiles without spills in benchmarks/static_regs.py's counts (64x32x4x1, 64x16x4x1,
#                         64x16x4x2): time, error against float64, and Nsight Compute (--clock-control none) sections
#                         per kernel (registers, spills, occupancy, issue slots, tensor pipe, stall reasons)
#   alternatives ~10 min  whole forwards of Enformer (batch 1, 8) and Borzoi (1, 4): unpatched, patched (dense,
#                         compressed), and the ports with their attention core replaced by what a user could assemble
#                         (SDPA with a built position bias, compiled FlexAttention over a built table;
#                         kvbound/bench/alternatives.py): FlexAttention compiles per shape (untimed); then AlphaGenome
#                         (1 Mb, batch 1, 2) unpatched, patched dense and on FlexAttention reading its compact pair
#                         bias (flex-tile-bias; 108 s at 7955972)
#   timeline    ~8 min    benchmarks/forward_timeline.py: one traced whole forward of Enformer (batch 8, then 1),
#                         Borzoi (4, then 1) and AlphaGenome (1), unpatched and patch-dense: device busy and idle
#                         time, the attention modules' device time, the transformer's span, a plot; then
#                         benchmarks/fused_norm_ab.py: AlphaGenome patched with and without its q, k, v norms fused
#                         (GPU only: the smoke runs nothing)
#
# models, models2, alphagenome, halves, largest, alternatives and timeline install the ports' wheels from .whl/
# (benchmarks/wheels.sh; carry `.whl`).
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1), whatever the caller's environment says.
set -uo pipefail

PARTS="verify attention traffic sweep sweep-d128 share bounded relative relative-ncu asm models models2 alphagenome halves largest largest-alphagenome alternatives timeline ring"
PART="${1:-}"
if [[ "$PART" == "list" || "$PART" == "-h" || "$PART" == "--help" ]]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
if [[ -z "$PART" || " $PARTS " != *" $PART "* ]]; then
    echo "usage: bash benchmarks/h200.sh PART   (PART: $PARTS; 'list' explains them)" >&2
    exit 2
fi

cd "$(dirname "$0")/.." || exit 2
ROOT="$PWD"
START_S=$SECONDS
SMOKE="${KVBOUND_SMOKE:-0}"
DEADLINE_S="${KVBOUND_DEADLINE_S:-560}"
PY="${PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/.cache/triton}"
mkdir -p "$TRITON_CACHE_DIR"

COMMIT="${KVBOUND_COMMIT:-}"
if [[ -z "$COMMIT" ]]; then
    COMMIT="$(git rev-parse --short HEAD 2>/dev/null || true)"
    [[ -n "$COMMIT" ]] || COMMIT="unknown"
    echo "WARNING: KVBOUND_COMMIT is not set; recording commit '$COMMIT'" >&2
fi
DATE="$(date -u +%Y-%m-%d)"
if [[ "$SMOKE" == "1" ]]; then
    OUT="${OUT:-/tmp/kvbound-h200-smoke}"
    DEVICE_TAG="cpu-smoke"
else
    OUT="${OUT:-$ROOT/.cache/out}"
    DEVICE_TAG="h200"
fi
mkdir -p "$OUT"
STAGE="$(mktemp -d /tmp/kvbound-stage.XXXXXX)"
REL="benchmarks/results/${DEVICE_TAG}_${DATE}_${COMMIT}/${PART}"
RES="$STAGE/$REL"
mkdir -p "$RES"
LOG="$OUT/$PART.log"
STATUS="$OUT/status.txt"
: >"$LOG"
: >"$STATUS"
exec > >(tee -a "$LOG") 2>&1
FAILED=()
PACKED=0

pack() {
    [[ "$PACKED" == "1" ]] && return
    PACKED=1
    echo "== packing results ($((SECONDS - START_S)) s since start)"
    sync
    cp "$LOG" "$RES/$PART.log" 2>/dev/null
    cp "$STATUS" "$RES/status.txt" 2>/dev/null
    tar -czf "$OUT/${PART}_${COMMIT}.tar.gz" -C "$STAGE" "$REL" && ls -l "$OUT/${PART}_${COMMIT}.tar.gz"
    local cache
    cache="$(realpath --relative-to="$ROOT" "$TRITON_CACHE_DIR" 2>/dev/null)"
    if [[ "$SMOKE" != "1" && -d "$TRITON_CACHE_DIR" && -n "$cache" && "$cache" != ..* ]]; then
        local tmp="$STAGE/triton_cache.tar.gz"
        tar -czf "$tmp" -C "$ROOT" "$cache" 2>/dev/null
        if [[ -f "$tmp" && $(stat -c %s "$tmp") -lt $((12 * 1024 * 1024)) ]]; then
            mv "$tmp" "$OUT/triton_cache.tar.gz"
        else
            echo "Triton cache not returned (larger than 12 MiB or not under the repository)"
        fi
    fi
}
on_signal() {
    echo "!! $1 received: packing what was measured"
    FAILED+=("signal-$1")
    pack
    exit 3
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap pack EXIT

rows_in() {  # data rows of a CSV (0 if absent)
    [[ -f "$1" ]] && echo $(($(wc -l <"$1") - 1)) || echo 0
}

# step NAME BUDGET_S CSV CMD...: run CMD under min(BUDGET_S, what the deadline leaves), record how it went.
step() {
    local name="$1" budget="$2" csv="$3"
    shift 3
    local left=$((DEADLINE_S - (SECONDS - START_S) - 15))
    local limit=$((budget < left ? budget : left))
    if ((limit < 30)); then
        echo "!! SKIPPED $name: only ${left} s left before the ${DEADLINE_S} s deadline"
        FAILED+=("$name(skipped)")
        echo "$name skipped 0 0" >>"$STATUS"
        return
    fi
    echo
    echo "== [$((SECONDS - START_S)) s] $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout -k 15 "$limit" "$@"
    local rc=$?
    local rows
    rows=$(rows_in "$csv")
    echo "$name $rc $((SECONDS - t0)) $rows" >>"$STATUS"
    if ((rc != 0)); then
        local why="exit status $rc"
        ((rc == 124 || rc == 137)) && why="timed out after ${limit} s"
        ((rc == 1)) && why="exit status 1 (a check failed: see check_failed rows)"
        echo "!! FAILED $name: $why; $rows rows kept in $(basename "$csv")"
        FAILED+=("$name")
    else
        echo "== $name done in $((SECONDS - t0)) s, $rows rows"
    fi
}

# bench CSV ARGS...: sets CMD to the bench command line, with the CPU-smoke substitutions (tiny shapes: no
# --shapes, nor --only where --shapes selects the shapes; no profiler; short ring lengths; each model's batches).
bench() {
    local csv="$1"
    shift
    local args=("$@")
    if [[ "$SMOKE" == "1" ]]; then
        local kept=() skip=0 a drop_only=0
        [[ " ${args[*]} " == *" --shapes "* ]] && drop_only=1
        for a in "${args[@]}"; do
            if [[ "$skip" == "1" ]]; then
                [[ "$a" == --* ]] && skip=0 || continue
            fi
            case "$a" in
                --shapes | --ncu-path | --batches) skip=1 ;;
                --only) [[ "$drop_only" == "1" ]] && skip=1 || kept+=("$a") ;;
                --ncu) ;;
                --lengths) kept+=("$a" 256) && skip=1 ;;
                *) kept+=("$a") ;;
            esac
        done
        args=("${kept[@]}" --cpu-smoke)
    fi
    CMD=("$PY" -m kvbound.bench --commit "$COMMIT" "${args[@]}" --overwrite --out "$csv")
}

install_wheels() {
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "!! no wheels in .whl/: the ports will be 'unsupported' (run benchmarks/wheels.sh and carry .whl)"
        FAILED+=("wheels")
        return
    fi
    local site=/tmp/site
    [[ "$SMOKE" == "1" ]] && site=/tmp/kvbound-site-smoke
    echo "== installing $(ls .whl/*.whl | wc -l) wheels into $site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl; then
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        echo "!! FAILED to install the wheels"
        FAILED+=("wheels")
    fi
}

echo "== kvbound benchmarks: part $PART, commit $COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ), smoke=$SMOKE"
echo "== results -> $OUT (archive member $REL)"
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
    || { echo "!! python/torch/triton not importable"; FAILED+=("import"); }
if [[ "$SMOKE" != "1" ]]; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
        --format=csv 2>&1 | head -9
fi

case "$PART" in
verify)
    # The GPU-only tests (one process), then the byte decode at every tile shape (one process per case).
    tiles=("$PY" benchmarks/byte_decode_tiles.py "$RES/byte_decode_tiles.csv" --jobs 10 --timeout-s 200)
    [[ "$SMOKE" == "1" ]] && tiles+=(--cpu-smoke)
    step gpu-tests 420 /dev/null "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider tests -k "not plain_decode"
    step byte-decode-tiles 240 "$RES/byte_decode_tiles.csv" "${tiles[@]}"
    ;;
attention)
    if [[ "$SMOKE" == "1" ]]; then
        step roofline-cli 30 /dev/null "$PY" -m kvbound.bench.roofline --help
    else
        step roofline 60 "$RES/ceilings.csv" "$PY" -m kvbound.bench.roofline --commit "$COMMIT" \
            --out "$RES/ceilings.csv" --plot "$STAGE/roofline.png"
    fi
    bench "$RES/attention_seed.csv" \
        --shapes benchmarks/shapes/seed.toml --configs r8b4 quant-r0b4 lowrank-r8
    step attention-seed 360 "$RES/attention_seed.csv" "${CMD[@]}"
    bench "$RES/encoder.csv" --suite encoder
    step encoder 150 "$RES/encoder.csv" "${CMD[@]}"
    ;;
traffic)
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
    [[ -n "$NCU" || "$SMOKE" == "1" ]] || { echo "!! ncu not found"; FAILED+=("ncu"); NCU=ncu; }
    for d in 64 128; do
        bench "$RES/traffic_ncu_d$d.csv" --ncu --ncu-path "${NCU:-ncu}" \
            --shapes benchmarks/shapes/seed.toml --only "seed-*-d$d" --configs r8b4 quant-r0b4 lowrank-r8 \
            --providers kvbound-compressed kvbound-dense sdpa-cudnn sdpa-flash sdpa-efficient --no-calibration
        step "traffic-d$d" 250 "$RES/traffic_ncu_d$d.csv" "${CMD[@]}"
    done
    ;;
sweep | sweep-d128)
    d=64
    [[ "$PART" == "sweep-d128" ]] && d=128
    bench "$RES/sweep_d$d.csv" --shapes benchmarks/shapes/seed.toml \
        --only "seed-n16384-d$d" "seed-n65536-d$d" --sweep --configs r8b8 r16b8 r16b4 r8b2 r4b2 r8b4-perblock \
        --providers kvbound-compressed kvbound-dense sdpa-cudnn --no-calibration
    step "sweep-d$d" 500 "$RES/sweep_d$d.csv" "${CMD[@]}"
    ;;
share)
    bench "$RES/share.csv" --shapes benchmarks/shapes/share.toml --configs r8b4 --no-calibration
    step share 500 "$RES/share.csv" "${CMD[@]}"
    ;;
bounded)
    sweep=("$PY" benchmarks/bounded_sweep.py "$RES/bounded.csv")
    if [[ "$SMOKE" == "1" ]]; then sweep+=(--cpu-smoke); else sweep+=(--plot "$RES/bounded.png"); fi
    step bounded 500 "$RES/bounded.csv" "${sweep[@]}"
    ;;
asm)
    # The GPU test reruns the byte-decode checks in a child process with the compiler's decode
    # (KVBOUND_ASM_DECODE=0); then the same layouts timed with the PTX decode (the default) and without it (uniform
    # loop, dense and cuDNN beside them).
    if [[ "$SMOKE" == "1" ]]; then
        step asm-tests 120 /dev/null "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_paths.py -k plain_decode
    else
        step asm-tests 330 /dev/null "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_gpu_paths.py -k plain_decode
    fi
    diag=("$PY" benchmarks/residual_diag.py --layouts packed4,packed8,packed4_contig50 --providers uniform,dense,cudnn
          --long-layouts "" --budget-s 80)
    [[ "$SMOKE" == "1" ]] && diag+=(--cpu-smoke)
    step residual-ptx 110 "$RES/residual_ptx.csv" "${diag[@]}" "$RES/residual_ptx.csv"
    step residual-plain 110 "$RES/residual_plain.csv" env KVBOUND_ASM_DECODE=0 "${diag[@]}" "$RES/residual_plain.csv"
    ;;
relative)
    bench "$RES/relative.csv" --suite relative
    step relative 500 "$RES/relative.csv" "${CMD[@]}"
    ;;
relative-ncu)
    relncu=("$PY" benchmarks/relative_ncu.py "$RES/relative_ncu.csv" --commit "$COMMIT" --tiles autotuned)
    [[ "$SMOKE" == "1" ]] || relncu+=(64x64x4x2 64x64x8x3 64x32x4x1 64x16x4x1 64x16x4x2)
    [[ "$SMOKE" == "1" ]] && relncu+=(--cpu-smoke)
    step relative-ncu 480 "$RES/relative_ncu.csv" "${relncu[@]}"
    ;;
halves)
    install_wheels
    step halves-tests 300 /dev/null "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider tests/test_gpu_paths.py \
        -k "carried_halves or every_relative_tile_and_skew"
    if [[ "$SMOKE" == "1" ]]; then
        echo "== relative-tiles: GPU only, not run in the smoke"
    else
        step relative-tiles 200 "$RES/relative_tiles.csv" "$PY" benchmarks/relative_tiles.py "$RES/relative_tiles.csv" \
            --skews shared-banked --tiles 64x64x4x1,64x64x4x2,64x64x8x3
    fi
    bench "$RES/models_enformer_halves.csv" --suite models --only 'enformer*' --batches 1 8
    step ports-enformer-halves 150 "$RES/models_enformer_halves.csv" env KVBOUND_RELATIVE_HALVES=1 "${CMD[@]}"
    ;;
alternatives)
    install_wheels
    bench "$RES/models_alternatives_enformer.csv" --suite models --only 'enformer*' --batches 1 8 --alternatives
    step alternatives-enformer 260 "$RES/models_alternatives_enformer.csv" "${CMD[@]}"
    bench "$RES/models_alternatives_borzoi.csv" --suite models --only 'borzoi*' --batches 1 4 --alternatives
    step alternatives-borzoi 260 "$RES/models_alternatives_borzoi.csv" "${CMD[@]}"
    bench "$RES/models_alternatives_alphagenome.csv" --suite models --only 'alphagenome*' --batches 1 2 \
        --alternatives --variants unpatched patch-dense flex-tile-bias
    step alternatives-alphagenome 300 "$RES/models_alternatives_alphagenome.csv" "${CMD[@]}"
    ;;
timeline)
    install_wheels
    if [[ "$SMOKE" == "1" ]]; then
        echo "== timeline: GPU only (it traces CUDA kernels), not run in the smoke"
    else
        timeline=("$PY" benchmarks/forward_timeline.py)
        step timeline 220 "$RES/forward_timeline.csv" "${timeline[@]}" "$RES/forward_timeline.csv" --commit "$COMMIT"
        step timeline-b1 130 "$RES/forward_timeline_b1.csv" "${timeline[@]}" "$RES/forward_timeline_b1.csv" \
            --batches 1 1 --commit "$COMMIT"
        step timeline-alphagenome 160 "$RES/forward_timeline_alphagenome.csv" "${timeline[@]}" \
            "$RES/forward_timeline_alphagenome.csv" --models alphagenome --batches 1 --commit "$COMMIT"
        step fused-norm 120 "$RES/fused_norm_ab.csv" "$PY" benchmarks/fused_norm_ab.py "$RES/fused_norm_ab.csv" \
            --commit "$COMMIT"
    fi
    ;;
largest | largest-alphagenome)
    install_wheels
    models=("enformer*" "borzoi*")
    [[ "$PART" == "largest-alphagenome" ]] && models=("alphagenome*")
    largest=("$PY" benchmarks/largest_batch.py "$RES/largest_batch.csv" --commit "$COMMIT" --probe-timeout-s 90
             --models "${models[@]}")
    [[ "$SMOKE" == "1" ]] && largest+=(--cpu-smoke)
    step largest-batch 540 "$RES/largest_batch.csv" "${largest[@]}"
    ;;
models)
    install_wheels
    bench "$RES/attention_models.csv" \
        --shapes benchmarks/shapes/models.toml --configs r8b4 quant-r0b4 lowrank-r8 --no-calibration
    step attention-models 270 "$RES/attention_models.csv" "${CMD[@]}"
    bench "$RES/models_b1.csv" --suite models \
        --only 'enformer*' 'borzoi*' --batches 1 --graphs
    step ports-enformer-borzoi 240 "$RES/models_b1.csv" "${CMD[@]}"
    ;;
models2)
    install_wheels
    bench "$RES/models_alphagenome.csv" --suite models \
        --only 'alphagenome*'
    step ports-alphagenome 330 "$RES/models_alphagenome.csv" "${CMD[@]}"
    if [[ "$SMOKE" == "1" ]]; then
        bench "$RES/models_larger_batch.csv" \
            --suite models --only 'enformer*' 'borzoi*'
        step ports-larger-batch 200 "$RES/models_larger_batch.csv" "${CMD[@]}"
    else
        bench "$RES/models_enformer_b8.csv" \
            --suite models --only 'enformer*' --batches 8
        step ports-enformer-b8 110 "$RES/models_enformer_b8.csv" "${CMD[@]}"
        bench "$RES/models_borzoi_b4.csv" \
            --suite models --only 'borzoi*' --batches 4
        step ports-borzoi-b4 110 "$RES/models_borzoi_b4.csv" "${CMD[@]}"
    fi
    ;;
alphagenome)
    install_wheels
    bench "$RES/models_alphagenome_b1.csv" --suite models --only 'alphagenome*' --batches 1
    step ports-alphagenome-b1 540 "$RES/models_alphagenome_b1.csv" "${CMD[@]}"
    ;;
ring)
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    [[ "$SMOKE" == "1" || "$gpus" -ge 2 ]] || echo "!! only $gpus GPU(s): the 2-GPU rows will be 'unsupported' (use nvidia-h200-x2)"
    bench "$RES/ring_w1.csv" --suite ring --world-sizes 1 \
        --lengths 65536 131072 262144 524288
    step ring-1gpu 200 "$RES/ring_w1.csv" "${CMD[@]}"
    bench "$RES/ring_w2.csv" --suite ring --world-sizes 2 \
        --lengths 65536 131072 262144 524288
    step ring-2gpu 300 "$RES/ring_w2.csv" "${CMD[@]}"
    ;;
esac

pack
echo
echo "== part $PART finished in $((SECONDS - START_S)) s"
column -t "$STATUS" 2>/dev/null || cat "$STATUS"
if ((${#FAILED[@]})); then
    echo "!! FAILED steps: ${FAILED[*]} (partial results are in the archive)"
    exit 1
fi
echo "== all steps ok"
