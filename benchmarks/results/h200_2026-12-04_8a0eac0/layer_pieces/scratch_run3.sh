pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export HF_HUB_OFFLINE=1
R=$OUT/r; mkdir -p $R
for i in 1 2; do
echo "== old ($i)"; PYTHONPATH=/tmp/site:$PWD/benchmarks/scratch_old/src timeout 200 python benchmarks/scratch_launch.py $R/launch_old_$i.csv 2>&1 | grep -v -i warn | grep -E "attention|largest|layer|ff|norm_to"
echo "== new ($i)"; PYTHONPATH=/tmp/site:$PWD/src timeout 200 python benchmarks/scratch_launch.py $R/launch_new_$i.csv 2>&1 | grep -v -i warn | grep -E "attention|largest|layer|ff|norm_to"
done
PYTHONPATH=/tmp/site:$PWD/src timeout 200 python benchmarks/scratch_prof3.py $R/prof3.txt 2>&1 | grep -v -i warn | tail -5
