"""Benchmark scaled dot-product attention: qkv ``auto``, qkv ``math`` and torch's kernel.

Usage::

    .venv/bin/python benchmarks/attention.py            # B=1, H=8, D=64, T=S in 256, 1024, 4096
    .venv/bin/python benchmarks/attention.py --quick    # tiny sizes, a few seconds of timing

For each length and backend, in one run and interleaved so that drift hits all alike:

* **time** of the forward pass (under ``torch.no_grad``, i.e. inference) and of forward +
  backward (inputs require grad, ``out.backward(dout)``): ``--warmup`` untimed calls, then
  ``--repeats`` timed ones; min and median are reported.
* **GFLOP/s** from the min time (the least disturbed run on a shared machine): forward
  counts ``4·B·H·T·S·D`` flops (two matmuls of ``2·T·S·D`` each), backward ``2.5×`` that, so
  forward + backward is ``3.5×``. The auto/torch ratios are given for min and median.
* **peak extra memory**: each configuration runs once more in a fresh subprocess (the method
  is in ``benchmarks/common.py``): the peak-RSS delta over one call, inputs not counted, i.e.
  the output and, in forward + backward, the saved tensors and the three input gradients.

The thread count is fixed (``--threads``, default torch's choice) and printed. Results go to a
rich table and to JSON (``benchmarks/results/attention.json``; ``--quick`` writes
``attention-quick.json`` so it never overwrites a full run).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import qkv
from common import (
    MEMORY_METHOD,
    peak_rss_bytes,
    reset_peak_rss,
    run_probe,
    summarise,
    time_calls,
)

B, H, D = 1, 8, 64
DTYPE = torch.float32
FULL_LENGTHS = (256, 1024, 4096)
QUICK_LENGTHS = (64, 128)
RESULTS = Path(__file__).resolve().parent / "results"
BACKWARD_FACTOR = 2.5  # backward flops per forward flop (two matmuls become five)

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS: dict[str, Attention] = {
    "qkv auto": lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v),
    "qkv math": lambda q, k, v: qkv.scaled_dot_product_attention(q, k, v, backend="math"),
    "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
}


def make_inputs(T: int, S: int, requires_grad: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q (B, H, T, D)``, ``k, v (B, H, S, D)`` and ``dout (B, H, T, D)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, dtype=DTYPE)  # (B, H, T, D)
    k = torch.randn(B, H, S, D, generator=gen, dtype=DTYPE)  # (B, H, S, D)
    v = torch.randn(B, H, S, D, generator=gen, dtype=DTYPE)  # (B, H, S, D)
    dout = torch.randn(B, H, T, D, generator=gen, dtype=DTYPE)  # (B, H, T, D)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, dout


def run_once(fn: Attention, q, k, v, dout, backward: bool) -> None:
    """One forward (inference) or one forward + backward, gradients cleared first."""
    if not backward:
        with torch.no_grad():
            fn(q, k, v)
        return
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(dout)


def _times(fn: Attention, inputs, backward: bool, warmup: int, repeats: int) -> list[float]:
    """Seconds per call for ``repeats`` calls after ``warmup`` untimed ones."""
    times, _ = time_calls(
        lambda: run_once(fn, *inputs, backward=backward), warmup=warmup, repeats=repeats
    )
    return times


def probe_memory(backend: str, T: int, mode: str) -> dict:
    """Runs inside the fresh subprocess: peak extra bytes of one call of ``backend``."""
    fn, backward = BACKENDS[backend], mode == "fwd_bwd"
    run_once(fn, *make_inputs(16, 16, backward), backward=backward)  # lazy init, thread pool
    inputs = make_inputs(T, T, backward)
    reset = reset_peak_rss()
    before = peak_rss_bytes()
    run_once(fn, *inputs, backward=backward)
    return {"peak_extra_bytes": peak_rss_bytes() - before, "peak_reset": reset}


def measure_memory(backend: str, T: int, mode: str, threads: int) -> int | None:
    """Peak extra bytes of one configuration, measured in a fresh subprocess."""
    cmd = [sys.executable, __file__, "--probe", backend, str(T), mode, "--threads", str(threads)]
    try:
        return run_probe(cmd, threads)["peak_extra_bytes"]
    except RuntimeError as err:
        print(f"memory probe failed for {backend} T={T} {mode}: {err}", file=sys.stderr)
        return None


def benchmark(lengths, warmup: int, repeats: int, threads: int, memory: bool) -> list[dict]:
    """Time every backend at every length (and probe its memory); one record per pair."""
    records = []
    for T in lengths:
        S = T
        fwd_flops = 4 * B * H * T * S * D
        inference = make_inputs(T, S, requires_grad=False)
        training = make_inputs(T, S, requires_grad=True)
        with torch.no_grad():
            expected = BACKENDS["torch sdpa"](*inference[:3])  # (B, H, T, D)
        for name, fn in BACKENDS.items():
            with torch.no_grad():
                err = float((fn(*inference[:3]) - expected).abs().max())
            record = {
                "T": T, "S": S, "backend": name, "max_abs_diff_vs_torch": err,
                "fwd": summarise(_times(fn, inference, False, warmup, repeats), fwd_flops),
                "fwd_bwd": summarise(
                    _times(fn, training, True, warmup, repeats),
                    fwd_flops * (1 + BACKWARD_FACTOR),
                ),
            }
            if memory:
                record["peak_extra_bytes"] = {
                    mode: measure_memory(name, T, mode, threads) for mode in ("fwd", "fwd_bwd")
                }
            records.append(record)
    return records


def ratios(records: list[dict]) -> list[dict]:
    """Time of qkv ``auto`` over torch's, per length and pass (1.0 = no dispatch overhead)."""
    by = {(r["T"], r["backend"]): r for r in records}
    out = []
    for T in sorted({r["T"] for r in records}):
        auto, ref = by[(T, "qkv auto")], by[(T, "torch sdpa")]
        row: dict = {"T": T}
        for mode in ("fwd", "fwd_bwd"):
            for stat in ("min_s", "median_s"):
                row[f"{mode}_{stat[:-2]}"] = auto[mode][stat] / ref[mode][stat]
        out.append(row)
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def print_report(console: Console, config: dict, records: list[dict], rat: list[dict]) -> None:
    console.print(
        f"B={B}, H={H}, D={D}, {config['dtype']}, threads={config['threads']}, "
        f"warmup={config['warmup']}, repeats={config['repeats']}, torch {config['torch']}"
    )
    table = Table(title="attention: time (ms), GFLOP/s (from the min), peak extra MiB")
    for col in ("T=S", "backend", "fwd min", "fwd med", "fwd GF/s",
                "f+b min", "f+b med", "f+b GF/s", "mem fwd", "mem f+b", "|Δ| vs torch"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for r in records:
        mem = r.get("peak_extra_bytes", {})
        table.add_row(
            str(r["T"]), r["backend"],
            f"{r['fwd']['min_s'] * 1e3:.2f}", f"{r['fwd']['median_s'] * 1e3:.2f}",
            f"{r['fwd']['gflops']:.1f}",
            f"{r['fwd_bwd']['min_s'] * 1e3:.2f}", f"{r['fwd_bwd']['median_s'] * 1e3:.2f}",
            f"{r['fwd_bwd']['gflops']:.1f}",
            _mib(mem.get("fwd")), _mib(mem.get("fwd_bwd")),
            f"{r['max_abs_diff_vs_torch']:.1e}",
        )
    console.print(table)
    console.print(
        f"flops: forward 4·B·H·T·S·D, backward {BACKWARD_FACTOR}× forward "
        f"(forward + backward {1 + BACKWARD_FACTOR}×). Memory: {config['memory_method']}"
    )
    ratio = Table("T=S", "fwd (min)", "fwd (median)", "fwd+bwd (min)", "fwd+bwd (median)",
                  title="time of qkv auto / torch sdpa (1.00 = same speed)")
    for r in rat:
        ratio.add_row(str(r["T"]), *(f"{r[f'{m}_{s}']:.2f}" for m in ("fwd", "fwd_bwd")
                                     for s in ("min", "median")))
    console.print(ratio)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's choice, %(default)s here)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (2; quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (7; quick 3)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory probes")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    parser.add_argument("--probe", nargs=3, metavar=("BACKEND", "T", "MODE"),
                        help=argparse.SUPPRESS)  # internal: one memory probe subprocess
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.probe:
        backend, T, mode = args.probe
        print(json.dumps(probe_memory(backend, int(T), mode)))
        return

    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if warmup < 0 or repeats < 1:
        parser.error(f"need --warmup >= 0 and --repeats >= 1, got {warmup} and {repeats}")
    lengths = QUICK_LENGTHS if args.quick else FULL_LENGTHS
    out = args.out or RESULTS / ("attention-quick.json" if args.quick else "attention.json")
    config = {
        "B": B, "H": H, "D": D, "dtype": str(DTYPE).removeprefix("torch."),
        "lengths": list(lengths), "threads": torch.get_num_threads(), "warmup": warmup,
        "repeats": repeats, "torch": torch.__version__, "qkv": qkv.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "flops": f"forward 4*B*H*T*S*D; backward {BACKWARD_FACTOR}x forward",
        "memory_method": MEMORY_METHOD,
    }
    records = benchmark(lengths, warmup, repeats, args.threads, memory=not args.no_memory)
    rat = ratios(records)
    console = Console(width=max(Console().width, 140))
    print_report(console, config, records, rat)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": records, "ratios": rat}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
