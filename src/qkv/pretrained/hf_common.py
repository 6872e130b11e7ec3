"""Reading Hugging Face-format folders: ``config.json``, the weights, activation names.

A Hugging Face model folder holds ``config.json`` (sizes and options; ``model_type`` says the
family) and the weights as ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), or as the older pickled ``pytorch_model.bin``, which is
read with ``torch.load(weights_only=True)`` so that no code in it can run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.checks import is_int
from qkv.data.files import read_json
from qkv.pretrained.errors import require

__all__ = ["HF_ACTIVATIONS", "hf_activation", "read_state_dict", "token_id"]

# Hugging Face activation name -> qkv feed-forward kind.
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def hf_activation(hf: Mapping[str, Any], key: str, where: str, default: str = "gelu") -> str:
    """The qkv activation for ``hf[key]``.

    Raises:
        ValueError: an activation qkv does not have (the message lists the known ones).
    """
    name = hf.get(key, default)
    if name not in HF_ACTIVATIONS:
        raise ValueError(
            f"{where}: {key}={name!r} is not supported; known: {sorted(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


def token_id(hf: Mapping[str, Any], key: str) -> int | None:
    """A special token id from ``config.json``: the first of a list; None when absent or
    outside ``[0, vocab_size)`` (GPT-2's defaults say 50256 even for small test vocabularies,
    and an id the model cannot produce is no stopping criterion)."""
    value = hf.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    vocab = hf.get("vocab_size")
    ok = is_int(value) and value >= 0
    return value if ok and (not isinstance(vocab, int) or value < vocab) else None


def read_state_dict(folder: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face folder, by name, on the CPU.

    Looks for, in order: ``model.safetensors``, ``model.safetensors.index.json`` (shards),
    ``pytorch_model.bin`` (``torch.load(..., weights_only=True)``).

    Raises:
        FileNotFoundError: none of those files is in ``folder`` (the message lists them).
        ImportError: ``safetensors`` is missing (with the install command).
    """
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    pickled = folder / "pytorch_model.bin"
    if single.is_file() or index.is_file():
        st = require("safetensors.torch", "safetensors")
        if single.is_file():
            return dict(st.load_file(str(single), device="cpu"))
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(st.load_file(str(folder / shard), device="cpu"))
        return state
    if pickled.is_file():
        loaded = torch.load(pickled, map_location="cpu", weights_only=True)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{pickled} does not hold a state dict (got {type(loaded).__name__})")
        return dict(loaded)
    raise FileNotFoundError(
        f"{folder} has no weights: expected model.safetensors, model.safetensors.index.json "
        "or pytorch_model.bin"
    )
