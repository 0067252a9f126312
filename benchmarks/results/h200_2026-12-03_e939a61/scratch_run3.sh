set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R/profile
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_conv_block.py -m gpu 2>&1 | tail -5 | tee $R/gpu_tests.txt
timeout 200 python benchmarks/scratch_conv.py $R $C 2>&1 | grep -v Warning | tee $R/conv_ab.log | tail -30
python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 8 --out $R/models_enformer.csv 2>&1 | tail -1
python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 4 --out $R/models_borzoi.csv 2>&1 | tail -1
timeout 60 python benchmarks/scratch_prof2.py enformer 8 2>&1 | grep -v Warn > $R/profile/enformer_b8.txt
cp benchmarks/scratch_conv.py benchmarks/scratch_prof2.py benchmarks/scratch_run3.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
