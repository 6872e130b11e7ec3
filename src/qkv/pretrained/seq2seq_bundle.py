"""What :func:`qkv.pretrained.load` returns for an encoder-decoder (BART, T5, Marian/Opus-MT).

:class:`Seq2SeqBundle` keeps ``.model`` (a plain :class:`qkv.models.Seq2SeqTransformer`: call
``model(src (B, S), tgt_in (B, T)) -> (B, T, V)``, or ``encode`` / ``decode`` with a cache),
``.tokenizer`` and ``.config``; ``translate(texts)`` maps strings to strings and ``generate``
one input (text or ids) to its output, both through :mod:`qkv.generate` (greedy by default,
beam search with ``beam_size``, sampling with ``temperature``). Sources are encoded by the
tokenizer's own post-processor (BART: ``<s> ... </s>``; T5, Marian: ``... </s>``); decoding
starts from the config's ``bos_id`` (the model's decoder start token) and stops at ``eos_id``.

Shapes: ``N`` texts, ``B`` batch, ``S`` source tokens, ``T`` target tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from qkv.checks import is_int, positive_int
from qkv.models import Seq2SeqTransformer
from qkv.pretrained.generation_config import FolderGeneration

__all__ = ["Seq2SeqBundle"]

DEFAULT_NEW_TOKENS = 128  # translate()'s output limit when not given (cut to the model's max_len)


@dataclass
class Seq2SeqBundle:
    """An encoder-decoder with its tokenizer.

    Attributes:
        model: the :class:`~qkv.models.Seq2SeqTransformer` (eval mode).
        tokenizer: encodes sources (``encode(text) -> ids``, with the model's framing) and
            decodes outputs (``decode(ids, skip_special_tokens=True)``); None for a folder
            without tokenizer files (then inputs must be token ids).
        name: the packaged name or the folder.
        source: where the weights came from.
        generation: the folder's ``generation_config.json`` (beams, length, banned tokens),
            used when a call sets no decoding option of its own; None: plain greedy.
    """

    model: Seq2SeqTransformer
    tokenizer: Any
    name: str
    source: dict[str, Any] = field(default_factory=dict)
    generation: FolderGeneration | None = None

    @property
    def config(self) -> Any:
        return self.model.config

    def source_ids(self, text_or_ids: object) -> list[int]:
        """Token ids of one source: a string (encoded with the tokenizer) or ids themselves.

        Raises:
            TypeError: another type, or a string without a tokenizer.
            ValueError: an empty source.
        """
        x = text_or_ids
        if isinstance(x, Tensor):
            x = x.tolist()
        if isinstance(x, (list, tuple)) and x and all(is_int(t) for t in x):
            return list(x)
        if not isinstance(x, str):
            raise TypeError(f"a source must be a str or a non-empty list of token ids, got "
                            f"{type(x).__name__}")  # fmt: skip
        if self.tokenizer is None:
            raise TypeError(f"{self.name} has no tokenizer; pass sources as token ids")
        ids = self.tokenizer.encode(x)
        if not ids:
            raise ValueError(f"the source {x!r:.60} encodes to no tokens")
        return ids

    def _limit(self, longest: int, max_new_tokens: int | None) -> int:
        """``max_new_tokens`` checked, or the default: ``2 * longest + 10`` up to
        :data:`DEFAULT_NEW_TOKENS`, within the model's ``max_len``."""
        if max_new_tokens is not None:
            return positive_int("max_new_tokens", max_new_tokens)
        return min(2 * longest + 10, DEFAULT_NEW_TOKENS, self.config.max_len)

    def generate_ids(
        self, sources: Sequence[object], *, max_new_tokens: int | None = None,
        beam_size: int | None = None, alpha: float = 0.0, temperature: float = 0.0,
        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
        length_penalty: float | None = None, early_stopping: bool | str = False,
        compile: bool = False,
    ) -> list[list[int]]:  # fmt: skip
        """Output token ids of each source (EOS and padding removed), decoded as one batch.

        Args:
            sources: ``N`` strings or lists of token ids.
            max_new_tokens: the most tokens per output (default ``2 * longest source + 10``,
                at most :data:`DEFAULT_NEW_TOKENS` and the model's ``max_len``).
            beam_size: beam search with this many beams (None: greedy or sampling).
            alpha: beam search length penalty (GNMT; 0 = plain log-probabilities, the ranking
                of Hugging Face's ``length_penalty=0``).
            temperature, top_k, top_p, seed: sampling (``temperature > 0``).
            length_penalty, early_stopping: beam search as transformers runs it
                (:func:`qkv.generate.beam_search_hf`: ``log p / |y| ** length_penalty`` and its
                stopping rules), for outputs equal to a checkpoint's ``generate``; needs
                ``beam_size``, excludes ``alpha``.
            compile: decode with a static KV cache and the steps after the first compiled by
                ``torch.compile`` (:mod:`qkv.generate.compiled`; the first call compiles,
                later ones in the same buckets reuse it); not with beam search.

        Returns:
            ``N`` lists of ids.

        Raises:
            TypeError, ValueError: bad sources or options (as :func:`qkv.generate.generate`).
        """
        from qkv.generate import beam_search_hf, generate, strip

        if isinstance(sources, (str, Tensor)) or not isinstance(sources, Sequence):
            raise TypeError(f"sources must be a list of strings or of id lists, got "
                            f"{type(sources).__name__}")  # fmt: skip
        if not sources:
            raise ValueError("give at least one source")
        rows = [self.source_ids(s) for s in sources]
        g = self.generation
        if g is not None and beam_size is None and not alpha and temperature == 0 \
                and length_penalty is None:  # fmt: skip
            return self._as_folder_says(rows, max_new_tokens, compile)
        n = self._limit(max(len(r) for r in rows), max_new_tokens)
        if compile and beam_size is not None:
            raise ValueError("compile=True (a static KV cache) does not serve beam search; "
                             "use compile=False with beam_size")  # fmt: skip
        if length_penalty is not None:
            if beam_size is None or alpha:
                raise ValueError("length_penalty (transformers' beam search) needs beam_size and "
                                 "excludes alpha (GNMT's penalty)")  # fmt: skip
            tokens = beam_search_hf(self.model, rows, beam_size=beam_size, max_new_tokens=n,
                                    length_penalty=length_penalty,
                                    early_stopping=early_stopping)  # (N, L)  # fmt: skip
            return strip(tokens, self.config.eos_id)
        tokens = generate(self.model, rows, max_new_tokens=n, beam_size=beam_size, alpha=alpha,
                          temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, compile=compile)  # (N, L)  # fmt: skip
        return strip(tokens, self.config.eos_id)

    def _as_folder_says(self, rows: list[list[int]], max_new_tokens: int | None,
                        compile: bool) -> list[list[int]]:  # fmt: skip
        """Decode as the folder's ``generation_config.json`` asks (transformers' way)."""
        from qkv.generate import GenerationControls, beam_search_hf, generate, strip

        g = self.generation
        assert g is not None
        if max_new_tokens is None and (g.max_new_tokens or g.max_length):
            max_new_tokens = min(g.max_new_tokens or g.max_length - 1, self.config.max_len)
        n = self._limit(max(len(r) for r in rows), max_new_tokens)
        if g.num_beams > 1:
            banned = [w[0] for w in g.bad_words_ids if len(w) == 1]
            tokens = beam_search_hf(self.model, rows, beam_size=g.num_beams, max_new_tokens=n,
                                    length_penalty=g.length_penalty,
                                    early_stopping=g.early_stopping, banned=banned,
                                    forced_eos=g.forced_eos)  # (N, L)  # fmt: skip
            return strip(tokens, self.config.eos_id)
        controls = GenerationControls(
            repetition_penalty=g.repetition_penalty, no_repeat_ngram_size=g.no_repeat_ngram_size,
            bad_words_ids=g.bad_words_ids, forced_eos=g.forced_eos)  # fmt: skip
        tokens = generate(self.model, rows, max_new_tokens=n, controls=controls,
                          compile=compile)  # (N, L)  # fmt: skip
        return strip(tokens, self.config.eos_id)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise TypeError(f"{self.name} has no tokenizer; use generate_ids")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def translate(
        self, texts: str | Sequence[str], *, beam_size: int | None = None, alpha: float = 0.0,
        max_new_tokens: int | None = None, batch_size: int = 16,
        length_penalty: float | None = None, early_stopping: bool | str = False,
        compile: bool = False,
    ) -> list[str]:  # fmt: skip
        """Translate (or summarise, or whatever the model was trained for) ``texts``.

        Args:
            texts: one string or ``N`` strings.
            beam_size: beam search with this many beams (None: greedy).
            alpha: beam search length penalty (see :meth:`generate_ids`).
            max_new_tokens: the most tokens per output (see :meth:`generate_ids`).
            batch_size: texts decoded together.
            length_penalty, early_stopping: transformers' beam search (see
                :meth:`generate_ids`).
            compile: a static cache and compiled steps (see :meth:`generate_ids`).

        Returns:
            ``N`` strings, special tokens removed (one for a single string).

        Raises:
            TypeError: non-string texts, or no tokenizer.
            ValueError: no texts; bad options.
        """
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise ValueError("give at least one text to translate")
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        batch_size = positive_int("batch_size", batch_size)
        out: list[str] = []
        for start in range(0, len(items), batch_size):
            ids = self.generate_ids(items[start : start + batch_size], beam_size=beam_size,
                                    alpha=alpha, max_new_tokens=max_new_tokens,
                                    length_penalty=length_penalty,
                                    early_stopping=early_stopping,
                                    compile=compile)  # fmt: skip
            out.extend(self._decode(row) for row in ids)
        return out

    def generate(
        self, source: object, max_new_tokens: int | None = None, *,
        beam_size: int | None = None, alpha: float = 0.0, temperature: float = 0.0,
        top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
        compile: bool = False,
    ) -> str:  # fmt: skip
        """The output text for one source (a string or token ids); options as
        :meth:`generate_ids`.

        Raises:
            TypeError, ValueError: as :meth:`generate_ids`; no tokenizer to decode with.
        """
        ids = self.generate_ids([source], max_new_tokens=max_new_tokens, beam_size=beam_size,
                                alpha=alpha, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, compile=compile)  # fmt: skip
        return self._decode(ids[0])
