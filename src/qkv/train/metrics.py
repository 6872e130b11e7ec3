"""Evaluation metrics: perplexity, token accuracy, exact match, BLEU and chrF.

BLEU and chrF come from ``sacrebleu`` (the reference implementation that papers report,
``pip install 'qkv[train]'``), imported when first used. Scores are on sacrebleu's 0-100
scale; exact match and token accuracy are fractions in ``[0, 1]``.

Corpus BLEU is the geometric mean of 1- to 4-gram precisions, and sacrebleu's corpus BLEU
(``use_effective_order=False``, as in papers) makes it 0 as soon as one order has no match:
references of fewer than 4 tokens have no 4-grams, so perfect outputs of 1-3 tokens score
0.0 (sacrebleu's ``sentence_bleu`` works around it with an "effective order", which makes
short-sentence scores incomparable instead). :func:`bleu_applies` is the rule qkv uses: BLEU
is reported only when the references average at least :data:`BLEU_MIN_TOKENS` tokens (in the
BLEU tokenizer's tokens); :func:`bleu_text` prints ``BLEU n/a (...)`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BLEU_MIN_TOKENS",
    "bleu",
    "bleu_applies",
    "bleu_text",
    "chrf",
    "describe_metrics",
    "exact_match",
    "mean_ref_tokens",
    "perplexity",
    "token_accuracy",
]

# BLEU's highest n-gram order: shorter references have no 4-grams and corpus BLEU reads 0.
BLEU_MIN_TOKENS = 4


def perplexity(nll_sum: float, tokens: int) -> float:
    """``exp(nll_sum / tokens)``: the perplexity of a mean token negative log-likelihood.

    Returns ``inf`` when the exponent overflows.

    Raises:
        ValueError: ``tokens < 1`` or a negative / non-finite ``nll_sum``.
    """
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not math.isfinite(nll_sum) or nll_sum < 0:
        raise ValueError(f"nll_sum must be a finite number >= 0, got {nll_sum!r}")
    try:
        return math.exp(nll_sum / tokens)
    except OverflowError:
        return math.inf


def token_accuracy(correct: int, tokens: int) -> float:
    """``correct / tokens``, the fraction of real target tokens predicted right.

    Raises:
        ValueError: ``tokens < 1`` or ``correct`` outside ``[0, tokens]``.
    """
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not 0 <= correct <= tokens:
        raise ValueError(f"correct must lie in [0, tokens={tokens}], got {correct!r}")
    return correct / tokens


def _check_pairs(hyps: Sequence[Any], refs: Sequence[Any]) -> None:
    if isinstance(hyps, str) or isinstance(refs, str):
        raise TypeError("hyps and refs must be sequences of sequences, got a str")
    if len(hyps) != len(refs):
        raise ValueError(f"hyps and refs must have equal lengths, got {len(hyps)} and {len(refs)}")
    if len(hyps) == 0:
        raise ValueError("hyps and refs must not be empty")


def exact_match(hyps: Sequence[Any], refs: Sequence[Any]) -> float:
    """Fraction of hypotheses equal to their reference as a whole (strings or id lists).

    Raises:
        ValueError: different lengths, or empty inputs.
    """
    _check_pairs(hyps, refs)
    return sum(list(h) == list(r) for h, r in zip(hyps, refs, strict=True)) / len(hyps)


def _sacrebleu() -> Any:
    try:
        import sacrebleu
    except ImportError:
        raise ImportError(
            "BLEU and chrF need the 'sacrebleu' package: pip install 'qkv[train]'"
        ) from None
    return sacrebleu


def _check_strings(hyps: Sequence[str], refs: Sequence[str]) -> None:
    _check_pairs(hyps, refs)
    for name, seq in (("hyps", hyps), ("refs", refs)):
        bad = [type(s).__name__ for s in seq if not isinstance(s, str)]
        if bad:
            raise TypeError(f"{name} must hold strings, got {bad[0]}")


def bleu(hyps: Sequence[str], refs: Sequence[str], *, tokenize: str = "13a") -> float:
    """Corpus BLEU (0-100) of ``hyps`` against one reference each, by sacrebleu.

    Args:
        hyps: decoded hypotheses.
        refs: references, ``refs[i]`` for ``hyps[i]``.
        tokenize: sacrebleu's tokenizer: ``"13a"`` (the WMT default, words) or ``"char"``
            (characters; meaningful for strings without spaces such as digit strings).

    Raises:
        ValueError: different lengths, empty inputs; TypeError: non-strings.
        ImportError: sacrebleu not installed (``pip install 'qkv[train]'``).
    """
    _check_strings(hyps, refs)
    return float(_sacrebleu().corpus_bleu(list(hyps), [list(refs)], tokenize=tokenize).score)


def mean_ref_tokens(refs: Sequence[str], *, tokenize: str = "13a") -> float:
    """The mean length of ``refs`` in tokens of sacrebleu's ``tokenize`` tokenizer.

    Raises:
        ValueError: empty ``refs``; TypeError: non-strings.
        ImportError: sacrebleu not installed (``pip install 'qkv[train]'``).
    """
    _check_strings(refs, refs)
    split = _sacrebleu().metrics.BLEU(tokenize=tokenize).tokenizer
    return sum(len(split(r).split()) for r in refs) / len(refs)


def bleu_applies(refs: Sequence[str], *, tokenize: str = "13a") -> tuple[bool, float]:
    """``(meaningful, mean tokens)``: whether corpus BLEU says anything about ``refs``.

    True when the references average at least :data:`BLEU_MIN_TOKENS` tokens (see the module
    docstring: below that, perfect outputs score 0.0).
    """
    mean = mean_ref_tokens(refs, tokenize=tokenize)
    return mean >= BLEU_MIN_TOKENS, mean


def bleu_text(metrics: dict[str, Any]) -> str | None:
    """How to print the BLEU of an evaluation's ``metrics``, or None when it has none.

    ``"BLEU 98.1"`` when ``metrics["bleu"]`` is there; ``"BLEU n/a (targets average 2.5
    tokens; BLEU needs 4-grams)"`` when the evaluation left BLEU out and recorded
    ``metrics["bleu_ref_tokens"]`` instead (see :func:`~qkv.train.evaluate_seq2seq`).
    """
    if metrics.get("bleu") is not None:
        return f"BLEU {metrics['bleu']:.1f}"
    if metrics.get("bleu_ref_tokens") is not None:
        return (f"BLEU n/a (targets average {metrics['bleu_ref_tokens']:.1f} tokens; BLEU "
                f"needs {BLEU_MIN_TOKENS}-grams)")  # fmt: skip
    return None


def describe_metrics(metrics: dict[str, Any]) -> str:
    """``metrics`` in words, as qkv prints them on the terminal (metrics.jsonl keeps the keys).

    ``step 200  loss 1.234  perplexity 3.43  token accuracy 91.2%  exact match 80.0%  BLEU 98.1
    chrF 99.0``: fractions as percentages, BLEU by :func:`bleu_text` (``BLEU n/a (targets
    average 2.9 tokens; BLEU needs 4-grams)`` in place of ``bleu_ref_tokens``), any other key
    with its underscores as spaces.
    """
    words = {"exact_match": "exact match", "token_accuracy": "token accuracy", "chrf": "chrF"}
    parts = []
    for key, value in metrics.items():
        if key in ("bleu", "bleu_ref_tokens"):
            if key == "bleu" or metrics.get("bleu") is None:
                parts.append(bleu_text({key: value}) or f"BLEU {value}")
        elif key == "step":
            parts.append(f"step {value:,}")
        elif key in ("exact_match", "token_accuracy"):
            parts.append(f"{words[key]} {value:.1%}")
        elif key == "chrf":
            parts.append(f"chrF {value:.1f}")
        elif isinstance(value, float):
            parts.append(f"{key.replace('_', ' ')} {value:.4g}")
        else:
            parts.append(f"{key.replace('_', ' ')} {value}")
    return "  ".join(parts)


def chrf(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus chrF (0-100, character n-gram F-score) of ``hyps`` against ``refs``, by sacrebleu.

    Raises:
        ValueError: different lengths, empty inputs; TypeError: non-strings.
        ImportError: sacrebleu not installed (``pip install 'qkv[train]'``).
    """
    _check_strings(hyps, refs)
    return float(_sacrebleu().corpus_chrf(list(hyps), [list(refs)]).score)
