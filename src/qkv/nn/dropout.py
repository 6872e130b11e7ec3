"""``torch.nn.Dropout`` that costs nothing when it does nothing.

A decoding step calls a few dropout modules per block; in evaluation (or at ``p = 0``) each
returns its input, but through ``nn.Module.__call__`` (a few microseconds each, a few hundred
times per step). :class:`Dropout` is ``nn.Dropout`` (same class name, ``repr``, no state)
whose call returns the input directly then, unless a hook is attached.
"""

from __future__ import annotations

from torch import Tensor, nn

from qkv.nn.hooks import module_hooks_attached

__all__ = ["Dropout"]


class Dropout(nn.Dropout):
    """:class:`torch.nn.Dropout`; identity without a module call in evaluation or at ``p=0``.

    Shapes: any ``(*)`` in, the same out.
    """

    def __call__(self, x: Tensor) -> Tensor:
        if (not self.training or self.p == 0.0) and not module_hooks_attached(self):
            return x
        return super().__call__(x)
