"""Decoding one 30 s window of Whisper with timestamps: the rules on the logits, greedy or
sampled steps, and the fallback to higher temperatures (Radford et al., 2022, section 4.5,
as openai-whisper's ``transcribe`` and transformers' long-form ``generate`` do it).

Timestamp tokens ``<|0.00|> .. <|30.00|>`` follow ``<|notimestamps|>`` in the vocabulary, one
per 20 ms. At every step, before choosing (:func:`apply_rules`):

* the suppressed tokens are banned, and at the first step the blank and EOT as well;
* a window starts with a timestamp (at most ``max_initial_timestamp`` seconds in);
* timestamps come in pairs (one closes a segment, the next opens one), except right before
  EOT; they never go back in time, and a segment is never empty;
* when the timestamps together are more probable than every text token, a timestamp it is.

A window's decode is judged (:func:`needs_fallback`) by its compression ratio (a repetition
loop compresses well), its mean log-probability, and the probability of ``<|nocaptions|>``
at the start-of-transcript position; a failed window is decoded again at the next
temperature, sampling ``best_of`` candidates and keeping the likeliest.

Shapes: ``B`` windows, ``S`` encoder frames (1500), ``E`` width, ``V`` vocabulary, ``P``
prompt length, ``t`` tokens sampled so far.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.pretrained.whisper.options import TranscribeOptions

__all__ = ["Vocab", "WindowResult", "apply_rules", "decode_windows", "needs_fallback"]

_NEG = float("-inf")


@dataclass(frozen=True)
class Vocab:
    """Whisper's special ids and the ids never or not first generated."""

    eot: int
    sot: int
    sot_prev: int
    no_speech: int
    no_timestamps: int
    suppress: tuple[int, ...] = ()
    suppress_first: tuple[int, ...] = ()

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1


@dataclass(frozen=True)
class WindowResult:
    """One window's decode: sampled ``tokens`` (EOT left out) and how good it looks."""

    tokens: tuple[int, ...]
    sum_logprob: float
    no_speech_prob: float
    compression_ratio: float
    temperature: float

    @property
    def avg_logprob(self) -> float:
        return self.sum_logprob / (len(self.tokens) + 1)  # EOT's log-probability counted


def apply_rules(logits: Tensor, sampled: Tensor, vocab: Vocab, timestamps: bool,
                max_initial: int | None) -> Tensor:  # fmt: skip
    """Ban, in place, what may not come next: ``logits (B, V)`` given ``sampled (B, t)``."""
    logits[:, list(vocab.suppress)] = _NEG
    t = sampled.shape[1]
    if t == 0:
        logits[:, list(vocab.suppress_first)] = _NEG
    if not timestamps:
        return logits
    tb = vocab.timestamp_begin
    logits[:, vocab.no_timestamps] = _NEG
    if t == 0:
        logits[:, :tb] = _NEG  # a window opens with a timestamp ...
        if max_initial is not None:
            logits[:, tb + max_initial + 1 :] = _NEG  # ... early in it
    else:
        is_ts = sampled >= tb  # (B, t)
        last = is_ts[:, -1]
        penult = is_ts[:, -2] if t >= 2 else torch.ones_like(last)
        logits[last & penult, tb:] = _NEG  # a pair closed: text (or EOT) next
        logits[last & ~penult, : vocab.eot] = _NEG  # one open: its pair or EOT next
        latest = torch.where(is_ts, sampled, -1).amax(dim=1)  # (B,) never decreasing
        bound = torch.where(last & ~penult, latest, latest + 1)
        bound = torch.where(latest >= 0, bound, tb)  # (B,) the first timestamp allowed
        ids = torch.arange(logits.shape[1], device=logits.device)  # (V,)
        logits.masked_fill_((ids >= tb) & (ids < bound[:, None]), _NEG)
    logprobs = logits.log_softmax(dim=-1)  # (B, V)
    timestamp = logprobs[:, tb:].logsumexp(dim=-1) > logprobs[:, :tb].amax(dim=-1)  # (B,)
    logits[:, :tb].masked_fill_(timestamp[:, None], _NEG)
    return logits


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs (B, V)``: ``(B,)`` on ``probs``' device, drawn where
    ``generator`` lives (the CPU for the seeded one), so a seed samples the same tokens
    whatever device the model is on."""
    where = probs.device if generator is None else generator.device
    return torch.multinomial(probs.to(where), 1, generator=generator)[:, 0].to(probs.device)


def _initial_steps(o: TranscribeOptions) -> int | None:
    """``max_initial_timestamp`` in timestamp steps (20 ms each), or None."""
    t = o.max_initial_timestamp
    return None if t is None else round(t / 0.02)


def compression_ratio(text: str) -> float:
    """UTF-8 bytes of ``text`` over its zlib-compressed bytes (high: a repetition loop)."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def needs_fallback(r: WindowResult, o: TranscribeOptions) -> bool:
    """Whether ``r`` is decoded again at a higher temperature (never when it is silence)."""
    if o.no_speech_threshold is not None and r.no_speech_prob > o.no_speech_threshold:
        return False
    bad_ratio = (o.compression_ratio_threshold is not None
                 and r.compression_ratio > o.compression_ratio_threshold)  # fmt: skip
    bad_logprob = o.logprob_threshold is not None and r.avg_logprob < o.logprob_threshold
    return bad_ratio or bad_logprob


def _ragged(prompts: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """Prompts left-padded to one length ``P``: ``(ids (B, P), keep (B, P), positions (B, P))``,
    each row's positions counted from its first real token."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device=device)
    keep = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts],
                        device=device)  # fmt: skip
    return ids, keep, (keep.long().cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def _decode_group(model, memory: Tensor, prompts: list[list[int]], vocab: Vocab,
                  o: TranscribeOptions, temperature: float, generator: torch.Generator | None
                  ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Decode ``B`` rows after their prompts (any lengths: left-padded, the padding hidden):
    ``(tokens (B, t) with EOT after each row's end, sum_logprob (B,), no_speech_prob (B,))``.
    Each row stops where it would alone: at EOT or ``min(max_new_tokens, max_len - its
    prompt)`` tokens."""
    ids, keep, positions = _ragged(prompts, vocab.eot, memory.device)
    B, P = ids.shape
    ragged = not bool(keep.all())
    room = torch.tensor([min(o.max_new_tokens, model.config.max_len - len(p)) for p in prompts],
                        device=memory.device)  # (B,) tokens each row may add  # fmt: skip
    cache = model.new_cache()
    out = model.decode(ids, memory, cache=cache, keep=keep if ragged else None,
                       positions=positions if ragged else None)  # (B, P, V)  # fmt: skip
    sot = torch.tensor([P - len(p) + p.index(vocab.sot) for p in prompts], device=memory.device)
    no_speech = out[torch.arange(B), sot].float().softmax(dim=-1)[:, vocab.no_speech]  # (B,)
    logits = out[:, -1].float()  # (B, V)
    sampled = ids.new_zeros((B, 0))  # (B, t)
    total = torch.zeros(B, dtype=torch.float64, device=ids.device)
    done = room <= 0
    max_initial = _initial_steps(o)
    for t in range(int(room.max())):
        logits = apply_rules(logits, sampled, vocab, o.timestamps, max_initial)
        logprobs = logits.log_softmax(dim=-1)  # (B, V)
        if temperature > 0:
            probs = (logits / temperature).softmax(dim=-1)
            token = _draw(probs, generator)  # (B,)
        else:
            token = logits.argmax(dim=-1)  # (B,)
        total += torch.where(done, 0.0, logprobs.gather(1, token[:, None])[:, 0].double())
        token = token.masked_fill(done, vocab.eot)
        sampled = torch.cat([sampled, token[:, None]], dim=1)
        done |= (token == vocab.eot) | (room <= t + 1)
        if bool(done.all()):
            break
        if ragged:
            keep = torch.cat([keep, keep.new_ones((B, 1))], dim=1)
            positions = positions[:, -1:] + 1
        logits = model.decode(token[:, None], memory, cache=cache,
                              keep=keep if ragged else None,
                              positions=positions if ragged else None)[:, -1].float()  # fmt: skip
    return sampled, total, no_speech


@torch.no_grad()
def _beam_one(model, memory: Tensor, prompt: list[int], sot_index: int, vocab: Vocab,
              o: TranscribeOptions, text_of) -> WindowResult:  # fmt: skip
    """Beam search (``o.beam_size`` beams, openai-whisper's rules: each beam's best
    ``beam_size + 1`` continuations compete, EOT-ended ones are kept until ``beam_size`` are
    done; the best by log-probability per token wins) over one window ``memory (S, E)``."""
    K, P = o.beam_size or 1, len(prompt)
    steps = min(o.max_new_tokens, model.config.max_len - P)
    mem = memory[None].expand(K, *memory.shape)  # (K, S, E)
    cache = model.new_cache()
    out = model.decode(torch.tensor([prompt] * K, device=memory.device), mem, cache=cache)
    no_speech = float(out[0, sot_index].float().softmax(dim=-1)[vocab.no_speech])
    logits, beams = out[:, -1].float(), [((), 0.0)] * K  # (K, V); (tokens, sum log-prob)
    finished: dict[tuple[int, ...], float] = {}
    max_initial = _initial_steps(o)
    for step in range(steps):
        sampled = torch.tensor([list(b[0]) for b in beams], dtype=torch.long,
                               device=memory.device)
        sampled = sampled.reshape(len(beams), step)  # (K', t)
        logprobs = apply_rules(logits, sampled, vocab, o.timestamps, max_initial).log_softmax(-1)
        top, ids = logprobs.topk(K + 1, dim=-1)  # (K, K + 1)
        scores: dict[tuple[int, ...], tuple[float, int]] = {}
        for k in range(len(beams)):
            for lp, tok in zip(top[k].tolist(), ids[k].tolist(), strict=True):
                scores[(*beams[k][0], tok)] = (beams[k][1] + lp, k)
        kept, ended = [], {}
        for seq in sorted(scores, key=lambda s: scores[s][0], reverse=True):
            if seq[-1] == vocab.eot:  # ranked above the K-th live beam: a candidate
                ended[seq[:-1]] = scores[seq][0]
            else:
                kept.append(seq)
                if len(kept) == K:
                    break
        for seq in sorted(ended, key=ended.get, reverse=True):
            if len(finished) < K:
                finished.setdefault(seq, ended[seq])
        if len(finished) >= K or not kept:
            break
        beams = [(seq, scores[seq][0]) for seq in kept]
        cache.reorder(torch.tensor([scores[seq][1] for seq in kept], device=memory.device))
        last = torch.tensor([[seq[-1]] for seq in kept], device=memory.device)  # (K', 1)
        mem = memory[None].expand(len(kept), *memory.shape)
        logits = model.decode(last, mem, cache=cache)[:, -1].float()
    for seq, total in beams:  # too few ended: the live beams count too
        if len(finished) >= K:
            break
        finished.setdefault(seq, total)
    best = max(finished, key=lambda s: finished[s] / max(1, len(s)))
    return WindowResult(best, finished[best], no_speech, compression_ratio(text_of(best)), 0.0)


def _result(row: Tensor, total: float, no_speech: float, temperature: float, vocab: Vocab,
            text_of) -> WindowResult:  # fmt: skip
    tokens = row.tolist()
    tokens = tokens[: tokens.index(vocab.eot)] if vocab.eot in tokens else tokens
    return WindowResult(tuple(tokens), float(total), float(no_speech),
                        compression_ratio(text_of(tokens)), temperature)  # fmt: skip


def decode_windows(model, memory: Tensor, prompts: list[list[int]], vocab: Vocab,
                   o: TranscribeOptions, temperature: float, text_of,
                   generator: torch.Generator | None = None) -> list[WindowResult]:  # fmt: skip
    """Decode each window ``memory[i] (S, E)`` after ``prompts[i]`` at one temperature.

    The windows decode as one batch (prompts of different lengths left-padded, the padding
    hidden: each row as it would alone); at ``temperature > 0`` each window
    is sampled ``o.best_of`` times and the candidate with the highest mean log-probability
    per token is kept; at temperature 0 with ``o.beam_size``, each window is beam-searched.
    ``text_of(tokens) -> str`` gives the text for the compression ratio.
    """
    results: list[WindowResult | None] = [None] * len(prompts)
    if o.beam_size is not None and temperature == 0:
        return [_beam_one(model, memory[i], p, p.index(vocab.sot), vocab, o, text_of)
                for i, p in enumerate(prompts)]  # fmt: skip
    copies = o.best_of if temperature > 0 else 1
    rows = [p for p in prompts for _ in range(copies)]
    mem = memory.repeat_interleave(copies, dim=0)  # (B * copies, S, E)
    sampled, total, no_speech = _decode_group(model, mem, rows, vocab, o, temperature,
                                              generator)  # fmt: skip
    for i in range(len(prompts)):
        cands = [_result(sampled[k], total[k], no_speech[k], temperature, vocab, text_of)
                 for k in range(i * copies, (i + 1) * copies)]  # fmt: skip
        results[i] = max(cands, key=lambda r: r.sum_logprob / max(1, len(r.tokens)))
    return results  # type: ignore[return-value]


def decode_with_fallback(model, memory: Tensor, prompts: list[list[int]], vocab: Vocab,
                         o: TranscribeOptions, text_of, generator: torch.Generator | None
                         ) -> list[WindowResult]:  # fmt: skip
    """:func:`decode_windows` at ``o.temperatures[0]``, then again at each next temperature
    for the windows that :func:`needs_fallback` (the last try is kept as it is)."""
    results: list[WindowResult | None] = [None] * len(prompts)
    todo = list(range(len(prompts)))
    for n, temperature in enumerate(o.temperatures):
        out = decode_windows(model, memory[todo], [prompts[i] for i in todo], vocab, o,
                             temperature, text_of, generator)  # fmt: skip
        last = n == len(o.temperatures) - 1
        again = []
        for i, r in zip(todo, out, strict=True):
            results[i] = r
            if not last and needs_fallback(r, o):
                again.append(i)
        todo = again
        if not todo:
            break
    return results  # type: ignore[return-value]
