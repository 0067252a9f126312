# One call: AlphaGenome at batch 1 and 2 (models suite) with the kernel's general loop compiled out where no block
# needs it, then the GPU tests that the change touches.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 170 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --out $OUT/models_b1_alphagenome.csv > $OUT/ag_b1.log 2>&1; echo "ag b1 rc=$? t=$SECONDS"
timeout 170 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 2 --variants unpatched patch-compressed --out $OUT/models_b2_alphagenome.csv > $OUT/ag_b2.log 2>&1; echo "ag b2 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("calibration_ms", "")[:7], r.get("peak_gib", r.get("peak_memory_gib", ""))[:6], r.get("note", "")[:160], r.get("reason", "")[:300])
PY
L=$((560 - SECONDS)); echo "tests budget $L s"
timeout $L python -m pytest -q -p no:cacheprovider -m gpu tests/test_general_runs.py tests/test_speculative_encode.py tests/test_capture.py tests/test_code_widths.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR|PASSED)" $OUT/gpu_tests.log | cut -c1-200 | head -40
