set -x
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=d0b3b1e
R=$OUT/r/benchmarks/results/h200_2026-12-03_${C}/repeat_b1
mkdir -p $R
nproc > $R/host.txt; uptime >> $R/host.txt
for i in 1 2; do
python -m kvbound.bench --commit $C --suite models --graphs --only 'enformer*' --batches 1 --out $R/models_enformer_b1_run$i.csv 2>&1 | tail -1
KVBOUND_FUSED_CONV=0 python -m kvbound.bench --commit $C --suite models --only 'enformer*' --batches 1 --out $R/models_enformer_b1_conv_off_run$i.csv 2>&1 | tail -1
done
uptime >> $R/host.txt
cp benchmarks/scratch_run4.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
