#!/bin/bash
# The largest batch of each port's forward that fits on this card (unpatched, dense patch, compressed patch).
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=${1:-wt}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
cp benchmarks/scratch_run62.sh $OUT/script_run62.sh
for mt in enformer:120 alphagenome:120 borzoi:60; do
  m=${mt%%:*}; pt=${mt##*:}
  left=$(( ${2:-550} - SECONDS ))
  [ $left -lt 60 ] && { echo "no time left for $m"; break; }
  timeout $left python benchmarks/largest_batch.py $OUT/largest_batch_$m.csv --models $m --probe-timeout-s $pt --commit $C > $OUT/largest_$m.log 2>&1
  echo "$m rc=$? t=$SECONDS"
  cut -d, -f1-9,12,13 $OUT/largest_batch_$m.csv 2>/dev/null
done
