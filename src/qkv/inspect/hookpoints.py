"""Finding hook points and attention layers by name, and attaching functions to them.

Every :class:`~qkv.nn.hooks.HookPoint` of a model has the name ``named_modules()`` gives it,
e.g. ``blocks.0.self_attn.hook_q`` or ``decoder_blocks.1.hook_resid_post``. A name pattern is
an exact name or a shell-style glob (``blocks.*.hook_resid_post``).

    with qkv.inspect.hooks(model, {"blocks.1.self_attn.hook_weights": zero_head_2}):
        logits = model(ids)           # the ablated model; hooks are removed afterwards
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from qkv.nn.core import AttentionCore
from qkv.nn.hooks import HookPoint

__all__ = ["attention_layers", "hook_points", "hooks", "match_names"]


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of ``model`` by name, in module order.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    return {
        name: m for name, m in _check_model(model).named_modules() if isinstance(m, HookPoint)
    }


def attention_layers(model: nn.Module) -> dict[str, AttentionCore]:
    """Every attention module of ``model`` by name, in module order (``blocks.0.self_attn``,
    ..., ``decoder_blocks.0.cross_attn``, ...; ``layers.0.self_attn`` in a torch-style
    :class:`qkv.nn.Transformer`): every :class:`~qkv.nn.core.AttentionCore`, which
    :class:`qkv.nn.Attention`, :class:`qkv.nn.MultiheadAttention` and the single heads are.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    return {
        name: m for name, m in _check_model(model).named_modules() if isinstance(m, AttentionCore)
    }


def match_names(
    available: Sequence[str], wanted: object, what: str, *, allow_int: bool = False
) -> list[str]:
    """The names in ``available`` that ``wanted`` selects, in ``available``'s order.

    Args:
        available: the names to choose from.
        wanted: None (all), a name or glob pattern, an int index into ``available`` (when
            ``allow_int``), or a sequence of those.
        what: the argument's name, for error messages.
        allow_int: accept integer indices (negative ones count from the end).

    Raises:
        TypeError: an item that is neither a string nor (when allowed) an int.
        ValueError: an index out of range or a pattern that matches nothing (the message
            lists some available names).
    """
    if wanted is None:
        return list(available)
    items = [wanted] if isinstance(wanted, (str, int)) else wanted
    if not isinstance(items, Sequence):
        raise TypeError(f"{what} must be None, a name, an index or a list of them, got {wanted!r}")
    chosen: set[str] = set()
    shown = ", ".join(list(available)[:8]) + (" ..." if len(available) > 8 else "")
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and allow_int:
            if not -len(available) <= item < len(available):
                raise ValueError(
                    f"{what} index {item} is out of range: the model has {len(available)} "
                    f"({shown})"
                )
            chosen.add(available[item])
        elif isinstance(item, str):
            hits = [n for n in available if n == item or fnmatch.fnmatchcase(n, item)]
            if not hits:
                raise ValueError(f"{what} {item!r} matches no name; available: {shown}")
            chosen.update(hits)
        else:
            kinds = "a name, a glob pattern or an int index" if allow_int else "a name or pattern"
            raise TypeError(f"each item of {what} must be {kinds}, got {item!r}")
    return [n for n in available if n in chosen]


@contextmanager
def hooks(
    model: nn.Module, functions: Mapping[str, Callable[[Any, str], Any]]
) -> Iterator[dict[str, HookPoint]]:
    """Attach functions to hook points for the duration of a ``with`` block.

    Args:
        model: any module with :class:`~qkv.nn.hooks.HookPoint` s (every qkv model).
        functions: ``{name or glob pattern: fn}``; ``fn(value, name)`` is called with the
            intermediate and the hook point's name each time it is computed, and returns None
            to read it or a replacement (same kind and shape) to change it.

    Yields:
        ``{name: HookPoint}`` of the hook points that were hooked.

    Raises:
        TypeError: a model that is not an ``nn.Module``, a function that is not callable.
        ValueError: a pattern that matches no hook point.

    Replacing ``hook_scores`` or ``hook_weights`` makes that layer compute its output from
    the replaced weights (the math path); every other hook point leaves the backend alone.
    """
    points = hook_points(model)
    handles = []
    hooked: dict[str, HookPoint] = {}
    try:
        for pattern, fn in functions.items():
            if not callable(fn):
                raise TypeError(f"the function for {pattern!r} must be callable, got {fn!r}")
            for name in match_names(list(points), pattern, "hook point"):
                point = points[name]
                handles.append(point.add_hook(lambda value, _p, fn=fn, name=name: fn(value, name)))
                hooked[name] = point
        yield hooked
    finally:
        for handle in handles:
            handle.remove()
