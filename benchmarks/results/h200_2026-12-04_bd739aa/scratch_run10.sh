pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
V="unpatched patch-dense sdpa-built-bias flex-built-table"
timeout 250 python -m kvbound.bench --commit $C --suite models --alternatives --only 'enformer*' --batches 1 8 \
  --variants $V --out $R/models_alternatives_enformer.csv 2>&1 | tail -3
timeout 270 python -m kvbound.bench --commit $C --suite models --alternatives --only 'borzoi*' --batches 1 4 \
  --variants $V --out $R/models_alternatives_borzoi.csv 2>&1 | tail -3
cp benchmarks/scratch_run10.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
