set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_conv_block.py tests/test_pair_pool.py -m gpu 2>&1 | tail -5 | tee $R/gpu_tests.txt
timeout 380 python benchmarks/scratch_conv.py $R $C 2>&1 | grep -v Warning | tee $R/conv_ab.log | tail -60
cp benchmarks/scratch_conv.py benchmarks/scratch_conv.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz . 
