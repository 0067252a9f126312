C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
timeout 60 python -m pytest -q -p no:cacheprovider -m gpu -s tests/test_pre_norm.py tests/test_peaks.py > $R/gpu_tests_norm_peaks.log 2>&1
echo "tests $((SECONDS-T0)) s" >> $R/times.txt
timeout 200 python benchmarks/scratch_norm_ab.py $R/fused_pre_norm_ab.csv $C borzoi:16,enformer:8,borzoi:1 > $R/fused_pre_norm_ab.log 2>&1
echo "ab $((SECONDS-T0)) s" >> $R/times.txt
echo "part,batch,layout,tile,ms,err,setting,commit" > $R/kernel_ab.csv
for s in "base 0 0" "scratch 1 0" "add 0 1" "both 1 1"; do set -- $s
  KVBOUND_Q_SCRATCH=$2 KVBOUND_RUNS_ADD=$3 PYTHONPATH=$PWD/src timeout 100 python benchmarks/scratch_kab.py $R/kernel_ab.csv $C "$1" >> $R/kernel_ab.log 2>&1
  echo "k $1 $((SECONDS-T0)) s" >> $R/times.txt
done
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
