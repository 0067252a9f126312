pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
mkdir -p $OUT/p
timeout 200 python benchmarks/scratch_prof.py enformer 1 > $OUT/p/enformer_b1.txt 2>&1
timeout 200 python benchmarks/scratch_prof.py borzoi 1 > $OUT/p/borzoi_b1.txt 2>&1
cp benchmarks/scratch_prof.py benchmarks/scratch_prof.sh $OUT/p/
