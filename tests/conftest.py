import os

import pytest
import torch

# Triton kernels run in the interpreter when there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off", "no")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run compiled kernels on a CUDA device; the others run Triton's interpreter on CPU
    tensors. One process has one mode, so each run skips the other kind and says how to run it."""
    if not torch.cuda.is_available():
        skip, gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine"), True
    elif INTERPRETER:
        reason = "a GPU test: Triton's interpreter is on in this run (TRITON_INTERPRET)"
        skip, gpu = pytest.mark.skip(reason=reason), True
    else:
        reason = "a CPU test: runs Triton's interpreter (on a CUDA machine: TRITON_INTERPRET=1 python -m pytest)"
        skip, gpu = pytest.mark.skip(reason=reason), False
    for item in items:
        if ("gpu" in item.keywords) == gpu:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Small forwards on a 2-core machine are fastest on one thread: modules that use it run on one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def wide_runs(monkeypatch):
    """The runs' tile search as ``KVBOUND_RUNS_WIDE=1`` sets it at import: the 128-row tiles added, runs counted over
    191 distances and unrolled up to 32; the launchers' caches cleared on entry and exit."""
    import importlib

    from kvbound.kernels import attention_dense

    api = importlib.import_module("kvbound.attention")  # the module (the package's name is the function)
    tuner = attention_dense._attention_dense_fwd
    caches = (attention_dense._TUNED, attention_dense._PLANS, tuner.cache, api._RUNS_ON_DEVICE, api._RUN_LAYOUTS)
    shapes = attention_dense._RELATIVE_SHAPES | attention_dense._RUNS_WIDE_SHAPES
    monkeypatch.setattr(attention_dense, "_RUNS_SHAPES", shapes)
    monkeypatch.setattr(attention_dense, "_RELATIVE_WINDOW", max(m + n - 1 for m, n, _, _ in shapes))
    monkeypatch.setattr(attention_dense, "MAX_RUN_SPAN", 32)
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()
