# One call on the GPU: AlphaGenome at 1 Mb, batch 1, unpatched / patched dense / patched compressed in one process.
pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_lite/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $OUT/gpu_ag.txt
timeout 400 python -m kvbound.bench --commit $C --suite models --only "alphagenome*" --batches 1 --variants unpatched patch-dense patch-compressed --out $OUT/models_b1_alphagenome.csv > $OUT/models_b1_alphagenome.log 2>&1; echo "alphagenome rc=$? t=$SECONDS"
tail -20 $OUT/models_b1_alphagenome.log | cut -c1-250
