pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1
R=$OUT/r
mkdir -p $R
# The new capture test against graphs.py without the per-replay refresh: it must fail there.
python - <<'PY'
p = "src/kvbound/graphs.py"
s = open(p).read()
s = s.replace("        for entry in self._operands:\n            entry.refresh()\n", "")
open(p, "w").write(s)
PY
grep -c "entry.refresh" src/kvbound/graphs.py
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_capture.py -k loaded_in_place 2>&1 | grep -v DEBUG | tail -6 | tee $R/without_refresh.txt
git checkout src/kvbound/graphs.py
