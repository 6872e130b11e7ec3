"""How long the ``qkv`` command takes to answer before doing any work: ``--help``, a
command's ``--help`` and an argument error, against ``python -c "import torch"`` (the floor:
every command needs torch) in the same run. Issue 27's target: ``qkv --help`` at most 0.5 s
above importing torch. Prints the median of ``--repeats`` fresh processes each, the CPU and
the thread count, and whether torch's compiler stack (``torch._dynamo``) was imported.

    python benchmarks/import_time.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.bench.measure import machine_line  # noqa: E402

QKV = [sys.executable, "-m", "qkv"]
CASES = {
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    'python -c "import qkv"': [sys.executable, "-c", "import qkv"],
    "qkv --help": [*QKV, "--help"],
    "qkv train --help": [*QKV, "train", "--help"],
    "qkv generate --help": [*QKV, "generate", "--help"],
    "qkv trian (a typo)": [*QKV, "trian"],
    "qkv train --steps x": [*QKV, "train", "copy", "--steps", "x"],
}
DYNAMO = ("import sys, runpy; sys.argv = ['qkv', '--help']\ntry:\n    runpy.run_module('qkv', "
          "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('torch._dynamo' in "
          "sys.modules, file=sys.stderr)")


def wall(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "100"}
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(machine_line())
    for cmd in CASES.values():  # warm the file cache
        wall(cmd)
    medians = {}
    for name, cmd in CASES.items():
        times = [wall(cmd) for _ in range(args.repeats)]
        medians[name] = statistics.median(times)
        print(f"  {name:28s} {medians[name]:6.2f} s  (min {min(times):.2f})")
    floor = medians['python -c "import torch"']
    extra = medians["qkv --help"] - floor
    print(f"qkv --help costs {extra:+.2f} s over importing torch (target: at most +0.50): "
          f"{'met' if extra <= 0.5 else 'NOT met'}")
    done = subprocess.run([sys.executable, "-c", DYNAMO], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=False)
    print(f"torch._dynamo imported by qkv --help: {done.stderr.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
