set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R/host
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_conv_block.py tests/test_pair_pool.py -m gpu 2>&1 | tail -5 | tee $R/gpu_tests.txt
timeout 90 python benchmarks/scratch_host.py enformer 1 $R/host 2>&1 | grep -v Warn | tee $R/host/enformer_b1.log
timeout 90 python benchmarks/scratch_host.py borzoi 1 $R/host 2>&1 | grep -v Warn | tee $R/host/borzoi_b1.log
python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 8 --out $R/models_enformer.csv 2>&1 | tail -1
python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 4 --out $R/models_borzoi.csv 2>&1 | tail -1
cp benchmarks/scratch_host.py benchmarks/scratch_run1.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
