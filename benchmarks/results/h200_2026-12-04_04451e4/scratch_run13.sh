pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 330 python benchmarks/operand_cache_ab.py $R/operand_cache_ab.csv --commit $C > $R/operand_cache_ab.log 2>&1
echo "ab rc=$?"
grep -v DEBUG $R/operand_cache_ab.log | tail -60
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pre_norm.py tests/test_models_ports.py tests/test_relative_runs.py 2>&1 | grep -v DEBUG | tail -4 | tee $R/gpu_tests.txt
cp benchmarks/scratch_run13.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
