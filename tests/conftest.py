import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Tests are small: one thread per worker keeps `pytest -n 2` from oversubscribing 2 cores.
torch.set_num_threads(1)

# QKV_TEST_DEVICE=cuda (make test-gpu) makes CUDA the default device, so tensors the tests
# create land on the GPU; tests/helpers.DEVICE names it. Without a GPU the triton backend's
# kernels run in Triton's interpreter on CPU tensors (set before anything imports them).
if os.environ.get("QKV_TEST_DEVICE", "cpu") != "cpu":
    torch.set_default_device(os.environ["QKV_TEST_DEVICE"])
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
