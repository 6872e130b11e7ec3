"""Random states as safetensors + JSON, never pickle (the optimizer's: :mod:`qkv.checkpoint`).

:func:`get_rng` and :func:`set_rng` capture and restore the random states a run depends on:
torch's CPU generator (dropout), the CUDA generators when CUDA is initialised, Python's
``random`` and NumPy's legacy global generator. Restoring all of them makes a resumed run draw
the same numbers as an uninterrupted one.

In a data-parallel run every rank starts from the run's seed (the same initial weights and
data order everywhere); then each rank ``r > 0`` switches torch to a stream of its own,
seeded by :func:`rank_seed`, so that dropout differs from rank to rank. :func:`rank_rng` and
:func:`set_rank_rng` carry one rank's torch states (CPU and its GPU) through a checkpoint as
``rng.rank<r>.torch`` / ``rng.rank<r>.cuda``; rank 0's are the plain entries above.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["get_rng", "rank_rng", "rank_seed", "set_rank_rng", "set_rng"]


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


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s torch stream in a data-parallel run (rank 0 keeps ``seed``)."""
    if rank == 0:
        return seed
    # a fixed odd multiplier (the golden ratio in 64 bits) spreads neighbouring seeds apart
    return (seed + rank * 0x9E3779B97F4A7C15) % 2**63


def rank_rng(rank: int, device: torch.device) -> dict[str, Tensor]:
    """This process's torch states (CPU, and ``device``'s when it is a GPU), named for ``rank``."""
    out = {f"rng.rank{rank}.torch": torch.get_rng_state()}
    if device.type == "cuda":
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rank_rng(tensors: dict[str, Tensor], rank: int, device: torch.device) -> bool:
    """Restore what :func:`rank_rng` saved for ``rank``; False when the checkpoint has none
    (it was written by fewer processes)."""
    cpu = tensors.get(f"rng.rank{rank}.torch")
    if cpu is None:
        return False
    torch.set_rng_state(cpu)
    cuda = tensors.get(f"rng.rank{rank}.cuda")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
    return True
