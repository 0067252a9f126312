# One call: the compressed kernel with and without its general-run loop (general_runs_ab.py), then AlphaGenome b1.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu.txt
timeout 400 python benchmarks/general_runs_ab.py $OUT/general_runs_ab.csv --commit $C > $OUT/general_runs_ab.log 2>&1; echo "ab rc=$? t=$SECONDS"
cat $OUT/general_runs_ab.log | cut -c1-250
