pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 420 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py tests/test_pre_norm.py tests/test_models_ports.py tests/test_speculative_encode.py tests/test_relative_runs.py tests/test_deferred_checks.py 2>&1 | grep -v DEBUG | tail -15 | tee $R/gpu_tests.txt
cp benchmarks/scratch_run17.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
