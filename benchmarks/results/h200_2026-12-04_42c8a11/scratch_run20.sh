pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py tests/test_models_ports.py tests/test_relative_runs.py tests/test_relpos.py tests/test_relpos_compressed.py 2>&1 | grep -v DEBUG | tail -4 | tee $R/gpu_tests.txt
for name in borzoi; do
  timeout 100 python -m kvbound.bench --commit $C --suite models --only "$name" --batches 1 4 \
    --variants unpatched patch-dense patch-compressed --out $R/models_$name.csv > $R/models_$name.log 2>&1
  echo "$name rc=$?"
done
python - <<'PY' $R
import csv, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/models_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r.get("batch"), r["provider"], r["status"], r.get("ms_p50"), r.get("attention_ms_p50"), r.get("diff_rel"))
PY
cp benchmarks/scratch_run20.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
