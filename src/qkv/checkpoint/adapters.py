"""LoRA adapters in a file of their own: a few megabytes beside a model of hundreds.

:func:`save_adapters` writes the adapter tensors (``lora_A``, ``lora_B`` of every
:class:`~qkv.nn.lora.LoRALinear`) to a safetensors file, atomically, with the layers they sit
on, the rank and alpha in its metadata; :func:`load_adapters` puts adapters on the same layers
of a fresh copy of the base model and loads them, checking every name, shape and value first.
No pickled code is read.

Shapes: ``r`` the rank, ``in`` / ``out`` a layer's widths.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from qkv.checkpoint.tensor_file import check_finite
from qkv.data.files import BadFileError, MissingFileError
from qkv.nn.lora import LoRALinear, add_lora, lora_parameters

__all__ = ["load_adapters", "save_adapters"]

_KEY = "qkv_lora"


def save_adapters(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model``'s LoRA adapters to ``path`` (safetensors), atomically.

    Raises:
        ValueError: a model without adapters, or adapters of different ranks or alphas.
    """
    from safetensors.torch import save_file

    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not layers:
        raise ValueError("the model has no LoRA adapters (qkv.nn.lora.add_lora adds them)")
    kinds = {(m.rank, m.alpha, m.drop.p) for m in layers.values()}
    if len(kinds) != 1:
        raise ValueError(f"adapters of different ranks, alphas or dropouts {sorted(kinds)}: "
                         "one file holds one kind")  # fmt: skip
    rank, alpha, dropout = kinds.pop()
    meta = {_KEY: json.dumps({"layers": list(layers), "rank": rank, "alpha": alpha,
                              "dropout": dropout})}  # fmt: skip
    tensors = {n: p.detach().contiguous().cpu() for n, p in lora_parameters(model).items()}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    if not path.is_file():
        raise MissingFileError(f"no adapter file at {path}", path=path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(_KEY, "null"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as err:  # safetensors' own SafetensorError has no documented base
        raise BadFileError(f"{path}: not a safetensors adapter file ({err})", path=path) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("layers"), list):
        raise BadFileError(f"{path}: no qkv LoRA metadata (written by save_adapters)", path=path)
    return meta, tensors


def load_adapters(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Put the adapters saved in ``path`` on ``model`` (the base model they were trained on).

    Returns:
        ``model``, adapted in place (its other parameters frozen).

    Raises:
        MissingFileError: no file.
        BadFileError: not an adapter file; layers the model does not have, tensors missing,
            unexpected, misshaped or not finite (named).
    """
    path = Path(path)
    meta, tensors = _read(path)
    names = set(dict(model.named_modules()))
    missing = [n for n in meta["layers"] if n not in names]
    if missing:
        raise BadFileError(f"{path}: adapters for layers this model does not have: "
                           f"{missing[:4]}", path=path)  # fmt: skip
    try:
        add_lora(model, meta["layers"], rank=meta["rank"], alpha=meta["alpha"],
                 dropout=meta["dropout"])  # fmt: skip
    except (ValueError, KeyError) as err:
        raise BadFileError(f"{path}: the adapters do not fit this model ({err})",
                           path=path) from None  # fmt: skip
    params = lora_parameters(model)
    if set(params) != set(tensors):
        extra, lost = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
        raise BadFileError(f"{path}: unexpected tensors {extra[:3]}, missing {lost[:3]}",
                           path=path)  # fmt: skip
    for name, p in params.items():
        t = tensors[name]
        if t.shape != p.shape:
            raise BadFileError(f"{path}: {name} has shape {tuple(t.shape)}, the model's "
                               f"{tuple(p.shape)}", path=path)  # fmt: skip
        check_finite(name, t, path)
        with torch.no_grad():
            p.copy_(t)
    return model
