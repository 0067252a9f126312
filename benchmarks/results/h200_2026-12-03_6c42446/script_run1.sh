C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > $R/gpu_state.txt 2>&1
PYTHONPATH=/tmp/site:$PWD/src timeout 240 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_kernel_checks.py tests/test_relative_runs_onehot.py tests/test_relative_runs.py tests/test_gpu_paths.py -k "onehot or peaks or runs or run_table" > $R/gpu_tests.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
for s in 0 3 4 6; do
KVBOUND_RUNS_ONEHOT=$s PYTHONPATH=/tmp/site:$PWD/src timeout 60 python benchmarks/scratch_ab.py $R/layer_ab.csv new $C layer > $R/layer_ab_$s.log 2>&1
echo "layer $s $((SECONDS-T0)) s" >> $R/times.txt
done
PYTHONPATH=/tmp/site:$PWD/benchmarks/scratch_old/src timeout 50 python benchmarks/scratch_ab.py $R/layer_ab.csv old d9a6c9d layer > $R/layer_ab_old.log 2>&1
echo "layer old $((SECONDS-T0)) s" >> $R/times.txt
for s in 0 1; do
KVBOUND_RELATIVE_BF16=$s PYTHONPATH=/tmp/site:$PWD/src timeout 50 python benchmarks/scratch_ab.py $R/layer_ab.csv new $C enflayer > $R/enf_ab_$s.log 2>&1
echo "enf $s $((SECONDS-T0)) s" >> $R/times.txt
done
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
