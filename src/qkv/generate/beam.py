"""Beam search with the GNMT length penalty, for decoder-only and encoder-decoder models.

Each input keeps ``K`` partial hypotheses (beams). At every step each beam is extended by
every token, the ``2K`` best extensions of each input are ranked by total log-probability;
those ending in EOS (among the first ``K``) become finished hypotheses, and the best ``K``
others are the next beams. The KV cache follows its beams through ``KVCache.reorder``.

Finished hypotheses are compared by ``log p(y) / lp(y)`` with the length penalty of Wu et
al. (2016, GNMT) ``lp(y) = ((5 + |y|) / 6) ** alpha``, ``|y|`` counting EOS; ``alpha = 0``
compares plain log-probabilities (then ``K = 1`` is exactly greedy search), larger ``alpha``
favours longer outputs.

Stopping is exact, not heuristic: an input is done when it has ``K`` finished hypotheses and
no live beam can still beat the K-th of them. Log-probabilities only fall as a beam grows,
so a live beam's score can rise at most to ``score / lp(max_new_tokens)`` (``alpha > 0``) or
stays at most ``score`` (``alpha = 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.generate.args import check_alpha, check_beams
from qkv.generate.search import _ids
from qkv.generate.session import Inputs, decoding, make_session

__all__ = ["beam_search", "length_penalty"]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha``."""
    return ((5.0 + length) / 6.0) ** alpha


@decoding
def beam_search(
    model: nn.Module,
    inputs: Inputs,
    *,
    beam_size: int = 4,
    max_new_tokens: int = 32,
    alpha: float = 0.6,
    num_return: int = 1,
    eos_id: int | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
    return_scores: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Beam search: the hypotheses of highest length-normalised log-probability.

    Args:
        model, inputs, max_new_tokens, eos_id, pad_id, bos_id: as :func:`~qkv.generate.greedy`.
        beam_size: ``K`` beams per input.
        alpha: length-penalty exponent (>= 0; GNMT used 0.6-0.7; 0 = none).
        num_return: hypotheses returned per input (<= ``beam_size``), best first.
        return_scores: also return each hypothesis' ``log p / lp``.

    Returns:
        ``tokens (B, L)`` (or ``(B, num_return, L)`` when ``num_return > 1``): new tokens,
        EOS included, ``pad_id`` after it; with ``return_scores`` also ``scores (B,)`` (or
        ``(B, num_return)``).

    Raises:
        ValueError: ``beam_size`` or ``num_return`` not a positive int, ``num_return >
            beam_size``, ``alpha`` not a finite number >= 0, and as
            :func:`~qkv.generate.greedy`.
    """
    check_beams(beam_size, num_return)
    alpha = check_alpha(alpha)
    eos, pad, bos, fill = _ids(model, eos_id, pad_id, bos_id)
    session = make_session(model, inputs, max_new_tokens, pad_id=pad, bos_id=bos)
    B, K = session.batch, beam_size
    # 1) the first logits, then every input's cache and state copied into K beams
    logp = session.first().log_softmax(-1)  # (B, V)
    device, V = logp.device, logp.shape[-1]
    rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,)
    session.select(rows)
    logp = logp[rows]  # (B*K, V)
    # Only beam 0 is live at the start, so the K copies do not propose the same tokens.
    scores = torch.full((B, K), float("-inf"), device=device)  # (B, K)
    scores[:, 0] = 0.0
    seqs = torch.empty((B * K, 0), dtype=torch.long, device=device)  # (B*K, t)
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    bound_lp = length_penalty(max_new_tokens, alpha) if alpha > 0 else 1.0
    for t in range(max_new_tokens):
        # 2) score every extension of every beam; keep the 2K best per input
        cand = (scores.reshape(B * K, 1) + logp).reshape(B, K * V)  # (B, K*V)
        top_scores, top_idx = cand.topk(min(2 * K, K * V), dim=-1)  # (B, 2K)
        top_beam, top_tok = top_idx // V, top_idx % V  # (B, 2K) each
        new_scores = torch.full((B, K), float("-inf"), device=device)  # (B, K)
        new_rows = torch.arange(B * K, device=device).reshape(B, K)  # (B, K) rows to keep
        new_tok = torch.full((B, K), fill, dtype=torch.long, device=device)  # (B, K)
        ts, tb, tt = top_scores.tolist(), top_beam.tolist(), top_tok.tolist()
        for b in range(B):
            if done[b]:
                continue
            # 3) EOS among the K best: a finished hypothesis; the rest fill the K beams
            live = 0
            for rank in range(len(ts[b])):
                s, beam, tok = ts[b][rank], tb[b][rank], tt[b][rank]
                if s == float("-inf"):
                    break
                if eos is not None and tok == eos:
                    if rank < K:
                        hyp = [*seqs[b * K + beam].tolist(), tok]
                        finished[b].append((s / length_penalty(len(hyp), alpha), hyp))
                    continue
                new_scores[b, live], new_rows[b, live], new_tok[b, live] = s, b * K + beam, tok
                live += 1
                if live == K:
                    break
            # 4) done when K hypotheses are finished and no live beam can beat the K-th
            if len(finished[b]) >= K:
                kth = sorted((h[0] for h in finished[b]), reverse=True)[K - 1]
                done[b] = kth >= float(new_scores[b, 0]) / bound_lp
        if all(done) or t == max_new_tokens - 1:
            scores, seqs = new_scores, torch.cat([seqs[new_rows.reshape(-1)],
                                                  new_tok.reshape(-1, 1)], dim=1)  # fmt: skip
            break
        # 5) move the beams (tokens and KV cache) to their new rows, then one cached step
        flat_rows = new_rows.reshape(-1)  # (B*K,)
        seqs = torch.cat([seqs[flat_rows], new_tok.reshape(-1, 1)], dim=1)  # (B*K, t+1)
        session.select(flat_rows)
        scores = new_scores
        logp = session.next(new_tok.reshape(-1)).log_softmax(-1)  # (B*K, V)
    # 6) inputs not done: their live beams compete as they are (length limit reached)
    for b in range(B):
        if not done[b]:
            for k in range(K):
                s = float(scores[b, k])
                if s > float("-inf"):
                    hyp = seqs[b * K + k].tolist()
                    finished[b].append((s / length_penalty(len(hyp), alpha), hyp))
    # 7) the best num_return per input, padded into one tensor
    best = [sorted(f, key=lambda h: h[0], reverse=True)[:num_return] for f in finished]
    L = max(len(h[1]) for hyps in best for h in hyps)
    tokens = torch.full((B, num_return, L), fill, dtype=torch.long)  # (B, R, L)
    out_scores = torch.full((B, num_return), float("-inf"))  # (B, R)
    for b, hyps in enumerate(best):
        for r, (s, hyp) in enumerate(hyps):
            tokens[b, r, : len(hyp)] = torch.tensor(hyp, dtype=torch.long)
            out_scores[b, r] = s
    if num_return == 1:
        tokens, out_scores = tokens[:, 0], out_scores[:, 0]  # (B, L), (B,)
    tokens = tokens.to(device)
    return (tokens, out_scores) if return_scores else tokens
