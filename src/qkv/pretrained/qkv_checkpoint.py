"""qkv's own checkpoints (written by :func:`qkv.checkpoint.save_checkpoint`) as bundles.

A checkpoint folder holds ``model.safetensors`` and a ``config.json`` naming the model class and
its config; :func:`qkv.checkpoint.load_checkpoint` rebuilds the model and reads the
tokenizers saved beside it. Here a :class:`~qkv.models.DecoderLM` becomes a
:class:`DecoderBundle` and an :class:`~qkv.models.Encoder` an :class:`EncoderBundle`, with the
checkpoint's ``"text"`` tokenizer (or its only one) adapted to the bundle's tokenizer methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from qkv.checkpoint import load_checkpoint
from qkv.data.batching import pad_rows
from qkv.data.files import BadFileError
from qkv.models import DecoderLM, Encoder
from qkv.pretrained.bundle import DecoderBundle, EncoderBundle

__all__ = ["QkvTokenizer", "load_qkv_checkpoint"]


class QkvTokenizer:
    """A :mod:`qkv.data` tokenizer (char, byte, BPE, WordPiece) with the bundle's method names.

    ``encode`` adds no BOS/EOS (qkv's language-model training feeds raw text streams); there is
    no chat template.
    """

    chat_template = None
    max_length = None

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"QkvTokenizer({self.inner!r})"

    @property
    def vocab_size(self) -> int:
        return int(self.inner.vocab_size)

    @property
    def eos_id(self) -> int | None:
        return getattr(self.inner, "eos_id", None)

    @property
    def pad_id(self) -> int | None:
        return getattr(self.inner, "pad_id", None)

    @property
    def bos_id(self) -> int | None:
        return getattr(self.inner, "bos_id", None)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (no special tokens). Raises TypeError for a non-str."""
        return list(self.inner.encode(text))

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True
                     ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Right-padded ``(ids (B, S), keep (B, S))``, as the pretrained tokenizer's."""
        rows = [self.encode(t) for t in texts]
        # min_len=1: an empty text is one padding position, masked
        return pad_rows(rows, self.pad_id or 0, min_len=1)  # (B, S), (B, S)

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = False) -> str:
        return self.inner.decode(ids, skip_special=skip_special_tokens)

    def encode_chat(self, messages: object, *, add_generation_prompt: bool = True) -> list[int]:
        """Raises ValueError: qkv checkpoints carry no chat template."""
        raise ValueError("this qkv checkpoint has no chat template; pass a plain prompt string")


def load_qkv_checkpoint(folder: str | Path, *, name: str | None = None
                        ) -> EncoderBundle | DecoderBundle:  # fmt: skip
    """Load a qkv checkpoint folder holding a ``DecoderLM`` or an ``Encoder``.

    Raises:
        qkv.checkpoint.CheckpointError (a BadFileError, a ValueError): unreadable or
            mismatched files.
        qkv.data.files.BadFileError: a checkpoint of another model class (e.g. a
            Seq2SeqTransformer).
    """
    ckpt = load_checkpoint(folder)
    name = name or str(folder)
    toks = ckpt.tokenizers
    inner = toks.get("text") or (next(iter(toks.values())) if len(toks) == 1 else None)
    tokenizer = None if inner is None else QkvTokenizer(inner)
    source = {"format": "qkv.checkpoint", "path": str(ckpt.path)}
    model = ckpt.model.eval()
    if isinstance(model, DecoderLM):
        return DecoderBundle(model, tokenizer, name, source)
    if isinstance(model, Encoder):
        return EncoderBundle(model, tokenizer, name, source)
    raise BadFileError(
        f"{ckpt.path / 'config.json'}: holds a {type(model).__name__}; qkv.pretrained.load "
        "takes DecoderLM and Encoder checkpoints (load_checkpoint reads the others)",
        path=ckpt.path / "config.json",
    )
