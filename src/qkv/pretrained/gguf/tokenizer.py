"""A byte-level BPE tokenizer rebuilt from a GGUF file's metadata.

GGUF files carry no ``tokenizer.json``; llama.cpp stores the pieces instead:

* ``tokenizer.ggml.model``: the algorithm; ``"gpt2"`` is byte-level BPE (GPT-2, SmolLM, Llama 3,
  Qwen). Each token is spelled in GPT-2's printable byte alphabet (``Ġ`` for a space).
* ``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``: the vocabulary (index = id), the
  merge rules ``"a b"`` best first, and each token's kind (3 = control, e.g. ``<|im_end|>``;
  4 = user-defined); both kinds are matched whole in the text, never split.
* ``tokenizer.ggml.pre``: the name of the pre-tokenizer, the regular expressions that cut text
  into words before merging. It must be the one the merges were learned with, or numbers and
  punctuation tokenise differently. The names are llama.cpp's (``llama-vocab.cpp``).
* ``tokenizer.ggml.bos_token_id`` / ``eos_token_id`` / ``add_bos_token``, ``chat_template``.

The result is a :class:`~qkv.pretrained.tokenizer.PretrainedTokenizer` over a
``tokenizers.Tokenizer`` (BPE model, pre-tokenizer, byte-level decoder).
"""

from __future__ import annotations

from typing import Any

from qkv.checks import is_int
from qkv.data.files import BadFileError, reading
from qkv.pretrained.errors import require
from qkv.pretrained.gguf.reader import GGUFFile
from qkv.pretrained.tokenizer import PretrainedTokenizer

__all__ = ["PRE_TOKENIZERS", "tokenizer_from_gguf"]

_CONTROL, _USER_DEFINED = 3, 4

# Llama 3's split (also used by several newer byte-level vocabularies).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how to cut text before BPE. "gpt2": GPT-2's own regex (the ByteLevel
# pre-tokenizer's built-in one). "smollm": every digit on its own, then GPT-2's regex
# (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM; Hugging Face's SmolLM tokenizer.json says the same
# with Digits(individual_digits=True) + ByteLevel).
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama3", "llama-bpe", "llama-v3")


def _pre_tokenizer(name: str, tokenizers: Any) -> Any:
    pt = tokenizers.pre_tokenizers
    if name in ("default", "gpt2"):
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":
        return pt.Sequence(
            [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False)]
        )
    if name in ("llama3", "llama-bpe", "llama-v3"):
        return pt.Sequence([
            pt.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(
        f"tokenizer.ggml.pre={name!r} is not supported; known pre-tokenizers: {PRE_TOKENIZERS}"
    )


def tokenizer_from_gguf(gguf: GGUFFile) -> PretrainedTokenizer:
    """Build the tokenizer a GGUF file describes (byte-level BPE only).

    Args:
        gguf: a file read by :func:`~qkv.pretrained.gguf.reader.read_gguf` (metadata suffices).

    Returns:
        A :class:`PretrainedTokenizer` whose ``encode`` gives the ids llama.cpp and Hugging
        Face give for this vocabulary (a BOS token first only when ``add_bos_token`` says so),
        with the file's chat template and special tokens.

    Raises:
        qkv.data.files.BadFileError (a ValueError): a tokenizer model other than ``"gpt2"``
            (byte-level BPE), an unknown pre-tokenizer name, missing or malformed
            vocabulary/merges/token types, or pieces the ``tokenizers`` library refuses.
        ImportError: ``tokenizers`` is missing (with the install command).
    """
    tokenizers = require("tokenizers", "tokenizers")
    kind = gguf.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise BadFileError(
            f"GGUF file {gguf.path} has tokenizer.ggml.model={kind!r}; qkv reads byte-level "
            "BPE vocabularies ('gpt2': GPT-2, SmolLM, Llama 3, Qwen) only",
            path=gguf.path,
        )
    tokens = gguf.require("tokenizer.ggml.tokens")
    merges = gguf.require("tokenizer.ggml.merges")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    _check_lists(gguf, tokens, merges, types)
    with reading(gguf.path, "a byte-level BPE vocabulary the tokenizers library accepts",
                 errors=(Exception,)):  # fmt: skip
        return _build(gguf, tokenizers, tokens, [tuple(m.split(" ", 1)) for m in merges], types)


def _check_lists(gguf: GGUFFile, tokens: Any, merges: Any, types: Any) -> None:
    """The vocabulary, merges and token types have the types and lengths llama.cpp writes."""
    problems = []
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        problems.append("tokenizer.ggml.tokens must be a non-empty list of strings")
    if not (isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)):
        problems.append("tokenizer.ggml.merges must be a list of 'a b' strings")
    if not (isinstance(types, list) and all(is_int(t) for t in types)
            and isinstance(tokens, list) and len(types) == len(tokens)):  # fmt: skip
        problems.append("tokenizer.ggml.token_type must be a list of ints, one per token")
    if problems:
        raise BadFileError(f"GGUF file {gguf.path}: " + "; ".join(problems), path=gguf.path)


def _build(gguf: GGUFFile, tokenizers: Any, tokens: list[str], merges: list[tuple[str, str]],
           types: list[int]) -> PretrainedTokenizer:  # fmt: skip
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    pre = gguf.get("tokenizer.ggml.pre", "default")
    backend.pre_tokenizer = _pre_tokenizer(pre if isinstance(pre, str) else repr(pre), tokenizers)
    backend.decoder = tokenizers.decoders.ByteLevel()
    whole = [
        tokenizers.AddedToken(tok, special=t == _CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_special_tokens([w for w in whole if w.special])
    backend.add_tokens([w for w in whole if not w.special])

    def token(key: str) -> str | None:
        idx = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if is_int(idx) and 0 <= idx < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
    }
    bos = special["bos_token"]
    if gguf.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    template = gguf.get("tokenizer.chat_template")
    return PretrainedTokenizer(
        backend, special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
    )
