# One call on the GPU: the calibrated code widths' GPU test, then AlphaGenome batch 1 with calibrated widths (the
# default) and, in a second process, with fixed widths (--fixed-widths), at this commit.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_code_widths.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR|E )" $OUT/gpu_tests.log | cut -c1-300 | head -20
timeout 200 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --out $OUT/models_b1_alphagenome.csv > $OUT/ag.log 2>&1; echo "ag rc=$? t=$SECONDS"
timeout 150 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --fixed-widths --variants unpatched patch-compressed --out $OUT/models_b1_alphagenome_fixed.csv > $OUT/ag_fixed.log 2>&1; echo "ag fixed rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        shares = {k: r[k][:5] for k in r if "_share_" in k and r[k]}
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compress_ms", "")[:5], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("peak_bytes"), shares, r.get("calibration_ms", "")[:7], r.get("note", "")[:200], r.get("reason", "")[:160])
PY
