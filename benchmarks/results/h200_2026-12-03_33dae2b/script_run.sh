C=$1
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
cp benchmarks/scratch_final.sh $R/script_run.sh
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py tests/test_pair_pool.py tests/test_pre_norm.py tests/test_deferred_checks.py tests/test_gpu_paths.py -k "not every_relative_tile and not every_tile_through and not byte_decode_every" > $R/gpu_tests.log 2>&1
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
