pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
for M in enformer:1:8 borzoi:1:4; do
  IFS=: read name b1 b2 <<< "$M"
  start=$(date +%s)
  timeout 285 python -m kvbound.bench --commit $C --suite models --graphs --alternatives --only "$name" \
    --batches $b1 $b2 --out $R/models_$name.csv > $R/models_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s"
done
python - <<'PY' $R
import csv, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/models_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r.get("batch"), r["provider"], r["status"], r.get("ms_p50"), r.get("attention_ms_p50"), r.get("peak_bytes"), r.get("reason","")[:80])
PY
cp benchmarks/scratch_run14.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
