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

Only inference is fitted, and only where its bits were seen not to move. A call that records
an autograd graph (grad enabled and an input that requires grad), and every backward, keeps
torch's setting: a training step's bits never depend on the machine's load. Inference (a call
with no graph, a decoding step under ``no_grad``) is fitted only once this process has checked
(at its first inference call on several threads, busy or not: about 20 ms, once), by running
them, that this CPU's kernels give the same bits on the fitted count and on torch's
(:func:`bits_hold`: torch's flash kernel, batched tile matmuls, a decoding step's GEMV and a
prefill's linear layer, torch's packed int8 and int4 kernels, on both counts, compared bit
for bit). BLAS libraries may split a
reduction over their threads (MKL does on some Intel CPUs), which changes the bits with the
thread count: there the check fails and the policy keeps torch's setting, so a result never
depends on the load. ``torch.set_num_threads`` is process-wide: a call from one Python thread
while another runs attention may see the fitted count; the setting is always restored.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from typing import ClassVar

import torch

__all__ = ["POLICIES", "SAMPLE_S", "bits_hold", "busy_seconds", "fitted", "fitted_threads",
           "others_busy", "policy", "set_policy", "threads_for"]

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
    bits: ClassVar[dict[tuple[int, int], bool]] = {}  # (fitted, requested) -> same bits


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


def _probe_inputs() -> list[tuple[Callable, Callable[[], tuple]]]:
    """The kernels a fitted call runs, on sizes where BLAS and ATen parallelise, as
    ``(kernel, inputs)`` pairs: torch's flash kernel (a prefill), batched tile matmuls (the
    tile loop), a decoding step's GEMV, a long reduction and a prefill's linear layer (MKL's
    and oneDNN's), each on seeded float32 inputs made when it runs (at most ~2 MiB live at a
    time)."""
    def rand(*shape):
        return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(0))

    def inputs(*makers):
        return lambda: tuple(make() for make in makers)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    linear = torch.nn.functional.linear
    qkv_ = rand(1, 4, 160, 64)
    return [
        (lambda a, b, c: sdpa(a, b, c, is_causal=True), inputs(qkv_, qkv_, qkv_)),
        (torch.matmul, inputs(rand(8, 64, 40), rand(8, 40, 333))),   # tile scores
        (torch.matmul, inputs(rand(8, 64, 333), rand(8, 333, 40))),  # tile outputs
        (linear, inputs(rand(1, 576), rand(768, 576))),              # a decoding GEMV
        (linear, inputs(rand(1, 4096), rand(64, 4096))),             # a long reduction
        (linear, inputs(rand(48, 576), rand(768, 576))),             # a prefill's GEMM
        *_onednn_probes(rand, inputs),
        (lambda x: torch.softmax(x, -1).sum(-1), inputs(rand(64, 2048))),
        *_packed_probes(rand),
    ]


def _onednn_probes(rand: Callable, inputs: Callable) -> list[tuple[Callable, Callable]]:
    """oneDNN's inner product (qkv.nn.linear's prefill GEMM, and its GEMV on CPUs not made
    by Intel) on one row and 48, where this torch has it."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):  # fmt: skip
        return []

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    return [(onednn, inputs(rand(rows, 576), rand(768, 576))) for rows in (1, 48)]


def _packed_probes(rand: Callable) -> list[tuple[Callable, Callable[[], tuple]]]:
    """torch's packed int8 and int4 CPU kernels (qkv.nn.quantized's decoding GEMV and short
    prefill), on one row and 48, where this torch has them."""
    def int8(x, w):
        return torch._weight_int8pack_mm(x.bfloat16(), w, torch.ones(768, dtype=torch.bfloat16))

    def int4(x, codes):
        tiled = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        scale_zero = torch.ones(576 // 32, 768, 2, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(x.bfloat16(), tiled, 32, scale_zero)

    def codes(low, high, dtype):
        gen = torch.Generator().manual_seed(0)
        return lambda: torch.randint(low, high, (768, 576), generator=gen, dtype=dtype)

    out = []
    for rows in (1, 48):
        if hasattr(torch, "_weight_int8pack_mm"):
            out.append((int8, lambda r=rows: (rand(r, 576)(), codes(-127, 128, torch.int8)())))
        if hasattr(torch, "_weight_int4pack_mm_for_cpu"):
            out.append((int4, lambda r=rows: (rand(r, 576)(), codes(0, 16, torch.int32)())))
    return out


def bits_hold(fitted_n: int, requested: int) -> bool:
    """Whether this CPU's kernels give the same bits on ``fitted_n`` threads as on
    ``requested``: each kernel of :func:`_probe_inputs` run on both counts and compared bit
    for bit, once per pair of counts and process (milliseconds; the setting is restored)."""
    key = (fitted_n, requested)
    if key not in _State.bits:
        before = torch.get_num_threads()
        try:
            _State.bits[key] = all(_same_bits(fn, make(), fitted_n, requested)
                                   for fn, make in _probe_inputs())  # fmt: skip
        finally:
            torch.set_num_threads(before)
    return _State.bits[key]


def _same_bits(fn: Callable, args: tuple, *counts: int) -> bool:
    outs = []
    for n in counts:
        torch.set_num_threads(n)
        with torch.no_grad():
            outs.append(fn(*args))
    return torch.equal(*outs)


def _records_graph(tensors: tuple) -> bool:
    if not tensors or not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class fitted_threads:  # noqa: N801  (a context manager used like a function)
    """Run the body on the threads the machine has free; ``as`` gives the count used (0 while
    tracing: the traced program keeps no thread setting). A class, not a generator: it wraps
    every attention call, and costs 2-3 µs when nothing changes (EPYC, 2 threads).

    ``tensors`` are the call's inputs: when grad is enabled and one requires grad (a training
    step), torch's setting is kept, as it is under ``no_grad`` if grad mode says the call is
    being differentiated. Never use it in a backward."""

    __slots__ = ("restore", "tensors")

    def __init__(self, *tensors: object) -> None:
        self.tensors = tensors

    def __enter__(self) -> int:
        self.restore = 0
        if _State.policy != "adaptive" or torch.compiler.is_compiling() \
                or torch.jit.is_tracing():
            return 0
        requested = torch.get_num_threads()
        if requested <= 1 or _records_graph(self.tensors):
            return requested
        # The check runs at the first inference call, busy or not (~20 ms once), so that
        # when it runs never depends on the load; other counts than one are checked lazily.
        if not _State.bits.get((1, requested)) and not bits_hold(1, requested):
            return requested
        n = threads_for(requested, _cores(), others_busy())
        if n == requested or not bits_hold(n, requested):
            return requested
        torch.set_num_threads(n)
        self.restore = requested
        return n

    def __exit__(self, *exc) -> bool:
        if self.restore:
            torch.set_num_threads(self.restore)
        return False


def fitted(fn: Callable) -> Callable:
    """Decorator: ``fn`` runs under :func:`fitted_threads` (a decoding step, say) when grad
    mode is off; with grad on it keeps torch's setting (it may be recording a graph)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with fitted_threads():
            return fn(*args, **kwargs)

    return wrapper
