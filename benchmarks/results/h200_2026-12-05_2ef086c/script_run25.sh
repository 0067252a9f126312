# One call on the H200: the GPU tests the last call did not reach and those whose default encoder changed.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}
R=$OUT/r/benchmarks/results/h200_${D}_$C
mkdir -p $R
timeout 290 python -m pytest -q -p no:cacheprovider -m gpu \
  "tests/test_gpu_paths.py::test_gpu_byte_decode_every_tile_at_2_and_8_bits_bf16[2-64-64]" \
  "tests/test_gpu_paths.py::test_gpu_byte_decode_every_tile_at_2_and_8_bits_bf16[8-128-192]" \
  tests/test_gpu_paths.py::test_gpu_plain_decode_through_the_byte_decode_checks \
  tests/test_speculative_encode.py tests/test_capture.py tests/test_encode_triton.py -rA --durations=8 > $R/gpu_tests_last.log 2>&1
echo "gpu tests rc=$? $(tail -1 $R/gpu_tests_last.log)"
grep -h -E "^(FAILED|ERROR|PASSED)" $R/gpu_tests_last.log | cut -c1-200
cp benchmarks/scratch_run25.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
