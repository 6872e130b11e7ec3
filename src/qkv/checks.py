"""Argument guards shared by every layer: ints that are not bools, finite numbers, positive ints.

``True`` is an ``int`` in Python, so ``isinstance(v, int)`` alone lets ``steps=True`` through;
these helpers say "an int, not a bool" once. The module imports nothing from qkv, so any layer
(``data``, ``generate``, ``train``, ``pretrained``, ``cli``) may use it.

:func:`values_unknown` says when a tensor's values cannot be read: checks of token ids or
positions against their ranges (``int(ids.max())``) are skipped then, so ``torch.compile``
with ``fullgraph=True``, ``torch.export``, ONNX export and the meta device trace the models;
shapes and dtypes are still checked, and an eager call checks the values as before.

:func:`remember_checked` / :func:`checked_before` keep the last tensors whose values were
checked (or are in range by construction: a position the generation loop computed, a token
it chose from the logits), so a value check reads a tensor from the device once, not once per
layer or per decoding step. A tensor is remembered by identity and version counter: changed
in place since, or a new tensor at a reused address, it is read again; a view of a remembered
tensor counts as checked (its values are among the base's).
"""

from __future__ import annotations

import math
import os
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["carry_checked", "check_device", "checked_before", "is_int", "is_number",
           "memory_bytes", "positive_int", "remember_checked", "values_unknown"]


def memory_bytes() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say): what guards
    against allocations that cannot fit compare with, before allocating."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def is_int(value: object) -> bool:
    """``value`` is an ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """``value`` is a finite ``int`` or ``float``, and not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_device(value: object, name: str = "device") -> torch.device:
    """``value`` (a ``torch.device`` or its name) as a device torch can use on this machine.

    ``cpu``; ``cuda`` / ``cuda:N`` when this torch build has CUDA and GPU ``N`` exists;
    ``mps`` when available; any other device type torch knows is tried by allocating an
    empty tensor on it.

    Raises:
        ValueError: ``"<name> 'banana' is not a device ..."`` or ``"<name> 'cuda' is not
            available: ..."``, before anything is loaded or allocated.
    """
    try:
        device = torch.device(value)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} {value!r:.80} is not a device: expected cpu, cuda, cuda:N, "
                         "mps, ...") from None  # fmt: skip
    why = ""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not torch.backends.cuda.is_built():
            why = "this torch build has no CUDA (a CPU build); use cpu"
        elif count == 0:
            why = "no CUDA GPU is visible; use cpu"
        elif device.index is not None and device.index >= count:
            why = f"GPU {device.index} does not exist ({count} visible: cuda:0..cuda:{count - 1})"
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            why = "MPS (Apple GPU) is not available on this machine; use cpu"
    elif device.type == "meta":
        why = "the meta device holds no data; use cpu"
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception as err:  # any failure means "not usable here"
            why = " ".join(str(err).split())[:200] or type(err).__name__
    if why:
        raise ValueError(f"{name} {value!r:.80} is not available: {why}")
    return device


def positive_int(name: str, value: object) -> int:
    """``value`` when it is an int >= 1 (not a bool).

    Raises:
        ValueError: ``"<name> must be a positive int, got <value>"``.
    """
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def values_unknown(t: torch.Tensor) -> bool:
    """True when ``t``'s values cannot be read without breaking a trace: under
    ``torch.compile`` / ``torch.export`` tracing, on the meta device, or a fake tensor.

    Value checks (ids in range, a 0/1 mask) are skipped then; everything else is checked.
    """
    if torch.compiler.is_compiling() or t.is_meta:
        return True
    if type(t) is torch.Tensor and not torch._is_functional_tensor(t) \
            and not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False  # a plain tensor holding its own values (0.2 us, where is_fake takes 1.5)
    return is_fake(t)


# Tensors whose values were checked last: id -> (weak reference, version counter, what).
_CHECKED: dict[int, tuple[weakref.ref, int, object]] = {}
_CHECKED_MAX = 32


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None


def remember_checked(t: torch.Tensor, what: object, *, unversioned: bool = False
                     ) -> torch.Tensor:
    """Remember that ``t``'s values passed the check ``what`` (any hashable description, e.g.
    ``("ids", vocab_size)``); returns ``t``. An inference-mode tensor keeps no version
    counter: it is remembered (by identity alone) only with ``unversioned=True``, which the
    generation loops, running in inference mode, pass for tensors they have just made."""
    if _version(t) is None and not unversioned:
        return t
    # (popped first, so an id a new tensor reuses moves to the newest end: the oldest entry
    # is the one evicted, never the tensor just checked)
    _CHECKED.pop(id(t), None)
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[id(t)] = (weakref.ref(t), _version(t), what)
    return t


def carry_checked(source: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a view of ``source``), remembered as checked when ``source`` is; returns it.
    (An inference-mode view does not name its base, so the mark is carried by hand.)"""
    entry = _CHECKED.get(id(source))
    if entry is not None and entry[0]() is source and entry[1] == _version(source):
        remember_checked(view, entry[2], unversioned=True)
    return view


def checked_before(t: torch.Tensor, what: object) -> bool:
    """Whether ``t`` (or the tensor it is a view of) passed the check ``what`` unchanged."""
    for candidate in (t, t._base):
        if candidate is None:
            continue
        entry = _CHECKED.get(id(candidate))
        if entry is not None and entry[0]() is candidate and entry[2] == what and (
            entry[1] == _version(candidate)
        ):
            return True
    return False
