# One call on the GPU: the models suite at Enformer batch 8 and Borzoi batch 4, with CUDA graphs and the stock
# alternatives, at this commit.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_larger.txt
for mb in "enformer 8" "borzoi 4"; do set -- $mb
  timeout 170 python -m kvbound.bench --commit $C --suite models --graphs --alternatives --only "$1*" --batches $2 --out $OUT/models_b$2_$1.csv > $OUT/models_b$2_$1.log 2>&1; echo "$1 $2 rc=$? t=$SECONDS"
done
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p50")[:7], r.get("attention_ms_p50")[:7], r.get("peak_bytes"), r.get("note", "")[:60], r.get("reason", "")[:160])
PY
