"""Packed vs padded language-model training on a variable-length corpus, side by side.

Usage::

    .venv/bin/python benchmarks/packing.py                    # stdlib docstrings, T=256 (~2 min)
    .venv/bin/python benchmarks/packing.py --corpus gettext   # the gettext pairs (if installed)
    .venv/bin/python benchmarks/packing.py --tiny             # a few steps: checks the script

The corpus is cut into documents: the paragraphs of the standard library's docstrings
(:func:`qkv.data.stdlib_corpus`, ``kind="docstrings"``, split at blank lines), or one
``english => translation`` line per gettext pair (:func:`qkv.data.gettext_pairs`). Each
document is ``BOS ids EOS`` with a character tokenizer. The same GPT-2-style
:class:`~qkv.models.DecoderLM`, seed and step count are trained twice with
:func:`qkv.train.train_lm`:

* **packed** (``TrainConfig(pack=True)``): several documents per row of ``T`` positions with
  document ids (document mask AND causal on the blockwise flex kernel, positions restarting);
* **padded** (``pack=False``): one document per row, each batch cut to its longest row (the
  usual dynamic padding; no mask is needed for right padding under a causal mask).

Reported per mode: **tokens/s** (real target tokens per second of stepping, as the training
loop counts them: padding never counts), **positions/s** (every position computed, padding
included), the **padding fraction** of the batches one epoch trains on, rows, steps per epoch,
and the final training loss. Runs alternate (packed, padded, packed, ...) ``--repeats`` times;
the table keeps each mode's best tokens/s. The machine is shared: each record keeps the
1-minute load average before and after, and the torch thread count. Results go to a table and
to ``benchmarks/results/packing.json`` (``--tiny``: ``packing-tiny.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from common import machine_info
from qkv.data import CharTokenizer, gettext_pairs, stdlib_corpus
from qkv.data.packing import IGNORE_INDEX, pack_lm, split_documents
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.train import TrainConfig, seed_everything, train_lm
from qkv.train.lm import document_batches

RESULTS = Path(__file__).parent / "results"


def documents(corpus: str, max_chars: int) -> tuple[list[str], str]:
    """The corpus's documents (strings) and a one-line description."""
    if corpus == "stdlib":
        text = stdlib_corpus(max_chars, kind="docstrings")
        return split_documents(text), f"stdlib docstrings, {len(text):,} characters"
    pairs = gettext_pairs("de", required=True)
    docs, total = [], 0
    for src, tgt in pairs:
        docs.append(f"{src} => {tgt}")
        total += len(docs[-1])
        if total >= max_chars:
            break
    return docs, f"gettext en=>de pairs, {total:,} characters"


def epoch_padding(rows, batch_size: int, packed: bool) -> tuple[float, int]:
    """Padding fraction of the positions one epoch's batches compute, and the batch count."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    computed = real = batches = 0
    for batch in document_batches(rows, batch_size, order, packed):
        computed += batch.targets.numel()
        real += int((batch.targets != IGNORE_INDEX).sum())
        batches += 1
    return 1.0 - real / computed, batches


def train_once(ids, vocab: int, args, packed: bool) -> dict:
    """One training run; its throughput and final loss."""
    seed_everything(0)
    config = DecoderLMConfig.gpt2_style(vocab, d_model=args.d_model, num_layers=args.layers,
                                        num_heads=args.heads, max_len=args.T)  # fmt: skip
    model = DecoderLM(config)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, block_size=args.T,
                        pack=packed, lr=1e-3, schedule="constant", warmup=0, progress=False,
                        plot=False, log_every=args.steps)  # fmt: skip
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    result = train_lm(model, ids, train)
    wall = time.perf_counter() - t0
    history = result.history
    real_tokens = sum(h["tokens"] for h in history)
    tail = history[-max(1, len(history) // 10) :]
    return {
        "tokens_per_s": result.tokens_per_second,
        "train_seconds": wall,
        "real_tokens": real_tokens,
        "final_loss": sum(h["loss"] for h in tail) / len(tail),
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", choices=("stdlib", "gettext"), default="stdlib")
    parser.add_argument("--max-chars", type=int, default=400_000)
    parser.add_argument("--T", type=int, default=256, help="row length (block_size)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="a few steps of a tiny model")
    args = parser.parse_args()
    if args.tiny:
        args.max_chars, args.T, args.steps, args.batch_size = 20_000, 64, 3, 4
        args.d_model, args.layers, args.heads, args.repeats = 16, 1, 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(highlight=False)
    texts, what = documents(args.corpus, args.max_chars)
    tok = CharTokenizer.fit(texts)
    ids = [tok.encode(d, add_bos=True, add_eos=True) for d in texts]
    console.print(f"{what}: {len(ids):,} documents, lengths {min(map(len, ids))}.."
                  f"{max(map(len, ids))} (mean {sum(map(len, ids)) / len(ids):.0f}), T={args.T}")

    records: dict[str, dict] = {}
    for mode in ("packed", "padded"):
        rows = pack_lm(ids, args.T, packed=mode == "packed")
        padding, batches = epoch_padding(rows, args.batch_size, mode == "packed")
        records[mode] = {"rows": len(rows), "padding_fraction": padding,
                         "steps_per_epoch": batches, "runs": []}  # fmt: skip
    for _ in range(args.repeats):
        for mode in ("packed", "padded"):  # alternating, so drifts in load hit both
            records[mode]["runs"].append(train_once(ids, tok.vocab_size, args, mode == "packed"))

    table = Table(title=f"packed vs padded LM training ({args.corpus}, T={args.T}, "
                  f"B={args.batch_size}, {args.steps} steps, best of {args.repeats})")
    for col in ("mode", "tokens/s", "positions/s", "padding", "rows", "steps/epoch",
                "final loss"):
        table.add_column(col, justify="right")
    for mode, rec in records.items():
        best = max(rec["runs"], key=lambda r: r["tokens_per_s"])
        positions = best["tokens_per_s"] / max(1e-9, 1.0 - rec["padding_fraction"])
        rec["best"] = {**best, "positions_per_s": positions}
        table.add_row(mode, f"{best['tokens_per_s']:,.0f}", f"{positions:,.0f}",
                      f"{rec['padding_fraction']:.1%}", f"{rec['rows']:,}",
                      f"{rec['steps_per_epoch']:,}", f"{best['final_loss']:.3f}")  # fmt: skip
    console.print(table)
    speedup = records["packed"]["best"]["tokens_per_s"] / records["padded"]["best"]["tokens_per_s"]
    console.print(f"packed / padded tokens/s: {speedup:.2f}x")

    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("packing-tiny.json" if args.tiny else "packing.json")
    payload = {"corpus": what, "args": vars(args), "machine": machine_info(), "modes": records,
               "packed_over_padded": speedup}  # fmt: skip
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)  # atomic: a reader never sees half a file
    console.print(f"results: {out}")


if __name__ == "__main__":
    main()
