"""Moved to :mod:`qkv.checkpoint` (below both :mod:`qkv.train` and :mod:`qkv.pretrained`).

Kept so that ``from qkv.train.checkpoint import load_checkpoint`` goes on working.
"""

from qkv.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint", "save_checkpoint"]
