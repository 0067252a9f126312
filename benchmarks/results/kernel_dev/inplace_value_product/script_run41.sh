# One call on the GPU: AlphaGenome batch 1 (unpatched and compressed) with the residual value products accumulated
# in place, then the compressed kernel's GPU tests, at this commit.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 150 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --variants unpatched patch-compressed --out $OUT/models_b1_alphagenome.csv > $OUT/ag_b1.log 2>&1; echo "ag b1 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compress_ms", "")[:5], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("diff_max_abs", "")[:8], r.get("calibration_ms", "")[:7], r.get("reason", "")[:300])
PY
L=$((420 - SECONDS)); echo "tests budget $L s"
timeout $L python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_paths.py tests/test_softcap.py tests/test_split_lowrank.py -k "residual_loop or byte_decode or plain_decode or compressed_runs or large_caps or split_lowrank" -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR|PASSED)" $OUT/gpu_tests.log | cut -c1-200 | head -40
