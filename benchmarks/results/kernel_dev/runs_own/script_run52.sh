# One call on the GPU: the runs' key loop reading each tile's own runs inside the loop (KVBOUND_RUNS_OWN=1, so that
# the software pipelining fetches them ahead) against the default (read one tile ahead by hand): the runs' GPU tests
# with the switch on, the kernel alone (Borzoi's layer, batches 1 / 4 / 16) and Borzoi's forward at batches 1 and 4,
# one process per setting.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
start=$(date +%s)
KVBOUND_RUNS_OWN=1 timeout 150 python -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_relative_runs.py > $OUT/gpu_tests_own.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; grep -v DEBUG $OUT/gpu_tests_own.log | tail -3
echo "part,batch,layout,tile,ms,err,setting,commit" > $OUT/kernel_ab.csv
for s in 0 1 0 1; do
  start=$(date +%s)
  KVBOUND_RUNS_OWN=$s timeout 120 python benchmarks/results/kernel_dev/runs_own/kernel_ab_own.py $OUT/kernel_ab.csv $C own$s >> $OUT/kernel_ab.log 2>&1
  echo "kernel own=$s rc=$? $(( $(date +%s) - start )) s"
done
for s in 0 1; do
  start=$(date +%s)
  KVBOUND_RUNS_OWN=$s timeout 110 python -m kvbound.bench --commit $C --suite models --only borzoi --batches 1 4 \
    --variants unpatched patch-dense --out $OUT/borzoi_own$s.csv > $OUT/borzoi_own$s.log 2>&1
  echo "borzoi own=$s rc=$? $(( $(date +%s) - start )) s"
done
python - $OUT <<'PY'
import csv, glob, sys
for r in csv.DictReader(open(sys.argv[1] + "/kernel_ab.csv")):
    print(*r.values())
for f in sorted(glob.glob(sys.argv[1] + "/borzoi_own*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["batch"], r["provider"], r["status"], r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("diff_rel", "")[:8], (r.get("reason") or "")[:200])
PY
