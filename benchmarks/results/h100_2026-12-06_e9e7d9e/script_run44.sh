# One call: the seed attention suite (every provider, r8b4 / quant-r0b4 / lowrank-r8) at this commit, then the GPU
# tests of the general-loop change and the CUDA-graph retry.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_general_runs.py tests/test_capture.py -rA > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $OUT/gpu_tests.log) t=$SECONDS"
grep -h -E "^(FAILED|ERROR)" $OUT/gpu_tests.log | cut -c1-200 | head -20
timeout 420 python -m kvbound.bench --commit $C --shapes benchmarks/shapes/seed.toml --configs r8b4 quant-r0b4 lowrank-r8 --out $OUT/attention_seed.csv > $OUT/attention_seed.log 2>&1; echo "seed rc=$? t=$SECONDS"
python - $OUT <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1] + "/attention_seed.csv")):
    print(r["shape"], r["provider"], r.get("config", ""), r["status"], r["ms_p50"][:7], r.get("err_rel", "")[:8], r.get("zero_residual_share", "")[:5], r.get("reason", "")[:120])
PY
