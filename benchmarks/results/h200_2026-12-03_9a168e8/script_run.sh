C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_pre_norm.py > $R/gpu_tests_pre_norm.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt; tail -3 $R/gpu_tests_pre_norm.log
timeout 100 python benchmarks/scratch_ffn.py $R/ffn_alone.csv $C > $R/ffn_alone.log 2>&1
echo "ffn $((SECONDS-T0)) s" >> $R/times.txt; cat $R/ffn_alone.log
timeout 260 python benchmarks/scratch_ffn_ab.py $R/fused_feed_forward_ab.csv $C borzoi:4,enformer:8,borzoi:16 > $R/fused_feed_forward_ab.log 2>&1
echo "ab $((SECONDS-T0)) s" >> $R/times.txt; cat $R/fused_feed_forward_ab.log
timeout 120 python benchmarks/scratch_ktiles.py $R/enformer_key_tiles.csv $C > $R/enformer_key_tiles.log 2>&1
echo "tiles $((SECONDS-T0)) s" >> $R/times.txt; cat $R/enformer_key_tiles.log
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
