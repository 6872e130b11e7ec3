"""Run a model once and keep every hook point's value: a typed activation cache.

    logits, cache = qkv.inspect.run_with_cache(model, ids)
    cache["blocks.0.hook_resid_post"]               # (B, T, E), detached
    cache.resid(1, "pre")                           # the residual stream entering block 1
    cache.accumulated_resid()                       # (L+1, B, T, E): every block's input + output
    parts = cache.decompose_resid(2)                # what the stream entering block 2 is made of
    parts.components.sum(0)                         # == cache.resid(2), to float error

``names`` chooses what to keep: None (every hook point), an exact name or a shell glob
(``"blocks.*.hook_resid_post"``), a list of those, or a predicate ``name -> bool``. Keeping a
``hook_scores`` or ``hook_weights`` makes that layer run the math backend (the only one that
forms the ``(B, H, T, S)`` tensors); every other hook point leaves the model's computation as it
is. ``hook_inputs`` (a record, not a tensor) is kept only when asked for by name.

The decomposition itself lives in :mod:`qkv.inspect.decompose`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from qkv.inspect.decompose import ResidComponents, decompose_resid
from qkv.inspect.hookpoints import hook_points, match_names
from qkv.nn.hooks import AttentionInputs

__all__ = ["ActivationCache", "run_with_cache", "select_hook_points"]


def _known(names: list[str]) -> str:
    """The hook point names with block indices folded (``blocks.*.hook_resid_pre``)."""
    folded = dict.fromkeys(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(folded)


def select_hook_points(model: nn.Module, names: object = None) -> list[str]:
    """The hook point names of ``model`` that ``names`` selects, in module order.

    Args:
        names: None (every hook point except ``hook_inputs`` records), an exact name or glob
            pattern, a list of those, or a predicate ``name -> bool``.

    Raises:
        TypeError: ``model`` not a module, ``names`` of another kind.
        ValueError: a name or pattern matching no hook point, or a predicate choosing none
            (the message lists the model's hook points, block indices folded to ``*``).
    """
    available = list(hook_points(model))
    if names is None:
        return [n for n in available if not n.endswith("hook_inputs")]
    if callable(names):
        chosen = [n for n in available if names(n)]
        if not chosen:
            raise ValueError(
                f"the names predicate chose no hook point; the model has: {_known(available)}"
            )
        return chosen
    if isinstance(names, (list, tuple)) and not names:
        raise ValueError("names is empty: pass None to keep every hook point")
    if isinstance(names, (str, list, tuple)) and all(
        isinstance(n, str) for n in ([names] if isinstance(names, str) else names)
    ):
        try:
            return match_names(available, names, "names")
        except ValueError as e:
            raise ValueError(
                f"{str(e).split(';')[0]}; the model's hook points are: {_known(available)}"
            ) from None
    raise TypeError(
        "names must be None, a hook point name or glob, a list of them or a predicate "
        f"name -> bool, got {names!r:.80}"
    )


class ActivationCache:
    """The values of a model's hook points from one forward call (tensors detached).

    Attributes:
        model: the module that ran.
        values: ``{hook point name: value}`` in module order (``(B, T, E)`` on the residual
            stream, ``(B, H, T, D)`` for ``hook_q``/``hook_out``, ``(B, H, T, S)`` for
            ``hook_scores``/``hook_weights``; a decoder run with cross-attention also has
            ``cross_attn.*`` and ``hook_cross_out``).
        training: whether the model was in training mode (dropout on).
    """

    def __init__(self, model: nn.Module, values: dict[str, Any], training: bool) -> None:
        self.model = model
        self.values = values
        self.training = training

    def __getitem__(self, name: str) -> Any:
        """The value of hook point ``name`` (a detached tensor). Raises KeyError naming what
        the cache holds."""
        if name not in self.values:
            raise KeyError(
                f"{name!r} is not in this cache; it holds: {_known(list(self.values))} "
                "(run_with_cache(..., names=None) keeps every hook point)"
            )
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def items(self):
        """``(name, value)`` pairs in module order."""
        return self.values.items()

    @property
    def names(self) -> list[str]:
        """The cached hook point names, in module order."""
        return list(self.values)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self.values)} hook points: {_known(self.names)})"

    # --- the residual stream ------------------------------------------------------------------

    def stacks(self) -> list[str]:
        """Names of the block stacks in the model (``["blocks"]``; an encoder-decoder has
        ``["encoder_blocks", "decoder_blocks"]``): every ``X`` with a ``X.0.hook_resid_pre``."""
        points = hook_points(self.model)
        return [n[: -len(".0.hook_resid_pre")] for n in points if n.endswith(".0.hook_resid_pre")]

    def default_stack(self, stack: str | None = None) -> str:
        """``stack`` checked, or the model's last stack (the one that feeds the output).

        Raises:
            ValueError: a model without blocks, or an unknown ``stack``.
        """
        found = self.stacks()
        if not found:
            raise ValueError(f"{type(self.model).__name__} has no blocks with residual hook points")
        if stack is None:
            return found[-1]
        if stack not in found:
            raise ValueError(f"stack must be one of {found}, got {stack!r}")
        return stack

    def num_layers(self, stack: str | None = None) -> int:
        """Blocks in ``stack`` (default: the last stack)."""
        s = self.default_stack(stack)
        return sum(1 for n in hook_points(self.model) if re.fullmatch(
            rf"{re.escape(s)}\.\d+\.hook_resid_pre", n))  # fmt: skip

    def resid(self, layer: int, where: str = "pre", stack: str | None = None) -> Tensor:
        """The residual stream ``(B, T, E)`` at block ``layer``: ``where`` is ``"pre"`` (its
        input), ``"mid"`` (after self-attention) or ``"post"`` (its output). ``layer`` may be
        negative; ``resid(L, "pre")`` is the last block's output.

        Raises:
            ValueError: ``layer`` out of range or bad ``where``; KeyError: not cached.
        """
        s, L = self.default_stack(stack), self.num_layers(stack)
        if where not in ("pre", "mid", "post"):
            raise ValueError(f"where must be 'pre', 'mid' or 'post', got {where!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not -L <= layer <= L:
            raise ValueError(f"layer must be an int in [-{L}, {L}], got {layer!r}")
        layer = layer % (L + 1) if layer < 0 else layer
        if layer == L:
            if where != "pre":
                raise ValueError(f"layer {L} (after the last block) has only where='pre'")
            return self[f"{s}.{L - 1}.hook_resid_post"]
        return self[f"{s}.{layer}.hook_resid_{where}"]

    def accumulated_resid(self, stack: str | None = None) -> Tensor:
        """``(L+1, B, T, E)``: the input of every block, then the last block's output."""
        L = self.num_layers(stack)
        return torch.stack([self.resid(i, "pre", stack) for i in range(L + 1)])

    def decompose_resid(self, layer: int | None = None, *, heads: bool = True,
                        stack: str | None = None) -> ResidComponents:  # fmt: skip
        """The residual stream ``(B, T, E)`` entering block ``layer`` (None: after the last
        block) as a sum of ``(N, B, T, E)`` components: embeddings, each head's write, the
        attention biases, the feed-forwards (:func:`qkv.inspect.decompose.decompose_resid`)."""
        return decompose_resid(self, layer, heads=heads, stack=stack)


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, AttentionInputs):
        return value  # a record of the call's own tensors, kept as it is
    return value


def run_with_cache(
    model: nn.Module,
    *inputs: Any,
    names: object = None,
    **forward_kwargs: Any,
) -> tuple[Any, ActivationCache]:
    """Run ``model(*inputs, **forward_kwargs)`` once and keep its hook points' values.

    Args:
        model: any module with :class:`~qkv.nn.hooks.HookPoint` s (every qkv model:
            :class:`~qkv.models.DecoderLM` ``(ids)``, :class:`~qkv.models.Encoder` ``(ids)``,
            :class:`~qkv.models.Seq2SeqTransformer` ``(src, tgt_in)``).
        *inputs: the model's positional arguments (``ids (B, T)``).
        names: what to keep (see :func:`select_hook_points`); None keeps every hook point.
        **forward_kwargs: passed to the model (``attention_mask=``, ...).

    Returns:
        ``(output, cache)``: the model's output (logits ``(B, T, V)``) and an
        :class:`ActivationCache` of detached copies.

    Raises:
        TypeError, ValueError: see :func:`select_hook_points`; a hook point that fires more
            than once in the call (a module reused, a generation loop): cache one call at a
            time; the model's own errors for bad inputs.
    """
    chosen = select_hook_points(model, names)
    points = hook_points(model)
    seen: dict[str, list[Any]] = {name: [] for name in chosen}

    def keep(value: Any, point: Any, name: str) -> None:
        seen[name].append(_detach(value))

    handles = [
        points[name].add_hook(lambda value, p, name=name: keep(value, p, name))
        for name in chosen
    ]
    try:
        output = model(*inputs, **forward_kwargs)
    finally:
        for handle in handles:
            handle.remove()
    repeated = [f"{n} ({len(v)}x)" for n, v in seen.items() if len(v) > 1]
    if repeated:
        raise ValueError(
            f"hook points fired more than once in one call: {', '.join(repeated[:4])}; "
            "run_with_cache keeps one value per hook point (cache one forward call at a time)"
        )
    values = {name: v[0] for name, v in seen.items() if v}
    return output, ActivationCache(model, values, model.training)

