"""Speed of the pretrained models on qkv against their reference libraries, side by side.

What ``benchmarks/pretrained.py`` and ``qkv bench --pretrained`` measure, float32 on the CPU,
the same thread count for both sides, the two sides alternating run by run (so drift on a
shared machine hits both alike), best (min) and median of the repeats:

* :func:`bench_minilm`: all-MiniLM-L6-v2 encoding varied sentences at batch 32, qkv's
  ``EncoderBundle.encode`` against sentence-transformers' ``encode`` on the same folder.
* :func:`bench_smollm2`: SmolLM2-135M-Instruct greedy generation (EOS off on both sides, so
  both make exactly ``new`` tokens; prefill included), :func:`qkv.generate.greedy` against
  transformers' ``generate`` on the same GGUF; optional variants in the same rounds
  (``compiled``, ``int8``, ``int4``), with the compile time measured apart.
* :func:`bench_context`: SmolLM2's per-token decode time after short and long contexts.

:func:`report` prints the ratios (> 1: qkv faster) and the issue's targets as a checklist.
transformers and sentence-transformers (the ``dev`` extra) are imported only when measuring.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table

from qkv.generate import greedy
from qkv.pretrained.errors import require
from qkv.pretrained.registry import load, locate

__all__ = ["TARGETS", "alternate", "bench_context", "bench_minilm", "bench_smollm2",
           "check_targets", "report", "sentences", "summarise"]

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
    """Encode ``n`` of :func:`sentences` at batch 32, qkv against sentence-transformers."""
    sentence_transformers = require("sentence_transformers", "sentence-transformers")
    from sentence_transformers import SentenceTransformer

    texts = sentences(n)
    bundle = load("all-MiniLM-L6-v2")
    st = SentenceTransformer(str(locate("all-MiniLM-L6-v2")), device="cpu")
    times = alternate({
        "qkv": lambda: bundle.encode(texts, batch_size=32),
        "sentence-transformers": lambda: st.encode(texts, batch_size=32, convert_to_tensor=True),
    }, repeats)  # fmt: skip
    ours, ref = bundle.encode(texts), st.encode(texts, batch_size=32, convert_to_tensor=True)
    return {
        "kind": "minilm",
        "label": f"MiniLM encode {n}, batch 32 (sentences/s)",
        "what": f"all-MiniLM-L6-v2: encode {n} sentences, batch 32 (sentences/s)",
        "qkv": summarise(times["qkv"], n),
        "reference": summarise(times["sentence-transformers"], n),
        "reference_name": f"sentence-transformers {sentence_transformers.__version__}",
        "max_abs_diff": float((ours - ref).abs().max()),
    }


def bench_smollm2(prompt_len: int, new: int, repeats: int, variants: Sequence[str]) -> dict:
    """Greedy generation, qkv eager against transformers, plus each of ``variants``
    (``"compiled"``: ``compile=True``; ``"int8"``/``"int4"``: weight-only quantised copies)
    in the same alternating rounds. Compile time is measured apart (the first call)."""
    require("gguf", "gguf")
    transformers = require("transformers", "transformers")

    bundle = load("SmolLM2-135M-Instruct")
    folder = str(locate("SmolLM2-135M-Instruct").parent)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32).eval()  # fmt: skip
    text = "Once upon a time, in a quiet harbour town, there lived an old sailor who " * 4
    prompt = bundle.tokenizer.encode(text)[:prompt_len]
    # EOS off: the last id of the vocabulary (an unused byte-level piece) ends nothing in
    # practice; every run is checked to have produced exactly `new` tokens.
    never = bundle.config.vocab_size - 1
    out: dict[str, list[int]] = {}

    def run(name: str, model: torch.nn.Module, **options: object) -> Callable[[], None]:
        def go() -> None:
            out[name] = greedy(model, [prompt], max_new_tokens=new, eos_id=never,
                               **options)[0].tolist()  # fmt: skip
            if len(out[name]) != new or never in out[name]:
                raise RuntimeError(f"{name} stopped early: {len(out[name])} of {new} tokens")
        return go

    def theirs() -> None:
        with torch.no_grad():
            ids = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)  # fmt: skip
        out["transformers"] = ids[0, len(prompt):].tolist()

    fns: dict[str, Callable[[], None]] = {"qkv": run("qkv", bundle.model), "transformers": theirs}
    extra: dict[str, object] = {}
    if "compiled" in variants:
        fns["qkv compiled"] = run("qkv compiled", bundle.model, compile=True)
        start = time.perf_counter()
        fns["qkv compiled"]()  # compiles (the timed rounds reuse it)
        extra["compile_s"] = time.perf_counter() - start
    for mode in ("int8", "int4"):
        if mode in variants:
            model = load("SmolLM2-135M-Instruct", quantize=mode).model
            fns[f"qkv {mode}"] = run(f"qkv {mode}", model)
    times = alternate(fns, repeats)

    def agree(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    record = {
        "kind": "smollm2",
        "label": f"SmolLM2 greedy {len(prompt)} -> {new} (tokens/s)",
        "what": f"SmolLM2-135M-Instruct: greedy, prompt {len(prompt)} -> {new} new tokens "
                "(tokens/s)",
        "qkv": summarise(times["qkv"], new),
        "reference": summarise(times["transformers"], new),
        "reference_name": f"transformers {transformers.__version__} generate, "
                          f"{ref.config._attn_implementation}",
        "tokens_equal_prefix": agree(out["qkv"], out["transformers"]),
        "variants": {},
        **extra,
    }
    for name in fns:
        if name.startswith("qkv "):
            record["variants"][name] = {**summarise(times[name], new),
                                        "tokens_equal_prefix": agree(out[name], out["qkv"])}
    return record


def bench_context(contexts: Sequence[int], steps: int, repeats: int) -> dict:
    """Per-token decode time of SmolLM2 (eager, one row) after ``contexts`` tokens of cache:
    the ratio of the longest to the shortest says how flat decoding stays in context."""
    from qkv.generate.session import DecoderSession

    model = load("SmolLM2-135M-Instruct").model
    per_token: dict[int, list[float]] = {n: [] for n in contexts}
    sessions = {}
    with torch.inference_mode():
        for n in contexts:
            prompt = [(i * 37) % 1000 + 10 for i in range(n)]
            sessions[n] = DecoderSession(model, [prompt], steps * (repeats + 1) + 1)
            sessions[n].first()
        token = torch.tensor([42])
        for n in contexts:  # warm-up
            for _ in range(steps):
                sessions[n].next(token)
        for _ in range(repeats):
            for n in contexts:  # alternating, as every other measurement here
                start = time.perf_counter()
                for _ in range(steps):
                    sessions[n].next(token)
                per_token[n].append((time.perf_counter() - start) / steps)
    lo, hi = min(contexts), max(contexts)
    return {
        "kind": "context",
        "label": f"SmolLM2 decode step, context {lo} vs {hi} (ms/token)",
        "ms_per_token": {n: {"min": 1e3 * min(v), "median": 1e3 * statistics.median(v)}
                         for n, v in per_token.items()},
        "ratio_longest_over_shortest_min": min(per_token[hi]) / min(per_token[lo]),
        "ratio_longest_over_shortest_median": (statistics.median(per_token[hi])
                                               / statistics.median(per_token[lo])),
    }


# (label, what it grades, needed): the targets for the pretrained models.
TARGETS = (
    ("SmolLM2 greedy: qkv eager vs transformers generate (tokens/s, best)", "smollm2", 1.5),
    ("all-MiniLM-L6-v2 encode: qkv vs sentence-transformers (sentences/s, best)", "minilm",
     1.2),
    ("SmolLM2 decode step: longest vs shortest context (ms/token, best)", "context", 1.3),
)


def check_targets(records: list[dict]) -> list[dict]:
    """``[{"target", "needs", "measured", "met"}]`` for the targets whose records exist."""
    found = {r["kind"]: r for r in records if "kind" in r}
    rows = []
    for label, kind, needed in TARGETS:
        r = found.get(kind)
        if r is None:
            continue
        if kind == "context":
            measured = r["ratio_longest_over_shortest_min"]
            rows.append({"target": label, "needs": f"<= {needed}x", "measured": measured,
                         "met": measured <= needed})
        else:
            measured = r["qkv"]["best_per_s"] / r["reference"]["best_per_s"]
            rows.append({"target": label, "needs": f">= {needed}x", "measured": measured,
                         "met": measured >= needed})
    return rows


def report(console: Console, config: dict, records: list[dict]) -> None:
    """Print the ratios of ``records`` (from the functions above) and the target checklist."""
    table = Table(title=f"qkv.pretrained vs references ({config['threads']} threads, float32)")
    for col in ("benchmark", "reference", "qkv best", "ref best", "ratio best", "qkv median",
                "ref median", "ratio median"):
        table.add_column(col, justify="left" if col in ("benchmark", "reference") else "right")
    compared = [r for r in records if "reference" in r]
    for r in compared:
        q, ref = r["qkv"], r["reference"]
        table.add_row(
            r["label"], r["reference_name"], f"{q['best_per_s']:.1f}", f"{ref['best_per_s']:.1f}",
            f"{q['best_per_s'] / ref['best_per_s']:.2f}x", f"{q['median_per_s']:.1f}",
            f"{ref['median_per_s']:.1f}", f"{q['median_per_s'] / ref['median_per_s']:.2f}x",
        )
    if compared:
        console.print(table)
    for r in records:
        if "ms_per_token" in r:  # bench_context
            steps = ", ".join(f"{n}: {v['min']:.1f} (median {v['median']:.1f})"
                              for n, v in r["ms_per_token"].items())  # fmt: skip
            console.print(f"{r['label']}: {steps}; longest/shortest "
                          f"{r['ratio_longest_over_shortest_min']:.2f}x (min), "
                          f"{r['ratio_longest_over_shortest_median']:.2f}x (median)")
            continue
        ref = r["reference"]
        keys = ("max_abs_diff", "tokens_equal_prefix", "texts_equal", "log_mel_max_abs_diff",
                "faster_whisper_name", "texts_equal_faster_whisper",
                "qkv_over_faster_whisper_best", "compile_s")
        extra = {k: r[k] for k in keys if k in r}
        console.print(f"{r['what']}: {extra}")
        for name, v in r.get("variants", {}).items():
            console.print(
                f"  {name}: best {v['best_per_s']:.1f}/s "
                f"({v['best_per_s'] / ref['best_per_s']:.2f}x transformers), "
                f"median {v['median_per_s']:.1f}/s "
                f"({v['median_per_s'] / ref['median_per_s']:.2f}x); tokens equal to qkv eager "
                f"for the first {v['tokens_equal_prefix']}")
    targets = check_targets(records)
    if targets:
        checklist = Table(title="targets (ratios from the best runs of this run)")
        for col in ("", "target", "needs", "measured"):
            checklist.add_column(col, justify="right" if col == "measured" else "left")
        for t in targets:
            checklist.add_row("met" if t["met"] else "NOT MET", t["target"], t["needs"],
                              f"{t['measured']:.2f}x")
        console.print(checklist)
