#!/usr/bin/env bash
# Train the four compact models (enformer, alphagenome; each with and without attention) within a fixed
# wall-clock budget, then (optionally) run `kvbound eval`, and pack everything into one archive.
#
# Data: the prepared cache eval/.cache (genome, motifs, tss, sim, variants; about 40 MB) must be present; make
# it on a machine with network with
#   KVBOUND_CACHE=eval/.cache python -m kvbound.eval.data fetch && KVBOUND_CACHE=eval/.cache python -m kvbound.eval.simulate
# (the second command scans chrX once, 1-4 minutes on a CPU, and keeps the result in eval/.cache/sim).
#
# The four trainings run at the same time, all on one GPU by default; when CUDA_VISIBLE_DEVICES lists two
# or more GPUs they are spread over them. All share one deadline (TOTAL_BUDGET_S after the start of this
# script, less PACK_RESERVE_S) and stop cleanly before it (python -m kvbound.eval.train --deadline-unix).
#
# Environment (defaults in brackets):
#   TOTAL_BUDGET_S [390]  wall clock of the training part, data loading and packing included
#   PACK_RESERVE_S [15]   kept at the end for packing
#   BATCH [8]             batch size of every training
#   STEPS [1000000]       step cap (the time budget normally stops first)
#   SEED [0]
#   MODELS [enformer enformer_noattn alphagenome alphagenome_noattn]  which of the four to train
#   TRAIN_ARGS            extra arguments of every training, e.g. "--track-weight enhancer=4 --tss-share 0.75"
#   INIT [0]              1: each training starts from its committed weights in eval/weights (when present)
#   RUN_EVAL [0]          1: run `kvbound eval` after training (EVAL_BUDGET_S [330], EVAL_ARGS extra arguments)
#   FIXTURE               a directory: train toy models on the synthetic fixture instead (CPU smoke test)
#   DEVICE                passed as --device (default: cuda when present)
#   OUT [eval/gpu_out]    the archive kvbound_eval_gpu.tar.gz is written here (one file)
#   PYTHON [python3]
set -euo pipefail
cd "$(dirname "$0")/.."
start_epoch=$(date +%s)
export KVBOUND_CACHE="${KVBOUND_CACHE:-eval/.cache}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
total_budget="${TOTAL_BUDGET_S:-390}"
pack_reserve="${PACK_RESERVE_S:-15}"
batch="${BATCH:-8}"
steps="${STEPS:-1000000}"
seed="${SEED:-0}"
out="${OUT:-eval/gpu_out}"
mkdir -p "$out" eval/weights eval/results
logs=$(mktemp -d)
python_bin="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # the working tree's kvbound, installed or not

if [ -n "${FIXTURE:-}" ]; then
  data_args=(--fixture "$FIXTURE")
  size=toy
  train_extra=(--eval-windows 2 --log-every 5 --eval-every 20)
else
  data_args=(--cache "$KVBOUND_CACHE")
  size=full
  train_extra=(--eval-windows 32 --log-every 50 --eval-every 500)
fi
device_args=()
if [ -n "${DEVICE:-}" ]; then device_args=(--device "$DEVICE"); fi

IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-0}"
n_gpus=${#gpus[@]}
cpus=$(nproc)
threads=$(( cpus / 4 > 0 ? cpus / 4 : 1 ))

# Write the simulator's cache once (a no-op when it is there) so the trainings do not race to write it.
# A failure here is left to show in the trainings' own logs, which the archive carries back.
"$python_bin" -m kvbound.eval.simulate "${data_args[@]}" --out "$logs/simulation_summary.json" \
  > "$logs/prepare.log" 2>&1 || echo "gpu_run: data preparation FAILED (prepare.log in the archive)" >&2

elapsed=$(( $(date +%s) - start_epoch ))
deadline=$(( start_epoch + total_budget - pack_reserve ))
budget=$(( deadline - $(date +%s) ))
if [ "$budget" -lt 10 ]; then
  echo "gpu_run: only ${budget}s left for training after ${elapsed}s of preparation (TOTAL_BUDGET_S=$total_budget)" >&2
  exit 1
fi
echo "gpu_run: preparation ${elapsed}s; the trainings have ${budget}s on ${n_gpus} GPU(s) (${gpus[*]})"

pids=()
names=()
index=0
models="${MODELS:-enformer enformer_noattn alphagenome alphagenome_noattn}"
read -r -a train_args <<< "${TRAIN_ARGS:-}"
for model in enformer alphagenome; do
  for attention in "" "--no-attention"; do
    name="$model${attention:+_noattn}"
    if [[ " $models " != *" $name "* ]]; then continue; fi
    init_args=()
    weights_name="$name"
    if [ "$size" = "toy" ]; then weights_name="${name}_toy"; fi
    if [ "${INIT:-0}" = "1" ] && [ -f "eval/weights/$weights_name.safetensors" ]; then
      init_args=(--init "eval/weights/$weights_name.safetensors")
    fi
    gpu="${gpus[$(( index % n_gpus ))]}"
    CUDA_VISIBLE_DEVICES="$gpu" OMP_NUM_THREADS="$threads" \
      "$python_bin" -m kvbound.eval.train --model "$model" $attention --size "$size" --steps "$steps" \
      --deadline-unix "$deadline" --batch-size "$batch" --seed "$seed" "${data_args[@]}" "${device_args[@]}" \
      "${train_extra[@]}" "${init_args[@]}" "${train_args[@]}" --weights-dir eval/weights --log-dir eval/results \
      > "$logs/train_$name.log" 2>&1 &
    pids+=($!)
    names+=("$name")
    index=$(( index + 1 ))
  done
done
if [ "${#pids[@]}" -eq 0 ]; then
  echo "gpu_run: MODELS='$models' names none of enformer enformer_noattn alphagenome alphagenome_noattn" >&2
  exit 2
fi
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "gpu_run: ${names[$i]} done"
  else
    echo "gpu_run: ${names[$i]} FAILED (log: eval/results/logs/train_${names[$i]}.log in the archive)" >&2
    tail -5 "$logs/train_${names[$i]}.log" >&2 || true
    failed=1
  fi
done
echo "gpu_run: training finished after $(( $(date +%s) - start_epoch ))s"

if [ "${RUN_EVAL:-0}" = "1" ]; then
  # shellcheck disable=SC2086
  "$python_bin" -m kvbound.eval.cli "${data_args[@]}" "${device_args[@]}" --out eval/results \
    --time-budget-s "${EVAL_BUDGET_S:-330}" ${EVAL_ARGS:-} > "$logs/eval.log" 2>&1 || failed=1
  echo "gpu_run: eval finished after $(( $(date +%s) - start_epoch ))s"
fi

nvidia-smi > "$logs/nvidia-smi.txt" 2>&1 || true
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "seconds: $(( $(date +%s) - start_epoch ))"
  echo "gpus: ${gpus[*]}"
  echo "training_budget_s: $budget"
} > "$logs/gpu_run.txt"
mkdir -p eval/results/logs
cp "$logs"/*.log "$logs"/*.txt "$logs"/*.json eval/results/logs/ 2>/dev/null || true
archive="$out/kvbound_eval_gpu.tar.gz"
shopt -s nullglob
weights=(eval/weights/*.safetensors)
tar -czf "$archive" "${weights[@]}" eval/results
echo "gpu_run: wrote $archive ($(du -h "$archive" | cut -f1)) after $(( $(date +%s) - start_epoch ))s"
rm -rf "$logs"
exit "$failed"
