#!/usr/bin/env bash
# The quality benchmark on one GPU, after eval/gpu_run.sh has trained the models (eval/weights/*.safetensors
# present in the tree), or the fidelity check of the public ports; results packed into one archive.
#
#   bash eval/gpu_eval.sh eval       `kvbound eval` within EVAL_BUDGET_S [530] seconds (needs eval/.cache)
#   bash eval/gpu_eval.sh fidelity   python -m kvbound.eval.fidelity: Enformer, Borzoi, AlphaGenome ports at full
#                                    size, random weights, one real chrX window, batch 1 (needs eval/.cache/genome,
#                                    motifs, tss, manifest.json and the ports' wheels in .whl/, see
#                                    benchmarks/wheels.sh)
#
# Environment: OUT [eval/gpu_out] (archive kvbound_eval_<mode>.tar.gz), EVAL_BATCH [8], EVAL_ARGS (extra
# `kvbound eval` arguments, e.g. "--windows 16 --max-variants 200", or "--test-chromosomes X 22" with chr22 in the
# cache: python -m kvbound.eval.data fetch --chromosomes X 22), EVAL_RESULTS [eval/results] (where `kvbound eval`
# writes; the held-out run of EVAL.md writes eval/results/heldout:
#   EVAL_RESULTS=eval/results/heldout EVAL_ARGS="--test-chromosomes X 22 --settings exact,default,paired,floor,paired_tau
#   --layer-windows 0 --scaling=" bash eval/gpu_eval.sh eval), FIXTURE (a directory: the synthetic fixture, CPU smoke
# test), DEVICE, PYTHON [python3].
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-eval}"
start_epoch=$(date +%s)
export KVBOUND_CACHE="${KVBOUND_CACHE:-eval/.cache}"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python_bin="${PYTHON:-python3}"
out="${OUT:-eval/gpu_out}"
results="${EVAL_RESULTS:-eval/results}"
mkdir -p "$out" eval/results/logs "$results/logs"
data_args=(--cache "$KVBOUND_CACHE")
if [ -n "${FIXTURE:-}" ]; then data_args=(--fixture "$FIXTURE"); fi
device_args=()
if [ -n "${DEVICE:-}" ]; then device_args=(--device "$DEVICE"); fi
status=0
case "$mode" in
  eval)
    # files that only some runs write: never pack a previous run's
    rm -f "$results/variants_chr22.csv" "$results/effects_chr22.csv"
    # shellcheck disable=SC2086
    "$python_bin" -m kvbound.eval.cli "${data_args[@]}" "${device_args[@]}" --out "$results" \
      --time-budget-s "${EVAL_BUDGET_S:-530}" --batch-size "${EVAL_BATCH:-8}" ${EVAL_ARGS:-} \
      > "$results/logs/eval.log" 2>&1 || status=$?
    files=()
    for name in quality.csv quality_by_stratum.csv effects.csv layers.csv scaling.csv variants.csv eval_run.json \
                pareto.png logs/eval.log variants_chr22.csv effects_chr22.csv; do
      files+=("$results/$name")
    done
    ;;
  fidelity)
    if [ -d .whl ] && [ -z "${FIXTURE:-}" ]; then
      "$python_bin" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvbound_site .whl/*.whl
      export PYTHONPATH="/tmp/kvbound_site:$PYTHONPATH"
    fi
    smoke=()
    if [ -n "${FIXTURE:-}" ]; then smoke=(--cpu-smoke); fi
    "$python_bin" -m kvbound.eval.fidelity "${data_args[@]}" "${device_args[@]}" "${smoke[@]}" \
      --out eval/results/fidelity.csv > eval/results/logs/fidelity.log 2>&1 || status=$?
    files=(eval/results/fidelity.csv eval/results/logs/fidelity.log)
    ;;
  *)
    echo "gpu_eval: expected 'eval' or 'fidelity', got '$mode'" >&2
    exit 2
    ;;
esac
present=()
for file in "${files[@]}"; do [ -e "$file" ] && present+=("$file"); done
archive="$out/kvbound_eval_$mode.tar.gz"
tar -czf "$archive" "${present[@]}"
echo "gpu_eval: $mode exited with $status after $(( $(date +%s) - start_epoch ))s; wrote $archive"
if [ "$mode" = eval ]; then tail -5 "$results/logs/eval.log" || true; else tail -5 eval/results/logs/fidelity.log || true; fi
exit "$status"
