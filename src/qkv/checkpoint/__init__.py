"""qkv's checkpoint format: a folder of safetensors + JSON, written atomically, read without pickle.

* :func:`save_checkpoint` / :func:`load_checkpoint` / :class:`Checkpoint` /
  :class:`CheckpointError`: the folder (:mod:`~qkv.checkpoint.folder`).
* :func:`is_qkv_checkpoint`: tell a qkv checkpoint from a Hugging Face folder.
* :mod:`~qkv.checkpoint.tensor_file` (:class:`TensorFile`: safetensors header first, then data
  checked finite) and :mod:`~qkv.checkpoint.backing` (a config checked against the header
  before a model is built), shared with :mod:`qkv.pretrained`'s loaders.
* :mod:`~qkv.checkpoint.optimizer`: optimizer state as tensors + JSON.

The format sits below :mod:`qkv.train` (which writes and resumes checkpoints) and
:mod:`qkv.pretrained` (which loads them as ready models); it needs only :mod:`qkv.models` (to
rebuild the model a checkpoint names) and :mod:`qkv.data` (its tokenizers).
"""

from qkv.checkpoint.folder import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    is_qkv_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from qkv.checkpoint.tensor_file import TensorFile, check_finite

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "TensorFile",
    "check_finite",
    "is_qkv_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
