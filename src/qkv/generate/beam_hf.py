"""Beam search as Hugging Face transformers runs it, for outputs equal to theirs.

:func:`~qkv.generate.beam_search` is the textbook search with GNMT's length penalty and an
exact stopping rule. Checkpoints published with a ``generation_config.json`` were tuned with
transformers' search, which differs in three ways, all reproduced here:

* finished hypotheses are ranked by ``log p(y) / |y| ** length_penalty`` with ``|y|`` the
  generated tokens, EOS included (``length_penalty = 1.0`` by default; 0 = plain
  log-probabilities);
* each step keeps the ``2K`` best extensions; those ending in EOS (or reaching the length limit)
  among the first ``K`` become candidates for the ``K`` finished slots, the best ``K`` others
  continue;
* stopping follows ``early_stopping``: ``True`` stops an input once it has ``K`` finished
  hypotheses; ``False`` (the default) also stops when the best live beam, scored at its current
  length, cannot beat the worst finished one (a heuristic, not a bound); ``"never"`` scores it
  at the length limit when ``length_penalty > 0``. Once an input can no longer improve it takes
  no new hypotheses, while the batch runs on for the others, as in transformers.

Scores stay in float32 with transformers' ``-1e9`` sentinels, so ties break the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from qkv.checks import is_number, positive_int
from qkv.generate.args import check_beams
from qkv.generate.search import _ids
from qkv.generate.session import Inputs, decoding, make_session

__all__ = ["EARLY_STOPPING", "beam_search_hf"]

EARLY_STOPPING = (True, False, "never")
_NEG = -1.0e9  # transformers' "impossible" score


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, k], ...]`` for ``x (B, N, ...)`` and ``index (B, K)``."""
    expand = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(
        *index.shape, *x.shape[2:]
    )
    return x.gather(1, expand)  # (B, K, ...)


@decoding
def beam_search_hf(
    model: nn.Module,
    inputs: Inputs,
    *,
    beam_size: int = 4,
    max_new_tokens: int = 32,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return: int = 1,
    eos_id: int | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
    banned: Sequence[int] = (),
    forced_eos: bool = False,
) -> Tensor:
    """Beam search with transformers' scoring and stopping (see the module docstring).

    Args:
        model, inputs, max_new_tokens, eos_id, pad_id, bos_id: as :func:`~qkv.generate.greedy`
            (``bos_id``: the decoder start token of an encoder-decoder).
        beam_size: ``K`` beams per input.
        length_penalty: exponent of the generated length dividing a finished hypothesis'
            log-probability (transformers' ``length_penalty``).
        early_stopping: ``True``, ``False`` or ``"never"`` (transformers' ``early_stopping``).
        num_return: hypotheses returned per input (<= ``beam_size``), best first.
        banned: token ids never generated (transformers' one-token ``bad_words_ids``: their
            log-probabilities set to ``-inf`` after the softmax, not renormalised).
        forced_eos: the last step can only be EOS, with log-probability 0 (transformers'
            ``forced_eos_token_id`` at the length limit).

    Returns:
        ``tokens (B, L)`` (``(B, num_return, L)`` when ``num_return > 1``): new tokens, EOS
        included, ``pad_id`` (or EOS) after it.

    Raises:
        ValueError: a bad ``beam_size``, ``num_return``, ``length_penalty`` or
            ``early_stopping``, and as :func:`~qkv.generate.greedy`.
    """
    K, N = check_beams(beam_size, num_return), positive_int("max_new_tokens", max_new_tokens)
    if not is_number(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not any(early_stopping is e or early_stopping == e for e in EARLY_STOPPING) or (
        isinstance(early_stopping, int) and not isinstance(early_stopping, bool)
    ):
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    lp = float(length_penalty)
    eos, pad, bos, fill = _ids(model, eos_id, pad_id, bos_id)
    session = make_session(model, inputs, N, pad_id=pad, bos_id=bos)
    B = session.batch
    if forced_eos and eos is None:
        raise ValueError("forced_eos needs an eos_id (the model config has none)")
    ban = torch.tensor(list(banned), dtype=torch.long)

    def processed(logits: Tensor, t: int) -> Tensor:
        logp = logits.float().log_softmax(-1)  # (rows, V)
        logp[:, ban.to(logp.device)] = float("-inf")
        if forced_eos and t == N - 1:
            logp.fill_(float("-inf"))[:, eos] = 0.0
        return logp

    logp = processed(session.first(), 0)  # (B, V)
    device, V = logp.device, logp.shape[-1]
    session.select(torch.arange(B, device=device).repeat_interleave(K))
    logp = logp.repeat_interleave(K, dim=0)  # (B*K, V)
    run_scores = torch.zeros(B, K, device=device)  # (B, K)
    run_scores[:, 1:] = _NEG  # only beam 0 proposes at the first step
    run_seqs = torch.full((B, K, N), fill, dtype=torch.long, device=device)  # (B, K, N)
    fin_seqs = run_seqs.clone()  # (B, K, N)
    fin_scores = torch.full((B, K), _NEG, device=device)  # (B, K)
    fin_done = torch.zeros(B, K, dtype=torch.bool, device=device)  # (B, K)
    fin_len = torch.ones(B, K, dtype=torch.long, device=device)  # (B, K) generated tokens
    open_ = torch.ones(B, 1, dtype=torch.bool, device=device)  # (B, 1) may still improve
    top_k = torch.arange(2 * K, device=device) < K  # (2K,) the first K of the 2K
    batch_rows = torch.arange(B, device=device)[:, None] * K  # (B, 1)
    for t in range(N):
        # 1) the 2K best extensions of each input's beams
        acc = (logp.reshape(B, K, V) + run_scores[:, :, None]).reshape(B, K * V)  # (B, K*V)
        top_lp, top_idx = acc.topk(2 * K, dim=-1)  # (B, 2K)
        beam, tok = top_idx // V, top_idx % V  # (B, 2K) each
        top_seqs = _gather(run_seqs, beam)  # (B, 2K, N)
        top_seqs[:, :, t] = tok
        hits = torch.zeros_like(tok, dtype=torch.bool) if eos is None else tok == eos
        if t + 1 >= N:
            hits = torch.ones_like(hits)  # the length limit ends every sequence
        # 2) the best K that did not end continue
        run_lp = top_lp + hits.float() * _NEG  # (B, 2K)
        keep = run_lp.topk(K, dim=-1).indices  # (B, K)
        run_seqs, new_scores = _gather(top_seqs, keep), _gather(run_lp, keep)  # (B, K, N), (B, K)
        src_beam = _gather(beam, keep)  # (B, K)
        # 3) those that ended among the first K compete for the K finished slots
        cand = top_lp / float(t + 1) ** lp  # (B, 2K)
        full = fin_done.all(-1, keepdim=True) & (early_stopping is True)  # (B, 1)
        cand = cand + full.float() * _NEG + (~open_).float() * _NEG
        cand = cand + (~(hits & top_k)).float() * _NEG
        merged = torch.cat([fin_scores, cand], 1)  # (B, 3K)
        best = merged.topk(K, dim=-1).indices  # (B, K)
        fin_seqs = _gather(torch.cat([fin_seqs, top_seqs], 1), best)  # (B, K, N)
        fin_scores = _gather(merged, best)  # (B, K)
        fin_done = _gather(torch.cat([fin_done, hits & top_k], 1), best)  # (B, K)
        fin_len = _gather(torch.cat([fin_len, torch.full_like(tok, t + 1)], 1), best)  # (B, K)
        run_scores = new_scores
        # 4) can the live beams still improve on the finished ones (transformers' heuristic)?
        length = N if (early_stopping == "never" and lp > 0.0) else t + 1
        best_live = run_scores[:, :1] / float(length) ** lp  # (B, 1)
        worst = torch.where(fin_done, fin_scores.min(-1, keepdim=True).values,
                            torch.full_like(fin_scores, _NEG))  # (B, K)  # fmt: skip
        open_ = open_ & (best_live > worst).any(-1, keepdim=True)
        all_full = bool(fin_done.all()) and early_stopping is True
        if not bool(open_.any()) or all_full or bool(hits.all()):
            break
        # 5) move the KV cache to the continuing beams; one cached step
        session.select((batch_rows + src_beam).reshape(-1))
        logp = processed(session.next(run_seqs[:, :, t].reshape(-1)), t + 1)  # (B*K, V)
    out = fin_seqs[:, :num_return, : int(fin_len[:, :num_return].max())]  # (B, R, L)
    return out[:, 0] if num_return == 1 else out
