C=$1
OLD=$2
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-02_$C
mkdir -p $R
PYTHONPATH=/tmp/site:$PWD/src timeout 200 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_relative_runs.py tests/test_gpu_paths.py -k "runs or run_table or relative_positions" > $R/gpu_tests.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
PYTHONPATH=/tmp/site:$PWD/benchmarks/scratch_old/src timeout 120 python benchmarks/scratch_ab.py $R/run_table_ab.csv host-table $OLD 1 > $R/run_table_ab_1.log 2>&1
echo "old $((SECONDS-T0)) s" >> $R/times.txt
PYTHONPATH=/tmp/site:$PWD/src timeout 120 python benchmarks/scratch_ab.py $R/run_table_ab.csv kernel-table $C 0 > $R/run_table_ab_2.log 2>&1
echo "new $((SECONDS-T0)) s" >> $R/times.txt
PYTHONPATH=/tmp/site:$PWD/benchmarks/scratch_old/src timeout 90 python benchmarks/scratch_ab.py $R/run_table_ab.csv host-table $OLD 0 > $R/run_table_ab_3.log 2>&1
echo "old2 $((SECONDS-T0)) s" >> $R/times.txt
PYTHONPATH=/tmp/site:$PWD/src timeout 90 python benchmarks/scratch_ab.py $R/run_table_ab.csv kernel-table $C 0 > $R/run_table_ab_4.log 2>&1
echo "new2 $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
