# One call: Enformer at batch 8, the compressed forward with the value columns of its relative-keys window in one part
# (the default) and in two (KVBOUND_DV_SPLIT=1).
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
timeout 200 python -m kvbound.bench --commit $C --suite models --only "enformer" --batches 8 --variants unpatched patch-compressed --out $OUT/models_b8_enformer.csv > $OUT/enf_b8.log 2>&1; echo "enformer b8 rc=$? t=$SECONDS"
KVBOUND_DV_SPLIT=1 timeout 150 python -m kvbound.bench --commit $C --suite models --only "enformer" --batches 8 --variants patch-compressed --out $OUT/enformer_b8_dv_split1.csv > $OUT/enf_b8_split.log 2>&1; echo "enformer b8 split rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("note", "")[:200], r.get("reason", "")[:300])
PY
