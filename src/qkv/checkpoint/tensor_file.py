"""safetensors files read in two steps: the header (names, shapes, no data), then the tensors.

Every loader of safetensors files (qkv checkpoints, Hugging Face folders) goes through
:class:`TensorFile`, so that

1. the header is read and validated first (the ``safetensors`` library checks that every
   tensor's byte range lies inside the file and matches its shape and dtype), and a loader can
   compare the shapes with its config *before* it builds a model (see
   :mod:`~qkv.checkpoint.backing`);
2. the tensors are read only after that, and each floating-point tensor is checked finite once
   (:func:`check_finite`): a NaN or an infinity in a weight is a corrupt file, named with the
   tensor, never a model that quietly produces NaN.

Nothing here unpickles: safetensors holds only a JSON header and raw numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from qkv.data.files import BadFileError, MissingFileError, library_error

__all__ = ["TensorFile", "check_finite"]


def check_finite(name: str, tensor: Tensor, path: str | os.PathLike, *, what: str = "tensor"
                 ) -> None:  # fmt: skip
    """Refuse a floating-point tensor holding a NaN or an infinity.

    Integer and bool tensors pass (they cannot hold either). One ``isfinite`` pass over the
    data; the count and the first bad position are computed only on failure.

    Args:
        name: the tensor's name in the file.
        tensor: its values.
        path: the file, for the message.
        what: how the message calls the tensor (``"GGUF tensor"``).

    Raises:
        BadFileError: ``"<path>: tensor 'name' (shape) holds N NaN/infinite value(s) (first
            at flat index i, value); expected finite weights: ..."``.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    bad = (~finite).reshape(-1)
    first = int(bad.nonzero()[0, 0])
    raise BadFileError(
        f"{path}: {what} {name!r} {tuple(tensor.shape)} holds {int(bad.sum())} NaN/infinite "
        f"value(s) (first at flat index {first}, {tensor.reshape(-1)[first].item()}); expected "
        "finite weights: the file is corrupt, or was saved after training diverged",
        path=path,
    )


class TensorFile:
    """A safetensors file whose header has been read and validated; data not yet read.

    Args:
        path: the ``.safetensors`` file.

    Attributes:
        path: the file.
        shapes: tensor name -> shape, from the header.
        dtypes: tensor name -> safetensors dtype name (``"F32"``, ``"BF16"``, ...).
        nbytes: the file's size in bytes.

    Raises:
        MissingFileError (a FileNotFoundError): no such file.
        BadFileError: not a safetensors file, truncated, or a header whose offsets, shapes or
            dtypes do not fit the file (the library's own message is quoted).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise MissingFileError(f"{self.path}: file missing", path=self.path)
        self.nbytes = self.path.stat().st_size
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    piece = f.get_slice(name)
                    self.shapes[name] = tuple(int(n) for n in piece.get_shape())
                    self.dtypes[name] = str(piece.get_dtype())
        except BaseException as err:  # SafetensorError, OSError, or a Rust panic
            if not library_error(err):
                raise
            raise BadFileError(
                f"{self.path}: not a readable safetensors file, truncated or corrupt ({err}); "
                "expected a JSON header of tensor names, dtypes, shapes and byte offsets "
                "followed by the data",
                path=self.path,
            ) from None

    @property
    def numel(self) -> int:
        """Number of values stored, over all tensors."""
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def read(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Every tensor, on ``device``, each floating-point one checked finite.

        Raises:
            BadFileError: the data cannot be read (the file changed since the header was
                read), or a tensor holds NaN or infinity (named).
        """
        from safetensors import safe_open

        tensors: dict[str, Tensor] = {}
        try:
            with safe_open(str(self.path), framework="pt", device=str(device)) as f:
                for name in self.shapes:
                    tensors[name] = f.get_tensor(name)
        except BaseException as err:
            if not library_error(err):
                raise
            raise BadFileError(
                f"{self.path}: not a readable safetensors file, truncated or corrupt ({err})",
                path=self.path,
            ) from None
        for name, t in tensors.items():
            check_finite(name, t, self.path)
        return tensors
