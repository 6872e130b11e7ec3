"""Per-token decode time (ms/token) of qkv's cached decode step, optionally against another
checkout of qkv in the same run (``--baseline PATH/src``), alternating the two.

    python benchmarks/decode_step.py --baseline /tmp/qkv-base/src --threads 1

Measures ``session.next(tokens)`` (one cached forward step, greedy token fed back) for
SmolLM2-135M-Instruct (when its package is installed) and a GPT-2-style DecoderLM (d_model 256,
4 layers, 4 heads, random weights), batch 1, prompt 32 tokens, 64 steps; prints the median and
the minimum over ``--repeats`` runs of each checkout. ``--load`` runs one busy process beside
the measurement (:func:`qkv.bench.measure.busy_core`); ``--policies adaptive,fixed`` runs each
checkout under both thread policies (``QKV_THREADS``: fit the threads to the free cores, or
keep torch's setting); ``--out FILE`` writes the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from contextlib import nullcontext

from common import busy_core, machine_info, machine_line

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
which, steps = sys.argv[2], int(sys.argv[3])
import qkv
from qkv.generate.session import make_session
if which == "smollm2":
    from qkv.pretrained import load
    model = load("SmolLM2-135M-Instruct").model
    V = model.config.vocab_size
else:
    from qkv.models import DecoderLM, DecoderLMConfig
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt2_style(vocab_size=1000, d_model=256, num_layers=4,
                                                 num_heads=4, max_len=512))
    V = 1000
model.eval()
prompt = [list(range(5, 37))]
times = []
with torch.no_grad():
    for _ in range(2):
        s = make_session(model, prompt, steps + 1, pad_id=None, bos_id=None)
        logits = s.first()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = s.next(logits.argmax(-1))
        times.append((time.perf_counter() - t0) / steps * 1e3)
print(json.dumps(min(times)))
"""


def run(src: str, which: str, threads: int, steps: int, policy: str = "adaptive") -> float:
    env = dict(os.environ, PYTHONPATH=src, QKV_THREADS=policy)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), which, str(steps)],
        env=env, capture_output=True, text=True, check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="src/ folder of another qkv checkout to compare")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="gpt2-small,smollm2")
    parser.add_argument("--load", action="store_true", help="one busy process beside it")
    parser.add_argument("--policies", default="adaptive", help="QKV_THREADS values to run")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    checkouts = {"this": os.path.abspath(here)}
    if args.baseline:
        checkouts["baseline"] = os.path.abspath(args.baseline)
    info = {**machine_info(), "threads": args.threads}
    print(f"decode step, batch 1, prompt 32, {args.steps} steps"
          f"{', one busy process beside it' if args.load else ''}; {machine_line(info)}")
    with busy_core() if args.load else nullcontext():
        rows = _measure(args, checkouts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)


def _measure(args, checkouts: dict[str, str]) -> list[dict]:
    rows = []
    runs = [(name, src, policy) for name, src in checkouts.items()
            for policy in args.policies.split(",")]
    for which in args.models.split(","):
        results: dict[tuple, list[float]] = {(n, p): [] for n, _, p in runs}
        for _ in range(args.repeats):
            for name, src, policy in runs:  # alternate, so drift hits all alike
                results[name, policy].append(run(src, which, args.threads, args.steps, policy))
        for (name, policy), ms in results.items():
            print(f"  {which:12s} {name:9s} {policy:9s} ms/token median "
                  f"{statistics.median(ms):7.2f}  min {min(ms):7.2f}  "
                  f"({', '.join(f'{m:.2f}' for m in ms)})", flush=True)
            rows.append({"model": which, "checkout": name, "policy": policy, "load": args.load,
                         "median_ms": statistics.median(ms), "min_ms": min(ms), "runs": ms})
    return rows


if __name__ == "__main__":
    main()
