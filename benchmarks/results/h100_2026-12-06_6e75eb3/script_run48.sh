# One call: AlphaGenome at batch 2 and Borzoi at batch 1 with the value columns in two parts.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
timeout 150 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 2 --variants unpatched patch-compressed --out $OUT/models_b2_alphagenome.csv > $OUT/ag_b2.log 2>&1; echo "ag b2 rc=$? t=$SECONDS"
timeout 150 python -m kvbound.bench --commit $C --suite models --only "borzoi" --batches 1 --out $OUT/models_b1_borzoi.csv > $OUT/borzoi_b1.log 2>&1; echo "borzoi b1 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("note", "")[:400], r.get("reason", "")[:300])
PY
