"""Activation patching: which activations carry the difference between two inputs.

Run the model on a *corrupted* input while one activation is replaced by its value on the
*clean* input, and measure the output with a metric (e.g. the logit difference between the
clean and the corrupted answer). A cell that brings the metric back to its clean value marks an
activation that carries the information (Meng et al., 2022, "Locating and Editing Factual
Associations in GPT"; Wang et al., 2022, "Interpretability in the Wild"):

* :func:`patch_residual`: one cell per (block, position) of the residual stream ``(L, T)``;
* :func:`patch_heads`: one cell per (block, head) of a per-head hook point (by default
  ``self_attn.hook_out``, the heads' outputs before ``out_proj``), at every position or one
  ``(L, H)``.

The patch is a hook on a :class:`~qkv.nn.hooks.HookPoint` that returns the corrupted run's
value with the clean slice written in; nothing else about the model changes.

    metric = lambda logits: logits[:, -1, good] - logits[:, -1, bad]
    grid = qkv.inspect.patch_residual(model, clean_ids, corrupted_ids, metric)   # (L, T)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from qkv.inspect.cache import run_with_cache
from qkv.inspect.hookpoints import hook_points

__all__ = ["patch_heads", "patch_residual", "run_metric"]

HEAD_POINTS = ("hook_out", "hook_q", "hook_k", "hook_v", "hook_scores", "hook_weights")


def _inputs(value: object, name: str) -> tuple[Any, ...]:
    """A model's positional inputs: one tensor, or a tuple of them (``(src, tgt_in)``)."""
    items = value if isinstance(value, tuple) else (value,)
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise TypeError(f"{name} must be a tensor or a tuple of tensors, got {value!r:.80}")
    return items


def run_metric(metric: Callable[[Any], Any], output: Any) -> float:
    """``metric(output)`` as a Python float.

    Raises:
        TypeError: ``metric`` is not callable or returns something that is not one number.
        ValueError: the metric is NaN or infinite.
    """
    value = metric(output)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"metric must return one number, got a tensor of shape {tuple(value.shape)} "
                "(reduce it over the batch, e.g. .mean())"
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric must return a number or a 1-element tensor, got {value!r:.80}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"metric returned {value}; it must be finite")
    return float(value)


def _setup(model: nn.Module, clean: object, corrupted: object, metric: object,
           names: list[str]) -> tuple[tuple, dict[str, Tensor]]:  # fmt: skip
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(metric):
        raise TypeError(f"metric must be callable (output -> number), got {metric!r:.80}")
    clean_in, corrupt_in = _inputs(clean, "clean"), _inputs(corrupted, "corrupted")
    shapes = [tuple(t.shape) for t in clean_in], [tuple(t.shape) for t in corrupt_in]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"clean and corrupted inputs must have the same shapes, got {shapes[0]} and "
            f"{shapes[1]}"
        )
    _, cache = run_with_cache(model, *clean_in, names=names)
    return corrupt_in, {n: cache[n] for n in names}


def _stack_layers(model: nn.Module, stack: str | None) -> tuple[str, int]:
    points = hook_points(model)
    stacks = [n[: -len(".0.hook_resid_pre")] for n in points if n.endswith(".0.hook_resid_pre")]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no blocks with residual hook points")
    s = stacks[-1] if stack is None else stack
    if s not in stacks:
        raise ValueError(f"stack must be one of {stacks}, got {stack!r}")
    return s, sum(1 for n in points if n.startswith(f"{s}.") and n.endswith(".hook_resid_pre"))


# Cells patched in one forward pass: the corrupted batch repeated, each copy patched at its
# own cell (SmolLM2-135M, 150 cells of 5 tokens: 28 s one run a cell).
CELLS_PER_RUN = 16


def _patched_run(model: nn.Module, inputs: tuple, name: str, patch: Callable[[Tensor], Tensor],
                 kwargs: dict) -> Any:  # fmt: skip
    """The output of one corrupted run with ``patch`` applied at hook point ``name``."""
    handle = hook_points(model)[name].add_hook(lambda value, _p: patch(value))
    try:
        return model(*inputs, **kwargs)
    finally:
        handle.remove()


def _replace(value: Tensor, clean: Tensor, index: tuple) -> Tensor:
    out = value.clone()
    out[index] = clean[index].to(out.dtype)
    return out


def _sweep(model: nn.Module, inputs: tuple, name: str, clean: Tensor, cells: list[tuple],
           metric: Callable, kwargs: dict) -> list[float]:  # fmt: skip
    """The metric of the corrupted run with ``clean[index]`` written in at hook point ``name``,
    for each index of ``cells``.

    Without keyword inputs, :data:`CELLS_PER_RUN` cells share a forward pass: the inputs are
    repeated along the batch and copy ``k`` is patched at cell ``k`` (every example of a
    copy sees only its own patch), and the metric reads each copy's slice of the output.
    Otherwise (or when the output is not one batch-first tensor) one run per cell.
    """
    B = inputs[0].shape[0]
    one_by_one = bool(kwargs) or any(t.shape[0] != B for t in inputs)
    out: list[float] = []
    start = 0
    while start < len(cells):
        chunk = cells[start : start + (1 if one_by_one else CELLS_PER_RUN)]
        start += len(chunk)
        K = len(chunk)
        big = tuple(t.repeat(K, *([1] * (t.dim() - 1))) for t in inputs)

        def patch(value: Tensor, chunk=chunk) -> Tensor:
            value = value.clone()
            for k, index in enumerate(chunk):
                part = value[k * B : (k + 1) * B]  # a view: written in place
                part[index] = clean[index].to(value.dtype)
            return value

        output = _patched_run(model, big, name, patch, kwargs)
        if isinstance(output, Tensor) and output.shape[:1] == (K * B,):
            out += [run_metric(metric, output[k * B : (k + 1) * B]) for k in range(K)]
        else:  # not a batch-first tensor: the metric needs whole outputs, one run a cell
            one_by_one = True
            out += [run_metric(metric, _patched_run(
                model, inputs, name, lambda v, i=index: _replace(v, clean, i), kwargs))
                for index in chunk]
    return out


@torch.no_grad()
def patch_residual(model: nn.Module, clean: object, corrupted: object,
                   metric: Callable[[Any], Any], *, where: str = "pre", stack: str | None = None,
                   **forward_kwargs: Any) -> Tensor:  # fmt: skip
    """Patch the residual stream one (block, position) at a time.

    Args:
        model: a qkv model (or any module with ``{stack}.{l}.hook_resid_*`` hook points).
        clean, corrupted: the model's inputs (``ids (B, T)``, or a tuple ``(src, tgt_in)``),
            of equal shapes.
        metric: ``output -> number`` (a float or a 1-element tensor), e.g. a logit difference.
        where: ``"pre"`` (block input), ``"mid"`` (after self-attention) or ``"post"`` (output).
        stack: the block stack (default: the one feeding the output).
        **forward_kwargs: passed to every run.

    Returns:
        ``(L, T)`` float32: ``metric`` of the corrupted run with the stream at block ``l``,
        position ``t`` (every sequence of the batch) replaced by the clean run's.

    Raises:
        TypeError: bad model, inputs or metric (one that returns several numbers).
        ValueError: inputs of different shapes, bad ``where``/``stack``, a non-finite metric.
    """
    if where not in ("pre", "mid", "post"):
        raise ValueError(f"where must be 'pre', 'mid' or 'post', got {where!r}")
    s, L = _stack_layers(model, stack)
    names = [f"{s}.{l}.hook_resid_{where}" for l in range(L)]
    inputs, clean_values = _setup(model, clean, corrupted, metric, names)
    T = clean_values[names[0]].shape[1]
    grid = torch.empty(L, T)
    for l, name in enumerate(names):
        cells = [(slice(None), t) for t in range(T)]
        grid[l] = torch.tensor(_sweep(model, inputs, name, clean_values[name], cells, metric,
                                      forward_kwargs))  # fmt: skip
    return grid


@torch.no_grad()
def patch_heads(model: nn.Module, clean: object, corrupted: object,
                metric: Callable[[Any], Any], *, point: str = "hook_out",
                position: int | None = None, stack: str | None = None,
                **forward_kwargs: Any) -> Tensor:  # fmt: skip
    """Patch one self-attention head at a time (at every position, or at one).

    Args:
        model, clean, corrupted, metric, stack, forward_kwargs: as :func:`patch_residual`.
        point: the per-head hook point of ``self_attn`` to patch: ``"hook_out"`` (the head's
            output ``(B, H, T, D)``), ``"hook_q"``, ``"hook_k"``, ``"hook_v"`` (``Hkv`` heads
            under grouped-query attention), ``"hook_scores"`` or ``"hook_weights"``
            (``(B, H, T, S)``; these make the layer run the math backend).
        position: None (every query position) or one position (the ``T`` axis, negative
            counts from the end).

    Returns:
        ``(L, H)`` float32 (``H`` the hook point's head count).

    Raises:
        TypeError, ValueError: as :func:`patch_residual`; an unknown ``point``, a position out
            of range.
    """
    if point not in HEAD_POINTS:
        raise ValueError(f"point must be one of {HEAD_POINTS}, got {point!r}")
    s, L = _stack_layers(model, stack)
    names = [f"{s}.{l}.self_attn.{point}" for l in range(L)]
    inputs, clean_values = _setup(model, clean, corrupted, metric, names)
    H, T = clean_values[names[0]].shape[1:3]
    if position is not None and (
        isinstance(position, bool) or not isinstance(position, int) or not -T <= position < T
    ):
        raise ValueError(f"position must be None or an int in [-{T}, {T}), got {position!r}")
    rows = slice(None) if position is None else position
    grid = torch.empty(L, H)
    for l, name in enumerate(names):
        cells = [(slice(None), h, rows) for h in range(H)]
        grid[l] = torch.tensor(_sweep(model, inputs, name, clean_values[name], cells, metric,
                                      forward_kwargs))  # fmt: skip
    return grid
