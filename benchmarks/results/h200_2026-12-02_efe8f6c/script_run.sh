C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-02_$C
mkdir -p $R
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_gpu_paths.py tests/test_relative_runs.py -k "compressed_runs or runs_bf16 or run_table or relative_positions" > $R/gpu_tests.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
timeout 200 python benchmarks/scratch_cab.py $R/compressed_runs_ab.csv $C 4,16 > $R/compressed_runs_ab.log 2>&1
echo "ab $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
