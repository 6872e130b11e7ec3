"""The tokenizer of a pretrained model: a ``tokenizers.Tokenizer`` plus what the model expects.

The Hugging Face ``tokenizers`` library does the splitting and merging (WordPiece for BERT,
byte-level BPE for GPT-2 and Llama-family models); this wrapper adds what lives beside the
vocabulary in a checkpoint: the special tokens (``[CLS] ... [SEP]`` framing comes from the
tokenizer's own post-processor), the longest input the model takes (truncation), the chat
template, and padding of batches into ``(B, S)`` tensors with a ``(B, S)`` keep mask.

Padding and truncation stored inside a ``tokenizer.json`` are switched off: all-MiniLM-L6-v2's
file pads every text to 128 tokens and truncates there, while sentence-transformers pads to the
longest text of a batch and truncates at 256. Truncation is set from ``max_length`` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from qkv.data.batching import pad_rows
from qkv.pretrained.chat import render_chat

__all__ = ["PretrainedTokenizer"]


def _check_text(name: str, text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    return text


class PretrainedTokenizer:
    """Text <-> token ids for one pretrained model.

    Args:
        backend: a ``tokenizers.Tokenizer`` (its post-processor adds the special tokens).
        max_length: truncate encodings to this many ids, special tokens included (None: never).
        special_tokens: ``{"bos_token": "<s>", "eos_token": ..., "pad_token": ..., ...}``
            (None values allowed); read by the chat template and the ``*_id`` properties.
        chat_template: Jinja source of the chat template, or None.

    Raises:
        ValueError: ``max_length`` not a positive int or None, or a special token that is not
            in the vocabulary.
    """

    def __init__(
        self,
        backend: Any,
        *,
        max_length: int | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
    ) -> None:
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self.backend = backend
        self.max_length = max_length
        self.special_tokens = {k: v for k, v in dict(special_tokens or {}).items()}
        for key, token in self.special_tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"special token {key}={token!r} is not in the vocabulary")
        self.chat_template = chat_template
        backend.no_padding()
        if max_length is None:
            backend.no_truncation()
        else:
            backend.enable_truncation(max_length, strategy="longest_first")

    def __repr__(self) -> str:
        return (
            f"PretrainedTokenizer(vocab_size={self.vocab_size}, max_length={self.max_length}, "
            f"chat_template={'yes' if self.chat_template else 'no'})"
        )

    # --- vocabulary ------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(_check_text("token", token))

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id``, or None when out of range."""
        return self.backend.id_to_token(int(token_id))

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad_token")

    # --- encoding --------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, framed with the model's special tokens, truncated to
        ``max_length``.

        Args:
            text: any string (empty included).
            add_special_tokens: apply the post-processor (e.g. ``[CLS] ... [SEP]``).

        Returns:
            ``list[int]``.

        Raises:
            TypeError: ``text`` is not a str.
        """
        text = _check_text("text", text)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Encode and right-pad a batch.

        Args:
            texts: ``B`` strings.
            add_special_tokens: as in :meth:`encode`.

        Returns:
            ``(ids (B, S) long, keep (B, S) bool)`` with ``S`` the longest encoding; padded
            positions hold the pad id (0 without one) and ``keep == False``.

        Raises:
            TypeError: ``texts`` is a str or holds a non-str.
            ValueError: ``texts`` is empty.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a list of str, got {type(texts).__name__}")
        if not texts:
            raise ValueError("texts must hold at least one string, got an empty list")
        for i, t in enumerate(texts):
            _check_text(f"texts[{i}]", t)
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        rows = [e.ids for e in encodings]
        pad = self.pad_id if self.pad_id is not None else 0
        return pad_rows(rows, pad)  # (B, S), (B, S)

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (``(T,)`` tensor or list).

        Raises:
            ValueError: a tensor that is not 1-D.
        """
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"ids must be 1-D (T,), got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, by the model's chat template.

        Args:
            messages: list of ``{"role": ..., "content": ...}``.
            add_generation_prompt: end with the opening of the assistant's turn.

        Raises:
            ValueError: the model has no chat template; malformed messages.
            TypeError: malformed messages.
        """
        if not self.chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass a plain prompt string"
            )
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
        )

    def encode_chat(self, messages: object, *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation: the rendered template, encoded without adding special
        tokens again (the template writes them), as Hugging Face's ``apply_chat_template``.

        Raises:
            ValueError / TypeError: as :meth:`apply_chat_template`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)
