# One call on the H200: the GPU test suite, file by file, under one deadline; files not reached are listed.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
C=$1; D=${2:-$(date -u +%Y-%m-%d)}; shift 2
R=$OUT/r/benchmarks/results/h200_${D}_$C
mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $R/gpu.txt
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee $R/versions.txt
START=$(date +%s); DEADLINE=${KV_DEADLINE:-540}
for f in "$@"; do
  left=$(( DEADLINE - ($(date +%s) - START) ))
  if [ $left -lt 40 ]; then echo "NOT RUN $f" | tee -a $R/gpu_tests_summary.txt; continue; fi
  timeout $((left - 10)) python -m pytest -q -p no:cacheprovider -m gpu $f -rA --durations=5 > $R/gpu_$(basename $f .py).log 2>&1
  echo "$f rc=$? $(tail -1 $R/gpu_$(basename $f .py).log)" | tee -a $R/gpu_tests_summary.txt
done
grep -h -E "^(FAILED|ERROR)" $R/gpu_*.log | cut -c1-300
cp benchmarks/scratch_run23.sh $R/
cd $OUT/r && tar czf $OUT/r.tgz .
