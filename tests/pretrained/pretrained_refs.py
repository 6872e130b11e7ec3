"""Shared loaders for the pretrained parity tests: each model is loaded once per process.

The reference libraries (transformers, sentence-transformers, accelerate for GGUF loading) are
test-only dependencies (``qkv[parity]``). A missing one fails the test with the install
command; it is never skipped.
"""

from __future__ import annotations

import contextlib
import importlib
from functools import cache
from typing import Any

import pytest
import torch

import qkv.pretrained

PARITY = "pip install 'qkv[parity]'"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Varied texts: plain, long (past 256 tokens), punctuation, accents, CJK, emoji, empty,
# whitespace, digits, special-token look-alikes.
TEXTS = [
    "The cat sat on the mat.",
    "A much longer sentence about transformers and attention, repeated. " * 40,
    "Punctuation!?... «quotes» — dashes; (parens) [brackets] {braces} @#$%^&*",
    "Café naïve résumé Ångström façade coöperate",
    "中文句子，日本語の文章、한국어 문장",
    "emoji 🙂👍🏽🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "",
    "   spaces   and\ttabs\nnewlines  ",
    "Numbers 12345 and 3.14159, dates 2024-01-01, x1000",
    "[CLS] <|im_start|> fake specials [SEP]",
]


def need(module: str, install: str = PARITY) -> Any:
    """Import a reference library or fail (not skip) with the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"the parity tests need {module!r} ({err}); install it with: {install}",
                    pytrace=False)  # fmt: skip


@cache
def minilm() -> qkv.pretrained.EncoderBundle:
    return qkv.pretrained.load("all-MiniLM-L6-v2")


@cache
def st_minilm() -> Any:
    st = need("sentence_transformers")
    return st.SentenceTransformer(str(qkv.pretrained.locate("all-MiniLM-L6-v2")), device="cpu")


@cache
def hf_bert() -> Any:
    transformers = need("transformers")
    path = str(qkv.pretrained.locate("all-MiniLM-L6-v2"))
    return transformers.BertModel.from_pretrained(path, attn_implementation="eager").eval()


@cache
def smollm2() -> qkv.pretrained.DecoderBundle:
    return qkv.pretrained.load("SmolLM2-135M-Instruct")


def plain_view_gguf() -> contextlib.AbstractContextManager:
    """transformers reads GGUF with ``gguf.GGUFReader``, 5 s of SmolLM2's header each time
    (twice per load: model and tokenizer). Within this block it reads through qkv's
    plain-view subclass, which reads every field and tensor as the package's reader does
    (tests/pretrained/test_pretrained_gguf.py checks it on this very file): the same
    reference, 10 s sooner."""
    from unittest import mock

    from qkv.pretrained.gguf.reader import _reader_class

    gguf = need("gguf")
    return mock.patch.object(gguf, "GGUFReader", _reader_class(gguf))


@cache
def hf_smollm2() -> tuple[Any, Any]:
    """transformers' LlamaForCausalLM (eager, float32) and tokenizer from the same GGUF."""
    transformers = need("transformers")
    need("accelerate")  # transformers needs it to load GGUF files
    folder = str(qkv.pretrained.locate("SmolLM2-135M-Instruct").parent)
    with plain_view_gguf():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=SMOLLM2_FILE, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_FILE)
    return model, tokenizer
