# One call on the H200: the rest of the GPU tests, then the models suite at batch 1 with the one-launch encoder by size.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}
R=$OUT/r/benchmarks/results/h200_${D}_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_models_ports.py tests/test_gpu_paths.py tests/test_encode_triton.py -rA --durations=8 > $R/gpu_tests_rest.log 2>&1
echo "gpu tests rc=$? $(tail -1 $R/gpu_tests_rest.log)"
grep -h -E "^(FAILED|ERROR)" $R/gpu_tests_rest.log | cut -c1-300
for m in enformer borzoi; do
  timeout 130 python -m kvbound.bench --commit $C --suite models --only "$m*" --batches 1 --out $R/models_b1_$m.csv > $R/models_b1_$m.log 2>&1; echo "$m rc=$?"
done
python - $R <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_b1_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p20"), r.get("ms_p50"), r.get("attention_ms_p50"), r.get("note", "")[:120], r.get("reason", "")[:200])
PY
cp benchmarks/scratch_run24.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
