import contextlib
import os
import sys

import pytest
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
        # Read through the instance: torch.compile traces this method, and cannot resolve a
        # global of a module named "conftest" (seen on the H200 run).
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.constructors and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type == "cpu":
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)


# QKV_TEST_DEVICE=cuda (make test-gpu) makes CUDA the tests' default device, so tensors the
# tests create land on the GPU; tests/helpers.DEVICE names it. Without a GPU the triton
# backend's kernels run in Triton's interpreter on CPU tensors (set before anything imports
# them).
_DEFAULT_DEVICE = None
if os.environ.get("QKV_TEST_DEVICE", "cpu") != "cpu":
    _DEFAULT_DEVICE = _OnDevice(os.environ["QKV_TEST_DEVICE"])
    _DEFAULT_DEVICE.__enter__()
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_speed

    with contextlib.suppress(ImportError):  # no triton: its tests say so
        interpreter_speed.install()


@pytest.fixture
def moved(monkeypatch):
    """The device a test moves its model to by hand, as a user does (``model.to(device)``):
    CUDA under ``QKV_TEST_DEVICE=cuda``, else torch's lazy-tensor device on the CPU
    (``tests/second_device.py``), which refuses CPU tensors in its ops as CUDA does. The
    default-device mode is off for the test, so tensors qkv makes without a device are made
    on the CPU, as they are for that user."""
    from second_device import second_device

    if _DEFAULT_DEVICE is None:
        yield second_device(monkeypatch)
        return
    _DEFAULT_DEVICE.__exit__(None, None, None)
    try:
        yield second_device(monkeypatch)
    finally:
        _DEFAULT_DEVICE.__enter__()


# On a GPU, backends refuse some grid cells by design; each refusal is pinned by its own test
# (tests/attention/test_triton.py, test_explain.py), so there such a cell is reported skipped,
# with the refusal as the reason, instead of failed.
GPU_REFUSALS = (
    "computes float32, bfloat16 and float16, not torch.float64",  # triton
    "only torch's CPU flash kernel returns the log-sum-exp",  # torch on CUDA
    "the fused kernel does not return attention weights",  # torch on CUDA
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("QKV_TEST_DEVICE", "cpu") == "cpu" or call.excinfo is None:
        return
    message = str(call.excinfo.value)
    if call.when == "call" and "cannot honour this call" in message and any(
        r in message for r in GPU_REFUSALS
    ):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: refused by design on this device: {message}")
