C=$1
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-02_$C
mkdir -p $R
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_gpu_paths.py tests/test_relative_runs.py tests/test_relpos_compressed.py tests/test_models_ports.py -k "compressed_runs or runs_bf16 or run_table or relative_positions or one_key_per_run" > $R/gpu_tests.log 2>&1
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
