"""GGUF files: metadata and float32 tensors, read with the ``gguf`` package.

GGUF (llama.cpp's format) is one file holding a key/value metadata table (architecture sizes,
the tokenizer's vocabulary and merges, the chat template) and the tensors, most of them
block-quantised (``Q4_1``: 32 weights share a float16 scale and minimum; ``Q8_0``: 32 int8
weights share a scale). qkv computes in float32, so every tensor is dequantised once on load
with ``gguf.quants.dequantize``, the package's reference implementation of llama.cpp's formats.

Shapes: GGUF lists dimensions fastest-first (``ne[0]`` is the row length), the reverse of
NumPy/torch order; :func:`read_gguf` returns tensors in torch order, so a linear layer's weight
is ``(out_features, in_features)`` as in ``nn.Linear``.

The header (metadata and tensor shapes) is read first and the data only on request, so a
loader can check the metadata's sizes against the shapes before it builds a model; every
dequantised tensor is checked finite (a block whose scale is NaN is a corrupt file, named).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from qkv.checkpoint.tensor_file import check_finite
from qkv.data.files import BadFileError, MissingFileError, library_error, reading
from qkv.pretrained.errors import require

__all__ = ["GGUFFile", "read_gguf"]


@functools.cache
def _reader_class(gguf: Any) -> type:
    """``gguf.GGUFReader``, reading its header through a plain NumPy view of the memory map.

    The reader slices its ``np.memmap`` once per value it parses (twice per string), and a
    memmap slice costs ~10 µs in NumPy's subclass hooks: SmolLM2's 98,000 vocabulary and
    merge strings took 3-5 s of a 6.7 s load. The same slices of a plain view of the same
    memory are the same values (tested field by field against the package's own reader) in
    a third of the time. Where the installed ``gguf`` no longer has the private method this
    replaces, with the same arguments, the package's reader is used as it is. Made once per
    ``gguf`` module.
    """
    import inspect

    base = gguf.GGUFReader
    method = getattr(base, "_get", None)
    if method is None or list(inspect.signature(method).parameters) != [
            "self", "offset", "dtype", "count", "override_order"]:  # fmt: skip
        return base

    class PlainViewReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            flat = self.__dict__.get("_plain")
            if flat is None:
                flat = self._plain = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            arr = flat[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainViewReader


@dataclass
class GGUFFile:
    """What a GGUF file holds, decoded.

    Attributes:
        path: the file read.
        metadata: every key/value: strings, ints, floats, bools, and lists of those.
        tensors: name -> float32 tensor in torch order (e.g. ``blk.0.attn_q.weight``
            ``(H·D, E)``); empty until :meth:`read_tensors` (or ``read_gguf(tensors=True)``).
        tensor_types: name -> the stored type (``"Q4_1"``, ``"F32"``, ...), for reports.
        shapes: name -> shape in torch order, from the header (known before any data is read).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Tensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    _reader: Any = field(default=None, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value that must be present.

        Raises:
            qkv.data.files.BadFileError (a ValueError): the key is missing (naming it and the
                file).
        """
        if key not in self.metadata:
            raise BadFileError(f"GGUF file {self.path} has no metadata key {key!r}",
                               path=self.path)  # fmt: skip
        return self.metadata[key]

    @property
    def numel(self) -> int:
        """Number of values the tensors hold (after dequantisation), from the header."""
        return sum(math.prod(shape) for shape in self.shapes.values())

    def close(self) -> None:
        """Drop the reader (and its memory map of the file); the metadata stays."""
        self._reader = None

    def read_tensors(self) -> dict[str, Tensor]:
        """Dequantise every tensor to float32 (into :attr:`tensors`), each checked finite.

        Raises:
            qkv.data.files.BadFileError (a ValueError): a tensor type the installed ``gguf``
                package cannot dequantise, data that does not fit its shape, or a tensor with
                NaN or infinite values (a block with a NaN scale), each named.
        """
        if self._reader is None:
            raise ValueError(f"{self.path}: the reader is closed; call read_gguf again")
        from gguf.quants import dequantize

        for t in self._reader.tensors:
            kind = t.tensor_type.name
            try:
                # A NaN or infinite block scale makes numpy warn; check_finite below names it.
                with np.errstate(all="ignore"):
                    array = dequantize(t.data, t.tensor_type)
            except NotImplementedError as err:
                raise BadFileError(
                    f"GGUF tensor {t.name!r} in {self.path} has type {kind}, which the "
                    f"installed gguf package cannot dequantise: {err}",
                    path=self.path,
                ) from err
            with reading(self.path, f"GGUF tensor {t.name!r} of type {kind} and shape "
                         f"{self.shapes[t.name]}"):  # fmt: skip
                array = np.asarray(array, dtype=np.float32).reshape(self.shapes[t.name])
            # F32 tensors come back as read-only views of the memory-mapped file: copy those.
            if not array.flags.writeable:
                array = array.copy()
            tensor = torch.from_numpy(array)
            check_finite(t.name, tensor, self.path, what=f"GGUF tensor ({kind})")
            self.tensors[t.name] = tensor
        return self.tensors


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
    """Read a GGUF file: metadata and shapes always, tensors dequantised to float32 unless
    ``tensors=False`` (then :meth:`GGUFFile.read_tensors` reads them later).

    Args:
        path: the ``.gguf`` file.
        tensors: also read and dequantise every tensor (the slow part: about 2 s for 135M
            parameters); ``False`` reads only the header: metadata (the tokenizer needs
            nothing else) and tensor shapes (enough to check the metadata's sizes).

    Returns:
        A :class:`GGUFFile`.

    Raises:
        qkv.data.files.MissingFileError (a FileNotFoundError): ``path`` does not exist.
        ImportError: the ``gguf`` package is missing (with the install command).
        qkv.data.files.BadFileError (a ValueError): the file is not GGUF, is truncated or
            corrupt, or holds a tensor type ``gguf`` cannot dequantise or a non-finite tensor.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"GGUF file not found: {path}", path=path)
    gguf = require("gguf", "gguf")
    try:
        reader = _reader_class(gguf)(str(path))
    except BaseException as err:  # ValueError, struct/numpy errors, IndexError on foreign files
        if not library_error(err):
            raise
        raise BadFileError(
            f"{path} is not a readable GGUF file ({type(err).__name__}: {str(err)[:300]}); "
            "expected llama.cpp's format: magic 'GGUF', version, metadata, tensor table, data",
            path=path,
        ) from None
    with reading(path, "GGUF metadata"):
        metadata = {name: _decode_field(f, gguf) for name, f in reader.fields.items()}
        shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist()))  # torch order
                  for t in reader.tensors}  # fmt: skip
        types = {t.name: t.tensor_type.name for t in reader.tensors}
    out = GGUFFile(path=path, metadata=metadata, tensor_types=types, shapes=shapes,
                   _reader=reader)  # fmt: skip
    if tensors:
        out.read_tensors()
    return out
