pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu_largest2.txt
for M in enformer:48:200 alphagenome:3:300; do
  IFS=: read name b t <<< "$M"
  V=""
  [[ $name == alphagenome ]] && V="--variants unpatched patch-dense flex-tile-bias"
  start=$(date +%s)
  timeout $t python -m kvbound.bench --commit $C --suite models --alternatives --only "$name" --batches $b \
    --warmup 1 --repeats 3 $V --out $R/models_largest_${name}_b$b.csv > $R/models_largest_${name}_b$b.log 2>&1
  echo "$name b$b rc=$? $(( $(date +%s) - start )) s"
done
python - <<'PY' $R
import csv, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/models_largest_*_b*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r.get("batch"), r["provider"], r["status"], r.get("ms_p50"), r.get("attention_ms_p50"), r.get("peak_bytes"), r.get("reason","")[:80])
PY
cp benchmarks/scratch_run16.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
