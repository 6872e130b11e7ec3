"""Random states as safetensors + JSON, never pickle (the optimizer's: :mod:`qkv.checkpoint`).

:func:`get_rng` and :func:`set_rng` capture and restore the random states a run depends on:
torch's CPU generator (dropout), the CUDA generators when CUDA is initialised, Python's
``random`` and NumPy's legacy global generator. Restoring all of them makes a resumed run draw
the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["get_rng", "set_rng"]


def get_rng() -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Capture every random state: ``(json_part, tensors)``."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    info: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    return info, tensors


def set_rng(info: dict[str, Any], tensors: dict[str, Tensor], where: str) -> None:
    """Restore what :func:`get_rng` captured.

    Raises:
        ValueError: a missing or malformed entry (naming ``where``).
    """
    try:
        version, internal, gauss = info["python"]
        kind, keys, pos, has_gauss, cached = info["numpy"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["rng.torch"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: malformed random state ({err!r})") from None
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
