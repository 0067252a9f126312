# One call on the GPU: the soft-cap GPU tests, the host time of a layer's pieces with cProfile of the patched modules,
# and the host path of eager batch-1 forwards (unpatched, patched dense, patched compressed) with cProfile.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200" | tr A-Z a-z); R=$OUT/r/benchmarks/results/${G:-gpu}_${D}_$C
mkdir -p $R/host
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_softcap.py -rA > $R/softcap_gpu_tests.log 2>&1; echo "softcap gpu tests rc=$? $(tail -1 $R/softcap_gpu_tests.log)"
grep -h -E "^(FAILED|ERROR)" $R/softcap_gpu_tests.log | cut -c1-300
timeout 120 python benchmarks/layer_host.py $R/layer_host.csv --calls 100 --rounds 3 --commit $C --cprofile $R/host > $R/layer_host.log 2>&1; echo "layer_host rc=$?"; grep -E "Enformer|kvbound.attention|dropped" $R/layer_host.log; tail -2 $R/layer_host.log | cut -c1-300
for m in enformer borzoi; do timeout 100 python benchmarks/scratch_host.py $m 1 $R/host > $R/host/${m}_b1.log 2>&1; echo "$m host rc=$?"; cat $R/host/${m}_b1.log | grep -v Warn | tail -4 | cut -c1-300; done
cp benchmarks/scratch_run31.sh $R/script_run31.sh; cp benchmarks/scratch_host.py $R/scratch_host.py
cd $OUT/r && tar czf $OUT/r.tgz .
