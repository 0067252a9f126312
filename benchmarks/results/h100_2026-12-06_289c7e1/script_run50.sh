# One call on the GPU: Enformer and Borzoi at the largest batches expected to fit on an 80 GB card (the models suite
# with the stock alternatives, warm-up 1, repeats 3), then the value-parts GPU tests.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1; EB=${2:-36}; BB=${3:-31}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
for M in enformer:$EB:240 borzoi:$BB:220; do
  IFS=: read name b t <<< "$M"
  start=$(date +%s)
  timeout $t python -m kvbound.bench --commit $C --suite models --alternatives --only "$name" --batches $b \
    --warmup 1 --repeats 3 --out $OUT/models_largest_${name}_b$b.csv > $OUT/models_largest_${name}_b$b.log 2>&1
  echo "$name b$b rc=$? $(( $(date +%s) - start )) s"
done
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_dv_split.py 2>&1 | grep -v DEBUG | tail -3 | tee $OUT/gpu_tests.txt
python - $OUT <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_largest_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r["batch"], r["provider"], r["status"], r.get("ms_p50", "")[:7], r.get("attention_ms_p50", "")[:7], r.get("peak_bytes"), r.get("note", "")[:80], r.get("reason", "")[:200])
PY
