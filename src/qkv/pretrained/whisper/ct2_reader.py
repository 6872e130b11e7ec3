"""CTranslate2 ``model.bin`` files: named tensors, read from the format, never executing code.

CTranslate2 (OpenNMT) stores a converted model as one binary file (written by
``ModelSpec._serialize`` in ``python/ctranslate2/specs/model_spec.py``; read by
``src/models/model.cc``). All integers are little-endian; a *string* is a ``uint16`` length
``n`` (counting a final NUL byte) followed by ``n`` bytes, the last one ``\\0``:

    uint32  binary version                   (4, 5 or 6 share the layout below)
    string  spec name                        ("WhisperSpec", "TransformerSpec", ...)
    uint32  spec revision
    uint32  number of variables N
    N times:
        string  name                         ("encoder/conv1/weight")
        uint8   rank R, then R x uint32 dims (row-major, torch order; rank 0 = a scalar)
        uint8   dtype id                     (0 float32, 1 int8, 2 int16, 3 int32,
                                              4 float16, 5 bfloat16)
        uint32  payload bytes                (must equal prod(dims) x item size)
        bytes   the payload
    uint32  number of aliases A
    A times: string alias, string target     (a tensor stored once under two names, e.g.
                                              a projection tied to the embedding)

Variables come in the order the converter sorted them (by name). Options are stored as
scalars (``decoder/pre_norm`` int8 1) and strings as int8 arrays of their bytes.

:func:`read_ct2` checks everything against the file's size before it allocates anything: a
truncated file, an unknown version or dtype id, a payload size that disagrees with the shape,
an absurd rank, count or size, a duplicate name, an alias to nothing, bytes after the end: each
raises :class:`~qkv.data.files.BadFileError` naming the file and the offset.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.data.files import BadFileError, MissingFileError

__all__ = ["CT2_DTYPES", "CT2File", "read_ct2"]

VERSIONS = (4, 5, 6)  # binary versions with the layout above (6 is current)
MAX_RANK = 8  # CTranslate2's tensors have rank <= 4; more means a corrupt file
# id -> (name, numpy dtype read from the file, torch dtype of the result)
CT2_DTYPES: dict[int, tuple[str, str, torch.dtype]] = {
    0: ("float32", "<f4", torch.float32),
    1: ("int8", "i1", torch.int8),
    2: ("int16", "<i2", torch.int16),
    3: ("int32", "<i4", torch.int32),
    4: ("float16", "<f2", torch.float16),
    5: ("bfloat16", "<i2", torch.bfloat16),  # read as int16 bits, then viewed as bfloat16
}


@dataclass
class CT2File:
    """What a CTranslate2 ``model.bin`` holds.

    Attributes:
        path: the file read.
        version: binary version (4-6).
        spec: the spec's name (``"WhisperSpec"``).
        revision: the spec's revision.
        shapes: name -> shape (torch order); aliases included.
        dtypes: name -> dtype name (``"float16"``); aliases included.
        tensors: name -> tensor in the stored dtype (empty when read with ``tensors=False``);
            an alias maps to the same tensor object as its target.
        aliases: alias -> the name of the stored tensor.
    """

    path: Path
    version: int
    spec: str
    revision: int
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def scalar(self, name: str) -> int | float:
        """The value of a rank-0 variable (an option such as ``decoder/pre_norm``).

        Raises:
            BadFileError: the variable is missing or not a scalar.
        """
        t = self.tensors.get(name)
        if t is None or t.dim() != 0:
            got = "missing" if t is None else f"shape {tuple(t.shape)}"
            raise BadFileError(f"{self.path}: expected a scalar variable {name!r}, got {got}",
                               path=self.path)  # fmt: skip
        return t.item()


class _Cursor:
    """Reads little-endian fields from ``data``, refusing to run past its end."""

    def __init__(self, data: memoryview, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 0

    def fail(self, message: str) -> BadFileError:
        return BadFileError(f"{self.path}: {message} (at byte {self.pos} of {len(self.data)}); "
                            "expected a CTranslate2 model.bin", path=self.path)  # fmt: skip

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.data) - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {len(self.data) - self.pos} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.uint("H", f"the length of {what}")
        raw = bytes(self.take(n, what))
        if n == 0 or raw[-1] != 0:
            raise self.fail(f"{what} is not a NUL-terminated string")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8: {raw[:40]!r}") from None


def _read_variable(cur: _Cursor, index: int, with_data: bool
                   ) -> tuple[str, tuple[int, ...], str, Tensor | None]:  # fmt: skip
    """One variable record: ``(name, shape, dtype name, tensor or None)``."""
    name = cur.string(f"the name of variable {index}")
    rank = cur.uint("B", f"the rank of {name!r}")
    if rank > MAX_RANK:
        raise cur.fail(f"variable {name!r} has rank {rank}; expected at most {MAX_RANK}")
    shape = tuple(cur.uint("I", f"a dimension of {name!r}") for _ in range(rank))
    type_id = cur.uint("B", f"the dtype of {name!r}")
    if type_id not in CT2_DTYPES:
        raise cur.fail(f"variable {name!r} has unknown dtype id {type_id}; expected one of "
                       + ", ".join(f"{k} ({v[0]})" for k, v in CT2_DTYPES.items()))
    dtype_name, np_dtype, torch_dtype = CT2_DTYPES[type_id]
    num_bytes = cur.uint("I", f"the size of {name!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
    if num_bytes != expected:
        raise cur.fail(f"variable {name!r} of shape {shape} and dtype {dtype_name} declares "
                       f"{num_bytes} bytes; expected {expected}")  # fmt: skip
    payload = cur.take(num_bytes, f"the data of {name!r}")  # checks the size before any copy
    if not with_data:
        return name, shape, dtype_name, None
    array = np.frombuffer(payload, dtype=np_dtype).reshape(shape).copy()
    tensor = torch.from_numpy(array)
    if torch_dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return name, shape, dtype_name, tensor


def read_ct2(path: str | os.PathLike, *, tensors: bool = True) -> CT2File:
    """Read a CTranslate2 ``model.bin`` (see the module docstring for the layout).

    Args:
        path: the file.
        tensors: also read the data (False: names, shapes and dtypes only, still checking
            that every payload is there).

    Returns:
        A :class:`CT2File`; tensors keep the stored dtype (float16 stays float16).

    Raises:
        MissingFileError: no file at ``path``.
        BadFileError: truncation, an unsupported version, an unknown dtype id, a payload
            size that disagrees with the shape, an absurd rank or count, a duplicate name,
            an alias to an unknown tensor, or trailing bytes; each names the file and offset.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"no CTranslate2 model.bin at {path}", path=path)
    with open(path, "rb") as f:
        data = memoryview(f.read())
    cur = _Cursor(data, path)
    version = cur.uint("I", "the binary version")
    if version not in VERSIONS:
        raise cur.fail(f"unsupported binary version {version}; qkv reads versions {VERSIONS}")
    spec = cur.string("the spec name")
    revision = cur.uint("I", "the spec revision")
    out = CT2File(path, version, spec, revision)
    count = cur.uint("I", "the number of variables")
    # each record takes at least 9 bytes (string length + NUL, rank, dtype, size)
    if count > (len(data) - cur.pos) // 9:
        raise cur.fail(f"the header declares {count} variables, more than the remaining "
                       f"{len(data) - cur.pos} bytes can hold (truncated or corrupt)")
    for i in range(count):
        name, shape, dtype_name, tensor = _read_variable(cur, i, tensors)
        if name in out.shapes:
            raise cur.fail(f"variable {name!r} appears twice")
        out.shapes[name], out.dtypes[name] = shape, dtype_name
        if tensor is not None:
            out.tensors[name] = tensor
    num_aliases = cur.uint("I", "the number of aliases")
    if num_aliases > (len(data) - cur.pos) // 6:
        raise cur.fail(f"the header declares {num_aliases} aliases, more than the remaining "
                       f"{len(data) - cur.pos} bytes can hold (truncated or corrupt)")
    for _ in range(num_aliases):
        alias = cur.string("an alias name")
        target = cur.string(f"the target of alias {alias!r}")
        if target not in out.shapes:
            raise cur.fail(f"alias {alias!r} points to {target!r}, which is not in the file")
        if alias in out.shapes:
            raise cur.fail(f"alias {alias!r} is also the name of a stored tensor")
        out.aliases[alias] = out.aliases.get(target, target)  # an alias of an alias: its target
        out.shapes[alias], out.dtypes[alias] = out.shapes[target], out.dtypes[target]
        if tensors:
            out.tensors[alias] = out.tensors[target]
    if cur.pos != len(data):
        raise cur.fail(f"{len(data) - cur.pos} unexpected bytes after the aliases")
    return out
