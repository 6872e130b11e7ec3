"""A second device on machines without a GPU, for tests that move a model by hand.

A path that has only run on the CPU makes two mistakes that show only on another device: a
tensor made without ``device=`` meeting the model's tensors in one op, and ``.numpy()`` of a
tensor on the device. torch's lazy-tensor device (``torch._lazy``, its TorchScript backend)
runs on the CPU and refuses both as CUDA does ("Input tensor is not a lazy tensor";
"can't convert lazy:0 device type tensor to numpy"), so the ``moved`` fixture
(``conftest.py``) hands it to tests where no GPU is, and CUDA where one is
(``QKV_TEST_DEVICE=cuda``).

Two of its own limits are worked around for a test's duration, neither changing a value:

* it cannot make inference tensors: ``torch.inference_mode`` runs as ``torch.no_grad``;
* iterating over one of its tensors (``unbind``) gives rows it no longer knows as its own:
  ``for row in t`` takes the rows by index instead.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from helpers import DEVICE


@functools.cache
def _start_lazy() -> str | None:
    """Start the lazy device once a process; why it cannot start, or None."""
    try:
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
    except (ImportError, RuntimeError) as err:  # a torch without it: say so, test nothing
        return f"torch {torch.__version__} has no lazy-tensor device to stand in for a GPU: {err}"
    return None


def _no_grad(mode: bool = True):
    return torch.no_grad() if mode else torch.enable_grad()


def _rows(t: torch.Tensor):
    return (t[i] for i in range(len(t)))


def second_device(monkeypatch) -> torch.device:
    """CUDA under ``QKV_TEST_DEVICE=cuda``; else the lazy device, with its two limits worked
    around until the test ends (``monkeypatch`` undoes them)."""
    if DEVICE.type != "cpu":
        return DEVICE
    why = _start_lazy()
    if why is not None:
        pytest.skip(why)
    monkeypatch.setattr(torch, "inference_mode", _no_grad)
    monkeypatch.setattr(torch.Tensor, "__iter__", _rows)
    return torch.device("lazy")


def assert_same_run(on_cpu, moved, where: str = "result", rel: float = 1e-6) -> None:
    """``moved == on_cpu`` through dataclasses, dicts, lists and tensors (``moved``'s may be on
    the device); floats and float tensors to ``rel`` relative. 1e-6 for float64 models, whose
    log-probs and losses are float32 (another device rounds them differently); a float32
    model's values pass through dozens of roundings of 6e-8 each: 1e-5."""
    if isinstance(on_cpu, torch.Tensor):
        on_cpu, moved = on_cpu.tolist(), moved.cpu().tolist()
    if dataclasses.is_dataclass(on_cpu):
        on_cpu, moved = dataclasses.asdict(on_cpu), dataclasses.asdict(moved)
    if isinstance(on_cpu, dict):
        assert on_cpu.keys() == moved.keys(), where
        for k in on_cpu:
            assert_same_run(on_cpu[k], moved[k], f"{where}.{k}", rel)
    elif isinstance(on_cpu, (list, tuple)):
        assert len(moved) == len(on_cpu), f"{where}: {len(on_cpu)} on the CPU, {len(moved)} moved"
        for i, (x, y) in enumerate(zip(on_cpu, moved, strict=True)):
            assert_same_run(x, y, f"{where}[{i}]", rel)
    elif isinstance(on_cpu, float):
        assert moved == pytest.approx(on_cpu, rel=rel, abs=1e-9), (
            f"{where}: {on_cpu} on the CPU, {moved} moved")
    else:
        assert moved == on_cpu, f"{where}: {on_cpu!r} on the CPU, {moved!r} moved"
