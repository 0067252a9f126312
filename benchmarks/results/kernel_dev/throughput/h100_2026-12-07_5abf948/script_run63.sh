#!/bin/bash
# Throughput at the largest batches: the patched forward near its largest batch against the port near its own.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=${1:-wt}
cp benchmarks/scratch_run63.sh $OUT/script_run63.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
run() { # model variant batch
  left=$(( 540 - SECONDS )); [ $left -lt 40 ] && { echo "no time for $1 $2 $3"; return; }
  timeout $left python -m kvbound.bench --commit $C --suite models --only $1 --batches $3 --variants $2 --warmup 1 --repeats 3 --out $OUT/throughput_$1_$2.csv >> $OUT/throughput_$1_$2.log 2>&1
  echo "$1 $2 b$3 rc=$? t=$SECONDS"
}
# run enformer unpatched 32 (earlier call)
run enformer patch-dense 64
# run borzoi unpatched 26 (earlier call)
# run borzoi patch-dense 68 (earlier call)
python - <<'P'
import csv, glob
for f in sorted(glob.glob(__import__('os').environ['OUT'] + '/throughput_*.csv')):
    for r in csv.DictReader(open(f)):
        print(r.get('shape'), r.get('provider'), r.get('batch'), r.get('status'), r.get('ms_p50'), r.get('peak_bytes'), (r.get('reason') or '')[:80])
P
