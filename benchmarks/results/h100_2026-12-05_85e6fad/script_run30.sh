# One call on the GPU: where a batch-1 forward's time goes (patched dense against patched compressed), then the
# models suite at Enformer batch 8.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}; L=${3:-130}
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200" | tr A-Z a-z); R=$OUT/r/benchmarks/results/${G:-gpu}_${D}_$C
mkdir -p $R
timeout 150 python benchmarks/forward_timeline.py $R/forward_timeline_b1.csv --models enformer borzoi --batches 1 1 --variants patch-dense patch-compressed --commit $C > $R/forward_timeline_b1.log 2>&1; echo "timeline b1 rc=$?"
grep -h -E "host_ms|syncs|idle|busy" $R/forward_timeline_b1.log | head -20; tail -3 $R/forward_timeline_b1.log | cut -c1-300
timeout $L python -m kvbound.bench --commit $C --suite models --only "enformer*" --batches 8 --out $R/models_enformer_b8.csv > $R/models_enformer_b8.log 2>&1; echo "enformer b8 rc=$?"
python - $R <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p50"), r.get("attention_ms_p50"), r.get("note", "")[-120:], r.get("reason", "")[:200])
PY
cp benchmarks/scratch_run30.sh $R/script_run30.sh
cd $OUT/r && tar czf $OUT/r.tgz .
