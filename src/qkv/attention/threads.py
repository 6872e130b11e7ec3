"""How many CPU threads an attention call uses: torch's setting, less the cores others keep busy.

qkv's CPU paths (flash tiles, programmable attention, flash-decoding) run as a sequence of
torch operations, each a parallel region whose work torch splits evenly over its threads and
then waits for the slowest. When another process keeps one of two cores busy, the thread that
shares that core gets half of it, so every region takes as long as it would on one thread, plus
the hand-offs: measured on a two-core machine with one busy process, qkv's soft-capped flex
call took 2.3-3.4x its quiet time on two threads, 1.9x on one (torch.compile's kernel, one
region per call, 1.6x). One thread on the free core is the faster choice there.

:func:`fitted_threads` wraps a call: it reads how busy this process's CPUs were over the last
fraction of a second (``/proc/stat``) less this process's own CPU time, and, while other
processes keep ``c`` cores busy, runs the call on ``cores - round(c)`` threads (at least one,
at most torch's setting), then restores torch's setting. The reading is taken at most every
:data:`SAMPLE_S` seconds, so a call pays a clock read; where ``/proc/stat`` does not exist
(macOS, Windows) torch's setting is used as is, as it is under ``torch.compile`` tracing and
with ``QKV_THREADS=fixed`` in the environment (or :func:`set_policy`\\ ``("fixed")``).

The thread count changes the time, not the bits: torch's kernels and qkv's backends give
bit-identical results on one thread and on two (``tests/attention/test_threads.py`` checks it,
forward and backward), so a result does not depend on the machine's load. Generation steps are
fitted too (:func:`fitted` on the sessions' ``first``/``next``); a training step is not (it
keeps torch's setting outside attention). ``torch.set_num_threads`` is process-wide: a call from
one Python thread while another runs attention may see the fitted count; the setting is always
restored.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable

import torch

__all__ = ["POLICIES", "SAMPLE_S", "busy_seconds", "fitted", "fitted_threads", "others_busy",
           "policy", "set_policy", "threads_for"]

POLICIES = ("adaptive", "fixed")
SAMPLE_S = 0.1  # seconds between two readings of the machine's load
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _policy_from_env() -> str:
    name = os.environ.get("QKV_THREADS", "adaptive")
    if name not in POLICIES:
        warnings.warn(f"QKV_THREADS={name!r} is not one of {POLICIES}; using 'adaptive'",
                      RuntimeWarning, stacklevel=2)
        return "adaptive"
    return name


class _State:
    policy = _policy_from_env()
    sample: tuple[float, float, float] | None = None  # (wall, machine busy s, our CPU s)
    others = 0.0  # cores other processes kept busy over the last interval
    cores: int | None = None  # CPUs this process may run on, read with each sample


def policy() -> str:
    """The thread policy: ``"adaptive"`` (the default) or ``"fixed"`` (torch's setting)."""
    return _State.policy


def set_policy(name: str) -> None:
    """Choose ``"adaptive"`` (fit threads to the cores others leave free) or ``"fixed"``.

    Raises:
        ValueError: another name.
    """
    if name not in POLICIES:
        raise ValueError(f"thread policy must be one of {POLICIES}, got {name!r}")
    _State.policy = name


def busy_seconds(stat: str, cpus: set[int] | None) -> float | None:
    """CPU seconds the given CPUs spent busy since boot, from the text of ``/proc/stat``
    (steal counts as busy: a hypervisor took it); ``cpus`` None = every CPU. None when the
    text has none of those CPUs. Only the CPUs this process may run on count: in a container
    pinned to 2 of a host's 64 CPUs, the other 62 are someone else's business."""
    total, found = 0, False
    for line in stat.splitlines():
        head, _, rest = line.partition(" ")
        if not head.startswith("cpu") or head == "cpu":
            continue
        if cpus is not None and int(head[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks) - ticks[3] - ticks[4]
        found = True
    return total / _CLOCK_TICKS if found else None


def _affinity() -> set[int] | None:
    """The CPUs this process may run on (None where the system does not say)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def _machine_busy_seconds(cpus: set[int] | None) -> float | None:
    """:func:`busy_seconds` of ``cpus`` now, or None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return busy_seconds(stat, cpus)


def others_busy(now: float | None = None) -> float | None:
    """Cores other processes kept busy over the last reading interval (None: unknown).

    Takes a new reading when the last one is :data:`SAMPLE_S` old or more; else returns the
    last value.
    """
    now = time.monotonic() if now is None else now
    last = _State.sample
    if last is not None and now - last[0] < SAMPLE_S:
        return _State.others
    cpus = _affinity()
    busy = _machine_busy_seconds(cpus)
    if busy is None:
        return None
    t = os.times()
    ours = t.user + t.system
    _State.sample = (now, busy, ours)
    _State.cores = len(cpus) if cpus else None
    if last is not None:
        # /proc/stat counts in ticks (10 ms): a short interval is coarse, never negative
        _State.others = max(0.0, ((busy - last[1]) - (ours - last[2])) / (now - last[0]))
    return _State.others


def threads_for(requested: int, cores: int, others: float | None) -> int:
    """Threads to run on: ``requested`` less the cores others keep busy, at least one.

    >>> threads_for(2, 2, 0.2), threads_for(2, 2, 0.7), threads_for(8, 8, 3.2)
    (2, 1, 5)
    """
    if others is None:
        return requested
    return max(1, min(requested, cores - int(others + 0.5)))


def _cores() -> int:
    """CPUs this process may run on, as read with the last load sample."""
    if _State.cores is None:
        cpus = _affinity()
        _State.cores = len(cpus) if cpus else (os.cpu_count() or 1)
    return _State.cores


class fitted_threads:  # noqa: N801  (a context manager used like a function)
    """Run the body on the threads the machine has free; ``as`` gives the count used (0 while
    tracing: the traced program keeps no thread setting). A class, not a generator: it wraps
    every attention call, and costs well under a microsecond when nothing changes."""

    __slots__ = ("restore",)

    def __enter__(self) -> int:
        self.restore = 0
        if _State.policy != "adaptive" or torch.compiler.is_compiling() \
                or torch.jit.is_tracing():
            return 0
        requested = torch.get_num_threads()
        if requested <= 1:
            return requested
        n = threads_for(requested, _cores(), others_busy())
        if n != requested:
            torch.set_num_threads(n)
            self.restore = requested
        return n

    def __exit__(self, *exc) -> bool:
        if self.restore:
            torch.set_num_threads(self.restore)
        return False


def fitted(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs under :func:`fitted_threads` (a decoding step, say)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with fitted_threads():
            return fn(*args, **kwargs)

    return wrapper
