"""A config is checked against the tensors a file holds before any model is built from it.

A config file is only a claim: ``"vocab_size": 10**12`` or ``"num_layers": 10**7`` would make a
loader allocate terabytes or loop for hours if it built the model first and compared the tensors
after. Every loader (qkv checkpoints, Hugging Face folders, GGUF files) therefore does, in
this order, using only the file's header (names and shapes, no data):

1. :func:`check_sizes`: every size in the config is bounded by what the file stores (a layer
   count by the number of tensors, any other size by the number of stored values), so the
   steps below cannot loop or allocate without bound;
2. the exact check: the tensors the config implies against the header's names and shapes
   (:func:`check_state_shapes` for qkv's own names; the converters' name maps for the others);
3. :func:`meta_model` and :func:`check_derived_buffers`: the model is built on PyTorch's
   ``meta`` device (shapes only, no memory), and the buffers it computes from the config rather
   than reading them from the file (RoPE and sinusoidal tables sized by ``max_len``) must fit
   a budget the file can justify (:data:`DERIVED_FLOOR` bytes, or the file's own size).

Only then is the real model built and the data read.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping

import torch
from torch import nn

from qkv.checks import is_int
from qkv.data.files import BadFileError

__all__ = [
    "DERIVED_FLOOR",
    "check_derived_buffers",
    "check_sizes",
    "check_state_shapes",
    "meta_model",
]

# Buffers a model derives from its config may take this many bytes whatever the file's size:
# RoPE tables for a 128k context at head width 128 take 128 MiB, so 256 MiB leaves room.
DERIVED_FLOOR = 256 * 2**20
# Sizes that no stored tensor has to back: position tables that are computed, not learned,
# are budgeted by check_derived_buffers instead.
_UNBACKED = ("max_len",)


def check_sizes(
    config: object, *, tensors: int, numel: int, config_file: str | os.PathLike,
    data_file: str | os.PathLike,
) -> None:  # fmt: skip
    """Refuse config sizes the file's tensors cannot back, before anything is built.

    Args:
        config: a frozen config dataclass (its int fields are checked).
        tensors: the number of tensors in the file's header.
        numel: the number of values they hold.
        config_file: where the config came from, for the message.
        data_file: the tensor file, for the message.

    Raises:
        BadFileError: a ``*layers`` field above ``tensors`` (each layer stores at least one
            tensor) or another size above ``numel`` (each scales at least one tensor).
    """
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if not is_int(value) or field.name in _UNBACKED:
            continue
        layers = field.name.endswith("layers")
        limit, unit = (tensors, "tensors") if layers else (numel, "values")
        if value > limit:
            raise BadFileError(
                f"{config_file}: {field.name}={value} cannot be right: {data_file} holds "
                f"{limit} {unit} in all; expected a config that matches the tensors",
                path=config_file,
            )


def check_state_shapes(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    tied: Mapping[str, str],
    data_file: str | os.PathLike,
    origin: str,
) -> None:
    """Compare a model's state-dict shapes with a file's header (qkv's own tensor names).

    Args:
        expected: the model's ``name -> shape`` (from the meta model or the given model).
        found: the header's ``name -> shape``.
        tied: names the file leaves out because they share another tensor (name -> source).
        data_file: the tensor file, for the message.
        origin: where ``expected`` comes from, for the message (``"the model <config.json>
            describes"``).

    Raises:
        BadFileError: missing or unexpected names (up to 8 of each listed), or a shape that
            differs (the first one named).
    """
    full = dict(found)
    for name, source in tied.items():
        if source in found:
            full[name] = found[source]
    missing = sorted(set(expected) - set(full))
    unexpected = sorted(set(full) - set(expected))
    if missing or unexpected:
        raise BadFileError(
            f"{data_file}: tensors do not match the model: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({origin})",
            path=data_file,
        )
    for name, shape in full.items():
        if tuple(shape) != tuple(expected[name]):
            raise BadFileError(
                f"{data_file}: tensor {name!r} has shape {tuple(shape)}, the model expects "
                f"{tuple(expected[name])} ({origin})",
                path=data_file,
            )


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on PyTorch's meta device: every parameter and buffer has a shape, no data."""
    with torch.device("meta"):
        return build()


def check_derived_buffers(
    meta: nn.Module, *, file_bytes: int, config_file: str | os.PathLike
) -> None:
    """Refuse a config whose computed buffers would outweigh what the file can justify.

    Buffers outside the state dict (non-persistent: RoPE ``cos``/``sin`` tables, sinusoidal
    position tables, ALiBi slopes) are computed from the config when the model is built; their
    size is set by numbers like ``max_len`` that no stored tensor backs.

    Args:
        meta: the model built by :func:`meta_model`.
        file_bytes: the size of the tensor file(s).
        config_file: where the config came from, for the message.

    Raises:
        BadFileError: the buffers would take more than ``max(file_bytes, DERIVED_FLOOR)``.
    """
    saved = set(meta.state_dict())
    derived = {n: b for n, b in meta.named_buffers() if n not in saved}
    total = sum(b.numel() * b.element_size() for b in derived.values())
    budget = max(file_bytes, DERIVED_FLOOR)
    if total > budget:
        biggest = max(derived, key=lambda n: derived[n].numel())
        raise BadFileError(
            f"{config_file}: the config asks for {_size(total)} of computed buffers (the "
            f"largest, {biggest!r}, has shape {tuple(derived[biggest].shape)}), more than the "
            f"{_size(budget)} the weights can justify; expected a smaller max_len",
            path=config_file,
        )


def _size(nbytes: int) -> str:
    if nbytes < 2**20:
        return f"{nbytes} bytes"
    exponent = min(int(math.log2(nbytes)) // 10, 4)
    return f"{nbytes / 2 ** (10 * exponent):.1f} {('', 'KiB', 'MiB', 'GiB', 'TiB')[exponent]}"
