# One call on the GPU: the models suite at batch 1 (Borzoi, Enformer) at this commit, then the split and relative
# compressed GPU tests.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
for m in borzoi enformer; do
  timeout 110 python -m kvbound.bench --commit $C --suite models --only "$m*" --batches 1 --out $OUT/models_b1_$m.csv > $OUT/models_b1_$m.log 2>&1; echo "$m rc=$? t=$SECONDS"
done
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b1_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p20"), r.get("ms_p50"), r.get("attention_ms_p50"), r.get("note", "")[:100], r.get("reason", "")[:160])
PY
L=$((400 - SECONDS)); echo "tests budget $L s"
timeout $L python -m pytest -q -p no:cacheprovider -m gpu tests/test_split_lowrank.py tests/test_models_ports.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log)"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-300
