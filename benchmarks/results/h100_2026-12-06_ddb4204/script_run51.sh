# One call on the GPU: the value-parts GPU tests (tests/test_dv_split.py), then Borzoi at batch 4 (patched with dense
# K/V) with the runs' query forms through shared memory (KVBOUND_Q_SCRATCH=1) and with the default, one process each.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
start=$(date +%s)
timeout 330 python -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_dv_split.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s"; grep -v DEBUG $OUT/gpu_tests.log | tail -4
for s in "default auto" "scratch 1"; do set -- $s
  start=$(date +%s)
  KVBOUND_Q_SCRATCH=$2 timeout 110 python -m kvbound.bench --commit $C --suite models --only borzoi --batches 4 \
    --variants unpatched patch-dense --out $OUT/borzoi_b4_q_scratch_$1.csv > $OUT/borzoi_b4_$1.log 2>&1
  echo "borzoi b4 $1 rc=$? $(( $(date +%s) - start )) s"
done
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/borzoi_*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["batch"], r["provider"], r["status"], r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("diff_rel", "")[:8], (r.get("reason") or "")[:200])
PY
