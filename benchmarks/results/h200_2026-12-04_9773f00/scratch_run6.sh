set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_split_lowrank.py tests/test_deferred_checks.py tests/test_capture.py 2>&1 | tail -4 | tee $R/gpu_tests.txt
timeout 120 python benchmarks/scratch_merge.py $R/merge.csv 2>&1 | grep -v -i warn | tee $R/merge.log
python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 4 --out $R/models_borzoi.csv 2>&1 | tail -1
python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 8 --out $R/models_enformer.csv 2>&1 | tail -1
cp benchmarks/scratch_run6.sh benchmarks/scratch_merge.py $R/
cd $OUT/r && tar czf $OUT/r.tgz .
