"""A generation timeline: the attention of each new token while a decoder-only LM decodes.

    gen = qkv.inspect.record_generation(model, prompt_ids, max_new_tokens=20)
    gen.new_ids                         # (N,): greedy tokens, as qkv.generate.greedy gives
    gen.weights["blocks.0.self_attn"]   # (N, H', P + N - 1): step s is the query at
                                        # position P - 1 + s over keys 0 .. P - 1 + s
    qkv.inspect.view(gen, labels, "generation.html")   # the viewer's scrubbable timeline

Greedy decoding is run here, a few lines long, exactly as :mod:`qkv.generate` runs it: the
prompt once, then one token at a time through the model's KV cache (``model.new_cache()``,
``forward(ids, cache=cache)``). Step ``s`` is the forward call that chooses new token ``s``:
step 0 is the prompt's last row, step ``s >= 1`` feeds new token ``s - 1``. Its weights come
from :func:`qkv.inspect.capture` with ``rows=-1`` on each call, so they are the exact
``(1, H', 1, S)`` weights of that cached call (rebuilt from the queries and the cached keys),
not a recomputation on the full sequence; they equal the causal rows of one full forward pass
to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checks import is_int, positive_int
from qkv.inspect.capture import capture, join_calls
from qkv.inspect.viewer_data import b64, weight_codes

__all__ = ["TIMELINE_BUDGET", "Generation", "record_generation"]

# Weights (steps × heads × keys, over all layers) the page's timeline may hold: one byte each.
TIMELINE_BUDGET = 16_000_000


@dataclass(frozen=True)
class Generation:
    """What :func:`record_generation` recorded.

    Attributes:
        ids: ``(P + N,)`` long: the prompt, then the ``N`` generated tokens.
        prompt_len: ``P``.
        weights: ``{layer name: (N, H', P + N - 1)}`` float32; row ``s`` is the attention of
            the query at position ``P - 1 + s`` (the one that chose new token ``s``) over keys
            ``0 .. P - 1 + s``, zeros to the right of them.
        heads: ``{layer name: the model's head numbers of the H' rows}``.
    """

    ids: Tensor
    prompt_len: int
    weights: dict[str, Tensor]
    heads: dict[str, list[int]]

    @property
    def new_ids(self) -> Tensor:
        """``(N,)``: the generated tokens."""
        return self.ids[self.prompt_len :]

    @property
    def steps(self) -> int:
        """``N``, the number of decoding steps (= generated tokens)."""
        return int(self.ids.numel()) - self.prompt_len

    def step(self, s: int, layer: str) -> Tensor:
        """``(H', P + s)``: the weights of step ``s`` in ``layer`` (its visible keys only).

        Raises:
            ValueError: ``s`` outside ``[0, N)`` or an unknown layer.
        """
        if not is_int(s) or not 0 <= s < self.steps:
            raise ValueError(f"step must be an int in [0, {self.steps}), got {s!r}")
        if layer not in self.weights:
            raise ValueError(f"layer {layer!r} was not recorded; recorded: {list(self.weights)}")
        return self.weights[layer][s, :, : self.prompt_len + s]

    def page_data(self, labels: list[str]) -> dict[str, Any]:
        """The timeline's entry in the viewer's JSON (weights as square-root byte codes).

        Raises:
            ValueError: fewer than ``P + N`` labels, or more weights than
                :data:`TIMELINE_BUDGET`.
        """
        n = int(self.ids.numel())
        if len(labels) < n:
            raise ValueError(f"the timeline needs {n} labels (prompt + generated tokens), "
                             f"got {len(labels)}")  # fmt: skip
        size = sum(w.numel() for w in self.weights.values())
        if size > TIMELINE_BUDGET:
            raise ValueError(
                f"the timeline holds {size:,} weights, more than the page's budget of "
                f"{TIMELINE_BUDGET:,}: record fewer layers=, heads= or max_new_tokens"
            )
        layers = [{"name": name, "heads": self.heads[name], "w": b64(weight_codes(w))}
                  for name, w in self.weights.items()]  # fmt: skip
        return {"prompt": self.prompt_len, "steps": self.steps, "S": max(n - 1, 1),
                "labels": list(labels[:n]), "layers": layers}  # fmt: skip

    def __repr__(self) -> str:
        return (f"Generation(prompt {self.prompt_len} tokens, {self.steps} new, "
                f"{len(self.weights)} layers)")  # fmt: skip


def _prompt(model: nn.Module, prompt_ids: Any) -> Tensor:
    """``prompt_ids`` as a ``(1, P)`` long tensor, checked against the vocabulary."""
    if isinstance(prompt_ids, Tensor):
        ids = prompt_ids
    elif isinstance(prompt_ids, (list, tuple)) and all(is_int(t) for t in prompt_ids):
        ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    else:
        raise TypeError(f"prompt_ids must be a (P,) or (1, P) tensor or a list of ints, got "
                        f"{type(prompt_ids).__name__}")  # fmt: skip
    if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be one non-empty prompt, (P,) or (1, P), got shape "
                         f"{tuple(ids.shape)}")  # fmt: skip
    V = getattr(getattr(model, "config", None), "vocab_size", None)
    if V is not None and not bool(((ids >= 0) & (ids < V)).all()):
        raise ValueError(f"prompt_ids has ids outside [0, {V}): {ids.tolist()!r:.80}")
    return ids.long()[None]  # (1, P)


@torch.no_grad()
def record_generation(
    model: nn.Module,
    prompt_ids: Any,
    max_new_tokens: int = 32,
    *,
    layers: Any = None,
    heads: Any = None,
    eos_id: int | None = None,
) -> Generation:
    """Greedy-decode one prompt with the KV cache and record each step's attention.

    Args:
        model: a decoder-only LM with ``new_cache()`` and ``forward(ids (1, T), cache=)``
            returning ``(1, T, V)`` logits, e.g. :class:`qkv.models.DecoderLM`.
        prompt_ids: ``(P,)`` or ``(1, P)`` token ids, or a list of ints.
        max_new_tokens: the most tokens generated.
        layers, heads: which attention layers and query heads to record (as in
            :func:`qkv.inspect.capture`; None: all).
        eos_id: stop after this token (it is kept); None: the model config's ``eos_id``, if
            it has one.

    Returns:
        a :class:`Generation`; ``new_ids`` equal :func:`qkv.generate.greedy`'s output.

    Raises:
        TypeError: a model that is not a decoder-only LM with a KV cache; bad ``prompt_ids``.
        ValueError: bad ids, ``max_new_tokens``, a prompt plus ``max_new_tokens`` beyond the
            model's ``max_len``; the errors of :func:`capture` for ``layers``/``heads``.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "new_cache") or (
        hasattr(model, "encode") and hasattr(model, "decode")
    ):
        raise TypeError("record_generation needs a decoder-only LM with new_cache() (e.g. "
                        f"qkv.models.DecoderLM), got {type(model).__name__}")  # fmt: skip
    positive_int("max_new_tokens", max_new_tokens)
    ids = _prompt(model, prompt_ids)  # (1, P)
    P = ids.shape[1]
    config = getattr(model, "config", None)
    limit = getattr(config, "max_len", None)
    if limit is not None and P + max_new_tokens > limit:
        raise ValueError(f"a prompt of {P} tokens + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's max_len={limit}")  # fmt: skip
    eos = eos_id if eos_id is not None else getattr(config, "eos_id", None)
    if eos is not None and (not is_int(eos) or eos < 0):
        raise ValueError(f"eos_id must be a non-negative int or None, got {eos!r}")
    first = next(iter(model.parameters()), None)
    ids = ids.to(first.device if first is not None else "cpu")
    new: list[Tensor] = []
    cache = model.new_cache()
    with capture(model, layers, heads, rows=-1) as cap:
        # 1) the prompt once: its last row chooses the first new token
        logits = model(ids, cache=cache)[:, -1]  # (1, V)
        for t in range(max_new_tokens):
            # 2) greedy choice; stop at EOS (kept) or at the limit
            token = logits.argmax(-1)  # (1,)
            new.append(token)
            if (eos is not None and int(token) == eos) or t == max_new_tokens - 1:
                break
            # 3) one cached step for the new token
            logits = model(token[:, None], cache=cache)[:, -1]  # (1, V)
    weights = {name: join_calls(cap.calls[name], name)[0].transpose(0, 1).float().cpu()
               for name in cap.layers}  # (N, H', P + N - 1)  # fmt: skip
    full = torch.cat([ids[0], torch.cat(new)]).cpu()  # (P + N,)
    return Generation(full, P, weights, {n: cap.heads[n] for n in cap.layers})
