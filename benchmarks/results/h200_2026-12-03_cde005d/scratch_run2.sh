set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1
R=$OUT/r/benchmarks/results/h200_2026-12-03_$C
mkdir -p $R/profile
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 8 --out $R/models_enformer.csv 2>&1 | tail -3
python -m kvbound.bench --commit $C --suite models --graphs --only 'borzoi*' --batches 1 4 --out $R/models_borzoi.csv 2>&1 | tail -3
for a in "enformer 1" "enformer 8" "borzoi 1"; do set -- $a; timeout 100 python benchmarks/scratch_prof2.py $1 $2 2>&1 | grep -v Warn > $R/profile/$1_b$2.txt; done
cp benchmarks/scratch_prof2.py benchmarks/scratch_run2.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
