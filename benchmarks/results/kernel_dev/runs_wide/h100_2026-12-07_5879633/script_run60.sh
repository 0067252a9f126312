#!/bin/bash
# tiles of the runs at Borzoi's layer (b4), GPU tests of the runs, Borzoi's models suite wide vs default at b4.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=${1:-wt}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
T0=$(date +%s)
timeout 120 python benchmarks/scratch_exp/tiles128.py $OUT/tiles128.csv $C 4 > $OUT/tiles128.log 2>&1
echo "tiles rc=$? t=$(( $(date +%s) - T0 ))"
KVBOUND_RUNS_WIDE=1 TILES_AUTO_ONLY=1 timeout 45 python benchmarks/scratch_exp/tiles128.py $OUT/tiles128_wide.csv $C 4 > $OUT/tiles128_wide.log 2>&1
echo "tiles wide rc=$? t=$(( $(date +%s) - T0 ))"
python - $OUT/tiles128.csv $OUT/tiles128_wide.csv <<'PY'
import csv, sys
for f in sys.argv[1:]:
    try:
        rows = list(csv.DictReader(open(f)))
    except FileNotFoundError:
        continue
    for r in rows:
        print(r["wide"], r["B"], r["variant"], r["tile"], str(r["span"])[:60], r["status"], r["ms_p50"], r["ms_graph"], r["compile_s"], r["err_max"], r["reason"][:150])
PY
tail -2 $OUT/tiles128.log
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_relative_runs.py -rA > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? t=$(( $(date +%s) - T0 ))"; tail -4 $OUT/gpu_tests.log
for v in wide default; do
  left=$(( 520 - ($(date +%s) - T0) ))
  [ $left -lt 40 ] && break
  if [ $v = wide ]; then export KVBOUND_RUNS_WIDE=1; else unset KVBOUND_RUNS_WIDE; fi
  timeout $(( left < 110 ? left : 110 )) python -m kvbound.bench --commit $C --suite models --graphs --variants unpatched patch-dense patch-dense-graph --only "borzoi*" --batches 4 --out $OUT/models_borzoi_$v.csv > $OUT/models_borzoi_$v.log 2>&1
  echo "models $v rc=$? t=$(( $(date +%s) - T0 ))"
  python - $OUT/models_borzoi_$v.csv <<'PY'
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except FileNotFoundError:
    rows = []
for r in rows:
    print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p20"), r.get("ms_p50"), r.get("attention_ms_p50"), r.get("note", "")[:60], r.get("reason", "")[:200])
PY
done
