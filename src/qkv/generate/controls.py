"""Generation controls: logit bias, repetition, frequency and presence penalties, no-repeat
n-grams, bad words, minimum and forced length, min-p; each the same as the logits processor of
transformers' ``generate``, or, for OpenAI's three (logit bias, frequency and presence
penalties), as OpenAI's API defines them.

One :class:`GenerationControls` record carries them all, every field "off" by default, and is
passed to :func:`~qkv.generate.greedy`, :func:`~qkv.generate.sample`,
:func:`~qkv.generate.stream` or :func:`~qkv.generate.generate` as ``controls=``. At each step
:meth:`GenerationControls.apply` edits the ``(B, V)`` logits from what each row holds so far,
``ids (B, L)``: the row's prompt (decoder-only), BOS (encoder-decoder) or forced prompt
(encoded inputs), then every token generated. Rows are left-padded with :data:`NO_TOKEN`
(never a token id), so a short prompt's padding counts as no token at all: a batch edits its
rows as each row alone.

The processors run in transformers' order (``_get_logits_processor`` in
``transformers/generation/utils.py``, v5.x): repetition penalty, no-repeat n-gram, bad words,
minimum new tokens, forced EOS; then, when sampling, temperature, top-k, top-p and min-p, the
last of which acts in :func:`~qkv.generate.sampling.filter_logits`. OpenAI's come around them
as vLLM orders them: the logit bias first, the frequency and presence penalties right after
the repetition penalty (both additive, over the tokens *generated* so far, not the prompt).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.checks import is_int, is_number
from qkv.generate.args import ParamError
from qkv.generate.session import DecoderSession, MemorySession, Seq2SeqSession

__all__ = ["NO_TOKEN", "GenerationControls", "check_min_p", "checked_controls", "prompt_ids"]

NO_TOKEN = -1  # left padding of a history: never a token id, so never "present"
PENALTY_RANGE = 2.0  # OpenAI's range of the frequency and presence penalties: [-2, 2]
BIAS_RANGE = 100.0  # OpenAI's range of a logit bias: [-100, 100]


def check_min_p(min_p: object) -> None:
    """Raises :class:`~qkv.generate.args.ParamError` (a ``ValueError``) unless ``min_p`` is
    None or a number in ``[0, 1]``."""
    if min_p is not None and (not is_number(min_p) or not 0.0 <= min_p <= 1.0):
        raise ParamError("min_p", f" must be None or a number in [0, 1], got {min_p!r}")


def _words(value: object) -> tuple[tuple[int, ...], ...]:
    """``bad_words_ids`` as a tuple of non-empty tuples of ids >= 0, or ValueError."""
    bad = isinstance(value, str | bytes | Tensor) or not isinstance(value, Sequence)
    words = () if bad else tuple(value)  # type: ignore[arg-type]
    if bad or any(isinstance(w, str | bytes | Tensor) or not isinstance(w, Sequence) or not w
                  or any(not is_int(t) or t < 0 for t in w) for w in words):  # fmt: skip
        raise ParamError("bad_words_ids", f" must be a sequence of non-empty sequences of "
                         f"token ids >= 0, got {value!r:.80}")  # fmt: skip
    return tuple(tuple(int(t) for t in w) for w in words)


def _biases(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or pairs of token id -> bias) as sorted ``(id, bias)`` pairs,
    or ParamError."""
    pairs = value.items() if isinstance(value, Mapping) else value
    bad = isinstance(pairs, str | bytes | Tensor) or not isinstance(pairs, Iterable)
    pairs = () if bad else [tuple(p) if isinstance(p, Sequence) else (p,) for p in pairs]
    if bad or any(len(p) != 2 or not is_int(p[0]) or p[0] < 0 or not is_number(p[1])
                  or not -BIAS_RANGE <= p[1] <= BIAS_RANGE for p in pairs):  # fmt: skip
        raise ParamError("logit_bias", f" must map token ids >= 0 to numbers in "
                         f"[-{BIAS_RANGE:g}, {BIAS_RANGE:g}], got {value!r:.80}")  # fmt: skip
    out = {int(t): float(b) for t, b in pairs}
    if len(out) != len(pairs):
        raise ParamError("logit_bias", f" must name each token once, got {value!r:.80}")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class GenerationControls:
    """What to ban or penalise while decoding; every default leaves decoding unchanged.

    Attributes:
        logit_bias: ``(token id, bias)`` pairs (a ``{id: bias}`` mapping is stored as sorted
            pairs), each bias in ``[-100, 100]`` added to the token's logit at every step
            (OpenAI's ``logit_bias``: -100 in effect bans a token, 100 all but forces it);
            () = off.
        repetition_penalty: > 0 (CTRL, Keskar et al. 2019); a token present in the row
            has its logit divided by it (multiplied where negative); 1.0 = off, above 1
            discourages repeats.
        frequency_penalty: in ``[-2, 2]``: a token's logit loses ``frequency_penalty`` times
            the number of times it was generated so far (OpenAI's; the prompt not counted);
            0 = off.
        presence_penalty: in ``[-2, 2]``: a token generated at least once loses this much
            (OpenAI's); 0 = off.
        no_repeat_ngram_size: ``n >= 0``: no n-gram appears twice in a row (prompt included);
            0 = off.
        bad_words_ids: token sequences never generated: a one-token entry is banned always
            (except one that is just ``eos_id``, as transformers), a longer one bans its last
            token where the row ends with the rest. Lists are stored as tuples.
        min_new_tokens: EOS is banned until this many new tokens exist; 0 = off.
        min_p: sampling only (greedy's argmax is always kept): after temperature, top-k and
            top-p, keep tokens whose probability is at least ``min_p`` times the largest
            (Nguyen et al. 2024); None = off.
        forced_eos: the last allowed step (``max_new_tokens``) must choose EOS, so every row
            ends with it.

    Raises:
        ParamError: (a ``ValueError``) a field outside its range; ``err.param`` names it.
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_new_tokens: int = 0
    min_p: float | None = None
    forced_eos: bool = False

    def __post_init__(self) -> None:
        p = self.repetition_penalty
        if not is_number(p) or not p > 0:
            raise ParamError("repetition_penalty", f" must be a finite number > 0 (1.0 = off), "
                             f"got {p!r}")  # fmt: skip
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ParamError(name, f" must be a number in [-{PENALTY_RANGE:g}, "
                                 f"{PENALTY_RANGE:g}] (0 = off), got {value!r}")  # fmt: skip
        object.__setattr__(self, "logit_bias", _biases(self.logit_bias))
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ParamError(name, f" must be an int >= 0 (0 = off), got {value!r}")
        object.__setattr__(self, "bad_words_ids", _words(self.bad_words_ids))
        check_min_p(self.min_p)
        if not isinstance(self.forced_eos, bool):
            raise ParamError("forced_eos", f" must be a bool, got {self.forced_eos!r}")

    @property
    def edits_logits(self) -> bool:
        """Whether :meth:`apply` changes anything (``min_p`` acts in the sampling filter)."""
        return (bool(self.logit_bias) or self.repetition_penalty != 1.0
                or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.no_repeat_ngram_size > 0
                or bool(self.bad_words_ids) or self.min_new_tokens > 0
                or self.forced_eos)  # fmt: skip

    def apply(self, logits: Tensor, ids: Tensor, new: int, last_step: bool,
              eos_id: int | None) -> Tensor:  # fmt: skip
        """The logits of one step, edited in transformers' order (a new tensor).

        Args:
            logits: ``(B, V)`` float.
            ids: ``(B, L)`` long: each row's tokens so far, prompt included, left-padded with
                :data:`NO_TOKEN`.
            new: tokens generated so far (0 at the first step).
            last_step: this step is the last ``max_new_tokens`` allows.
            eos_id: the end token (None: minimum length and forced EOS have nothing to do).

        Returns:
            ``(B, V)`` float; banned tokens at ``-inf``.
        """
        # 0) logit bias (vLLM's place); 1) repetition penalty, then OpenAI's frequency and
        # presence penalties; 2) no-repeat n-grams, 3) bad words, 4) minimum new tokens,
        # 5) forced EOS: the order of transformers' _get_logits_processor
        V, inf = logits.shape[-1], float("inf")
        if self.logit_bias:
            logits = logit_bias(logits, self.logit_bias)
        if self.repetition_penalty != 1.0:
            logits = repetition_penalty(logits, ids, self.repetition_penalty)
        if self.frequency_penalty != 0.0 or self.presence_penalty != 0.0:
            counts = token_counts(ids[:, ids.shape[1] - new :], V)  # (B, V): generated only
            logits = (logits - self.frequency_penalty * counts
                      - self.presence_penalty * (counts > 0).to(logits.dtype))  # fmt: skip
        if self.no_repeat_ngram_size > 0:
            logits = logits.masked_fill(repeated_ngrams(ids, self.no_repeat_ngram_size, V), -inf)
        if self.bad_words_ids:
            logits = logits.masked_fill(bad_words(ids, self.bad_words_ids, eos_id, V), -inf)
        if eos_id is not None and new < self.min_new_tokens:
            logits = logits.clone()
            logits[:, eos_id] = -inf
        if eos_id is not None and self.forced_eos and last_step:
            logits = torch.full_like(logits, -inf)
            logits[:, eos_id] = 0.0
        return logits


def _present(ids: Tensor, rows: Tensor, V: int) -> Tensor:
    """``(B, V)`` bool, True at ``rows (B, N)``'s ids (``NO_TOKEN`` and ids >= V marked in a
    spare column that is dropped)."""
    cols = rows.masked_fill(rows < 0, V).clamp(max=V)  # (B, N)
    mask = torch.zeros((ids.shape[0], V + 1), dtype=torch.bool, device=ids.device)  # (B, V+1)
    return mask.scatter_(1, cols, True)[:, :V]  # (B, V)


def logit_bias(logits: Tensor, pairs: tuple[tuple[int, float], ...]) -> Tensor:
    """``logits (B, V)`` with each ``(id, bias)`` pair's bias added to its column (a new
    tensor)."""
    ids = torch.tensor([t for t, _ in pairs], device=logits.device)  # (N,)
    bias = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits.index_add(1, ids, bias[None].expand(logits.shape[0], -1))  # (B, V)


def token_counts(rows: Tensor, V: int) -> Tensor:
    """``(B, V)`` float: how often each id occurs in ``rows (B, N)`` (``NO_TOKEN`` and ids
    >= V not counted)."""
    cols = rows.masked_fill(rows < 0, V).clamp(max=V)  # (B, N)
    counts = torch.zeros((rows.shape[0], V + 1), device=rows.device)  # (B, V+1)
    return counts.scatter_add_(1, cols, torch.ones_like(cols, dtype=counts.dtype))[:, :V]


def repetition_penalty(logits: Tensor, ids: Tensor, penalty: float) -> Tensor:
    """``logits (B, V)`` with every token present in ``ids (B, L)`` penalised once:
    ``logit * penalty`` where negative, else ``logit / penalty`` (CTRL)."""
    present = _present(ids, ids, logits.shape[-1])  # (B, V)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)  # (B, V)
    return torch.where(present, penalised, logits)


def repeated_ngrams(ids: Tensor, n: int, V: int) -> Tensor:
    """``(B, V)`` bool: tokens that would complete an n-gram already in ``ids (B, L)``.

    A window of ``n`` real tokens whose first ``n - 1`` equal the row's last ``n - 1`` bans
    its last token; windows touching the padding never match.
    """
    B, L = ids.shape
    if L < n:
        return torch.zeros((B, V), dtype=torch.bool, device=ids.device)
    windows = ids.unfold(1, n, 1)  # (B, L - n + 1, n)
    prefix = ids[:, L - n + 1 :]  # (B, n - 1)
    matches = (windows[..., :-1] == prefix[:, None]).all(-1) & (windows >= 0).all(-1)  # (B, W)
    banned = torch.where(matches, windows[..., -1], NO_TOKEN)  # (B, W)
    return _present(ids, banned, V)


def bad_words(ids: Tensor, words: tuple[tuple[int, ...], ...], eos_id: int | None,
              V: int) -> Tensor:  # fmt: skip
    """``(B, V)`` bool: the last token of every bad word whose other tokens end the row
    (one-token words: always, except a lone ``eos_id``)."""
    banned = torch.zeros((ids.shape[0], V), dtype=torch.bool, device=ids.device)  # (B, V)
    for word in words:
        *prefix, last = word
        if not prefix:
            if last != eos_id:
                banned[:, last] = True
            continue
        if len(prefix) > ids.shape[1]:
            continue
        want = torch.tensor(prefix, dtype=ids.dtype, device=ids.device)  # (K,)
        banned[:, last] |= (ids[:, -len(prefix) :] == want).all(-1)  # (B,)
    return banned


def checked_controls(controls: object, vocab: int | None,
                     eos_id: int | None) -> GenerationControls | None:  # fmt: skip
    """``controls`` once checked against the model: its bad words inside the vocabulary
    ``[0, vocab)``, an EOS id when ``forced_eos`` asks for one.

    Raises:
        TypeError: ``controls`` neither None nor a :class:`GenerationControls`.
        ParamError: (a ``ValueError``) a bad word outside the vocabulary, ``forced_eos``
            without an EOS id.
    """
    if controls is None:
        return None
    if not isinstance(controls, GenerationControls):
        raise TypeError(f"controls must be a GenerationControls or None, got "
                        f"{type(controls).__name__}")  # fmt: skip
    for name, ids in (("bad_words_ids", [t for w in controls.bad_words_ids for t in w]),
                      ("logit_bias", [t for t, _ in controls.logit_bias])):  # fmt: skip
        outside = [t for t in ids if vocab is not None and t >= vocab]
        if outside:
            raise ParamError(name, f" must hold tokens of the model's vocabulary [0, {vocab}), "
                             f"got {outside[0]}")  # fmt: skip
    if controls.forced_eos and eos_id is None:
        raise ParamError("forced_eos", "=True needs an eos_id (none given, none in "
                         "model.config)")  # fmt: skip
    return controls


def prompt_ids(session: object) -> Tensor:
    """``(B, P)`` long: what each row of a fresh session holds before the first new token,
    left-padded with :data:`NO_TOKEN` (decoder-only prompts; BOS; a forced prompt)."""
    if isinstance(session, MemorySession):
        return session.prompts  # (B, P), one length
    if isinstance(session, Seq2SeqSession):
        device = session.memory.device
        return torch.full((session.batch, 1), session.bos_id, dtype=torch.long, device=device)
    assert isinstance(session, DecoderSession), type(session).__name__
    ids = session.ids  # (B, P), left-padded
    if session.mask is None:
        return ids
    return ids.masked_fill(~session.mask[:, : ids.shape[1]], NO_TOKEN)  # (B, P)
