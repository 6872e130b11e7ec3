"""The grammar engines for ``response_format`` side by side: llguidance and xgrammar on
SmolLM2's vocabulary (49,152 tokens), the same JSON schemas and the same token sequences.

Usage::

    .venv/bin/python benchmarks/grammar_engines.py     # about a minute; needs both installed

For each schema: the time to build the tokenizer's tables once, to compile the schema, and per
decoding step the time to compute the allowed-token mask (median and largest) and to advance
by one token, over the tokens of a valid answer (encoded by SmolLM2's tokenizer). What
``qkv serve`` picked rests on this (``qkv.serve.structured``). Results go to
``benchmarks/results/grammar-engines.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import qkv.pretrained
from common import machine_info, machine_line

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]}},
        "required": ["name", "age", "tags", "role"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "tags": ["maths", "poetry"], "role": "admin"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "quantity", "price"],
            "additionalProperties": False}},
        "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"],
        "additionalProperties": False},
        {"id": "ABC-1234", "items": [{"sku": "tea", "quantity": 2, "price": 3.5},
                                     {"sku": "cup", "quantity": 1, "price": 8.0}], "paid": True}),
}  # fmt: skip


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def llguidance_run(tokenizer_json: str, eos: int, schema: dict, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
    tables = _ms(start)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    compile_ms = _ms(start)
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)
    return {"tables_ms": tables, "compile_ms": compile_ms,
            **_steps(tokens, lambda: lt.fill_next_token_bitmask(matcher, mask, 0),
                     matcher.consume_token)}  # fmt: skip


def _steps(tokens: list[int], fill, advance) -> dict:
    """Per token: the mask's time (``fill()``), then advancing by it (``advance(t)``)."""
    masks, steps = [], []
    for t in tokens:
        start = time.perf_counter()
        fill()
        masks.append(_ms(start))
        start = time.perf_counter()
        assert advance(t), f"the grammar refused token {t}"
        steps.append(_ms(start))
    return {"mask_ms": statistics.median(masks), "mask_max_ms": max(masks),
            "advance_ms": statistics.median(steps)}


def xgrammar_run(backend, vocab: int, eos: int, schema: dict, tokens: list[int]) -> dict:
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    tables = _ms(start)
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    compile_ms = _ms(start)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    return {"tables_ms": tables, "compile_ms": compile_ms,
            **_steps(tokens, lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token)}


def main() -> None:
    info = machine_info()
    print(f"{machine_line(info)}; {torch.get_num_threads()} torch threads")
    tokenizer = qkv.pretrained.load("SmolLM2-135M-Instruct").tokenizer
    backend, eos = tokenizer.backend, tokenizer.eos_id
    vocab = backend.get_vocab_size(with_added_tokens=True)
    rows = []
    for name, (schema, example) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(example), add_special_tokens=False)
        rows.append({"schema": name, "engine": "llguidance", "tokens": len(tokens),
                     **llguidance_run(backend.to_str(), eos, schema, tokens)})
        rows.append({"schema": name, "engine": "xgrammar", "tokens": len(tokens),
                     **xgrammar_run(backend, vocab, eos, schema, tokens)})
    print(f"{'schema':<8}{'engine':<12}{'tokens':>7}{'tables':>10}{'compile':>10}"
          f"{'mask/step':>11}{'mask max':>10}{'advance':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['schema']:<8}{r['engine']:<12}{r['tokens']:>7}{r['tables_ms']:>8.0f}ms"
              f"{r['compile_ms']:>8.1f}ms{r['mask_ms']:>9.3f}ms{r['mask_max_ms']:>8.3f}ms"
              f"{r['advance_ms']:>7.3f}ms")
    out = Path(__file__).parent / "results" / "grammar-engines.json"
    out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
