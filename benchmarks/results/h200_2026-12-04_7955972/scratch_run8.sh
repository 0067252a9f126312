set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 500 python -m kvbound.bench --commit $C --suite models --alternatives --only 'alphagenome*' --batches 1 2 \
  --variants unpatched patch-dense flex-tile-bias --out $R/models_alphagenome_alternatives.csv 2>&1 | tail -25 | tee $R/models_alphagenome_alternatives.log
cp benchmarks/scratch_run8.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
