#!/usr/bin/env bash
# Train the compact models on the simulated chrX tracks and run the quality benchmark on one GPU.
#
# The machine needs the prepared data cache (no network there): on a machine with network run
#   KVBOUND_CACHE=eval/.cache python -m kvbound.eval.data fetch
# and copy eval/.cache/{genome,motifs,tss,manifest.json} (17.7 MB) to the GPU machine. The simulator runs
# on the CPU on first use (about 1-4 minutes for 70 Mbp) and caches its tracks in eval/.cache/sim/.
#
# Environment: STEPS (default 3000), BATCH (default 8), MODELS (default "enformer alphagenome").
set -euo pipefail
cd "$(dirname "$0")/.."
export KVBOUND_CACHE="${KVBOUND_CACHE:-eval/.cache}"
steps="${STEPS:-3000}"
batch="${BATCH:-8}"
python -m kvbound.eval.data info
for model in ${MODELS:-enformer alphagenome}; do
  python -m kvbound.eval.train --model "$model" --steps "$steps" --batch-size "$batch"
  python -m kvbound.eval.train --model "$model" --no-attention --steps "$steps" --batch-size "$batch"
done
python -m kvbound.eval.cli --out eval/results "$@"
