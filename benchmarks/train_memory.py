"""Measure the memory levers of training: activation checkpointing and bfloat16 autocast.

Usage::

    .venv/bin/python benchmarks/train_memory.py           # the full config (~5-8 min on 2 cores)
    .venv/bin/python benchmarks/train_memory.py --quick   # tiny sizes: checks the script

One training config (a :class:`~qkv.models.DecoderLM`, byte tokens of this repository's
README, :func:`qkv.train.train_lm`, dropout 0.1) in four modes: float32, float32 with
``checkpoint_activations``, ``bf16`` autocast, and both. Each mode runs in a fresh subprocess
(large buffers mmapped, so freed memory leaves the resident set) and reports:

* **peak MiB**: the peak resident set during the steps after the first, above the resident
  set at the end of the first step: the activations that backward keeps, the gradients
  (freed after each step: ``zero_grad(set_to_none=True)``) and temporaries. The first step
  is left out because it also loads what stays (the AdamW moments, lazily imported modules,
  the kernels' first-call caches: ``kept_after_step1_bytes`` in the JSON);
* **s/step**: the median of the steps after the first (warm-up: the optimizer's state, the
  kernels' first calls);
* **loss**: the training loss of the last step (float32 with and without checkpointing must
  agree to the last digit).

The modes run twice: with the CPU's default kernels, then with torch, MKL and oneDNN held to
AVX2 (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``, as
``make test-avx2`` does): how a CPU without AVX-512 (and without native bfloat16) runs. The
table gives each pass's CPU capability, whether oneDNN has bfloat16 kernels there, the CPU's
model name (``lscpu``) and the torch thread count, and each mode's ratios against float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(d_model=256, num_layers=6, num_heads=4, block_size=512, batch_size=4, steps=4)
QUICK = dict(d_model=32, num_layers=2, num_heads=2, block_size=64, batch_size=2, steps=3)
MODES = {  # name -> TrainConfig fields
    "fp32": dict(bf16=False, checkpoint_activations=False),
    "fp32 + ckpt": dict(bf16=False, checkpoint_activations=True),
    "bf16": dict(bf16=True, checkpoint_activations=False),
    "bf16 + ckpt": dict(bf16=True, checkpoint_activations=True),
}
PASSES = {  # name -> environment of the subprocesses
    "default": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
}  # fmt: skip


def _rss_bytes() -> int:
    """This process's resident set now (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def probe(mode: str, sizes: dict) -> dict:
    """Train one mode in this (fresh) process; its record (see the module docstring)."""
    import gc

    import torch

    from common import peak_rss_bytes, reset_peak_rss
    from qkv.data import ByteTokenizer
    from qkv.models import DecoderLM, DecoderLMConfig
    from qkv.train import TrainConfig, seed_everything, train_lm
    from qkv.train.memory import native_bf16

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    ids = ByteTokenizer().encode(text * 4)
    seed_everything(0)
    model = DecoderLM(DecoderLMConfig(256, d_model=sizes["d_model"], num_layers=sizes["num_layers"],
                                      num_heads=sizes["num_heads"], max_len=sizes["block_size"],
                                      dropout=0.1))  # fmt: skip
    config = TrainConfig(steps=sizes["steps"], batch_size=sizes["batch_size"],
                         block_size=sizes["block_size"], lr=1e-3, schedule="constant", warmup=1,
                         progress=False, plot=False, **MODES[mode])  # fmt: skip
    stamps: list[float] = []  # the end of each step (after step 1: after the reset below)
    rss: list[int] = []  # before the first step, after it

    def on_step(event: dict) -> None:
        if event["step"] == 1:  # warm-up done: measure the steady steps from here
            gc.collect()
            rss.append(_rss_bytes())
            if not reset_peak_rss():
                raise OSError("cannot reset the peak-RSS mark (/proc/self/clear_refs)")
        stamps.append(time.perf_counter())

    gc.collect()
    reset_peak_rss()
    rss.append(_rss_bytes())
    start = time.perf_counter()
    result = train_lm(model, ids, config, callbacks=[on_step])
    peak = peak_rss_bytes() - rss[1]
    steps = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    return {
        "mode": mode,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
        "threads": torch.get_num_threads(),
        "peak_bytes": peak,
        "kept_after_step1_bytes": rss[1] - rss[0],
        "step_s": statistics.median(steps[1:]),
        "first_step_s": steps[0],
        "loss": result.history[-1]["loss"],
        "params": model.num_parameters(),
    }


def run_mode(mode: str, pass_env: dict, quick: bool, threads: int) -> dict:
    """:func:`probe` in a fresh subprocess with ``pass_env`` on top of the probe environment."""
    from common import probe_env

    cmd = [sys.executable, __file__, "--probe", mode, *(["--quick"] if quick else [])]
    env = {**probe_env(threads), **pass_env}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    """``lscpu``'s model name (the CPU's own word for itself)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def table(records: dict[str, list[dict]], sizes: dict) -> str:
    """The results as one plain-text table (printed, and pasted in the docs)."""
    first = next(iter(records.values()))[0]
    head = (f"DecoderLM d_model {sizes['d_model']}, {sizes['num_layers']} layers, "
            f"{sizes['num_heads']} heads, block_size {sizes['block_size']}, batch "
            f"{sizes['batch_size']}, {first['params']:,} parameters, {sizes['steps']} steps; "
            f"CPU: {cpu_model()}, torch threads {first['threads']}, load average "
            f"{os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    lines = [head, f"{'pass':<8} {'capability':<10} {'oneDNN bf16':<11} {'mode':<12} "
             f"{'peak MiB':>9} {'x fp32':>7} {'s/step':>7} {'x fp32':>7} {'loss':>8}"]  # fmt: skip
    for name, recs in records.items():
        fp32 = recs[0]
        for r in recs:
            lines.append(
                f"{name:<8} {r['capability']:<10} {'yes' if r['native_bf16'] else 'no':<11} "
                f"{r['mode']:<12} {r['peak_bytes'] / 2**20:>9.0f} "
                f"{r['peak_bytes'] / fp32['peak_bytes']:>7.2f} {r['step_s']:>7.2f} "
                f"{r['step_s'] / fp32['step_s']:>7.2f} {r['loss']:>8.4f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--probe", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.probe:
        print(json.dumps(probe(args.probe, sizes)))
        return
    import torch

    threads = torch.get_num_threads()
    records: dict[str, list[dict]] = {}
    for name, env in PASSES.items():
        records[name] = []
        for mode in MODES:
            record = run_mode(mode, env, args.quick, threads)
            print(f"{name:<8} {mode:<12} {record['step_s']:.2f} s/step, "
                  f"{record['peak_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
            records[name].append(record)
    print(table(records, sizes))
    out = ROOT / "benchmarks" / "results" / f"train_memory{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps({"sizes": sizes, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
