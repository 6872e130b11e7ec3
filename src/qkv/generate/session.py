"""A decoding session: the one interface greedy search, sampling and beam search drive.

A session holds a batch of ``B`` rows being decoded and the model's KV cache:

* ``first() -> logits (B, V)``: run the prompt (decoder-only) or the encoder and BOS
  (encoder-decoder); the logits of the first new token.
* ``next(tokens (B,)) -> logits (B, V)``: feed one token per row, get the next logits; only
  the new token is computed, every earlier key and value comes from the cache.
* ``select(rows (B',))``: keep rows ``rows`` in that order (beam search: expand each prompt
  into ``K`` beams, then reorder beams after each step), via ``KVCache.reorder``.

Decoder-only prompts of different lengths are **left**-padded so that every row's next token
is in the last column; ``attention_mask`` hides the padding and ``positions`` count each
row's real tokens from 0, so a row computes what it computes alone. Encoder-decoder sources
are right-padded with ``pad_id`` (the encoder masks them); every row starts from BOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checks import is_int, positive_int

__all__ = [
    "DecoderSession",
    "Seq2SeqSession",
    "is_seq2seq",
    "make_session",
    "model_device",
]

Inputs = Sequence[Sequence[int]] | Tensor


def is_seq2seq(model: nn.Module) -> bool:
    """True for encoder-decoder models (``encode`` and ``decode``), False for decoder-only.

    Raises:
        TypeError: a module that is neither (no ``new_cache``).
    """
    if not hasattr(model, "new_cache"):
        raise TypeError(
            f"model must be a decoder-only LM or an encoder-decoder model with new_cache(), "
            f"got {type(model).__name__}"
        )
    return hasattr(model, "encode") and hasattr(model, "decode")


def _rows(inputs: Inputs, what: str) -> list[list[int]]:
    """``inputs`` as lists of ints: a ``(B, L)`` integer tensor or a sequence of id lists."""
    if isinstance(inputs, Tensor):
        if inputs.dim() != 2 or inputs.is_floating_point() or inputs.dtype == torch.bool:
            raise ValueError(
                f"{what} must be a (B, L) integer tensor or a list of id lists, got shape "
                f"{tuple(inputs.shape)} and dtype {inputs.dtype}"
            )
        return inputs.tolist()
    if isinstance(inputs, str) or not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise ValueError(f"{what} must be a non-empty list of id lists, got {inputs!r:.80}")
    rows = []
    for i, row in enumerate(inputs):
        if isinstance(row, Tensor):
            row = row.tolist()
        if isinstance(row, str) or not isinstance(row, Sequence):
            raise ValueError(f"{what}[{i}] must be a list of token ids, got {row!r:.80}")
        if any(not is_int(t) for t in row):
            raise ValueError(f"{what}[{i}] must hold ints, got {list(row)!r:.80}")
        rows.append(list(row))
    return rows


def _check_rows(rows: list[list[int]], what: str, vocab: int | None) -> None:
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"{what}[{i}] is empty; give at least one token (e.g. BOS)")
        if vocab is not None and not all(0 <= t < vocab for t in row):
            raise ValueError(f"{what}[{i}] has ids outside [0, {vocab}): {row!r:.80}")


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _max_len(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "max_len", None)


class DecoderSession:
    """Decoding state of a decoder-only model (see the module docstring).

    Args:
        model: ``forward(input_ids, *, attention_mask, cache, positions) -> (B, T, V)`` and
            ``new_cache()``, e.g. :class:`qkv.models.DecoderLM`.
        prompts: ``B`` prompts of token ids (any lengths >= 1), or a ``(B, P)`` tensor.
        max_new_tokens: the most tokens that will be generated (checked against the model's
            ``max_len``).

    Raises:
        ValueError: empty or malformed prompts, ids outside the vocabulary, or a prompt plus
            ``max_new_tokens`` longer than the model's ``max_len``.
    """

    def __init__(self, model: nn.Module, prompts: Inputs, max_new_tokens: int) -> None:
        rows = _rows(prompts, "prompts")
        config = getattr(model, "config", None)
        _check_rows(rows, "prompts", getattr(config, "vocab_size", None))
        P = max(len(r) for r in rows)
        limit = _max_len(model)
        if limit is not None and P + max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {P} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_len={limit}"
            )
        device = model_device(model)
        self.model, self.batch = model, len(rows)
        ids = torch.zeros((self.batch, P), dtype=torch.long)  # (B, P), 0 under the mask
        keep = torch.zeros((self.batch, P), dtype=torch.bool)  # (B, P)
        for b, row in enumerate(rows):
            ids[b, P - len(row) :] = torch.tensor(row)
            keep[b, P - len(row) :] = True
        self.ids = ids.to(device)
        # Without padding, no mask at all: the model keeps its plain causal path.
        self.mask = None if bool(keep.all()) else keep.to(device)  # (B, S) as S grows
        self.positions = (keep.long().cumsum(1) - 1).clamp(min=0).to(device)  # (B, P)
        self.cache = model.new_cache()

    def first(self) -> Tensor:
        """Run the prompts; returns ``(B, V)`` logits of the first new token."""
        positions = None if self.mask is None else self.positions
        logits = self.model(self.ids, attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, P, V)  # fmt: skip
        self.next_pos = self.positions[:, -1:] + 1  # (B, 1)
        return logits[:, -1].float()  # (B, V)

    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)``; returns ``(B, V)`` logits of the token after them."""
        positions = None
        if self.mask is not None:
            ones = self.mask.new_ones((self.mask.shape[0], 1))  # (B, 1)
            self.mask = torch.cat([self.mask, ones], dim=1)  # (B, S + 1)
            positions = self.next_pos
        logits = self.model(tokens[:, None], attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, 1, V)  # fmt: skip
        self.next_pos = self.next_pos + 1
        return logits[:, -1].float()  # (B, V)

    def select(self, rows: Tensor) -> None:
        """Keep batch rows ``rows (B',)`` in that order."""
        self.cache.reorder(rows)
        self.next_pos = self.next_pos[rows]  # (B', 1)
        if self.mask is not None:
            self.mask = self.mask[rows]  # (B', S)
        self.batch = rows.numel()


class Seq2SeqSession:
    """Decoding state of an encoder-decoder model (see the module docstring).

    Args:
        model: ``encode(src, src_mask)``, ``decode(tgt_in, memory, src_mask, *, cache)`` and
            ``new_cache()``, e.g. :class:`qkv.models.Seq2SeqTransformer`.
        sources: ``B`` sources of token ids (usually ending in EOS), or a ``(B, S)`` tensor
            right-padded with ``pad_id``.
        max_new_tokens: the most tokens that will be generated.
        pad_id, bos_id: padding and decoder start ids.

    Raises:
        ValueError: empty or malformed sources, ids outside the vocabulary, a source or
            ``max_new_tokens`` longer than the model's ``max_len``, or no ``bos_id``.
    """

    def __init__(
        self, model: nn.Module, sources: Inputs, max_new_tokens: int, pad_id: int, bos_id: Any
    ) -> None:
        if bos_id is None:
            raise ValueError("bos_id is needed to start decoding; the model config has none")
        config = getattr(model, "config", None)
        if isinstance(sources, Tensor):
            rows = [[t for t in r if t != pad_id] for r in _rows(sources, "sources")]
        else:
            rows = _rows(sources, "sources")
        _check_rows(rows, "sources", getattr(config, "src_vocab_size", None))
        S = max(len(r) for r in rows)
        limit = _max_len(model)
        if limit is not None and max(S, max_new_tokens) > limit:
            raise ValueError(
                f"a source of {S} tokens or max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_len={limit}"
            )
        device = model_device(model)
        src = torch.full((len(rows), S), pad_id, dtype=torch.long)  # (B, S)
        for b, row in enumerate(rows):
            src[b, : len(row)] = torch.tensor(row)
        src = src.to(device)
        self.model, self.batch, self.bos_id = model, len(rows), bos_id
        self.src_mask = (src != pad_id)[:, None, None, :]  # (B, 1, 1, S) keep
        self.memory = model.encode(src, self.src_mask)  # (B, S, E)
        self.cache = model.new_cache()

    def first(self) -> Tensor:
        """Encode (done) and feed BOS; returns ``(B, V)`` logits of the first token."""
        bos = torch.full((self.batch,), self.bos_id, dtype=torch.long, device=self.memory.device)
        return self.next(bos)

    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)``; returns ``(B, V)`` logits of the token after them."""
        logits = self.model.decode(tokens[:, None], self.memory, self.src_mask,
                                   cache=self.cache)  # (B, 1, V)  # fmt: skip
        return logits[:, -1].float()  # (B, V)

    def select(self, rows: Tensor) -> None:
        """Keep batch rows ``rows (B',)`` in that order (memory, mask and cache)."""
        self.cache.reorder(rows)
        self.memory = self.memory[rows]  # (B', S, E)
        self.src_mask = self.src_mask[rows]  # (B', 1, 1, S)
        self.batch = rows.numel()


def make_session(
    model: nn.Module, inputs: Inputs, max_new_tokens: int, *, pad_id: int | None,
    bos_id: int | None,
) -> DecoderSession | Seq2SeqSession:  # fmt: skip
    """The session for ``model``'s kind (see :func:`is_seq2seq`).

    Raises:
        TypeError: a model of neither kind; ValueError: as the sessions.
    """
    positive_int("max_new_tokens", max_new_tokens)
    if is_seq2seq(model):
        return Seq2SeqSession(model, inputs, max_new_tokens, 0 if pad_id is None else pad_id,
                              bos_id)  # fmt: skip
    return DecoderSession(model, inputs, max_new_tokens)
