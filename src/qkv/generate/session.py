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

Inputs that are not token ids (a spectrogram, an image) are encoded by the caller and passed
as :class:`EncodedInputs`: the encoder's memory plus a forced decoder prompt (Whisper's
``<|startoftranscript|><|notimestamps|>``) and tokens never to generate; every decoding
method then runs a :class:`MemorySession` on them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from qkv.attention.threads import fitted
from qkv.checks import carry_checked, is_int, positive_int, remember_checked
from qkv.generate.args import length_limit

__all__ = [
    "DecoderSession",
    "EncodedInputs",
    "MemorySession",
    "Seq2SeqSession",
    "decoding",
    "is_seq2seq",
    "make_session",
    "model_device",
]

Inputs = Sequence[Sequence[int]] | Tensor


_F = TypeVar("_F", bound=Callable[..., Any])


def decoding(fn: _F) -> _F:
    """Run a decoding method under ``torch.inference_mode`` (no autograd bookkeeping at all:
    about 15% of an eager step of a small model) and give back ordinary tensors (clones), so
    callers may modify what they receive in place."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return _plain(out)

    return run  # type: ignore[return-value]


def _plain(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.clone()
    if isinstance(out, tuple | list):
        return type(out)(_plain(o) for o in out)
    return out


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
        max_new_tokens: the most tokens that will be generated (checked against a learned
            position table's size, :func:`~qkv.generate.args.length_limit`; rotary and ALiBi
            models generate past ``max_len``, as transformers does).

    Raises:
        ValueError: empty or malformed prompts, ids outside the vocabulary, or a prompt plus
            ``max_new_tokens`` longer than a learned position table.
    """

    def __init__(self, model: nn.Module, prompts: Inputs, max_new_tokens: int) -> None:
        rows = _rows(prompts, "prompts")
        config = getattr(model, "config", None)
        _check_rows(rows, "prompts", getattr(config, "vocab_size", None))
        P = max(len(r) for r in rows)
        limit = length_limit(model)  # rotary, ALiBi: none (the forward takes any length)
        if limit is not None and P + max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {P} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_len={limit} (learned positions)"
            )
        device = model_device(model)
        self.model, self.batch = model, len(rows)
        self.limit = getattr(model, "position_limit", None)  # what the model checks against
        ids = torch.zeros((self.batch, P), dtype=torch.long)  # (B, P), 0 under the mask
        keep = torch.zeros((self.batch, P), dtype=torch.bool)  # (B, P)
        for b, row in enumerate(rows):
            ids[b, P - len(row) :] = torch.tensor(row)
            keep[b, P - len(row) :] = True
        self.ids = ids.to(device)
        # Without padding, no mask at all: the model keeps its plain causal path.
        self.mask = None if bool(keep.all()) else keep.to(device)  # (B, S) as S grows
        self.positions = remember_checked(  # (B, P), in [0, P): the model need not read them
            (keep.long().cumsum(1) - 1).clamp(min=0).to(device), ("positions", self.limit),
            unversioned=True)
        # Room for every token up front: no step regrows (copies) the cache.
        params = inspect.signature(model.new_cache).parameters
        room = {"max_len": P + max_new_tokens} if "max_len" in params else {}
        self.cache = model.new_cache(**room)

    @fitted
    def first(self) -> Tensor:
        """Run the prompts; returns ``(B, V)`` logits of the first new token."""
        positions = None if self.mask is None else self.positions
        logits = self.model(self.ids, attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, P, V)  # fmt: skip
        self.next_pos = remember_checked(self.positions[:, -1:] + 1,
                                         ("positions", self.limit), unversioned=True)
        return logits[:, -1].float()  # (B, V)

    @fitted
    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)``; returns ``(B, V)`` logits of the token after them."""
        positions = None
        if self.mask is not None:
            ones = self.mask.new_ones((self.mask.shape[0], 1))  # (B, 1)
            self.mask = torch.cat([self.mask, ones], dim=1)  # (B, S + 1)
            positions = self.next_pos
        ids = carry_checked(tokens, tokens[:, None])  # (B, 1): chosen by a loop, not re-read
        logits = self.model(ids, attention_mask=self.mask, cache=self.cache,
                            positions=positions)  # (B, 1, V)  # fmt: skip
        # In range by construction (each forward checks the length against the table), so
        # the model does not read them back at the next step.
        self.next_pos = remember_checked(self.next_pos + 1, ("positions", self.limit),
                                         unversioned=True)
        return logits[:, -1].float()  # (B, V)

    def select(self, rows: Tensor) -> None:
        """Keep batch rows ``rows (B',)`` in that order."""
        self.cache.reorder(rows)
        self.next_pos = remember_checked(self.next_pos[rows], ("positions", self.limit),
                                         unversioned=True)
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

    @fitted
    def first(self) -> Tensor:
        """Encode (done) and feed BOS; returns ``(B, V)`` logits of the first token."""
        bos = torch.full((self.batch,), self.bos_id, dtype=torch.long, device=self.memory.device)
        return self.next(bos)

    @fitted
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


@dataclass(frozen=True)
class EncodedInputs:
    """Already encoded inputs of an encoder-decoder model, and how to start decoding them.

    Attributes:
        memory: ``(B, S, E)``, the output of the model's ``encode``.
        prompts: the forced decoder prefix of each row: ``B`` id lists of one length ``P >= 1``
            or a ``(B, P)`` tensor; generation starts after it (replacing BOS).
        suppress: token ids never generated (their logits are set to ``-inf``).
        suppress_first: token ids not generated as the first new token (e.g. EOS, a space).
        memory_mask: cross-attention keep mask broadcastable to ``(B, H, T, S)``, or None.
    """

    memory: Tensor
    prompts: Inputs
    suppress: Sequence[int] = ()
    suppress_first: Sequence[int] = ()
    memory_mask: Tensor | None = None


class MemorySession:
    """Decoding state of an encoder-decoder model from :class:`EncodedInputs`.

    Args:
        model: ``decode(tokens, memory, memory_mask, *, cache)`` and ``new_cache()``, e.g.
            :class:`qkv.models.speech.SpeechSeq2Seq`.
        inputs: the memory, prompts and suppressed tokens.
        max_new_tokens: the most tokens that will be generated.

    The cross-attention keys/values are projected from the memory once, at :meth:`first`,
    and held in the cache (``LayerKVCache.set_static``); :meth:`select` reorders them.

    Raises:
        TypeError: ``inputs`` not :class:`EncodedInputs`, a memory that is not a tensor.
        ValueError: prompts of unequal lengths, ids outside the vocabulary, a memory whose
            batch differs from the prompts', a prompt plus ``max_new_tokens`` beyond the
            model's ``max_len``.
    """

    def __init__(self, model: nn.Module, inputs: EncodedInputs, max_new_tokens: int) -> None:
        if not isinstance(inputs, EncodedInputs):
            raise TypeError(f"inputs must be EncodedInputs, got {type(inputs).__name__}")
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", getattr(config, "tgt_vocab_size", None))
        rows = _rows(inputs.prompts, "prompts")
        _check_rows(rows, "prompts", vocab)
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"prompts must all have one length, got lengths "
                             f"{sorted({len(r) for r in rows})}")  # fmt: skip
        memory = inputs.memory
        if not isinstance(memory, Tensor) or memory.dim() != 3:
            got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise TypeError(f"memory must be a (B, S, E) tensor, got {got}")
        if memory.shape[0] != len(rows):
            raise ValueError(f"memory has batch size {memory.shape[0]} but there are "
                             f"{len(rows)} prompts")  # fmt: skip
        limit = _max_len(model)
        if limit is not None and len(rows[0]) + max_new_tokens > limit:
            raise ValueError(f"a prompt of {len(rows[0])} tokens + max_new_tokens="
                             f"{max_new_tokens} exceeds the model's max_len={limit}")  # fmt: skip
        device = model_device(model)
        self.model, self.batch = model, len(rows)
        self.prompts = torch.tensor(rows, dtype=torch.long, device=device)  # (B, P)
        self.memory, self.memory_mask = memory, inputs.memory_mask
        self.suppress = _ban_list(inputs.suppress, vocab, "suppress", device)
        self.suppress_first = _ban_list(inputs.suppress_first, vocab, "suppress_first", device)
        self.cache = model.new_cache()

    def _logits(self, tokens: Tensor) -> Tensor:
        logits = self.model.decode(tokens, self.memory, self.memory_mask,
                                   cache=self.cache)[:, -1].float()  # (B, V)  # fmt: skip
        logits[:, self.suppress] = float("-inf")
        return logits

    @fitted
    def first(self) -> Tensor:
        """Feed the prompts (projecting the memory's keys/values once); returns ``(B, V)``
        logits of the first new token."""
        logits = self._logits(self.prompts)  # (B, V)
        logits[:, self.suppress_first] = float("-inf")
        return logits

    @fitted
    def next(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens (B,)``; returns ``(B, V)`` logits of the token after them."""
        return self._logits(tokens[:, None])

    def select(self, rows: Tensor) -> None:
        """Keep batch rows ``rows (B',)`` in that order (memory, mask and cache)."""
        self.cache.reorder(rows)
        self.memory = self.memory[rows]  # (B', S, E)
        if self.memory_mask is not None and self.memory_mask.shape[0] > 1:
            self.memory_mask = self.memory_mask[rows]  # (B', 1, 1, S)
        self.batch = rows.numel()


def _ban_list(ids: object, vocab: int | None, name: str, device: torch.device) -> Tensor:
    """Token ids to suppress as a ``(N,)`` long tensor, checked against the vocabulary."""
    if isinstance(ids, (str, Tensor)) or not isinstance(ids, Sequence) or any(
        not is_int(t) or t < 0 or (vocab is not None and t >= vocab) for t in ids
    ):
        raise ValueError(f"{name} must be a list of token ids in [0, {vocab}), got {ids!r:.80}")
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def make_session(
    model: nn.Module, inputs: Inputs | EncodedInputs, max_new_tokens: int, *,
    pad_id: int | None, bos_id: int | None,
) -> DecoderSession | Seq2SeqSession | MemorySession:  # fmt: skip
    """The session for ``model``'s kind (see :func:`is_seq2seq`), or a
    :class:`MemorySession` for :class:`EncodedInputs` (compiled decoding:
    :func:`qkv.generate.compiled.open_session`).

    Raises:
        TypeError: a model of neither kind; ValueError: as the sessions.
    """
    positive_int("max_new_tokens", max_new_tokens)
    if isinstance(inputs, EncodedInputs):
        if not is_seq2seq(model):
            raise TypeError(f"EncodedInputs need an encoder-decoder model, got "
                            f"{type(model).__name__}")  # fmt: skip
        return MemorySession(model, inputs, max_new_tokens)
    if not getattr(model, "encodes_tokens", True):
        raise TypeError(
            f"{type(model).__name__} encodes features, not token ids: pass "
            "qkv.generate.session.EncodedInputs(model.encode(features), prompts) as the inputs"
        )
    if is_seq2seq(model):
        return Seq2SeqSession(model, inputs, max_new_tokens, 0 if pad_id is None else pad_id,
                              bos_id)  # fmt: skip
    return DecoderSession(model, inputs, max_new_tokens)
