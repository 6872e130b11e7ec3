"""Decoding: greedy search, sampling (temperature, top-k, top-p) and beam search, with the KV cache.

Every method works for decoder-only models (:class:`qkv.models.DecoderLM`: prompts of any
lengths, left-padded with an attention mask and per-row positions) and encoder-decoder models
(:class:`qkv.models.Seq2SeqTransformer`: sources right-padded, decoding from BOS), and a batch
gives the same tokens as its rows one at a time. Decoding uses the model as it is: call
``model.eval()`` first (with dropout on, every method would be random).

* :func:`greedy`, :func:`sample`, :func:`beam_search`, and :func:`generate` choosing among
  them; each returns the ``(B, L)`` new tokens, EOS kept, padding after it.
* :func:`stream`: one prompt, token ids yielded as they are chosen (for chat).
* :func:`translate`, :func:`complete`: strings in, strings out, through a tokenizer.
* :class:`GenerationControls`: repetition penalty, no-repeat n-grams, bad words, minimum and
  forced length, min-p, as transformers' logits processors (``controls=``; not beam search).
* :func:`strip`: output rows as lists cut at EOS; :func:`filter_logits`, :func:`top_p_keep`,
  :func:`length_penalty`: the pieces, for inspection and tests.
"""

from qkv.generate.beam import beam_search, length_penalty
from qkv.generate.beam_hf import beam_search_hf
from qkv.generate.controls import GenerationControls
from qkv.generate.lookup import prompt_lookup
from qkv.generate.sampling import Sampler, filter_logits, top_p_keep
from qkv.generate.search import greedy, sample, stream, strip
from qkv.generate.session import DecoderSession, Seq2SeqSession, is_seq2seq, make_session
from qkv.generate.text import complete, generate, translate

__all__ = [
    "DecoderSession",
    "GenerationControls",
    "Sampler",
    "Seq2SeqSession",
    "beam_search",
    "beam_search_hf",
    "complete",
    "filter_logits",
    "generate",
    "greedy",
    "is_seq2seq",
    "length_penalty",
    "make_session",
    "prompt_lookup",
    "sample",
    "stream",
    "strip",
    "top_p_keep",
    "translate",
]
