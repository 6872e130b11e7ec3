"""Load ``qkv serve`` with concurrent clients: SmolLM2-135M-Instruct behind the OpenAI API on
127.0.0.1, in this process, asked by 1, 4 and 16 clients at once against the same requests one
at a time.

Usage::

    .venv/bin/python benchmarks/serve.py            # about 3 minutes on 2 CPU threads
    .venv/bin/python benchmarks/serve.py --quick    # short answers: checks the script

1. The app of ``qkv serve`` (:func:`qkv.serve.app.make_app`, the continuous-batching
   engine, ``--max-batch 16``) runs under uvicorn on a free port of 127.0.0.1.
2. **Sequential**: 16 chat requests (prompts that ask for long answers; greedy; fixed seeds;
   64 to 128 new tokens each, EOS may end one earlier: the tokens counted are the ones the
   server reports) are sent one at a time. Their texts are each request's output alone.
3. **Concurrent**: the first 1, 4 and 16 of the same requests are sent at once, one thread
   each (OpenAI's client, streaming). Every text must equal its sequential one.
4. **A full pool**: a second server whose KV-cache pool (``--num-blocks``) holds exactly 16 of
   the requests, its batch room for more, gets 17 at once: the 17th waits for blocks and is
   served (its time to first token shows the wait), none is refused.

Reported per run: generated tokens per second of wall time, time to first token (p50) and
latency (p50, p99: nearest rank) over its requests, and throughput over the sequential
throughput on the same requests. Results go to ``benchmarks/results/serve.json`` (``--quick``:
``serve-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
import torch
import uvicorn

import qkv.pretrained
from common import machine_info, machine_line
from qkv.generate.batching import BatchingEngine
from qkv.serve.app import make_app

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["a lighthouse keeper", "the water cycle", "a robot learning to paint", "how bread is "
          "made", "the history of the bicycle", "a dragon who is afraid of fire", "how "
          "volcanoes form", "a day at a busy train station", "the life of a honeybee", "how a "
          "compiler works", "a journey across the desert", "why the sky is blue", "a city under "
          "the sea", "how vaccines work", "a chess match between friends", "the first winter "
          "on Mars"]  # fmt: skip
LENGTHS = (64, 80, 96, 128)  # new tokens asked, cycled over the requests
TIMEOUT = 300  # seconds any one request may take


@dataclass
class Answer:
    text: str
    tokens: int
    first_s: float  # time to the first piece of text
    total_s: float  # time to the end


def start_server(bundle, *, max_batch: int, num_blocks: int | None = None):
    """The app on a free port of 127.0.0.1 in a thread; returns (url, engine, stop)."""
    engine = BatchingEngine(bundle.model, eos_id=bundle.eos_id, max_batch=max_batch,
                            num_blocks=num_blocks, tokenizer=bundle.tokenizer)  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(bundle, engine), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(60)

    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", engine, stop


def ask(client: openai.OpenAI, job: tuple[str, int, int]) -> Answer:
    """One streamed chat request: its text, token count and times."""
    prompt, max_tokens, seed = job
    start, first, pieces, tokens = time.perf_counter(), None, [], 0
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, seed=seed, stream=True, stream_options={"include_usage": True},
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return Answer("".join(pieces), tokens, (first or end) - start, end - start)


def at_once(client: openai.OpenAI, jobs: list) -> tuple[list[Answer], float]:
    """All ``jobs`` at once, one thread each; the answers and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(client, job), jobs, timeout=TIMEOUT))
    return answers, time.perf_counter() - start


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def row(label: str, answers: list[Answer], wall: float, baseline: float | None) -> dict:
    tokens = sum(a.tokens for a in answers)
    rate = tokens / wall
    return {"run": label, "requests": len(answers), "tokens": tokens, "tokens_per_s": rate,
            "ttft_p50_s": nearest_rank([a.first_s for a in answers], 0.5),
            "latency_p50_s": nearest_rank([a.total_s for a in answers], 0.5),
            "latency_p99_s": nearest_rank([a.total_s for a in answers], 0.99),
            "vs_sequential": rate / baseline if baseline else None}  # fmt: skip


def print_table(rows: list[dict]) -> None:
    print(f"{'run':<22}{'requests':>9}{'tokens':>8}{'tokens/s':>10}{'TTFT p50':>10}"
          f"{'lat p50':>9}{'lat p99':>9}{'vs seq':>8}")  # fmt: skip
    for r in rows:
        vs = f"{r['vs_sequential']:.2f}x" if r["vs_sequential"] else "1.00x"
        print(f"{r['run']:<22}{r['requests']:>9}{r['tokens']:>8}{r['tokens_per_s']:>10.1f}"
              f"{r['ttft_p50_s']:>9.2f}s{r['latency_p50_s']:>8.2f}s{r['latency_p99_s']:>8.2f}s"
              f"{vs:>8}")  # fmt: skip


def full_pool(bundle, quick: bool) -> dict:
    """17 clients at once on a pool sized for 16 of their requests: all served, none refused."""
    prompt, max_tokens = f"Write a story about {TOPICS[0]}.", 16 if quick else 64
    need = -(-(len(bundle.prompt_ids([{"role": "user", "content": prompt}])) + max_tokens) // 16)
    url, engine, stop = start_server(bundle, max_batch=17, num_blocks=16 * need)
    try:
        client = openai.OpenAI(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0)
        alone = ask(client, (prompt, max_tokens, 0))
        answers, wall = at_once(client, [(prompt, max_tokens, i) for i in range(17)])
    finally:
        stop()
    assert all(a.text == alone.text for a in answers), "a request of the full pool differs"
    assert engine.blocks.held == 0, "blocks were not given back"
    firsts = sorted(a.first_s for a in answers)
    return {"blocks": 16 * need, "blocks_per_request": need, "served": len(answers),
            "wall_s": wall, "first_16_ttft_max_s": firsts[15],
            "17th_ttft_s": firsts[16]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens a request")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    print(f"{machine_line(info)}; CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} torch threads")  # fmt: skip
    bundle = qkv.pretrained.load(MODEL)
    jobs = [(f"Write a long, detailed story about {topic}.", 16 if args.quick else
             LENGTHS[i % len(LENGTHS)], i) for i, topic in enumerate(TOPICS)]  # fmt: skip
    url, _, stop = start_server(bundle, max_batch=16)
    try:
        client = openai.OpenAI(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0)
        ask(client, ("Hi", 4, 0))  # warm-up
        alone = [at_once(client, [job]) for job in jobs]  # one at a time
        seq = [a for (a,), _ in alone]
        rows = [row("sequential", seq, sum(w for _, w in alone), None)]
        for n in (1, 4, 16):
            answers, wall = at_once(client, jobs[:n])
            bad = [i for i, a in enumerate(answers) if a.text != seq[i].text]
            assert not bad, f"{n} clients: requests {bad} differ from their output alone"
            base = sum(a.tokens for a in seq[:n]) / sum(w for _, w in alone[:n])
            rows.append(row(f"{n} concurrent", answers, wall, base))
    finally:
        stop()
    print_table(rows)
    print("every concurrent answer equals its sequential one")
    pool = full_pool(bundle, args.quick)
    print(f"full pool: {pool['served']} of 17 clients served on {pool['blocks']} blocks "
          f"({pool['blocks_per_request']} a request, room for 16); first 16 started by "
          f"{pool['first_16_ttft_max_s']:.2f} s, the 17th waited {pool['17th_ttft_s']:.2f} s "
          f"for blocks")  # fmt: skip
    out = Path(__file__).parent / "results" / ("serve-quick.json" if args.quick else "serve.json")
    result = {"machine": info, "rows": rows, "full_pool": pool,
              "sequential": [asdict(a) for a in seq]}  # fmt: skip
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
