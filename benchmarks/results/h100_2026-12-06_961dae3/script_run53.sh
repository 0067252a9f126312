# One call on the GPU: Borzoi at batches 1 and 4 with CUDA graphs and the stock alternatives, at this commit (the
# runs' key loop reading each tile's own runs).
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
start=$(date +%s)
timeout 300 python -m kvbound.bench --commit $C --suite models --graphs --alternatives --only borzoi --batches 1 4 \
  --out $OUT/models_borzoi.csv > $OUT/models_borzoi.log 2>&1
echo "borzoi rc=$? $(( $(date +%s) - start )) s"
python - $OUT <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1] + "/models_borzoi.csv")):
    print(r["batch"], r["provider"], r["status"], r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("diff_rel", "")[:8], (r.get("reason") or "")[:120])
PY
