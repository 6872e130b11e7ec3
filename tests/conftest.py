import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

sys.path.insert(0, os.path.dirname(__file__))

# Tests are small: one thread per worker keeps `pytest -n 2` from oversubscribing 2 cores.
torch.set_num_threads(1)



class _OnDevice(TorchFunctionMode):
    """torch's default-device mode, except that a tensor drawn from a CPU generator is drawn
    on the CPU and then moved: the tests' seeded CPU generators keep working, and give the
    same values as on a CPU-only run."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type == "cpu":
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


# QKV_TEST_DEVICE=cuda (make test-gpu) makes CUDA the tests' default device, so tensors the
# tests create land on the GPU; tests/helpers.DEVICE names it. Without a GPU the triton
# backend's kernels run in Triton's interpreter on CPU tensors (set before anything imports
# them).
if os.environ.get("QKV_TEST_DEVICE", "cpu") != "cpu":
    _OnDevice(os.environ["QKV_TEST_DEVICE"]).__enter__()
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
