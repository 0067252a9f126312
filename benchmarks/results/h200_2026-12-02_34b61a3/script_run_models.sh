C=$1
T0=$SECONDS
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r/benchmarks/results/h200_2026-12-02_$C
mkdir -p $R
timeout 360 python -m kvbound.bench --commit $C --suite models --only 'borzoi*' --batches 1 4 16 --out $R/models_borzoi.csv > $R/models_borzoi.log 2>&1
echo "models $((SECONDS-T0)) s" >> $R/times.txt
timeout 150 python benchmarks/forward_timeline.py $R/forward_timeline_borzoi.csv --models borzoi --batches 4 --commit $C > $R/forward_timeline_borzoi.log 2>&1
echo "timeline $((SECONDS-T0)) s" >> $R/times.txt
cd $OUT/r && tar czf $OUT/r.tgz benchmarks
