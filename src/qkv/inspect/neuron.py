"""The neuron view's numbers: the elementwise terms ``q_i ⊙ k_j · scale`` that make a score.

A head's pre-softmax score of query ``i`` for key ``j`` is a sum over the head width ``D``:

    score_ij = Σ_d q_i[d] · k_j[d] · scale          (scale = 1/sqrt(D) unless the model sets one)

The neuron view (BertViz's, Vig 2019) shows those ``D`` terms for one pair, so you can see
which dimensions of the query and key agree. ``q`` and ``k`` are read at ``hook_q`` / ``hook_k``
(after rotary positions; cached keys included), ``scale`` from the layer's ``hook_inputs``.
Masks, ALiBi and a ``score_mod`` are added *after* this sum, as the kernel adds them.

    t = qkv.inspect.qk_terms(model, ids, "blocks.1.self_attn", head=0, query=5, key=2)
    t.terms.sum() == t.score

The page carries each chosen layer's ``q (H', T, D)`` and ``k (H', S, D)`` as float32
(:class:`NeuronPages`), within :data:`NEURON_BUDGET` floats; the browser multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checks import is_int
from qkv.inspect.adapters import run_model
from qkv.inspect.hookpoints import attention_layers, hooks, match_names
from qkv.inspect.viewer_data import b64
from qkv.nn.hooks import AttentionInputs

__all__ = ["NEURON_BUDGET", "NeuronPages", "QKTerms", "neuron_page_layers", "qk_terms"]

# Floats (q and k, all layers) the page's neuron view may hold: 4 bytes each, ~5 MB of base64.
NEURON_BUDGET = 1_000_000


@dataclass(frozen=True)
class QKTerms:
    """One query/key pair of one head, taken apart.

    Attributes:
        query: ``(D,)`` the query vector ``q_i`` (after rotary positions).
        key: ``(D,)`` the key vector ``k_j`` (of the key/value head this query head reads).
        scale: the factor on ``q·k``.
        terms: ``(D,)`` ``q_i ⊙ k_j · scale``.
        score: their sum, the pre-softmax score (before masks and position biases).
    """

    query: Tensor
    key: Tensor
    scale: float
    terms: Tensor
    score: float


def head_qk(inputs: AttentionInputs, batch: int) -> tuple[Tensor, Tensor, float]:
    """``(q (H, T, D), k (H, S, D), scale)`` of one batch row: grouped-query key heads
    repeated so that key head ``h`` is the one query head ``h`` reads."""
    q, k = inputs.query[batch], inputs.key[batch]  # (H, T, D), (Hkv, S, D)
    if q.shape[0] != k.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)  # (H, S, D)
    scale = inputs.scale if inputs.scale is not None else 1.0 / q.shape[-1] ** 0.5
    return q, k, float(scale)


def _index(value: Any, size: int, name: str) -> int:
    if not is_int(value) or not -size <= value < size:
        raise ValueError(f"{name} must be an int in [{-size}, {size}), got {value!r}")
    return value % size


@torch.no_grad()
def qk_terms(
    model: nn.Module,
    input_ids: Tensor,
    layer: str | int,
    head: int,
    query: int,
    key: int,
    *,
    target: Tensor | None = None,
    batch: int = 0,
    model_kwargs: dict[str, Any] | None = None,
) -> QKTerms:
    """The ``D`` terms of the score of ``query`` for ``key`` in one head of one layer.

    Args:
        model: a qkv model.
        input_ids: its input ``(B, T)`` (and ``target`` for an encoder-decoder).
        layer: an attention layer's name or index (as in :func:`qkv.inspect.capture`).
        head: the query head.
        query, key: positions (negative ones count from the end).
        batch: the batch row.
        model_kwargs: more arguments of the model's forward.

    Returns:
        a :class:`QKTerms` (float32 tensors on the CPU).

    Raises:
        ValueError: a layer that does not match exactly one attention layer, or that ran
            more than once; ``head``, ``query``, ``key`` or ``batch`` out of range.
    """
    names = match_names(list(attention_layers(model)), layer, "layer", allow_int=True)
    if len(names) != 1:
        raise ValueError(f"layer must name one attention layer, {layer!r} matches {names}")
    name = names[0]
    seen: dict[str, list[Any]] = {"hook_q": [], "hook_k": [], "hook_inputs": []}

    def keep(value: Any, point: str) -> None:
        seen[point.rsplit(".", 1)[1]].append(value)

    with hooks(model, {f"{name}.{p}": keep for p in seen}):
        run_model(model, input_ids, target, model_kwargs)
    if len(seen["hook_inputs"]) != 1:
        raise ValueError(f"{name} ran {len(seen['hook_inputs'])} times in one forward pass")
    qs, ks = seen["hook_q"][0], seen["hook_k"][0]  # (B, H, T, D), (B, Hkv, S, D)
    b = _index(batch, qs.shape[0], "batch")
    q_all, k_all, scale = head_qk(
        AttentionInputs(qs, ks, ks, scale=seen["hook_inputs"][0].scale), b)  # fmt: skip
    H, T, _ = q_all.shape
    h = _index(head, H, "head")
    q = q_all[h, _index(query, T, "query")].float().cpu()  # (D,)
    k = k_all[h, _index(key, k_all.shape[1], "key")].float().cpu()  # (D,)
    terms = q * k * scale  # (D,)
    return QKTerms(q, k, scale, terms, float(terms.sum()))


class NeuronPages:
    """The neuron view's JSON, built a layer at a time: each layer's float32
    ``q (H', T, D)`` and ``k (H', S, D)`` while they fit ``budget`` floats in all.

    Attributes:
        layers: the page entries, in the order added.
        left_out: names of the layers that did not fit.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = NEURON_BUDGET if budget is None else budget
        self.used = 0
        self.layers: list[dict[str, Any]] = []
        self.left_out: list[str] = []

    def add(self, name: str, inputs: AttentionInputs, heads: list[int], batch: int) -> None:
        """Add one layer's call (its batch row ``batch``, query heads ``heads``)."""
        _, _, T, D = inputs.query.shape
        size = len(heads) * (T + inputs.key.shape[2]) * D
        if self.used + size > self.budget:  # checked before anything is copied
            self.left_out.append(name)
            return
        self.used += size
        q, k, scale = head_qk(inputs, batch)
        q, k = q[heads].float().cpu(), k[heads].float().cpu()  # (H', T, D), (H', S, D)
        self.layers.append({"name": name, "heads": list(heads), "T": T, "S": k.shape[1],
                            "D": D, "scale": scale, "q": b64(q.numpy().astype("<f4")),
                            "k": b64(k.numpy().astype("<f4"))})  # fmt: skip


def neuron_page_layers(
    inputs: dict[str, AttentionInputs], heads: dict[str, list[int]], batch: int,
    budget: int | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:  # fmt: skip
    """:class:`NeuronPages` of several layers at once: ``(page entries, names left out)``."""
    pages = NeuronPages(budget)
    for name, rec in inputs.items():
        pages.add(name, rec, heads[name], batch)
    return pages.layers, pages.left_out
