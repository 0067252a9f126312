C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-02_$C
mkdir -p $R
timeout 330 python benchmarks/scratch_gather.py $R $C kernel > $R/gather_kernel.log 2>&1
echo "kernel $((SECONDS-T0)) s" >> $R/times.txt
timeout 200 python benchmarks/scratch_gather.py $R $C model 0,1,2 > $R/gather_model.log 2>&1
echo "model $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
