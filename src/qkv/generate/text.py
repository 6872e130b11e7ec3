"""Text in, text out: one entry point over every decoding method, and tokenizer round trips.

* :func:`generate` picks the method from its arguments: ``beam_size`` -> beam search,
  ``temperature > 0`` -> sampling, otherwise greedy.
* :func:`translate`: source strings -> target strings with an encoder-decoder model
  (sources encoded as ``tokens + EOS``, the convention of :mod:`qkv.data.batching`).
* :func:`complete`: prompt strings -> continuations with a decoder-only model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from qkv.checks import positive_int
from qkv.generate.args import check_sampling, default_new_tokens, length_limit, special_ids
from qkv.generate.beam import beam_search
from qkv.generate.controls import GenerationControls
from qkv.generate.search import sample, strip
from qkv.generate.session import Inputs, is_seq2seq

__all__ = ["COMPLETE_DEFAULT_TOKENS", "complete", "generate", "translate"]

COMPLETE_DEFAULT_TOKENS = 64  # complete()'s max_new_tokens when not given (room permitting)


def _eos(model: nn.Module, options: dict[str, Any]) -> int | None:
    """The EOS id decoding will stop at (given in ``options`` or the config's), checked."""
    ids = {k: options.get(k) for k in ("eos_id", "pad_id", "bos_id")}
    return special_ids(model, **ids, seq2seq=is_seq2seq(model))[0]


def generate(
    model: nn.Module,
    inputs: Inputs,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | Sequence[int] | None = None,
    beam_size: int | None = None,
    alpha: float = 0.6,
    eos_id: int | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
    compile: bool = False,
    controls: GenerationControls | None = None,
) -> Tensor:
    """Decode ``inputs`` with beam search (``beam_size``), sampling (``temperature > 0``) or
    greedy search (the default).

    Args:
        model, inputs, max_new_tokens, eos_id, pad_id, bos_id: as :func:`greedy`.
        temperature, top_k, top_p, seed: as :func:`sample` (ignored by beam search).
        beam_size, alpha: as :func:`beam_search`.
        compile: as :func:`greedy` (not with beam search).
        controls: as :func:`sample`: a :class:`~qkv.generate.controls.GenerationControls`
            (not with beam search yet: refused).

    Returns:
        ``(B, L)`` long new tokens, EOS included, then ``pad_id``.

    Raises:
        ValueError: as the method chosen; beam search together with ``temperature > 0``,
            ``compile=True`` or ``controls``.
    """
    ids: dict[str, Any] = dict(eos_id=eos_id, pad_id=pad_id, bos_id=bos_id)
    check_sampling(temperature, top_k, top_p)
    if beam_size is not None:
        if temperature:
            raise ValueError(
                f"beam_size={beam_size} searches, temperature={temperature} samples: pick one"
            )
        if compile:
            raise ValueError("compile=True (a static KV cache) does not serve beam search; "
                             "use compile=False with beam_size")  # fmt: skip
        if controls is not None:
            raise ValueError(f"controls are not supported by beam search yet (beam_size="
                             f"{beam_size}); use greedy or sampling, or controls=None")  # fmt: skip
        out = beam_search(model, inputs, beam_size=beam_size, max_new_tokens=max_new_tokens,
                          alpha=alpha, **ids)  # fmt: skip
        assert isinstance(out, Tensor)
        return out
    return sample(model, inputs, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, top_p=top_p, seed=seed, compile=compile, controls=controls,
                  **ids)  # fmt: skip


def translate(
    model: nn.Module,
    texts: Sequence[str],
    src_tok: Any,
    tgt_tok: Any,
    *,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
    **options: Any,
) -> list[str]:
    """Translate ``texts`` with an encoder-decoder model.

    Args:
        model: e.g. :class:`qkv.models.Seq2SeqTransformer`.
        texts: source strings.
        src_tok, tgt_tok: tokenizers of the two sides (qkv's: PAD=0, BOS=1, EOS=2).
        batch_size: sources decoded together.
        max_new_tokens: per batch; default ``2 * longest source + 10`` (capped by the
            model's ``max_len``).
        **options: passed to :func:`generate` (``beam_size``, ``temperature``, ...).

    Returns:
        one string per text.

    Raises:
        TypeError: a decoder-only model or non-string texts; ValueError: as :func:`generate`.
    """
    if not is_seq2seq(model):
        raise TypeError(f"translate needs an encoder-decoder model, got {type(model).__name__}")
    if isinstance(texts, str) or any(not isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of strings")
    positive_int("batch_size", batch_size)
    if max_new_tokens is not None:
        positive_int("max_new_tokens", max_new_tokens)
    eos = _eos(model, options)
    limit = getattr(getattr(model, "config", None), "max_len", None)
    out: list[str] = []
    for start in range(0, len(texts), batch_size):
        sources = [src_tok.encode(t, add_eos=True) for t in texts[start : start + batch_size]]
        n = max_new_tokens or 2 * max(len(s) for s in sources) + 10
        n = min(n, limit) if limit is not None else n
        tokens = generate(model, sources, max_new_tokens=n, **options)
        out.extend(tgt_tok.decode(row) for row in strip(tokens, eos))
    return out


def complete(
    model: nn.Module,
    prompts: Sequence[str],
    tokenizer: Any,
    *,
    max_new_tokens: int | None = None,
    add_bos: bool = True,
    **options: Any,
) -> list[str]:
    """Continue each prompt string with a decoder-only model; returns the new text only.

    Args:
        model: e.g. :class:`qkv.models.DecoderLM`.
        prompts: prompt strings.
        tokenizer: the model's tokenizer.
        max_new_tokens: tokens generated per prompt; None = :data:`COMPLETE_DEFAULT_TOKENS`,
            cut to the room the longest prompt leaves within the model's ``max_len``.
        add_bos: start each prompt with BOS (as in training with BOS-separated documents).
        **options: passed to :func:`generate`.

    Raises:
        TypeError: an encoder-decoder model or non-string prompts; ValueError: as
            :func:`generate`, and a prompt that alone fills the model's ``max_len``.
    """
    if is_seq2seq(model):
        raise TypeError(f"complete needs a decoder-only model, got {type(model).__name__}")
    if isinstance(prompts, str) or any(not isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a list of strings")
    if max_new_tokens is not None:
        positive_int("max_new_tokens", max_new_tokens)
    eos = _eos(model, options)
    ids = [tokenizer.encode(p, add_bos=add_bos) for p in prompts]
    if max_new_tokens is None:
        limit = length_limit(model)
        longest = max((len(i) for i in ids), default=0)
        max_new_tokens = default_new_tokens(limit, longest, COMPLETE_DEFAULT_TOKENS)
    tokens = generate(model, ids, max_new_tokens=max_new_tokens, **options)
    return [tokenizer.decode(row) for row in strip(tokens, eos)]
