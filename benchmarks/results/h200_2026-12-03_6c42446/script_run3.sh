pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export HF_HUB_OFFLINE=1
T=tests/test_gpu_paths.py::test_gpu_compressed_runs_bf16_borzoi_layout
echo "== old"; PYTHONPATH=/tmp/site:$PWD/benchmarks/scratch_old/src timeout 100 python -m pytest -q -p no:cacheprovider -m gpu -s $T 2>&1 | grep -E "kernel max|N=|passed|failed" 
echo "== new onehot 0"; KVBOUND_RUNS_ONEHOT=0 PYTHONPATH=/tmp/site:$PWD/src timeout 100 python -m pytest -q -p no:cacheprovider -m gpu -s $T 2>&1 | grep -E "kernel max|N=|passed|failed"
echo "== new default"; PYTHONPATH=/tmp/site:$PWD/src timeout 100 python -m pytest -q -p no:cacheprovider -m gpu -s $T 2>&1 | grep -E "kernel max|N=|passed|failed"
