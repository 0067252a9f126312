# One call on the GPU: soft-cap and read-count tests, the host time of a layer's pieces (dense and compressed), then the
# GPU-marked tests of the files changed since 2ef086c.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200" | tr A-Z a-z); R=$OUT/r/benchmarks/results/${G:-gpu}_${D}_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 130 python -m pytest -q -p no:cacheprovider tests/test_softcap.py tests/test_attention.py -k "softcap or cap or wider or first_call_on_unrecorded or one_host_sync" -rA > $R/softcap_tests.log 2>&1; echo "softcap and read-count tests rc=$? $(tail -1 $R/softcap_tests.log)"
grep -h -E "^(FAILED|ERROR)" $R/softcap_tests.log | cut -c1-300
timeout 100 python benchmarks/layer_host.py $R/layer_host.csv --calls 100 --rounds 3 --commit $C > $R/layer_host.log 2>&1; echo "layer_host rc=$?"; grep -E "Enformer|kvbound.attention|compiled|binding" $R/layer_host.log; tail -3 $R/layer_host.log | cut -c1-300
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative_encode.py tests/test_capture.py tests/test_attention.py tests/test_deferred_checks.py tests/test_models_ports.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(tail -1 $R/gpu_tests.log)"
grep -h -E "^(FAILED|ERROR)" $R/gpu_tests.log | cut -c1-300
cp benchmarks/scratch_run29.sh $R/script_run.sh
cd $OUT/r && tar czf $OUT/r.tgz .
