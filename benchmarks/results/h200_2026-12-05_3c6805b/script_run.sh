# One call on the H200: the one-launch speculative encoder checked and timed (KVBOUND_ONE_PASS_ENCODE).
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}
R=$OUT/r/benchmarks/results/h200_${D}_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_encode_triton.py tests/test_speculative_encode.py 2>&1 | grep -v DEBUG | tail -6 | tee $R/gpu_tests.txt
timeout 150 python benchmarks/one_pass_encode.py $R/one_pass_encode.csv --commit $C --batches 1 2 4 8 --calls 100 --rounds 3 > $R/one_pass_encode.log 2>&1; echo "one_pass rc=$?"
grep -h "path=" $R/one_pass_encode.log | head -40
timeout 180 python benchmarks/speculative_ab.py $R/speculative_ab.csv --models enformer borzoi --batches 1 --rounds 5 --calls 3 --commit $C > $R/speculative_ab.log 2>&1; echo "ab rc=$?"
grep -h "variant=" $R/speculative_ab.log
cp benchmarks/scratch_run21.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
