pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu_models.txt
for name in enformer borzoi; do
  start=$(date +%s)
  timeout 150 python -m kvbound.bench --commit $C --suite models --graphs --only "$name" --batches 1 \
    --variants unpatched unpatched-graph patch-dense patch-dense-graph --out $R/models_b1_$name.csv > $R/models_b1_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s"
done
python - <<'PY' $R
import csv, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/models_b1_*.csv")):
    for r in csv.DictReader(open(f)):
        print(r["shape"], r.get("batch"), r["provider"], r["status"], r.get("ms_p20"), r.get("ms_p50"), r.get("ms_p80"), r.get("attention_ms_p50"), r.get("peak_bytes"))
PY
cp benchmarks/scratch_run19.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
