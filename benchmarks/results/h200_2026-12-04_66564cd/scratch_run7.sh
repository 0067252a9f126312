set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 230 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py -rA 2>&1 | grep -E "PASS|FAIL|Error|error|passed|failed|assert" | tail -20 | tee $R/gpu_tests.txt
timeout 75 python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 --out $R/models_enformer.csv 2>&1 | tail -1
timeout 85 python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 --out $R/models_borzoi.csv 2>&1 | tail -1
cp benchmarks/scratch_run7.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
