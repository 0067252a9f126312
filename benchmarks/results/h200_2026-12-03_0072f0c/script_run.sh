C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
timeout 120 python benchmarks/scratch_relu_rows.py $R/relu_epilogue_rows.csv $C > $R/relu_epilogue_rows.log 2>&1
cat $R/relu_epilogue_rows.log
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
