"""Per-token decode time (ms/token) of qkv's cached decode step, optionally against another
checkout of qkv in the same run (``--baseline PATH/src``), alternating the two.

    python benchmarks/decode_step.py --baseline /tmp/qkv-base/src --threads 1

Measures ``session.next(tokens)`` (one cached forward step, greedy token fed back) for
SmolLM2-135M-Instruct (when its package is installed) and GPT-2-style DecoderLMs with random
weights (``gpt2-small``: d_model 256, 4 layers, 4 heads; ``gpt2-124m``: GPT-2's own sizes,
d_model 768, 12 layers, 12 heads, 50,257 tokens), batch 1, prompt 32 tokens, 64 steps; prints
the median and the minimum over ``--repeats`` runs of each checkout. ``--device cuda --modes
eager,compiled,graphs`` times a GPU's eager steps, compiled steps, and compiled steps replayed
from CUDA graphs (what ``compile=True`` does there; ``make gpu-check`` runs it); ``hf`` and
``hf-static`` time transformers' GPT-2 of the same sizes (its own random weights) beside it,
eager and through ``generate()`` on a static cache (a token's time: ``steps + 2`` new
tokens less 2, over ``steps``). ``--load`` runs one busy process beside the measurement
(:func:`qkv.bench.measure.busy_core`); ``--policies adaptive,fixed`` runs each checkout
under both thread policies (``QKV_THREADS``: fit the threads to the free cores, or
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
which, steps, device, mode = sys.argv[2], int(sys.argv[3]), sys.argv[5], sys.argv[6]
dtype = getattr(torch, sys.argv[7])
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
prompt = [list(range(5, 37))]
size = (dict(vocab_size=50257, d_model=768, num_layers=12, num_heads=12)
        if which == "gpt2-124m" else dict(vocab_size=1000, d_model=256, num_layers=4,
                                          num_heads=4))


def timed(step, warm):
    warm()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def qkv_run():
    from qkv.generate import compiled
    from qkv.generate.session import make_session
    if which == "smollm2":
        from qkv.pretrained import load
        model = load("SmolLM2-135M-Instruct").model
    else:
        from qkv.models import DecoderLM, DecoderLMConfig
        torch.manual_seed(0)
        model = DecoderLM(DecoderLMConfig.gpt2_style(max_len=512, **size))
    model = model.to(device, dtype).eval()
    compiled.CUDA_GRAPHS = mode == "graphs"
    s = (make_session(model, prompt, steps + 1, pad_id=None, bos_id=None) if mode == "eager"
         else compiled.open_session(model, prompt, steps + 1, pad_id=None, bos_id=None,
                                    compile=True))
    box = [s.first()]
    step = lambda: box.append(s.next(box.pop().argmax(-1)))
    return timed(step, step)  # (a compiled session's first step compiles)


def hf_run():
    # transformers' GPT-2 of the same sizes (its own random weights): the peer's speed.
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=size["num_layers"], n_embd=size["d_model"],
                                     n_head=size["num_heads"], vocab_size=size["vocab_size"],
                                     n_positions=512)
    model = transformers.GPT2LMHeadModel(config).to(device, dtype).eval()
    ids = torch.tensor(prompt, device=device)
    if mode == "hf-static":  # generate() on a static cache (compiled by transformers on a GPU)
        def gen(n):
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=0)
            sync()
            return time.perf_counter() - t0
        gen(steps + 2)
        return (gen(steps + 2) - gen(2)) / steps * 1e3
    out = model(ids, use_cache=True)
    state = [out.past_key_values, out.logits[:, -1:].argmax(-1)]
    def step():
        o = model(state[1], past_key_values=state[0], use_cache=True)
        state[:] = [o.past_key_values, o.logits[:, -1:].argmax(-1)]
    return timed(step, step)


with torch.inference_mode():
    run = hf_run if mode.startswith("hf") else qkv_run
    print(json.dumps(min(run() for _ in range(2))))  # the first compiles: the min is the second
"""


def run(src: str, which: str, threads: int, steps: int, policy: str = "adaptive",
        device: str = "cpu", mode: str = "eager", dtype: str = "float32") -> float:
    """ms a token of one child run, or NaN (and the child's last error line printed) where
    it failed: a peer this transformers cannot run leaves the other rows standing."""
    env = dict(os.environ, PYTHONPATH=src, QKV_THREADS=policy)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), which, str(steps), "", device, mode, dtype],
        env=env, capture_output=True, text=True,
    )
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  ({which} {mode} failed: {last[:300]})", flush=True)
        return float("nan")
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU)")
    parser.add_argument("--modes", default="eager",
                        help="eager, compiled (torch.compile, no CUDA graphs), graphs "
                             "(compile=True as qkv runs it: CUDA graphs on a GPU); hf, "
                             "hf-static: transformers' GPT-2 of the same sizes, eager on a "
                             "dynamic cache, and generate() on a static cache")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    unknown = set(args.modes.split(",")) - {"eager", "compiled", "graphs", "hf", "hf-static"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; eager, compiled, graphs, hf, "
                     "hf-static")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    checkouts = {"this": os.path.abspath(here)}
    if args.baseline:
        checkouts["baseline"] = os.path.abspath(args.baseline)
    info = {**machine_info(), "threads": args.threads}
    gpu = ""
    if args.device.startswith("cuda"):
        import torch

        gpu = f"{torch.cuda.get_device_name()}, "
    print(f"decode step, batch 1, prompt 32, {args.steps} steps, {args.dtype}"
          f"{', one busy process beside it' if args.load else ''}; {gpu}{machine_line(info)}")
    with busy_core() if args.load else nullcontext():
        rows = _measure(args, checkouts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)


def _measure(args, checkouts: dict[str, str]) -> list[dict]:
    rows = []
    runs = [(name, src, policy, mode) for name, src in checkouts.items()
            for policy in args.policies.split(",") for mode in args.modes.split(",")]
    for which in args.models.split(","):
        results: dict[tuple, list[float]] = {(n, p, m): [] for n, _, p, m in runs}
        for _ in range(args.repeats):
            for name, src, policy, mode in runs:  # alternate, so drift hits all alike
                ms = run(src, which, args.threads, args.steps, policy, args.device, mode,
                         args.dtype)
                results[name, policy, mode].append(ms)
                print(f"  ({which} {name} {policy} {mode}: {ms:.3f} ms/token)", flush=True)
        for (name, policy, mode), ms in results.items():
            print(f"  {which:12s} {name:9s} {policy:9s} {mode:8s} ms/token median "
                  f"{statistics.median(ms):7.2f}  min {min(ms):7.2f}  "
                  f"({', '.join(f'{m:.2f}' for m in ms)})", flush=True)
            rows.append({"model": which, "checkout": name, "policy": policy, "mode": mode,
                         "device": args.device, "dtype": args.dtype, "load": args.load,
                         "median_ms": statistics.median(ms), "min_ms": min(ms), "runs": ms})
    return rows


if __name__ == "__main__":
    main()
