"""qkv.flex_attention against torch's flex_attention, eager and compiled, side by side.

    python benchmarks/flex.py [--T 1024 4096] [--repeats 5] [--threads 2] [--no-compile] [--load]

B=1, H=8, D=64, float32. Masks: document (8 equal documents), sliding window (256, causal),
prefix-LM (prefix T/4), soft-capping (tanh, cap 30, causal). For each, forward times of:
qkv eager (block mask from qkv.create_block_mask), torch eager flex_attention (its block mask
from torch's create_block_mask), torch.compile(flex_attention) (compile time printed apart),
and qkv with no mask at all (the "same call without a mask"); then qkv forward+backward, which
torch cannot do on CPU. Runs are interleaved (A B C A B C ...) and the minimum and median over
``--repeats`` are printed; the block masks are built once, outside the timings. ``--load``
runs one busy process beside the measurement (``benchmarks/load.py`` compares quiet and loaded
runs in one go). The first line names the CPU, its instruction set, the threads and the date;
a cell whose median is over 1.5x its minimum is marked ``!`` (another process was running).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from contextlib import nullcontext

import torch
from torch.nn.attention import flex_attention as tf

import qkv
from common import busy_core, machine_info, machine_line, unstable

CAP = 30.0


def _mods(T: int):
    docs = torch.arange(T) // (T // 8)
    window, prefix = 256, T // 4
    return {
        "document": (None, lambda b, h, q, k: docs[q] == docs[k]),
        "window256": (None, lambda b, h, q, k: (q >= k) & (q - k < window)),
        "prefix-lm": (None, lambda b, h, q, k: (k < prefix) | (q >= k)),
        "softcap": (lambda s, b, h, q, k: CAP * torch.tanh(s / CAP), lambda b, h, q, k: q >= k),
    }


def _time(fn, repeats_out: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    repeats_out.append(time.perf_counter() - t0)


def _measure(q, k, v, score, ours, theirs, compiled, repeats: int, eager: bool):
    """Interleaved timings ``{kind: [seconds]}`` and the compile time of one mod."""
    runs: dict[str, list[float]] = {"qkv": [], "none": [], "eager": [], "comp": [], "bwd": []}
    compile_s = float("nan")
    if compiled is not None:
        t0 = time.perf_counter()
        compiled(q, k, v, score, theirs)
        compile_s = time.perf_counter() - t0
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(repeats):
        _time(lambda: qkv.flex_attention(q, k, v, score, ours), runs["qkv"])
        _time(lambda: qkv.flex_attention(q, k, v, score), runs["none"])
        if eager:
            _time(lambda: tf.flex_attention(q, k, v, score, theirs), runs["eager"])
        if compiled is not None:
            _time(lambda: compiled(q, k, v, score, theirs), runs["comp"])
        _time(lambda: qkv.flex_attention(qg, kg, vg, score, ours).sum().backward(), runs["bwd"])
    return runs, compile_s


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-torch-eager", action="store_true", help="skip torch's eager flex")
    p.add_argument("--load", action="store_true", help="one busy process beside it")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    compiled = None
    if not a.no_compile:
        compiled = torch.compile(tf.flex_attention, dynamic=False)
    print(f"flex attention forward, B=1 H=8 D=64 float32; {machine_line(machine_info())}"
          f"{'; one busy process beside it' if a.load else ''}; min / median of {a.repeats} "
          "interleaved runs, ms (! = unstable: another process was running)")
    with busy_core() if a.load else nullcontext():
        _run(a, compiled)


def _run(a, compiled) -> None:
    for T in a.T:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, T, 64, generator=g) for _ in range(3))
        print(f"\nT = {T}")
        print(f"{'mod':11}{'qkv':>14}{'qkv no mask':>14}{'torch eager':>14}{'compiled':>14}"
              f"{'compile s':>11}{'x eager':>9}{'x comp.':>9}{'no-mask/qkv':>12}"
              f"{'qkv fwd+bwd':>13}")
        for name, (score, mask) in _mods(T).items():
            ours = qkv.create_block_mask(mask, None, None, T, T)
            theirs = tf.create_block_mask(mask, None, None, T, T, device="cpu")
            runs, compile_s = _measure(q, k, v, score, ours, theirs, compiled, a.repeats,
                                       not a.no_torch_eager)

            def ms(key, runs=runs):
                r = runs[key]
                return (min(r) * 1e3, statistics.median(r) * 1e3, unstable(r)) if r else (
                    float("nan"), float("nan"), False)  # fmt: skip

            ours_ms, none_ms, eager_ms, comp_ms = ms("qkv"), ms("none"), ms("eager"), ms("comp")

            def cell(lo, med, shaky):
                return f"{lo:6.0f}/{med:<6.0f}" + ("!" if shaky else " ")
            print(f"{name:11}{cell(*ours_ms):>14}{cell(*none_ms):>14}{cell(*eager_ms):>14}"
                  f"{cell(*comp_ms):>14}{compile_s:11.1f}{eager_ms[0] / ours_ms[0]:9.2f}"
                  f"{comp_ms[0] / ours_ms[0]:9.2f}{none_ms[0] / ours_ms[0]:12.2f}"
                  f"{cell(*ms('bwd')):>13}")


if __name__ == "__main__":
    main()
