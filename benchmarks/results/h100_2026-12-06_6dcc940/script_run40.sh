# One call on the GPU: the patch's GPU tests at this commit, then AlphaGenome at batch 2, every variant in one
# process, without expandable segments (the cache released after calibration).
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative_encode.py tests/test_models_ports.py tests/test_capture.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-300 | head -20
timeout 280 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 2 --out $OUT/models_b2_alphagenome.csv > $OUT/ag_b2.log 2>&1; echo "ag b2 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compress_ms", "")[:5], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("peak_bytes"), r.get("calibration_ms", "")[:7], r.get("note", "")[:120], r.get("reason", "")[:300])
PY
