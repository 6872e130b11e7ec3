"""Prompt-lookup decoding: greedy search that checks several tokens per forward, drafted from
the context itself.

When the output copies its input (summaries, edits, code, "repeat the paragraph above"), the
next tokens are often in the context already. Prompt lookup (Saxena, 2023, "Prompt Lookup
Decoding"; transformers' ``prompt_lookup_num_tokens``) drafts them by string matching instead
of with a second model, and verifies them as speculative decoding does (Leviathan et al.,
2023, "Fast Inference from Transformers via Speculative Decoding"), greedily:

1. the prompt runs once and gives the first token;
2. the last ``n`` tokens of the context (prompt + output so far, ``n`` from ``ngram`` down to
   1) are searched in the context; the tokens after the latest earlier occurrence are the
   draft ``d`` (up to ``draft`` of them, see :func:`find_draft`);
3. the model runs the last token and the draft, ``1 + k`` tokens, in one cached forward: its
   greedy choices ``c_0 .. c_k`` are what it would choose after each prefix of the draft;
4. the longest prefix with ``d_i == c_i`` (``m`` tokens) is accepted, plus ``c_m``, the
   model's own choice after it: ``m + 1`` new tokens for one forward, and at least one;
5. the cache is cropped back to the accepted tokens (:meth:`qkv.nn.KVCache.crop`), so the
   rejected draft leaves nothing behind.

Every output token is the model's argmax after exactly the tokens before it, so the tokens are
:func:`~qkv.generate.greedy`'s. One caveat, shared by every speculative decoder: the forward of
``1 + k`` tokens computes the same logits as ``1 + k`` single steps with other kernel shapes
(a causal mask, other reduction orders), equal up to rounding; an argmax whose top two logits
lie within that rounding could, in principle, tie-break the other way.

Decoder-only models, one prompt (no batch: each row would accept a different number of
tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention.threads import fitted
from qkv.checks import is_int, positive_int
from qkv.generate.args import length_limit, output_vocab, special_ids
from qkv.generate.session import decoding, model_device

__all__ = ["LookupResult", "find_draft", "prompt_lookup"]


@dataclass(frozen=True)
class LookupResult:
    """What :func:`prompt_lookup` generated, and how many forwards it took.

    Attributes:
        tokens: the new token ids, EOS not included (at most ``max_new_tokens``).
        forwards: model calls, the prompt's included (:func:`~qkv.generate.greedy` makes one
            per token).
        drafted: draft tokens fed to the model.
        accepted: draft tokens equal to the model's own choices, and so output (an accepted
            EOS ends the output instead; a draft stops at EOS). Without EOS each forward adds
            its accepted tokens and one of its own: ``len(tokens) == forwards + accepted``.
    """

    tokens: list[int]
    forwards: int
    drafted: int
    accepted: int

    @property
    def acceptance(self) -> float:
        """``accepted / drafted`` (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def find_draft(context: Tensor, ngram: int, draft: int) -> list[int]:
    """Up to ``draft`` tokens predicted to follow ``context``, copied from ``context`` itself.

    For ``n`` from ``min(ngram, L - 1)`` down to 1, the last ``n`` tokens are searched among
    the earlier windows of ``n`` tokens; the first ``n`` with a match wins, and its latest
    (most recent) match ``i``. The draft is what followed it, ``context[i + n:]``, cut to
    ``draft`` tokens. A recent match has fewer than ``draft`` tokens after it; the draft then
    repeats them, as an overlapping copy (LZ77) does: the text is assumed to go on repeating
    with period ``L - n - i``. (transformers' ``PromptLookupCandidateGenerator`` takes the
    earliest match instead, and stops at the end of the context.)

    Args:
        context: ``(L,)`` token ids (prompt and output so far).
        ngram: the longest suffix searched, >= 1.
        draft: the most tokens returned, >= 1.

    Returns:
        the draft, ``0 <= len <= draft`` ints (empty: no suffix occurs earlier).
    """
    L = context.numel()
    for n in range(min(ngram, L - 1), 0, -1):
        suffix = context[L - n :]  # (n,)
        windows = context[: L - 1].unfold(0, n, 1)  # (L - n, n): windows followed by a token
        hits = (windows == suffix).all(dim=1).nonzero()  # (M, 1)
        if hits.numel():
            start = int(hits[-1]) + n
            tail = context[start : start + draft].tolist()
            return [tail[t % len(tail)] for t in range(draft)]
    return []


def _prompt(prompt: object, vocab: int | None) -> list[int]:
    """``prompt`` (a list of ids or a 1-D integer tensor) as a non-empty list in ``[0, V)``."""
    if isinstance(prompt, Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt must be a 1-D integer tensor or a list of token ids, got "
                             f"shape {tuple(prompt.shape)}, dtype {prompt.dtype}")  # fmt: skip
        prompt = prompt.tolist()
    if (
        isinstance(prompt, str | bytes)
        or not isinstance(prompt, Sequence)
        or not all(is_int(t) for t in prompt)
    ):
        raise ValueError(f"prompt must be a list of token ids (ints), got {prompt!r:.80}")
    if not prompt:
        raise ValueError("prompt is empty; give at least one token (e.g. BOS)")
    if vocab is not None and not all(0 <= t < vocab for t in prompt):
        raise ValueError(f"prompt has ids outside the vocabulary [0, {vocab}): {prompt!r:.80}")
    return list(prompt)


def _check_model(model: object) -> None:
    if not isinstance(model, nn.Module) or not hasattr(model, "new_cache"):
        raise ValueError(f"model must be a decoder-only LM with new_cache() (e.g. "
                         f"qkv.models.DecoderLM), got {type(model).__name__}")  # fmt: skip
    if hasattr(model, "encode") and hasattr(model, "decode"):
        raise ValueError(f"model must be decoder-only; {type(model).__name__} is an "
                         f"encoder-decoder model (use qkv.generate.greedy)")  # fmt: skip


def _new_cache(model: nn.Module, room: int):
    """A cache with room for ``room`` tokens that keeps every position: a rolling cache
    (sliding windows) drops old positions that a cropped-back draft would need again."""
    params = inspect.signature(model.new_cache).parameters
    options = {"max_len": room, "rolling": False}
    return model.new_cache(**{k: v for k, v in options.items() if k in params})


@fitted
def _choices(model: nn.Module, tokens: list[int], cache, last: int) -> list[int]:
    """Feed ``tokens`` after the cache; the model's greedy choice after each of the ``last``
    final tokens (``last`` ints)."""
    ids = torch.tensor([tokens], dtype=torch.long, device=model_device(model))  # (1, T)
    logits = model(ids, cache=cache)  # (1, T, V)
    return logits[0, -last:].float().argmax(-1).tolist()  # (last,)


def _agreed(draft: list[int], choices: list[int]) -> int:
    """``m``: how many leading draft tokens equal the model's choices."""
    m = 0
    while m < len(draft) and draft[m] == choices[m]:
        m += 1
    return m


@decoding
def prompt_lookup(
    model: nn.Module,
    prompt: Sequence[int] | Tensor,
    *,
    max_new_tokens: int = 32,
    ngram: int = 3,
    draft: int = 10,
    eos_id: int | None = None,
) -> LookupResult:
    """Greedy decoding of one prompt, several tokens per forward when the output copies the
    context (see the module docstring); the tokens of :func:`~qkv.generate.greedy`.

    Args:
        model: a decoder-only LM with ``new_cache()`` and ``forward(ids (1, T), cache=...)
            -> (1, T, V)``, e.g. :class:`qkv.models.DecoderLM`.
        prompt: the token ids, a list or a ``(P,)`` integer tensor, ``P >= 1``.
        max_new_tokens: the most tokens generated (never more: a draft is cut to the room
            left, less the token the model adds after it).
        ngram: the longest context suffix looked up (then shorter ones, down to 1).
        draft: the most tokens drafted per forward.
        eos_id: stop at this token (not output); None = the model config's, as
            :func:`~qkv.generate.greedy` (no EOS: run to ``max_new_tokens``).

    Returns:
        :class:`LookupResult`: the tokens (EOS not included) and the forward counts.

    Raises:
        ValueError: a model that is not a decoder-only LM with ``new_cache``; a prompt that is
            empty, not ints, or outside the vocabulary; ``max_new_tokens``, ``ngram`` or
            ``draft`` not an int >= 1; an ``eos_id`` outside the vocabulary; a prompt plus
            ``max_new_tokens`` past a learned position table.
    """
    _check_model(model)
    ids = _prompt(prompt, output_vocab(model))
    N = positive_int("max_new_tokens", max_new_tokens)
    positive_int("ngram", ngram)
    positive_int("draft", draft)
    eos = special_ids(model, eos_id, None, None, seq2seq=False)[0]
    limit = length_limit(model)
    if limit is not None and len(ids) + N > limit:
        raise ValueError(f"a prompt of {len(ids)} tokens + max_new_tokens={N} exceeds the "
                         f"model's max_len={limit} (learned positions)")  # fmt: skip
    return _decode(model, ids, N, ngram, draft, eos)


def _decode(model: nn.Module, ids: list[int], N: int, ngram: int, draft: int,
            eos: int | None) -> LookupResult:  # fmt: skip
    """The loop of :func:`prompt_lookup`, on checked arguments."""
    P = len(ids)
    context = torch.tensor(ids + [0] * N, dtype=torch.long)  # (P + N,), filled to P + len(out)
    cache = _new_cache(model, P + N)
    out: list[int] = []
    drafted = accepted = 0
    # 1) the prompt gives the first token
    new, forwards = _choices(model, ids, cache, 1), 1
    while True:
        # 2) keep the new tokens up to EOS; stop there or at the limit
        if eos is not None and eos in new:
            out += new[: new.index(eos)]
            break
        context[P + len(out) : P + len(out) + len(new)] = torch.tensor(new)
        out += new
        if len(out) >= N:
            break
        # 3) draft from the context; the forward adds one token of its own, hence room - 1
        L, room = P + len(out), N - len(out) - 1
        d = find_draft(context[:L], ngram, min(draft, room)) if room else []
        if eos is not None and eos in d:
            d = d[: d.index(eos) + 1]  # nothing after EOS can be output
        # 4) one forward of the last token + the draft; the cache held the L - 1 before it
        choices = _choices(model, [out[-1], *d], cache, 1 + len(d))  # (1 + k,)
        m = _agreed(d, choices)
        forwards, drafted, accepted = forwards + 1, drafted + len(d), accepted + m
        # 5) roll the cache back to the context + the accepted draft tokens
        if m < len(d):
            cache.crop(L + m)
        new = choices[: m + 1]
    return LookupResult(out, forwards, drafted, accepted)
