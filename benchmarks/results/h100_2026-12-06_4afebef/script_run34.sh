# One call on the GPU: split launch (auto) against one launch (off) in the patched compressed models, eager and in
# CUDA graphs, at batch 1 and a larger batch.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_split.txt
echo "name,batch,round,split,eager_ms,graph_ms,fallbacks" > $OUT/split_ab.csv
for mb in "borzoi 1" "enformer 1" "borzoi 4" "enformer 8"; do
  timeout 110 python benchmarks/scratch_split.py $mb >> $OUT/split_ab.csv 2>/tmp/err.txt; echo "$mb rc=$? t=$SECONDS"; tail -2 /tmp/err.txt | cut -c1-300
done
cat $OUT/split_ab.csv
