"""Measurement helpers of ``qkv bench`` and the benchmark scripts: timing, peak RSS, probes.

Timing: ``time_interleaved`` runs untimed warm-up calls, then ``repeats`` timed repeats of
``number`` calls each (``number`` grows until one repeat lasts ``min_repeat_s``, as
``timeit``'s autorange does, so microsecond calls are not drowned in timer noise), cycling
through the functions compared so drift hits all alike; ``summarise`` reports the minimum
(the least disturbed run on a shared machine) and the median.

Peak memory: a probe runs in a fresh subprocess, builds its inputs, warms the code up on a
tiny input, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``, Linux >= 4.0;
elsewhere the mark is not reset, which can only overstate the baseline), runs one call and
reads the peak RSS (``VmHWM`` on Linux, ``ru_maxrss`` elsewhere): the difference is the
resident memory the call needed beyond its inputs. ``MALLOC_MMAP_THRESHOLD_`` is fixed in the
subprocess so large buffers are mapped and unmapped, not recycled invisibly by malloc.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone

import torch

__all__ = [
    "MEMORY_METHOD",
    "UNSTABLE_SPREAD",
    "available_memory_bytes",
    "busy_core",
    "machine_info",
    "machine_line",
    "peak_rss_bytes",
    "probe_env",
    "reset_peak_rss",
    "run_probe",
    "summarise",
    "time_calls",
    "time_interleaved",
    "unstable",
]

MEMORY_METHOD = (
    "peak-RSS delta (VmHWM) over one call in a fresh subprocess, peak mark reset via "
    "/proc/self/clear_refs after building the inputs (inputs not counted)"
)


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int,
    repeats: int | dict[str, int],
    min_repeat_s: float = 0.0,
) -> dict[str, tuple[list[float], int]]:
    """Seconds per call of each function, timed round-robin so drift hits all alike.

    Every function gets ``warmup`` untimed calls, then ``repeats`` (one count for all, or one
    per name) timed repeats of ``number`` back-to-back calls; ``number`` doubles from 1 until
    one repeat lasts at least ``min_repeat_s``, and that calibrating repeat counts as the
    first. Returns ``{name: (seconds per call for each repeat, number)}``.
    """
    counts = repeats if isinstance(repeats, dict) else dict.fromkeys(fns, repeats)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    results: dict[str, tuple[list[float], int]] = {}
    for name, fn in fns.items():
        number = 1
        while True:
            start = time.perf_counter()
            for _ in range(number):
                fn()
            elapsed = time.perf_counter() - start
            if elapsed >= min_repeat_s or number >= 1 << 20:
                break
            number *= 2
        results[name] = ([elapsed / number], number)
    for r in range(1, max(counts.values(), default=0)):
        for name, fn in fns.items():
            if r >= counts[name]:
                continue
            times, number = results[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - start) / number)
    return results


def time_calls(
    fn: Callable[[], object], *, warmup: int, repeats: int, min_repeat_s: float = 0.0
) -> tuple[list[float], int]:
    """Seconds per call of ``fn`` for each of ``repeats`` timed repeats, and calls per repeat
    (``time_interleaved`` with one function)."""
    return time_interleaved(
        {"fn": fn}, warmup=warmup, repeats=repeats, min_repeat_s=min_repeat_s
    )["fn"]


def summarise(times: Sequence[float], flops: float) -> dict:
    """``min_s``, ``median_s``, GFLOP/s from the minimum, and whether the repeats spread as
    contention makes them (:func:`unstable`)."""
    best = min(times)
    return {
        "min_s": best,
        "median_s": statistics.median(times),
        "gflops": flops / best / 1e9 if best > 0 else float("nan"),
        "unstable": unstable(times),
    }


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False if unable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` on Linux, else ``ru_maxrss``.

    ``ru_maxrss`` is not used on Linux: it also covers the pre-exec memory of the parent
    (the benchmark itself, far larger than a probe), and clear_refs does not reset that part.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, kB elsewhere


def probe_env(threads: int) -> dict[str, str]:
    """Environment of a probe subprocess: fixed threads, large buffers always mmapped."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))


def run_probe(cmd: list[str], threads: int, timeout: float = 600) -> dict:
    """Run a probe subprocess and return the JSON object on the last line of its stdout.

    Raises:
        RuntimeError: the subprocess failed or timed out; the message holds its stderr tail.
    """
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=probe_env(threads), timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"probe timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = proc.stderr.strip().splitlines()[-5:]
        raise RuntimeError(
            f"probe failed (exit {proc.returncode}): {' '.join(cmd)}\n" + "\n".join(tail)
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_memory_bytes() -> int:
    """Memory the system can give without swapping: ``MemAvailable`` (Linux), else total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What a result depends on: versions, CPU, cores, threads, memory."""
    import qkv

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "qkv": qkv.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # set: torch's kernels of that instruction set were forced on a CPU that has more
        "forced_capability": os.environ.get("ATEN_CPU_CAPABILITY") or None,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "available_memory_bytes": available_memory_bytes(),
    }


# Repeats whose median is this many times their minimum were disturbed: something else ran.
UNSTABLE_SPREAD = 1.5


def unstable(times: Sequence[float]) -> bool:
    """Whether repeats spread as contention makes them (median / min > UNSTABLE_SPREAD)."""
    best = min(times)
    return best > 0 and statistics.median(times) / best > UNSTABLE_SPREAD


def machine_line(info: dict | None = None) -> str:
    """One line for every printed result: CPU, instruction set, threads, torch, date (UTC)."""
    info = info or machine_info()
    return (f"{info['cpu']} ({info['cpu_capability']}), {info['threads']} of {info['cores']} "
            f"threads, torch {info['torch']}, {info['date']}")


# A busy loop that ends by itself (a safety: the context manager kills it first).
_BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def busy_core(seconds: float = 1800.0) -> Iterator[subprocess.Popen]:
    """Run one busy process (a Python loop, one core's worth) beside the body: the load of a
    browser tab, an IDE or a data loader on a two-core machine. It is killed on exit and ends
    by itself after ``seconds`` in any case."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY.format(seconds=float(seconds))],
                            stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(0.3)  # let the scheduler see it
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
