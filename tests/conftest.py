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
