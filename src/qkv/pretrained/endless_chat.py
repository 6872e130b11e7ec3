"""A chat that goes on forever in flat memory: the conversation lives in an attention-sink
cache (:mod:`qkv.nn.sink_cache`) and each turn feeds only what is new.

A plain chat (:meth:`qkv.pretrained.DecoderBundle.stream`) renders the whole conversation with
the chat template every turn and runs it through the model: exact, but each turn costs the
whole history, and past the model's context the history no longer fits. :class:`EndlessChat`
keeps one cache for the conversation: the first ``sinks`` positions and the last ``recent``
ones. Each turn renders the conversation, feeds the text after what was already fed (the new
user turn and the template's markup), then the reply token by token. Memory stays that of
``sinks + recent`` positions however long the chat; the model sees the start of the
conversation (the system prompt's first tokens, its attention sink) and the recent turns.

What it gives up: tokens are cut at turn boundaries (the new text is encoded on its own, so
a token cannot span the boundary), and once positions are dropped a reply depends on the
recent turns only. When the rendered conversation no longer starts with what was fed (a
``/reset``, a template that rewrites earlier turns), the cache starts over from the whole
conversation.

Shapes: ``V`` vocabulary; one row.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from qkv.checks import positive_int
from qkv.generate.args import check_sampling
from qkv.generate.sampling import Sampler
from qkv.pretrained.stop_text import TextStream

__all__ = ["EndlessChat"]

CHUNK = 256  # tokens fed per forward when a turn's text is long


class EndlessChat:
    """One conversation with a chat model, held in an attention-sink cache.

    Args:
        bundle: a :class:`~qkv.pretrained.DecoderBundle` with a chat template and a rotary
            model (``new_cache(recent=...)``).
        sinks: first positions kept (StreamingLLM's 4).
        recent: last positions kept.

    Raises:
        ValueError: no chat template, a model whose cache cannot keep sinks, bad sizes.
    """

    def __init__(self, bundle, *, sinks: int = 4, recent: int = 2044) -> None:
        if not getattr(bundle.tokenizer, "chat_template", None):
            raise ValueError(f"{bundle.name} has no chat template: an endless chat needs one")
        self.bundle, self.sinks, self.recent = bundle, sinks, positive_int("recent", recent)
        self.reset()

    def reset(self) -> None:
        """Forget everything fed (a new, empty cache)."""
        self.cache = self.bundle.model.new_cache(recent=self.recent, sinks=self.sinks)
        self.fed = ""  # the rendered conversation text fed so far
        self.logits: Tensor | None = None  # (V,) after the last fed token

    @property
    def held(self) -> int:
        """Positions the cache holds (at most ``sinks + recent`` between turns)."""
        return self.cache[0].held

    @torch.inference_mode()
    def _feed(self, ids: list[int]) -> Tensor:
        device = next(self.bundle.model.parameters()).device
        for start in range(0, len(ids), CHUNK):
            piece = torch.tensor([ids[start : start + CHUNK]], device=device)
            self.logits = self.bundle.model(piece, cache=self.cache)[0, -1].float()  # (V,)
        assert self.logits is not None
        return self.logits

    def reply(self, messages: list[dict[str, str]], *, max_new_tokens: int = 256,
              temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
              seed: int | None = None) -> Iterator[str]:  # fmt: skip
        """Stream the reply to ``messages`` (the whole conversation, ending with the user's
        turn) as text pieces; append the joined reply as the assistant's turn before the next
        call.

        Raises:
            ValueError, TypeError: malformed messages, bad sampling options.
        """
        positive_int("max_new_tokens", max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        tok = self.bundle.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        if not text.startswith(self.fed):
            self.reset()
        ids = tok.encode(text[len(self.fed) :], add_special_tokens=False)
        logits = self._feed(ids) if ids else self.logits
        if logits is None:
            raise ValueError("nothing to answer: the conversation renders to no new text")
        choose = (lambda x: x.argmax(-1)) if temperature == 0 else Sampler(
            1, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p,
            device=logits.device)  # fmt: skip
        new: list[int] = []
        shown = TextStream(lambda ids: tok.decode(ids, skip_special_tokens=True))
        for _ in range(max_new_tokens):
            token = int(choose(logits[None])[0])
            if token == self.bundle.eos_id:
                break
            new.append(token)
            logits = self._feed([token])
            piece = shown.push(token)
            if piece:
                yield piece
        rest = shown.close()
        if rest:
            yield rest
        self.fed = text + tok.decode(new, skip_special_tokens=False)
