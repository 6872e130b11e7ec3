"""What :func:`qkv.pretrained.load` returns: a model, its tokenizer, and what to do with them.

* :class:`EncoderBundle` (sentence encoders such as all-MiniLM-L6-v2): ``encode(texts)`` gives
  L2-normalised sentence embeddings ``(N, E)``, ``similarity(texts)`` their cosine table.
* :class:`DecoderBundle` (language models such as SmolLM2): ``generate(prompt or messages)``
  gives the continuation as text, ``stream(...)`` yields it piece by piece as tokens are
  chosen; a list of chat messages goes through the model's chat template first.

Both keep ``.model`` (a plain :class:`qkv.models.Encoder` / :class:`qkv.models.DecoderLM`: call
it on token ids), ``.tokenizer`` and ``.config`` (the model's config); ``.source`` says where
the weights came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.checks import positive_int
from qkv.generate.engine import SamplingParams, decoding_params
from qkv.generate.session import model_device
from qkv.models import DecoderLM, Encoder
from qkv.pretrained.stop_text import TextStream

__all__ = ["DecoderBundle", "EncoderBundle", "cosine_table"]

# The decoding keywords' defaults (DecoderBundle.generate): given with params=, refused.
_DEFAULTS = dict(temperature=0.0, top_k=None, top_p=None, seed=None, controls=None, stop=())


def cosine_table(embeddings: Tensor) -> Tensor:
    """Pairwise cosine similarities of ``embeddings (N, E)`` -> ``(N, N)``.

    Raises:
        ValueError: ``embeddings`` not 2-D.
    """
    if not isinstance(embeddings, Tensor) or embeddings.dim() != 2:
        got = tuple(embeddings.shape) if isinstance(embeddings, Tensor) else type(embeddings)
        raise ValueError(f"embeddings must be a (N, E) tensor, got {got}")
    unit = F.normalize(embeddings, p=2.0, dim=1)  # (N, E)
    return unit @ unit.T  # (N, N)


def _texts(texts: object) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Iterable):
        raise TypeError(f"texts must be a str or a list of str, got {type(texts).__name__}")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    return out


@dataclass
class EncoderBundle:
    """A sentence encoder with its tokenizer.

    Attributes:
        model: the :class:`~qkv.models.Encoder` (eval mode).
        tokenizer: a :class:`~qkv.pretrained.tokenizer.PretrainedTokenizer` truncating at the
            model's input limit (256 for all-MiniLM-L6-v2, as sentence-transformers).
        name: the packaged name or the folder.
        source: where the weights came from (``{"format": ..., "path": ...}``).
        normalize: ``encode`` L2-normalises (sentence-transformers' ``Normalize`` module).
    """

    model: Encoder
    tokenizer: Any
    name: str
    source: dict[str, Any] = field(default_factory=dict)
    normalize: bool = True

    @property
    def config(self) -> Any:
        return self.model.config

    def encode(self, texts: str | Sequence[str], batch_size: int = 32) -> Tensor:
        """Sentence embeddings: mean of the last hidden states over real tokens, normalised.

        All texts are tokenized at once and sorted by their token counts, so each batch pads
        only to its own longest row (sorting by characters, as sentence-transformers does,
        leaves ~14% padding on mixed text); the rows come back in the input order.

        Args:
            texts: one string or ``N`` strings (empty strings are fine: ``[CLS] [SEP]``).
            batch_size: texts per forward pass.

        Returns:
            ``(N, E)`` float32 on the CPU, whatever the model's device (one row for a single
            string: ``(1, E)``).

        Raises:
            TypeError: non-string texts.
            ValueError: ``batch_size`` not a positive int.
        """
        items = _texts(texts)
        batch_size = positive_int("batch_size", batch_size)
        E = self.model.config.d_model
        if not items:
            return torch.zeros((0, E))
        with torch.inference_mode():
            ids, keep = self.tokenizer.encode_batch(items)  # (N, S) each, right-padded
            device = model_device(self.model)
            ids_on, keep_on = ids.to(device), keep.to(device)  # the model's inputs
            lengths = keep.sum(dim=1)  # (N,)
            order = torch.argsort(lengths, descending=True, stable=True)  # (N,)
            out = torch.empty((len(items), E))  # (N, E)
            for start in range(0, len(items), batch_size):
                rows = order[start : start + batch_size]  # (B,)
                S = int(lengths[rows[0]])  # the batch's longest row (sorted descending)
                on = rows.to(device)
                hidden = self.model(ids_on[on, :S], attention_mask=keep_on[on, :S])  # (B, S, E)
                pooled = self.model.pool(hidden, keep_on[on, :S])  # (B, E)
                if self.normalize:
                    pooled = F.normalize(pooled, p=2.0, dim=1)
                out[rows] = pooled.float().cpu()
        return out.clone()  # an ordinary tensor (made in inference mode)

    def similarity(self, texts: Sequence[str], batch_size: int = 32) -> Tensor:
        """Cosine similarity of every pair of ``texts``: ``(N, N)``."""
        return cosine_table(self.encode(texts, batch_size=batch_size))


@dataclass
class DecoderBundle:
    """A causal language model with its tokenizer and chat template.

    Attributes:
        model: the :class:`~qkv.models.DecoderLM` (eval mode); ``model(ids (B, T))`` gives
            logits ``(B, T, V)``.
        tokenizer: a :class:`~qkv.pretrained.tokenizer.PretrainedTokenizer` (may be None
            for a folder without tokenizer files: then prompts must be token ids).
        name: the packaged name or the path.
        source: where the weights came from.
        eos_id: the id that ends a reply (the tokenizer's EOS, else the config's).
    """

    model: DecoderLM
    tokenizer: Any
    name: str
    source: dict[str, Any] = field(default_factory=dict)
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if self.eos_id is None:
            tok_eos = getattr(self.tokenizer, "eos_id", None)
            self.eos_id = tok_eos if tok_eos is not None else self.model.config.eos_id

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (an instruction-tuned model)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, prompt_or_messages: object, chat: bool | None = None) -> list[int]:
        """Token ids for a prompt string, a chat (list of messages) or ids themselves.

        ``chat`` decides what a string is: None (default) one user message rendered with
        the chat template when the model has one (what ``qkv generate`` does; an
        instruction-tuned model given bare text answers badly), else the text as is; True
        requires the template; False encodes the text as is.

        Raises:
            TypeError: another type; a string or chat without a tokenizer.
            ValueError: an empty prompt; a chat (or ``chat=True``) for a model with no chat
                template.
        """
        p = prompt_or_messages
        if isinstance(p, str) and chat is not False and (chat or self.has_chat_template):
            if not p:
                raise ValueError("the prompt is empty: give at least one token of text")
            p = [{"role": "user", "content": p}]
        if isinstance(p, Tensor):
            p = p.tolist()
        if isinstance(p, (list, tuple)) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        ):
            return list(p)
        if not isinstance(p, (str, list, tuple)):
            raise TypeError(
                "prompt must be a str, a list of chat messages or a list of token ids, got "
                f"{type(p).__name__}"
            )
        if self.tokenizer is None:
            raise TypeError(f"{self.name} has no tokenizer; pass the prompt as token ids")
        ids = self.tokenizer.encode(p) if isinstance(p, str) else self.tokenizer.encode_chat(p)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token of text")
        return ids

    def _record(self, params: SamplingParams | None, max_new_tokens: int,
                **options: Any) -> SamplingParams:  # fmt: skip
        """``params``, or the record of the decoding keywords (:func:`decoding_params`).

        Raises:
            TypeError: ``params`` not a :class:`SamplingParams`.
            ValueError: ``params`` together with decoding keywords; bad options.
        """
        if params is None:
            return decoding_params(max_new_tokens, **options)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got "
                            f"{type(params).__name__}")  # fmt: skip
        given = [k for k, v in options.items() if v != _DEFAULTS[k]]
        given += ["max_new_tokens"] if max_new_tokens != 128 else []
        if given:
            raise ValueError(f"params holds every decoding option; got {given} as well: pass "
                             "them in params (dataclasses.replace) or drop params")  # fmt: skip
        return params

    def _search(self, params: SamplingParams, compile: bool) -> dict[str, Any]:
        """The keyword arguments of :func:`qkv.generate.generate` / ``stream`` for ``params``
        (its stop strings are this bundle's to apply, on the text)."""
        options = {k: v for k, v in params.keywords().items() if k != "stop"}
        return dict(options, eos_id=self.eos_id, compile=compile)

    def generate_ids(self, prompt_or_messages: object, max_new_tokens: int = 128, *,
                     temperature: float = 0.0, top_k: int | None = None,
                     top_p: float | None = None, seed: int | None = None,
                     compile: bool = False, chat: bool | None = None,
                     controls: Any = None, params: SamplingParams | None = None) -> list[int]:
        """The new token ids (EOS not included); arguments as :meth:`generate` (stop strings,
        which act on the text, are not read here)."""
        from qkv.generate import generate, strip

        record = self._record(params, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, controls=controls)  # fmt: skip
        ids = self.prompt_ids(prompt_or_messages, chat)
        out = generate(self.model, [ids], **self._search(record, compile))  # (1, L)
        return strip(out, self.eos_id)[0]

    def generate(self, prompt_or_messages: object, max_new_tokens: int = 128, *,
                 temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None,
                 compile: bool = False, chat: bool | None = None, controls: Any = None,
                 stop: str | Sequence[str] = (),
                 params: SamplingParams | None = None) -> str:  # fmt: skip
        """Continue a prompt, or answer a chat, and return the new text.

        Args:
            prompt_or_messages: a string (one user message through the chat template when
                the model has one, unless ``chat=False``: see :meth:`prompt_ids`), a list of
                ``{"role", "content"}`` messages (rendered with the chat template, ending
                with the assistant's turn), or token ids.
            max_new_tokens: the most tokens generated; EOS stops earlier.
            temperature: 0 = greedy; > 0 samples (with ``top_k`` / ``top_p`` filtering).
            top_k, top_p, seed: sampling options (see :func:`qkv.generate.sample`).
            compile: decode with a static KV cache and the steps compiled by
                ``torch.compile`` (:mod:`qkv.generate.compiled`; the first call compiles,
                ~45 s for SmolLM2-135M on 2 cores; later calls reuse it). Same tokens.
            chat: how a string prompt is read (see :meth:`prompt_ids`).
            controls: a :class:`qkv.generate.GenerationControls` (repetition penalty,
                n-gram and bad-word bans, min-p, minimum and forced lengths), or None.
            stop: stop strings: the text ends before the first one it contains, matched on
                the decoded text (:mod:`qkv.pretrained.stop_text`).
            params: a :class:`~qkv.generate.engine.SamplingParams` holding all of
                ``max_new_tokens`` .. ``stop`` instead (what ``qkv generate`` and ``qkv chat``
                build with :func:`~qkv.generate.engine.decoding_params`); None = the keywords'.

        Returns:
            The generated text, special tokens removed.

        Raises:
            TypeError / ValueError: as :meth:`prompt_ids`, bad sampling options (a
                :class:`~qkv.generate.args.ParamError` naming the option), ``params``
                together with the decoding keywords.
        """
        record = self._record(params, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, controls=controls, stop=stop)  # fmt: skip
        if record.stop:
            return "".join(self.stream(prompt_or_messages, compile=compile, chat=chat,
                                       params=record))  # fmt: skip
        ids = self.generate_ids(prompt_or_messages, compile=compile, chat=chat, params=record)
        if self.tokenizer is None:
            raise TypeError(f"{self.name} has no tokenizer; use generate_ids")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self, prompt_or_messages: object, max_new_tokens: int = 128, *,
               temperature: float = 0.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None,
               compile: bool = False, counter: list[int] | None = None,
               chat: bool | None = None, controls: Any = None,
               stop: str | Sequence[str] = (),
               params: SamplingParams | None = None) -> Iterator[str]:  # fmt: skip
        """Like :meth:`generate`, yielding text pieces as soon as they are decodable.

        A piece is held back while it ends inside a multi-byte character (a byte-level token
        can hold half of an emoji) or could be the start of a stop string, so every yielded
        piece is valid text and the pieces join to :meth:`generate`'s result. ``counter``, a
        list, gets one entry appended per new token (how many were generated, for a
        tokens/s figure).
        """
        from qkv.generate import stream

        if self.tokenizer is None:
            raise TypeError(f"{self.name} has no tokenizer; use generate_ids")
        record = self._record(params, max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, controls=controls, stop=stop)  # fmt: skip
        text = TextStream(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                          record.stop)  # fmt: skip
        ids = self.prompt_ids(prompt_or_messages, chat)
        for token in stream(self.model, ids, **self._search(record, compile)):
            if counter is not None:
                counter.append(token)
            piece = text.push(token)
            if piece:
                yield piece
            if text.stopped:
                return
        rest = text.close()
        if rest:
            yield rest
