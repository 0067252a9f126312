C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
timeout 400 python benchmarks/scratch_norm_ab.py $R/fused_pre_norm_ab.csv $C borzoi:4,borzoi:16,enformer:8,borzoi:1 > $R/fused_pre_norm_ab.log 2>&1
echo "ab $((SECONDS-T0)) s" >> $R/times.txt
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_pre_norm.py tests/test_peaks.py tests/test_gpu_paths.py tests/test_models_ports.py -k "borzoi or enformer or pre_norm or peaks or deferred or relative" > $R/gpu_tests.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
