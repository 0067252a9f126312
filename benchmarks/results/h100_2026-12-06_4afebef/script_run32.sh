# One call on the GPU: the models suite at batch 1 (Enformer, Borzoi), an in-process A/B of the compressed forward's
# host path (kept workspaces, no encode timing, against fresh workspaces with timing), then the GPU tests of the new code.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
for m in enformer borzoi; do
  timeout 125 python -m kvbound.bench --commit $C --suite models --only "$m*" --batches 1 --out $OUT/models_b1_$m.csv > /tmp/models_b1_$m.log 2>&1; echo "$m rc=$? t=$SECONDS"
done
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b1_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p20"), r.get("ms_p50"), r.get("attention_ms_p50"), r.get("note", "")[:100], r.get("reason", "")[:160])
PY
for m in enformer borzoi; do timeout 85 python benchmarks/scratch_ab.py $m 1 2 >> $OUT/ab.csv 2>/tmp/ab_$m.err; echo "ab $m rc=$? t=$SECONDS"; tail -3 /tmp/ab_$m.err | cut -c1-300; done
cat $OUT/ab.csv
L=$((575 - SECONDS)); echo "tests budget $L s"
timeout $L python -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative_encode.py tests/test_capture.py tests/test_deferred_checks.py "tests/test_softcap.py::test_gpu_bfloat16_attention_at_large_caps_matches_the_reference" -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log)"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-300
cd /tmp && tar czf $OUT/logs.tgz models_b1_*.log ab_*.err
