# One call on the GPU: record_modes GPU tests, AlphaGenome batch 1 (r8b4 default with mode shares; r8b8), then
# Enformer batch 8 with graphs and alternatives if time is left.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative_encode.py -k record_modes -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-300
timeout 170 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --variants unpatched patch-compressed --out $OUT/models_b1_alphagenome_r8b4.csv > $OUT/ag_r8b4.log 2>&1; echo "ag r8b4 rc=$? t=$SECONDS"
timeout 150 python -m kvbound.bench --commit $C --suite models --only "alphagenome" --batches 1 --bits 8 --variants unpatched patch-compressed --out $OUT/models_b1_alphagenome_r8b8.csv > $OUT/ag_r8b8.log 2>&1; echo "ag r8b8 rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b*.csv")):
    for r in csv.DictReader(open(f)):
        shares = {k: r[k][:5] for k in r if "_share_" in k and r[k]}
        print(f.split("/")[-1], r["shape"], r["batch"], r["provider"], r["status"], r.get("config"), r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("compression_ratio", "")[:5], r.get("diff_rel", "")[:8], r.get("max_err_over_tau", "")[:6], shares, r.get("reason", "")[:160])
PY
