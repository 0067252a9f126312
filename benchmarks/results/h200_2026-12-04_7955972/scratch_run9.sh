pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu_tests_gpu.txt
timeout ${2:-540} python -m pytest -p no:cacheprovider -m gpu -v -rfE --durations=15 tests 2>&1 | grep -v DEBUG > $R/gpu_tests_full.log
echo "rc=${PIPESTATUS[0]}" >> $R/gpu_tests_full.log
tail -40 $R/gpu_tests_full.log
cp benchmarks/scratch_run9.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
