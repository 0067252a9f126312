C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
cp benchmarks/scratch_graphs.sh $R/script_run.sh
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py tests/test_pair_pool.py tests/test_pre_norm.py tests/test_deferred_checks.py > $R/gpu_tests.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
timeout 190 python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 8 --out $R/models_enformer.csv > $R/models_enformer.log 2>&1
echo "enformer $((SECONDS-T0)) s" >> $R/times.txt
timeout 240 python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 4 --out $R/models_borzoi.csv > $R/models_borzoi.log 2>&1
echo "borzoi $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
