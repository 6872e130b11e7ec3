"""Benchmark the pretrained models on qkv against their reference libraries, side by side.

Usage::

    .venv/bin/python benchmarks/pretrained.py            # full run, a few minutes on 2 threads
    .venv/bin/python benchmarks/pretrained.py --quick    # small sizes: checks the script

Two measurements, float32 on the CPU, the same thread count for both sides (``--threads``):

1. **all-MiniLM-L6-v2 sentence encoding**: 256 varied sentences (short and long, punctuation,
   accents, CJK, emoji), batch 32, qkv's ``EncoderBundle.encode`` against
   sentence-transformers' ``SentenceTransformer.encode`` on the same model folder. Both sort
   by length, pad per batch, truncate at 256 tokens, mean-pool and normalise.
2. **SmolLM2-135M-Instruct greedy generation**: a 32-token prompt, 128 new tokens, qkv's
   ``qkv.generate.greedy`` (KV cache) on the GGUF loaded by ``qkv.pretrained.load`` against
   transformers' ``generate`` (``do_sample=False``, its default attention, KV cache) on the
   same GGUF loaded by transformers, float32. EOS is disabled on both sides (qkv: an id the
   model never produces; transformers: ``min_new_tokens``) so both produce exactly 128 tokens;
   the time includes the prompt's prefill. The tokens of both are compared.

The two sides alternate run by run, so drift on a shared machine hits both alike; the best
(min) and median of ``--repeats`` runs are reported, and the ratio qkv / reference of the
throughputs (> 1 means qkv is faster). Results go to a rich table and to
``benchmarks/results/pretrained.json`` (``--quick`` writes ``pretrained-quick.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import qkv.pretrained
from qkv.generate import greedy

RESULTS = Path(__file__).resolve().parent / "results"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_PIECES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention weighs every token against every other one",
    "Café naïve résumé, Ångström and façade",
    "中文句子，日本語の文章、한국어 문장",
    "emoji 🙂👍🏽🎉 and flags 🇫🇷🇯🇵",
    "Punctuation!?... «quotes» — (parens) [brackets]",
    "Numbers like 3.14159 and 2024-01-01 appear too",
    "a rather long clause that keeps going about transformers, keys, queries and values",
]


def sentences(n: int) -> list[str]:
    """``n`` deterministic varied sentences: 1 to 12 pieces each (a few past 256 tokens)."""
    out = []
    for i in range(n):
        k = 1 + (i * 7) % 12 if i % 16 else 40  # every 16th one is long
        out.append(" ".join(_PIECES[(i + j) % len(_PIECES)] for j in range(k)))
    return out


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Run each function ``repeats`` times, alternating, after one untimed warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def summarise(times: list[float], items: int) -> dict:
    return {"items": items, "min_s": min(times), "median_s": statistics.median(times),
            "best_per_s": items / min(times), "median_per_s": items / statistics.median(times)}


def bench_minilm(n: int, repeats: int) -> dict:
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    texts = sentences(n)
    bundle = qkv.pretrained.load("all-MiniLM-L6-v2")
    st = SentenceTransformer(str(qkv.pretrained.locate("all-MiniLM-L6-v2")), device="cpu")
    times = alternate({
        "qkv": lambda: bundle.encode(texts, batch_size=32),
        "sentence-transformers": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True),
    }, repeats)  # fmt: skip
    ours, ref = bundle.encode(texts), st.encode(texts, batch_size=32, convert_to_tensor=True)
    return {
        "label": f"MiniLM encode {n}, batch 32 (sentences/s)",
        "what": f"all-MiniLM-L6-v2: encode {n} sentences, batch 32 (sentences/s)",
        "qkv": summarise(times["qkv"], n),
        "reference": summarise(times["sentence-transformers"], n),
        "reference_name": f"sentence-transformers {sentence_transformers.__version__}",
        "max_abs_diff": float((ours - ref).abs().max()),
    }


def bench_smollm2(prompt_len: int, new: int, repeats: int) -> dict:
    import transformers

    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")
    folder = str(qkv.pretrained.locate("SmolLM2-135M-Instruct").parent)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()  # fmt: skip
    text = "Once upon a time, in a quiet harbour town, there lived an old sailor who " * 4
    prompt = bundle.tokenizer.encode(text)[:prompt_len]
    never = bundle.config.vocab_size  # an eos id no step can produce: exactly `new` tokens
    out: dict[str, list[int]] = {}

    def ours() -> None:
        out["qkv"] = greedy(bundle.model, [prompt], max_new_tokens=new, eos_id=never)[0].tolist()

    def theirs() -> None:
        with torch.no_grad():
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)  # fmt: skip
        out["transformers"] = ids[0, len(prompt):].tolist()

    times = alternate({"qkv": ours, "transformers": theirs}, repeats)
    a, b = out["qkv"], out["transformers"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return {
        "label": f"SmolLM2 greedy {len(prompt)} -> {new} (tokens/s)",
        "what": f"SmolLM2-135M-Instruct: greedy, prompt {len(prompt)} -> {new} new tokens "
                "(tokens/s)",
        "qkv": summarise(times["qkv"], new),
        "reference": summarise(times["transformers"], new),
        "reference_name": f"transformers {transformers.__version__} generate, "
                          f"{ref.config._attn_implementation}",
        "tokens_equal_prefix": agree,
    }


def report(console: Console, config: dict, records: list[dict]) -> None:
    table = Table(title=f"qkv.pretrained vs references ({config['threads']} threads, float32)")
    for col in ("benchmark", "reference", "qkv best", "ref best", "ratio best", "qkv median",
                "ref median", "ratio median"):
        table.add_column(col, justify="left" if col in ("benchmark", "reference") else "right")
    for r in records:
        q, ref = r["qkv"], r["reference"]
        table.add_row(
            r["label"], r["reference_name"], f"{q['best_per_s']:.1f}", f"{ref['best_per_s']:.1f}",
            f"{q['best_per_s'] / ref['best_per_s']:.2f}x", f"{q['median_per_s']:.1f}",
            f"{ref['median_per_s']:.1f}", f"{q['median_per_s'] / ref['median_per_s']:.2f}x",
        )
    console.print(table)
    for r in records:
        extra = {k: r[k] for k in ("max_abs_diff", "tokens_equal_prefix") if k in r}
        console.print(f"{r['what']}: {extra}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads for both sides (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs each (3; quick 1)")
    parser.add_argument("--only", choices=("minilm", "smollm2"), default=None)
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 3)
    config = {"threads": args.threads, "repeats": repeats, "quick": args.quick,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    records = []
    if args.only in (None, "minilm"):
        records.append(bench_minilm(32 if args.quick else 256, repeats))
    if args.only in (None, "smollm2"):
        records.append(bench_smollm2(32, 8 if args.quick else 128, repeats))
    report(Console(width=160), config, records)
    out = args.out or RESULTS / ("pretrained-quick.json" if args.quick else "pretrained.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": records}, indent=2))


if __name__ == "__main__":
    main()
