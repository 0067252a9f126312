C=$1
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
cp benchmarks/scratch_diag.sh benchmarks/scratch_borzoi_diff.py $R/
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py tests/test_pair_pool.py > $R/gpu_tests.log 2>&1
timeout 200 python benchmarks/scratch_borzoi_diff.py > $R/borzoi_diff.txt 2>&1
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
