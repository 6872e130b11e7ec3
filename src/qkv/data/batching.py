"""Batches of token ids: padded seq2seq batches bucketed by length, and random LM windows.

Seq2seq convention (the same for every tokenizer, since all share PAD=0, BOS=1, EOS=2):

* the source is ``tokens + [EOS]``;
* the target is ``[BOS] + tokens + [EOS]``; the decoder reads ``tgt_in = target[:-1]`` and
  learns to predict ``tgt_out = target[1:]`` (teacher forcing);
* padding uses ``PAD_ID`` everywhere, so a loss with ``ignore_index=PAD_ID`` skips it, and the
  masks are SDPA *keep* masks (True = a real token that may be attended to).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.checks import positive_int
from qkv.data.tokenizer_base import PAD_ID, Tokenizer

__all__ = [
    "Example",
    "LMBatch",
    "Seq2SeqBatch",
    "bucket_batches",
    "collate",
    "encode_pairs",
    "lm_batches",
    "pad_rows",
]


@dataclass(frozen=True)
class Example:
    """One encoded pair: ``src`` = tokens + EOS, ``tgt`` = BOS + tokens + EOS."""

    src: tuple[int, ...]
    tgt: tuple[int, ...]


@dataclass(frozen=True)
class Seq2SeqBatch:
    """A padded batch of ``B`` encoded pairs.

    Attributes:
        src: ``(B, S)`` source ids, right-padded with ``PAD_ID``.
        tgt_in: ``(B, T)`` decoder inputs (target without its last token).
        tgt_out: ``(B, T)`` next-token labels (target without BOS), ``PAD_ID`` where padded.
        src_mask: ``(B, 1, 1, S)`` bool keep mask of real source tokens, for the encoder's
            self-attention and the decoder's cross-attention.
        tgt_mask: ``(B, 1, 1, T)`` bool keep mask of real decoder inputs (combine it with a
            causal mask for decoder self-attention).
        src_lengths: ``(B,)`` real source lengths.
        tgt_lengths: ``(B,)`` real lengths of ``tgt_in`` (= of ``tgt_out``).
        indices: ``(B,)`` positions of the examples in the list they were batched from.
    """

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    src_mask: Tensor
    tgt_mask: Tensor
    src_lengths: Tensor
    tgt_lengths: Tensor
    indices: Tensor

    @property
    def num_tokens(self) -> int:
        """Real target tokens to predict (the loss normaliser)."""
        return int(self.tgt_lengths.sum())

    def to(self, device: torch.device | str) -> Seq2SeqBatch:
        """The same batch with every tensor on ``device``."""
        return Seq2SeqBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class LMBatch:
    """``B`` windows of a token stream, or ``B`` rows of documents, for language modelling.

    Attributes:
        inputs: ``(B, T)`` ids.
        targets: ``(B, T)`` the ids one position later: ``targets[:, t] == stream[start + t + 1]``
            (rows of documents: the next id inside the document, and
            :data:`qkv.data.packing.IGNORE_INDEX` on padding).
        document_ids: ``(B, T)`` document ids of packed rows
            (:func:`qkv.data.packing.pack_lm`), for the model's ``document_ids=``; None for
            windows of a stream and for one document per row.
    """

    inputs: Tensor
    targets: Tensor
    document_ids: Tensor | None = None

    def to(self, device: torch.device | str) -> LMBatch:
        """The same batch on ``device``."""
        docs = None if self.document_ids is None else self.document_ids.to(device)
        return LMBatch(self.inputs.to(device), self.targets.to(device), docs)


def encode_pairs(
    pairs: Iterable[tuple[str, str]], src_tok: Tokenizer, tgt_tok: Tokenizer | None = None
) -> list[Example]:
    """Encode ``(source, target)`` strings: source + EOS, BOS + target + EOS.

    Args:
        pairs: string pairs (e.g. ``task.pairs("train")``).
        src_tok: tokenizer of the source side.
        tgt_tok: tokenizer of the target side; ``None`` uses ``src_tok``.

    Raises:
        ValueError: a pair that is not two strings.
    """
    tgt_tok = src_tok if tgt_tok is None else tgt_tok
    examples = []
    for n, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"pairs[{n}] must be a (source, target) pair, got {pair!r}")
        src = src_tok.encode(pair[0], add_eos=True)
        tgt = tgt_tok.encode(pair[1], add_bos=True, add_eos=True)
        examples.append(Example(tuple(src), tuple(tgt)))
    return examples


def pad_rows(
    rows: Sequence[Sequence[int]], pad_id: int = PAD_ID, *, min_len: int = 0
) -> tuple[Tensor, Tensor]:
    """Right-pad rows of token ids into one tensor, with the keep mask of the real tokens.

    Args:
        rows: ``B`` lists of ids (empty ones allowed).
        pad_id: the id written into padded positions.
        min_len: the least width ``S`` (``1`` keeps an all-empty batch one column wide).

    Returns:
        ``(ids (B, S) long, keep (B, S) bool)`` with ``S = max(min_len, longest row)``;
        ``keep`` is True on real tokens and False on padding.
    """
    S = max(min_len, *(len(r) for r in rows)) if rows else min_len
    ids = torch.full((len(rows), S), pad_id, dtype=torch.long)  # (B, S)
    keep = torch.zeros((len(rows), S), dtype=torch.bool)  # (B, S)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(list(row), dtype=torch.long)
        keep[b, : len(row)] = True
    return ids, keep


def _keep_mask(ids: Tensor, pad_id: int) -> Tensor:
    """SDPA keep mask ``(B, 1, 1, S)`` of the positions of ``ids (B, S)`` that are not padding
    (what :func:`qkv.attention.masks.padding_from_ids` builds; data needs only torch)."""
    return (ids != pad_id)[:, None, None, :]  # (B, 1, 1, S)


def collate(
    examples: Sequence[Example], indices: Sequence[int] | None = None, *, pad_id: int = PAD_ID
) -> Seq2SeqBatch:
    """Pad ``examples`` into one :class:`Seq2SeqBatch`.

    Args:
        examples: ``B >= 1`` examples; each source needs 1 token, each target 2 (BOS, EOS).
        indices: the ``(B,)`` numbers recorded in ``batch.indices``; default ``0..B-1``.
        pad_id: the padding id.

    Raises:
        ValueError: no examples, a too-short example, or ``indices`` of another length.
    """
    if len(examples) == 0:
        raise ValueError("examples must hold at least one Example, got none")
    indices = list(range(len(examples))) if indices is None else list(indices)
    if len(indices) != len(examples):
        raise ValueError(f"indices must have {len(examples)} entries, got {len(indices)}")
    for i, ex in zip(indices, examples, strict=True):
        if len(ex.src) < 1 or len(ex.tgt) < 2:
            raise ValueError(
                f"example {i} must have >= 1 source and >= 2 target ids (BOS, EOS), got "
                f"{len(ex.src)} and {len(ex.tgt)}"
            )
    src, _ = pad_rows([ex.src for ex in examples], pad_id)  # (B, S)
    tgt, _ = pad_rows([ex.tgt for ex in examples], pad_id)  # (B, T + 1)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]  # (B, T) each
    # The last real target token (EOS) is never an input, so tgt_in's real length is len - 1.
    tgt_lengths = torch.tensor([len(ex.tgt) - 1 for ex in examples])  # (B,)
    positions = torch.arange(tgt_in.shape[1])  # (T,)
    tgt_in = tgt_in.masked_fill(positions[None, :] >= tgt_lengths[:, None], pad_id)  # (B, T)
    return Seq2SeqBatch(
        src=src,
        tgt_in=tgt_in,
        tgt_out=tgt_out,
        src_mask=_keep_mask(src, pad_id),  # (B, 1, 1, S)
        tgt_mask=_keep_mask(tgt_in, pad_id),  # (B, 1, 1, T)
        src_lengths=torch.tensor([len(ex.src) for ex in examples]),
        tgt_lengths=tgt_lengths,
        indices=torch.tensor(indices),
    )


def bucket_batches(
    examples: Sequence[Example],
    *,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    pad_id: int = PAD_ID,
) -> list[Seq2SeqBatch]:
    """One epoch of batches with little padding: examples of similar length go together.

    1. Examples are sorted by ``(source length, target length)``; with ``shuffle``, ties are
       broken in a seeded random order, so batches change from seed to seed.
    2. Consecutive examples form a batch: ``batch_size`` examples each, or as many as fit in
       ``batch_tokens`` padded tokens (``B * max(S, T)``; a single longer example gets a batch
       of its own).
    3. With ``shuffle``, the batch order is shuffled (seeded), so lengths do not rise through
       the epoch. Pass ``seed=epoch`` for a new order each epoch.

    Every example appears in exactly one batch; ``batch.indices`` says which.

    Args:
        examples: from :func:`encode_pairs`.
        batch_size: examples per batch; give this or ``batch_tokens``.
        batch_tokens: padded tokens per batch; give this or ``batch_size``.
        shuffle: randomise tie order and batch order (else both follow length order).
        seed: the seed of that randomness.
        pad_id: the padding id.

    Returns:
        the batches; ``[]`` for no examples.

    Raises:
        ValueError: both or neither of ``batch_size`` / ``batch_tokens``, or not positive.
    """
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError(
            f"give exactly one of batch_size or batch_tokens, got batch_size={batch_size!r}, "
            f"batch_tokens={batch_tokens!r}"
        )
    if batch_tokens is None:
        positive_int("batch_size", batch_size)
    else:
        positive_int("batch_tokens", batch_tokens)
    rng = random.Random(seed)
    order = list(range(len(examples)))
    if shuffle:
        rng.shuffle(order)
    order.sort(key=lambda i: (len(examples[i].src), len(examples[i].tgt)))  # stable: keeps ties
    groups: list[list[int]] = []
    if batch_size is not None:
        groups = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    else:
        group: list[int] = []
        width = 0  # the padded length of ``group``
        for i in order:
            need = max(len(examples[i].src), len(examples[i].tgt) - 1)
            if group and (len(group) + 1) * max(width, need) > batch_tokens:
                groups.append(group)
                group, width = [], 0
            group.append(i)
            width = max(width, need)
        if group:
            groups.append(group)
    if shuffle:
        rng.shuffle(groups)
    return [collate([examples[i] for i in g], g, pad_id=pad_id) for g in groups]


def lm_batches(
    ids: Sequence[int] | Tensor,
    block_size: int,
    batch_size: int,
    seed: int = 0,
    *,
    num_batches: int | None = None,
) -> Iterator[LMBatch]:
    """Random windows of a token stream, with targets shifted by one (nanoGPT style).

    Each batch draws ``batch_size`` start positions uniformly from ``[0, N - block_size - 1]``
    with a ``torch.Generator`` seeded by ``seed``; the same seed gives the same batches.

    Args:
        ids: ``(N,)`` the token stream (a 1-D integer tensor or a list of ints).
        block_size: ``T``, the window length; ``N`` must be at least ``T + 1``.
        batch_size: ``B`` windows per batch.
        seed: seed of the start positions.
        num_batches: how many batches to yield; default ``max(1, (N - 1) // (B * T))``, about
            one pass over the stream.

    Returns:
        an iterator of :class:`LMBatch` with ``(B, T)`` tensors (made lazily, one per step).

    Raises:
        ValueError: a stream that is not 1-D integers, or not longer than ``block_size``, or
            sizes that are not positive.
    """
    stream = torch.as_tensor(ids)
    if stream.dim() != 1 or stream.is_floating_point() or stream.dtype == torch.bool:
        raise ValueError(
            f"ids must be a 1-D integer stream (N,), got shape {tuple(stream.shape)} and "
            f"dtype {stream.dtype}"
        )
    positive_int("block_size", block_size)
    positive_int("batch_size", batch_size)
    if stream.numel() < block_size + 1:
        raise ValueError(
            f"ids must hold at least block_size + 1 = {block_size + 1} tokens, got {stream.numel()}"
        )
    if num_batches is None:
        num_batches = max(1, (stream.numel() - 1) // (batch_size * block_size))
    positive_int("num_batches", num_batches)
    return _windows(stream.long(), block_size, batch_size, seed, num_batches)


def _windows(stream: Tensor, T: int, B: int, seed: int, num_batches: int) -> Iterator[LMBatch]:
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(T + 1)  # (T + 1,)
    for _ in range(num_batches):
        starts = torch.randint(0, stream.numel() - T, (B,), generator=generator)  # (B,)
        window = stream[starts[:, None] + offsets[None, :]]  # (B, T + 1)
        yield LMBatch(inputs=window[:, :-1], targets=window[:, 1:])  # (B, T) each
