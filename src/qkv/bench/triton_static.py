"""What the triton backend's kernels compile to on a GPU this machine does not have.

Speed needs a GPU; the compiled code does not. This module runs qkv's own launch code
(:mod:`qkv.attention.triton.launch`) on CPU tensors with a stand-in Triton driver that reports
an NVIDIA target (Hopper, sm_90, 132 multiprocessors, unless told otherwise). Each launch is
compiled by Triton's own JIT, with the same argument specialisation a real launch gets
(16-byte alignment, integers divisible by 16, integers equal to 1), and nothing runs. For each
kernel it reports what decides speed before any timing can:

- ``registers`` and ``spill_bytes`` (the stack frame: registers that did not fit, stored to
  local memory and read back each iteration);
- ``shared_bytes`` and ``pipelined`` (whether the loads became asynchronous copies, which is
  what ``num_stages`` buys);
- ``programs_per_sm`` (occupancy from registers, shared memory and warps) and the grid;
- ``loops``: the machine instructions (SASS) of each loop body, and how many of them read or
  write local memory (spilled registers), the largest first: what one step of a kernel's
  main loop costs before any memory is read.

It is how tile sizes are chosen between GPU sessions: a tile that spills or does not pipeline
is not worth a GPU minute. ``python -m benchmarks.triton_static`` prints the table.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["Compiled", "compiled_launches", "launches_recorded", "loop_bodies"]

_REGISTERS_PER_SM = 65536
_MAX_WARPS_PER_SM = 64
_MAX_PROGRAMS_PER_SM = 32


@dataclass(frozen=True)
class Compiled:
    """One launch as compiled for the stand-in GPU."""

    kernel: str
    grid: tuple[int, ...]
    options: dict
    registers: int
    spill_bytes: int
    shared_bytes: int
    pipelined: bool
    cubin: bytes = field(default=b"", repr=False)

    @functools.cached_property
    def loops(self) -> tuple[tuple[int, int], ...]:
        """``(instructions, local loads and stores)`` of each loop body, largest first."""
        return _loops(self.cubin)

    @property
    def warps(self) -> int:
        return self.options["num_warps"]

    def programs_per_sm(self, shared_per_sm: int = 232448) -> int:
        """Programs one multiprocessor holds at once, limited by registers, shared memory
        (``shared_per_sm``: 227 KiB on Hopper) and warps."""
        threads = 32 * self.warps
        by_regs = _REGISTERS_PER_SM // max(1, self.registers * threads)
        by_shared = shared_per_sm // max(1, self.shared_bytes + 1024)
        return max(0, min(by_regs, by_shared, _MAX_WARPS_PER_SM // self.warps,
                          _MAX_PROGRAMS_PER_SM))


class _StandInDriver:
    """Enough of Triton's driver interface for its JIT to compile (never launch)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump <flag>`` of a compiled kernel (the cuobjdump Triton ships)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def _usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` of a compiled kernel."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))
    return int(found.group(1)), int(found.group(2))


_SASS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_LOCAL = re.compile(r"\b(LDL|STL)\b")


def _loops(cubin: bytes) -> tuple[tuple[int, int], ...]:
    return loop_bodies(_cuobjdump(cubin, "-sass"))


def loop_bodies(sass: str) -> tuple[tuple[int, int], ...]:
    """``(instructions, local loads and stores)`` of each loop in a ``cuobjdump -sass``
    listing, largest first: a loop is a branch back to an earlier instruction, its body the
    instructions from there to the branch."""
    code = [(int(at, 16), text) for at, text in _SASS.findall(sass)]
    index = {at: n for n, (at, _) in enumerate(code)}
    bodies = []
    for n, (at, text) in enumerate(code):
        target = _BRANCH.search(text)
        start = index.get(int(target.group(1), 16)) if target else None
        if start is not None and code[start][0] < at:
            body = [t for _, t in code[start:n + 1]]
            bodies.append((len(body), sum(bool(_LOCAL.search(t)) for t in body)))
    return tuple(sorted(bodies, reverse=True))


def _compile(kernel, grid, args, options) -> Compiled:
    if not hasattr(kernel, "warmup"):  # an interpreted kernel compiles nothing
        raise RuntimeError(
            f"{kernel.__name__} was made for Triton's interpreter: compile in a process that "
            "imports triton without TRITON_INTERPRET=1 (as python -m benchmarks.triton_static "
            "does)")
    compiled = kernel.warmup(*args, grid=grid, **options)
    cubin = compiled.asm["cubin"]
    registers, stack = _usage(cubin)
    return Compiled(kernel.__name__, tuple(grid), dict(options), registers, stack,
                    compiled.metadata.shared, "cp.async" in compiled.asm["ptx"], cubin)


@contextlib.contextmanager
def launches_recorded(arch: int = 90, on_launch=None) -> Iterator[None]:
    """Within: Triton compiles for a stand-in ``sm_<arch>`` driver, and a compiled kernel's
    launch calls ``on_launch(compiled kernel, its launcher's arguments)`` (by default nothing)
    instead of running, with no launch metadata built: Triton's and qkv's host-side launch
    work, timed or checked without a GPU."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import driver

    sink = on_launch or (lambda compiled, args: None)
    saved = {name: CompiledKernel.__dict__[name] for name in ("run", "launch_metadata")}
    active = driver._active
    driver.set_active(_StandInDriver(arch))
    CompiledKernel.run = property(lambda self: (lambda *args: sink(self, args)))
    CompiledKernel.launch_metadata = lambda self, *args: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(CompiledKernel, name, value)
        driver._active = active


@contextlib.contextmanager
def _stand_in(arch: int, multiprocessors: int) -> Iterator[list[Compiled]]:
    """Within: triton launches compile for ``sm_<arch>`` and are recorded, not run."""
    from triton.runtime import driver

    from qkv.attention.triton import launch as triton_launch
    from qkv.attention.triton import plan as triton_plan

    saved = os.environ.pop("TRITON_INTERPRET", None)
    records: list[Compiled] = []
    active = driver._active  # (None on a machine without a GPU: Triton finds none to reset to)
    driver.set_active(_StandInDriver(arch))
    patched = {(triton_launch, "_launch"): lambda kernel, grid, args, options: records.append(
                   _compile(kernel, grid, args, options)),
               (triton_plan, "gpu_multiprocessors"): lambda device: multiprocessors}
    originals = {where: getattr(*where) for where in patched}
    try:
        for (module, name), value in patched.items():
            setattr(module, name, value)
        yield records
    finally:
        for (module, name), value in originals.items():
            setattr(module, name, value)
        driver._active = active
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def compiled_launches(call, arch: int = 90, multiprocessors: int = 132) -> list[Compiled]:
    """The triton launches ``call()`` makes (a function calling
    :mod:`qkv.attention.triton.launch` with CPU tensors shaped as on the GPU), each compiled
    for ``sm_<arch>`` with ``multiprocessors`` multiprocessors, none run."""
    with _stand_in(arch, multiprocessors) as records, torch.no_grad():
        call()
    return records
