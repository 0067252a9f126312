pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
R=$OUT/r/benchmarks/results/h200_2026-12-03_4eeb99e
mkdir -p $R
PYTHONPATH=/tmp/site:$PWD/src timeout 240 python benchmarks/scratch_ln.py $R/layernorm_cast.csv 4eeb99e > $R/layernorm_cast.log 2>&1
cat $R/layernorm_cast.log
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
