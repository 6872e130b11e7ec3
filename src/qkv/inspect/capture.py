"""Capture attention weights (and any hook point) while a model runs, without changing it.

    with qkv.inspect.capture(model, layers=[0, -1], heads=[0, 3], rows=-1) as cap:
        logits = model(ids)
    cap.weights["blocks.0.self_attn"]        # (B, 2, 1, S): heads 0 and 3, last query row
    cap.kinds["blocks.0.self_attn"]          # "causal self"

How: a hook on each chosen layer's ``hook_inputs`` (:class:`~qkv.nn.hooks.AttentionInputs`:
queries and keys after rotary positions and the KV cache, and the mask parts) rebuilds the
exact weights of the requested heads and rows with :mod:`qkv.inspect.weights`. The model's
own attention call is not touched: outputs are bitwise the same and the backend ``auto``
chose is still the one that runs. If a hook replaces a layer's scores or weights (an
ablation, see :func:`~qkv.inspect.hookpoints.hooks`), that layer already runs the math path,
and what is captured is the weights it really used, read from its ``hook_weights``.

Programmable attention (a layer called with ``score_mod=`` / ``block_mask=``, e.g. a packed
row's document mask) is captured the same way: the weights are rebuilt by
:func:`qkv.flex_attention` with ``need_weights=True`` on the chosen heads and rows
(:mod:`qkv.inspect.weights`), for any mod, at the kernel's cost.

Hooks that replace ``hook_q``/``hook_k`` are seen by capture whatever the order they were
attached in; one that replaces the whole ``hook_inputs`` record is seen only when attached
before :func:`capture` starts (hooks run in the order they were added).

Several forward calls (generation with the KV cache: the prompt, then one token at a time)
are kept per call in ``cap.calls``; ``cap.weights`` stacks their query rows, so with a cache
row ``i`` is the attention of position ``i`` over every earlier position (prompt and outputs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from qkv.checks import memory_bytes
from qkv.inspect.hookpoints import attention_layers, hook_points, match_names
from qkv.inspect.weights import check_heads, check_rows, weights_of
from qkv.nn.core import AttentionCore
from qkv.nn.hooks import AttentionInputs

__all__ = ["Captured", "capture", "join_calls"]

KINDS = ("self", "causal self", "cross")


def join_calls(calls: list[Tensor], name: str = "layer") -> Tensor:
    """Stack the query rows of successive calls ``(B, H', T_i, S_i)`` into
    ``(B, H', ΣT_i, max S_i)``, padding keys on the right with zeros.

    With a KV cache each call's keys extend the previous ones, so the result is the weights
    a single call over the whole sequence would give (zeros where the causal mask hides).

    Raises:
        ValueError: no calls, or calls whose batch or head counts differ (e.g. beam search
            reordered the batch): use the per-call list instead.
    """
    if not calls:
        raise ValueError(f"{name} was never called while capturing")
    if len(calls) == 1:
        return calls[0]
    B, H = calls[0].shape[:2]
    if any(c.shape[:2] != (B, H) for c in calls):
        shapes = [tuple(c.shape) for c in calls]
        raise ValueError(
            f"{name} was called {len(calls)} times with different batch or head counts "
            f"{shapes}; read cap.calls[{name!r}] instead of cap.weights"
        )
    S = max(c.shape[3] for c in calls)
    padded = [torch.nn.functional.pad(c, (0, S - c.shape[3])) for c in calls]  # (B, H', T_i, S)
    return torch.cat(padded, dim=2)  # (B, H', ΣT_i, S)


class Captured:
    """What :func:`capture` recorded.

    Attributes:
        calls: ``{layer name: [weights (B, H', T', S) per forward call]}``.
        kinds: ``{layer name: "self" | "causal self" | "cross"}``.
        heads: ``{layer name: the captured query heads}`` (the ``H'`` axis, in order).
        num_heads: ``{layer name: H}`` of the layer.
        values: ``{hook point name: [value per call]}`` for the ``record`` patterns.
        inputs: ``{layer name: [AttentionInputs per call]}`` when ``keep_inputs``.
        rows: the ``rows`` argument of :func:`capture`.
    """

    def __init__(self, rows: object = None) -> None:
        self.calls: dict[str, list[Tensor]] = {}
        self.kinds: dict[str, str] = {}
        self.heads: dict[str, list[int]] = {}
        self.num_heads: dict[str, int] = {}
        self.values: dict[str, list[Any]] = {}
        self.inputs: dict[str, list[AttentionInputs]] = {}
        self.rows = rows

    @property
    def weights(self) -> dict[str, Tensor]:
        """``{layer name: (B, H', T', S)}``: each layer's weights, calls stacked by
        :func:`join_calls` (a single call's weights as they are)."""
        return {name: join_calls(c, name) for name, c in self.calls.items() if c}

    @property
    def layers(self) -> list[str]:
        """Names of the layers that were captured, in module order."""
        return [name for name, c in self.calls.items() if c]

    def __getitem__(self, layer: str | int) -> Tensor:
        """Weights of one layer, by name or by index into :attr:`layers`."""
        names = self.layers
        if isinstance(layer, int) and not isinstance(layer, bool) and (
            -len(names) <= layer < len(names)
        ):
            layer = names[layer]
        if layer not in names:
            raise KeyError(f"no captured layer {layer!r}; captured: {names}")
        return join_calls(self.calls[str(layer)], str(layer))

    def __repr__(self) -> str:
        parts = [f"{n} {self.kinds.get(n, '?')} {tuple(w.shape)}" for n, w in self.weights.items()]
        return "Captured(" + "; ".join(parts) + ")"


def _kind(previous: str | None, inputs: AttentionInputs) -> str:
    if inputs.cross:
        return "cross"
    # A cached decoding step (one query) is called without is_causal; it stays causal.
    if inputs.is_causal or previous == "causal self":
        return "causal self"
    return "self"


def _clone(value: Any) -> Any:
    # Cache buffers are written in place later: keep a copy, detached from autograd.
    return value.detach().clone() if isinstance(value, Tensor) else value


@contextmanager
def capture(
    model: nn.Module,
    layers: object = None,
    heads: object = None,
    rows: object = None,
    *,
    record: object = None,
    keep_inputs: bool = False,
) -> Iterator[Captured]:
    """Record attention weights of ``model``'s attention layers while it runs.

    Args:
        model: any module with qkv attention modules (every qkv model, and models built
            from the torch drop-ins such as :class:`qkv.nn.Transformer`).
        layers: None (every attention layer), or names, glob patterns (``"*cross_attn"``) or
            int indices into the model's attention layers in module order, alone or in a list.
        heads: None (all) or query head indices, the same for every captured layer.
        rows: None (all), an int (one query row, e.g. ``-1`` the last) or a step-1 slice,
            applied to each call.
        record: hook point names or glob patterns whose values to keep in ``cap.values``
            (e.g. ``"blocks.*.hook_resid_post"``).
        keep_inputs: also keep each call's :class:`~qkv.nn.hooks.AttentionInputs`.

    Yields:
        a :class:`Captured`, filled as the model runs in the thread that opened the capture:
        captures of one model opened in several threads at once each record their own
        thread's calls (thread-safe; the hooks of the others see and ignore them).

    Raises:
        TypeError: ``model`` is not a module; bad ``heads``/``rows`` types.
        ValueError: a ``layers`` or ``record`` pattern that matches nothing, a head out of
            range for a layer, a model without attention layers; a ``rows`` int beyond a
            call's query count (raised from the model's forward).
    """
    found = attention_layers(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no qkv attention modules to capture (qkv.nn.Attention, "
            "MultiheadAttention, the Transformer drop-ins or the single heads)"
        )
    chosen = match_names(list(found), layers, "layers", allow_int=True)
    cap = Captured(rows)
    check_rows(rows, 1 << 62)  # types and step now; ranges per call
    for name in chosen:
        cap.heads[name] = check_heads(heads, found[name].num_heads, name)
        cap.num_heads[name] = found[name].num_heads
        cap.calls[name] = []
    owner = threading.get_ident()  # a capture records the calls of the thread that opened it
    handles = [
        found[name].hook_inputs.add_hook(
            lambda inputs, _p, name=name: _on_call(cap, name, found[name], inputs, keep_inputs)
            if threading.get_ident() == owner else None
        )
        for name in chosen
    ]
    points = hook_points(model)
    for name in match_names(list(points), record, "record") if record is not None else []:
        cap.values[name] = []
        handles.append(points[name].add_hook(
            lambda value, _p, name=name: cap.values[name].append(_clone(value))
            if threading.get_ident() == owner else None
        ))
    try:
        yield cap
    finally:
        for handle in handles:
            handle.remove()


_memory_bytes = memory_bytes  # (one name here, so a test can stand in a smaller machine)


def _check_size(name: str, inputs: AttentionInputs, heads, span: slice) -> None:
    """Refuse, before the call computes anything, weights that would not fit: a capture keeps
    ``(B, H', T', S)`` per call, and a long input on a model with no length limit (RoPE) ran
    for minutes before running out of memory (issue 31)."""
    q, k = inputs.query, inputs.key
    count = q.shape[0] * (q.shape[1] if heads is None else len(heads)) * (
        span.stop - span.start) * k.shape[2]
    need, memory = count * max(4, q.element_size()), _memory_bytes()
    if memory and need > memory // 2:
        raise ValueError(
            f"capturing {name}'s weights for this call needs {need / 2**30:.1f} GiB "
            f"(B·H'·T'·S = {count:,} values), over half this machine's memory "
            f"({memory / 2**30:.0f} GiB): pass heads= or rows= to capture less, or a shorter "
            "input")


def _on_call(
    cap: Captured, name: str, module: AttentionCore, inputs: AttentionInputs, keep: bool
) -> None:
    """One call of a captured layer: note its kind, then its weights (or how to read them)."""
    cap.kinds[name] = _kind(cap.kinds.get(name), inputs)
    if keep:
        cap.inputs.setdefault(name, []).append(inputs)
    heads = cap.heads[name]
    span = check_rows(cap.rows, inputs.query.shape[2])
    _check_size(name, inputs, heads, span)
    if module.hook_scores.listening or module.hook_weights.listening:
        # Someone replaces (or reads) this layer's scores/weights, so it runs the math path:
        # capture what it really uses, after their hooks, once, from hook_weights.
        def read(weights: Tensor, _p: Any) -> None:
            handle.remove()
            cap.calls[name].append(_clone(weights[:, heads, span]))  # (B, H', T', S)

        handle = module.hook_weights.add_hook(read)
        return
    cap.calls[name].append(weights_of(inputs, heads, span))  # (B, H', T', S)
