"""Context-parallel attention against one process: time and per-rank peak memory; DDP tokens/s.

    python benchmarks/distributed.py [--T 16384] [--worlds 2,4] [--repeats 3] [--skip-train]

Part 1 runs attention forward + backward on ``(B, H, T, D)`` float32 inputs, causal:
  * one process, ``qkv.scaled_dot_product_attention`` (``auto``: the fastest exact kernel),
    with as many threads as the first world size;
  * ``N`` gloo processes of one thread each for each ``N`` in ``--worlds``,
    ``ring_attention`` and ``all_to_all_attention`` on the sequence shards.
Each measurement runs in fresh processes: inputs are built, one warm-up call runs on tiny
inputs, the peak-RSS mark is reset (``/proc/self/clear_refs``), then the timed call runs; peak
memory is the growth of ``VmHWM`` over the RSS after inputs were built (the method of
``qkv.bench.memprobe``), per process. Runs are interleaved (one, ring, all-to-all, one, ...)
and the minimum and median over ``--repeats`` are printed.

Large allocations are always mmapped in the measured processes (``MALLOC_MMAP_THRESHOLD_``),
so memory freed returns to the system and RSS counts what is held.

Part 2 runs ``benchmarks/distributed_train.py`` (DDP tokens/s on 1 and 2 processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv.bench.measure import peak_rss_bytes, reset_peak_rss
from qkv.distributed import all_to_all_attention, ring_attention, shard_sequence

KERNELS = {"ring": ring_attention, "all_to_all": all_to_all_attention}


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _inputs(B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    return q, k, v, do


def _one_process(spec: dict, out: str) -> None:
    torch.set_num_threads(spec["threads"])
    B, H, T, D = spec["B"], spec["H"], spec["T"], spec["D"]
    small = [t.requires_grad_() for t in _inputs(1, H, 64, D)[:3]]
    qkv.scaled_dot_product_attention(*small, is_causal=True).sum().backward()
    before = _rss()
    q, k, v, do = _inputs(B, H, T, D)
    for t in (q, k, v):
        t.requires_grad_()
    base = _rss()
    reset_peak_rss()
    t0 = time.perf_counter()
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    Path(out).write_text(json.dumps({"s": seconds, "peak": peak - base, "total": peak - before}))


def _rank(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    fn = KERNELS[spec["method"]]
    B, H, T, D = spec["B"], spec["H"], spec["T"], spec["D"]
    small = [shard_sequence(t, 2).requires_grad_() for t in _inputs(1, H, 64, D)[:3]]
    fn(*small, is_causal=True).sum().backward()
    dist.barrier()
    before = _rss()
    full = _inputs(B, H, T, D)
    # Each rank keeps only its shards (as a job that loads its part of the data would).
    q, k, v, do = (shard_sequence(t, 2).clone() for t in full)
    del full
    for t in (q, k, v):
        t.requires_grad_()
    base = _rss()
    dist.barrier()
    reset_peak_rss()
    t0 = time.perf_counter()
    fn(q, k, v, is_causal=True, seq_len=T).backward(do)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    Path(f"{out}.{rank}").write_text(
        json.dumps({"s": seconds, "peak": peak - base, "total": peak - before})
    )
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, spec: dict, world: int) -> dict:
    """``{"s": seconds, "peak": bytes}``: for context parallelism the slowest rank's time and
    the largest rank's peak."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        if kind == "one":
            ctx = mp.get_context("spawn")
            p = ctx.Process(target=_one_process, args=({**spec, "threads": world}, out))
            p.start()
            p.join()
            return json.loads(Path(out).read_text())
        mp.spawn(_rank, args=(world, _free_port(), {**spec, "method": kind}, out), nprocs=world)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
        return {key: max(r[key] for r in ranks) for key in ("s", "peak", "total")}


def main(argv=None) -> None:
    # Large blocks always mmapped: freed memory leaves the resident set at once, so RSS peaks
    # count what a call holds (glibc's dynamic threshold would otherwise recycle the freed
    # full-sequence inputs on the heap). Read by every spawned process at start-up.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--worlds", default="2", help="comma-separated rank counts, e.g. 2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-train", action="store_true")
    a = p.parse_args(argv)
    spec = dict(B=a.B, H=a.H, T=a.T, D=a.D)
    worlds = [int(w) for w in a.worlds.split(",")]
    threads = worlds[0]
    kinds = [("one process", "one", threads)] + [
        (f"{kind} x{w} /rank", kind, w) for w in worlds for kind in ("ring", "all_to_all")
    ]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in kinds}
    for _ in range(a.repeats):  # interleaved: one, ring, all-to-all, one, ...
        for label, kind, w in kinds:
            runs[label].append(measure(kind, spec, w))
    print(f"attention forward+backward, causal, float32, B={a.B} H={a.H} T={a.T} D={a.D}; "
          f"one process with {threads} threads vs N gloo ranks x 1 thread "
          f"(torch {torch.__version__}, {os.cpu_count()} CPUs: times with N > CPUs share cores)")
    print("peak: growth during the call over the inputs; total: also the inputs (what has to "
          "fit)")
    print(f"{'':22}{'min s':>8}{'median s':>10}{'peak MiB':>10}{'x one':>7}"
          f"{'total MiB':>11}{'x one':>7}")
    one = runs["one process"]
    one_peak, one_total = min(r["peak"] for r in one), min(r["total"] for r in one)
    for label, _, _ in kinds:
        times = [r["s"] for r in runs[label]]
        peak, total = min(r["peak"] for r in runs[label]), min(r["total"] for r in runs[label])
        print(f"{label:22}{min(times):8.2f}{statistics.median(times):10.2f}"
              f"{peak / 2**20:10.1f}{peak / one_peak:7.2f}{total / 2**20:11.1f}"
              f"{total / one_total:7.2f}")
    if not a.skip_train:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import distributed_train

        print()
        distributed_train.main([])


if __name__ == "__main__":
    main()
