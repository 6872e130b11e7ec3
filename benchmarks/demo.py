"""What ``qkv demo`` gives on this machine: its held-out exact match, and how long it takes.

    python benchmarks/demo.py [--threads 1 2] [--load] [--out FILE.json]

Runs the full demo (``qkv demo --out TMP --threads N``) once per thread count, in a subprocess,
and reads what it wrote: the test exact match (``qkv eval``'s figure, from the run's own
metrics), the steps and the training seconds; the checkpoint's SHA-256 says whether two runs
trained the same weights bit for bit. ``--load`` runs each again with one busy process beside
it. The demo
trains a fixed budget of steps, so the exact match may not move with the machine or its load;
only the seconds do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from common import busy_core, machine_info, machine_line


def run_demo(threads: int) -> dict:
    """One full demo in a subprocess: ``{"threads", "exact_match", "steps", "train_s",
    "total_s", "sha256"}``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "qkv", "demo", "--out", str(out), "--threads", str(threads)],
            capture_output=True, text=True, timeout=3600, env={**os.environ, "COLUMNS": "200"})
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"qkv demo failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        text = proc.stdout
        em = re.search(r"test exact match: ([\d.]+)% \(([\d,]+) of ([\d,]+)", text)
        trained = re.search(r"trained ([\d,]+) steps in ([\d.]+) s", text)
        weights = (out / "best" / "model.safetensors").read_bytes()
        return {"threads": threads, "exact_match": float(em.group(1)) / 100,
                "right": int(em.group(2).replace(",", "")),
                "of": int(em.group(3).replace(",", "")),
                "steps": int(trained.group(1).replace(",", "")),
                "train_s": float(trained.group(2)), "total_s": total,
                "sha256": hashlib.sha256(weights).hexdigest()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--load", action="store_true", help="again with one busy process beside it")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    info = machine_info()
    print(f"qkv demo, full recipe; "
          f"{machine_line({**info, 'threads': ', '.join(map(str, a.threads))})}")
    rows = []
    for load in (False, True) if a.load else (False,):
        with busy_core() if load else nullcontext():
            for n in a.threads:
                r = run_demo(n)
                rows.append({**r, "load": load})
                print(f"  {n} thread(s), {'one busy process beside it' if load else 'quiet'}: "
                      f"test exact match {r['exact_match']:.1%} ({r['right']:,} of {r['of']:,}),"
                      f" {r['steps']:,} steps, training {r['train_s']:.1f} s, "
                      f"{r['total_s']:.0f} s in all, weights {r['sha256'][:12]}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": info, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
