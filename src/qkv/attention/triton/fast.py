"""Launching a Triton kernel again without Triton's per-launch binding.

``kernel[grid](*args, **options)`` spends host time before the GPU sees anything: Triton binds
the arguments to the signature, works out each one's specialisation (a pointer 16-byte
aligned or not, an integer equal to 1, divisible by 16, 32 or 64 bits), builds the cache key
from them, looks the compiled kernel up and builds the launch metadata. For a decoding step,
whose kernels take microseconds, that is much of the call: 15 µs for the forward's 40
arguments, 6 µs for the merge's 7 (``benchmarks/triton_host.py``, triton 3.9, AMD EPYC).

:func:`launch` keeps, for each kernel, launch options and specialisation, the compiled kernel
Triton chose the first time, and later hands the arguments straight to its launcher (what
Triton itself does after its lookup). The specialisation is worked out here, in the terms
Triton uses (:func:`specialisation`); ``tests/attention/test_triton.py`` (through
``triton_compile_check.py --fast``) holds it to Triton's own choice, argument for argument,
for aligned and unaligned pointers and integers equal to 1, divisible by 16 and past 32 bits.
Whatever the fast path cannot vouch for goes
through Triton: a kernel with pre-run hooks, launch hooks (a profiler), Triton's interpreter,
or ``QKV_TRITON_FAST_LAUNCH=0`` (:data:`ENABLED`). What Triton reads from its own settings at
every launch (``TRITON_DEBUG``, instrumentation) is taken as it was at a kernel's first
launch; :func:`clear` forgets the kept kernels after changing them.
"""

from __future__ import annotations

import os

__all__ = ["ENABLED", "clear", "launch", "specialisation"]

# (kernel, device, options, specialisation) -> (compiled kernel, the values of the
# parameters after the positional arguments: constexprs and defaults, in signature order)
_COMPILED: dict[tuple, tuple] = {}
_I32 = (-(2**31), 2**31)


# QKV_TRITON_FAST_LAUNCH=0 (read at import) sends every launch through Triton's own binding.
ENABLED = os.environ.get("QKV_TRITON_FAST_LAUNCH", "1") != "0"


def specialisation(args: tuple) -> tuple:
    """What Triton's JIT specialises a kernel on, for positional ``args``: a tensor's dtype and
    whether its address is a multiple of 16 bytes; an integer's width (32 or 64 bits), whether
    it equals 1 (a constant then) or divides by 16; nothing of a float, of a bool, or of None."""
    key = []
    for a in args:
        kind = type(a)
        if kind is int:
            width = 0 if _I32[0] <= a < _I32[1] else 2 if a < 2**63 else 4  # i32, i64, u64
            key.append(1 if a == 1 else 2 + width + (a % 16 == 0))
        elif kind is float:
            key.append(0)
        elif kind is bool:
            key.append("u1")  # (not True itself: True == 1)
        elif a is None:
            key.append("none")
        else:  # a tensor
            key.append((a.dtype, a.data_ptr() % 16 == 0))
    return tuple(key)


def launch(kernel, grid: tuple[int, ...], args: tuple, options: dict) -> None:
    """``kernel[grid](*args, **options)``; from the second launch of the same kernel, options
    and :func:`specialisation` on, the compiled kernel's own launcher, called as Triton calls
    it. ``options`` are keyword arguments: the kernel's constexprs and ``num_warps``/
    ``num_stages``."""
    triton = _triton()
    if (not ENABLED or type(kernel) is not triton.JITFunction or kernel.pre_run_hooks
            or triton.hooked()):  # (an interpreted kernel is no JITFunction)
        kernel[grid](*args, **options)
        return
    device = triton.driver.active.get_current_device()
    key = (kernel, device, tuple(options.items()), specialisation(args))
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **options)
        if compiled is not None:
            _COMPILED[key] = (compiled, _tail(kernel, len(args), options))
        return
    compiled, tail = hit
    stream = triton.driver.active.get_current_stream(device)
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None,
                 None, None, *args, *tail)


class _Triton:
    """What :func:`launch` reads of Triton, imported once."""

    def __init__(self) -> None:
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self.driver, self.JITFunction, self.runtime = driver, JITFunction, knobs.runtime

    def hooked(self) -> bool:
        """Whether launch hooks are set (a profiler): their metadata come from Triton's path."""
        hooks = (self.runtime.launch_enter_hook, self.runtime.launch_exit_hook)
        return any(getattr(h, "calls", h) for h in hooks)  # (a chain of hooks, or one)


_TRITON: _Triton | None = None


def _triton() -> _Triton:
    global _TRITON
    if _TRITON is None:
        _TRITON = _Triton()
    return _TRITON


def _tail(kernel, given: int, options: dict) -> tuple:
    """The values of ``kernel``'s parameters after the first ``given``: from ``options``, else
    the parameter's default (what Triton's binder passes the launcher)."""
    values = []
    for param in kernel.params[given:]:
        name = param.name
        values.append(options.get(name, param.default))
    return tuple(values)


def clear() -> None:
    """Forget every kept compiled kernel (tests; a new driver)."""
    _COMPILED.clear()
