C=$1
export PYTHONPATH=$PWD/src
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R
timeout 200 python benchmarks/scratch_normtune.py $R/norm_tiles.csv $C > $R/norm_tiles.log 2>&1
sort -t' ' -k4 -g $R/norm_tiles.log | head -5; cat $R/norm_tiles.log | awk '{print $1,$2,$3,$4,$5,$6}' | column -t | head -120
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
