pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-04_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 200 python benchmarks/forward_timeline.py $R/forward_timeline_compressed.csv --models enformer borzoi \
  --batches 8 4 --variants patch-dense patch-compressed --commit $C > $R/forward_timeline_compressed.log 2>&1
echo "timeline rc=$?"
grep -v DEBUG $R/forward_timeline_compressed.log | grep -E "Error|module|forward_ms|attention_launched|tower_busy" | head -60
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_speculative_encode.py tests/test_capture.py 2>&1 | grep -v DEBUG | tail -3 | tee $R/gpu_tests.txt
cp benchmarks/scratch_run12.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
