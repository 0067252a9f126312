#!/usr/bin/env bash
# Download the wheels `kvbound bench --suite models` needs on a GPU machine without network into .whl/ (run it
# where pip can reach PyPI, from any directory; .whl/ is git-ignored).
#
# The GPU image (Python 3.12, torch 2.11, transformers 5.17, einops, numpy, pandas, safetensors, sortedcontainers,
# packaging) lacks the three ports and what they import beyond that: enformer_pytorch's package __init__ imports
# polars and pyfaidx (for its dataset helpers), borzoi_pytorch imports intervaltree. Everything here is pure Python
# except polars (one abi3 wheel, ~33 MB; 1.20.0 rather than 2.x, whose separate runtime wheel alone is 54 MB and
# would make the copy to the GPU machine much larger). Installed with --no-deps: the
# ports' pins (enformer-pytorch: transformers==4.56.2; borzoi-pytorch: transformers<5) are not honoured, and the
# image's transformers 5.17 is used (all three import and run with it: checked on the CPU with transformers 5.17.0).
#
# On the GPU machine, with .whl/ copied next to the sources, start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit; export HF_HUB_OFFLINE=1;
# (the full command is in the docstring of src/kvbound/bench/ports.py).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    enformer-pytorch==0.8.12 borzoi-pytorch==0.5.1 alphagenome-pytorch==0.3.1 \
    polars==1.20.0 pyfaidx==0.9.2.2 intervaltree==3.2.1
ls -l .whl
du -sh .whl

# .whl_lite/: the same without polars (33 MB), replaced by an import-only stand-in package, for calls that must also
# carry the evaluation data (eval/.cache, 39 MB) under the 64 MiB limit. enformer_pytorch imports polars only for
# its BED-file dataset helper (enformer_pytorch.data), which no benchmark uses; any use of the stand-in raises.
# On the GPU machine install .whl_lite/*.whl exactly as .whl/*.whl.
rm -rf .whl_lite
mkdir -p .whl_lite
cp .whl/*.whl .whl_lite/
rm .whl_lite/polars-*.whl
stub="$(mktemp -d)"
mkdir -p "$stub/polars"
cat > "$stub/polars/__init__.py" <<'PY'
"""Import-only stand-in for polars on machines without it: enformer_pytorch imports polars for its BED-file
dataset helper (enformer_pytorch.data), which attention benchmarks never use. Any use raises."""


def __getattr__(name):
    raise ImportError(f"polars is not installed here (stand-in module); polars.{name} is unavailable")
PY
cat > "$stub/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"
[project]
name = "polars"
version = "0.0.0+stub"
[tool.setuptools]
packages = ["polars"]
TOML
python3 -m pip wheel -q --no-deps -w .whl_lite "$stub"
rm -rf "$stub"
ls -l .whl_lite
du -sh .whl_lite
