# One call: the value columns in two parts in the compressed kernel. GPU tests of the change, the kernel A/B at
# AlphaGenome's shape, AlphaGenome at batch 1 and Borzoi at batch 4.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_dv_split.py tests/test_general_runs.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-300 | head -20
timeout 150 python benchmarks/general_runs_ab.py $OUT/dv_split_ab.csv --cases alphagenome-packed8 alphagenome-packed4 --commit $C > $OUT/ab.log 2>&1; echo "ab rc=$? t=$SECONDS"
cut -c1-200 $OUT/ab.log
timeout 170 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --variants unpatched patch-compressed --out $OUT/models_b1_alphagenome.csv > $OUT/ag_b1.log 2>&1; echo "ag b1 rc=$? t=$SECONDS"
timeout 150 python -m kvbound.bench --commit $C --suite models --only "borzoi" --batches 4 --out $OUT/models_b4_borzoi.csv > $OUT/borzoi_b4.log 2>&1; echo "borzoi b4 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("note", "")[:400], r.get("reason", "")[:300])
PY
