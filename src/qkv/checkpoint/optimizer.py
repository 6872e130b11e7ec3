"""Optimizer state as safetensors + JSON, never pickle.

:func:`optimizer_to_flat` turns ``optimizer.state_dict()`` into tensors (``exp_avg``,
``exp_avg_sq``, ``step`` ...) named ``optimizer.<param index>.<key>`` and a JSON-able rest
(param groups, non-tensor entries); :func:`optimizer_from_flat` reverses it. A training
checkpoint (:mod:`qkv.checkpoint.folder`) stores both halves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["optimizer_from_flat", "optimizer_to_flat"]


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Split ``optimizer.state_dict()`` into ``(json_part, tensors)``.

    Returns:
        ``json_part`` = ``{"state": {index: {key: value or {"tensor": name}}}, "param_groups":
        [...]}`` and ``tensors`` = ``{name: tensor}`` (contiguous CPU copies).
    """
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, entries in sd["state"].items():
        out: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, Tensor):
                name = f"optimizer.{index}.{key}"
                tensors[name] = value.detach().cpu().contiguous().clone()
                out[key] = {"tensor": name}
            else:
                out[key] = value
        state[str(index)] = out
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}, tensors


def optimizer_from_flat(
    optimizer: torch.optim.Optimizer, flat: dict[str, Any], tensors: dict[str, Tensor], where: str
) -> None:
    """Load what :func:`optimizer_to_flat` wrote into ``optimizer``.

    Args:
        optimizer: an optimizer over the same parameters, in the same groups.
        flat: the JSON part.
        tensors: the tensors.
        where: the file(s) named in error messages.

    Raises:
        ValueError: a missing tensor, a different number of groups or parameters, or a state
            tensor whose shape differs from its parameter's.
    """
    try:
        groups = [
            {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
            for g in flat["param_groups"]
        ]
        state: dict[int, dict[str, Any]] = {}
        for index, entries in flat["state"].items():
            state[int(index)] = {
                key: _tensor(tensors, value["tensor"], where)
                if isinstance(value, dict) and "tensor" in value
                else value
                for key, value in entries.items()
            }
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{where}: malformed optimizer state ({err!r})") from None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = sum(len(g["params"]) for g in groups)
    if len(groups) != len(optimizer.param_groups) or saved != len(params):
        raise ValueError(
            f"{where}: optimizer state for {len(groups)} groups / {saved} parameters, but the "
            f"optimizer has {len(optimizer.param_groups)} groups / {len(params)} parameters"
        )
    for index, entries in state.items():
        if not 0 <= index < len(params):
            raise ValueError(f"{where}: optimizer state for parameter {index} of {len(params)}")
        for key, value in entries.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != params[index].shape:
                raise ValueError(
                    f"{where}: optimizer tensor 'optimizer.{index}.{key}' has shape "
                    f"{tuple(value.shape)}, its parameter has shape {tuple(params[index].shape)}"
                )
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _tensor(tensors: dict[str, Tensor], name: str, where: str) -> Tensor:
    if name not in tensors:
        raise ValueError(f"{where}: missing tensor {name!r}")
    return tensors[name]
