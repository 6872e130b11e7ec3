"""GGUF files: metadata and float32 tensors, read with the ``gguf`` package.

GGUF (llama.cpp's format) is one file holding a key/value metadata table (architecture sizes,
the tokenizer's vocabulary and merges, the chat template) and the tensors, most of them
block-quantised (``Q4_1``: 32 weights share a float16 scale and minimum; ``Q8_0``: 32 int8
weights share a scale). qkv computes in float32, so every tensor is dequantised once on load
with ``gguf.quants.dequantize``, the package's reference implementation of llama.cpp's formats.

Shapes: GGUF lists dimensions fastest-first (``ne[0]`` is the row length), the reverse of
NumPy/torch order; :func:`read_gguf` returns tensors in torch order, so a linear layer's weight
is ``(out_features, in_features)`` as in ``nn.Linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.pretrained.errors import require

__all__ = ["GGUFFile", "read_gguf"]


@dataclass
class GGUFFile:
    """What a GGUF file holds, decoded.

    Attributes:
        path: the file read.
        metadata: every key/value: strings, ints, floats, bools, and lists of those.
        tensors: name -> float32 tensor in torch order (e.g. ``blk.0.attn_q.weight``
            ``(H·D, E)``).
        tensor_types: name -> the stored type (``"Q4_1"``, ``"F32"``, ...), for reports.
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Tensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value that must be present.

        Raises:
            ValueError: the key is missing (naming it and the file).
        """
        if key not in self.metadata:
            raise ValueError(f"GGUF file {self.path} has no metadata key {key!r}")
        return self.metadata[key]


def _decode_field(field: Any, gguf: Any) -> Any:
    """One metadata value from the reader's raw parts (works across ``gguf`` versions)."""
    kinds = gguf.GGUFValueType
    types = list(field.types)
    if not types:
        return None

    def scalar(part: np.ndarray, kind: Any) -> Any:
        if kind == kinds.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part.tolist()[0]
        return bool(value) if kind == kinds.BOOL else value

    if types[0] == kinds.ARRAY:
        item = types[-1]
        return [scalar(field.parts[i], item) for i in field.data]
    return scalar(field.parts[field.data[0]], types[0])


def read_gguf(path: str | os.PathLike, *, tensors: bool = True) -> GGUFFile:
    """Read a GGUF file: metadata always, tensors dequantised to float32 unless ``tensors=False``.

    Args:
        path: the ``.gguf`` file.
        tensors: also read and dequantise every tensor (the slow part: about 2 s for 135M
            parameters); ``False`` reads only the metadata (the tokenizer needs nothing else).

    Returns:
        A :class:`GGUFFile`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ImportError: the ``gguf`` package is missing (with the install command).
        ValueError: the file is not GGUF, or holds a tensor type ``gguf`` cannot dequantise.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    gguf = require("gguf", "gguf")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # the reader raises ValueError/struct errors on foreign files
        raise ValueError(f"{path} is not a readable GGUF file: {err}") from err
    metadata = {name: _decode_field(f, gguf) for name, f in reader.fields.items()}
    out = GGUFFile(path=path, metadata=metadata)
    if not tensors:
        return out
    from gguf.quants import dequantize

    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # torch order: rows first
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:
            raise ValueError(
                f"GGUF tensor {t.name!r} in {path} has type {t.tensor_type.name}, which the "
                f"installed gguf package cannot dequantise: {err}"
            ) from err
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:
            array = array.copy()
        out.tensors[t.name] = torch.from_numpy(array)
        out.tensor_types[t.name] = t.tensor_type.name
    return out
