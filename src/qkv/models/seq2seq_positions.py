"""Positions of an encoder-decoder stack, built from a :class:`Seq2SeqConfig`.

:func:`stack_positions` is :func:`~qkv.models.parts.make_positions` plus the two generic
options pretrained encoder-decoders need:

* ``sinusoidal_layout="split"``: the sinusoidal table with all sines first, then all cosines
  (:class:`SplitSinusoidalEncoding`; fairseq and Marian lay it out so), instead of the paper's
  interleaved columns. The values are the same, only the column order differs.
* ``position_offset``: position ``p`` reads row ``p + offset`` (BART's learned table keeps two
  unused rows first), so a learned table has ``max_len + offset`` rows.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from qkv.models.parts import PositionParts, make_positions
from qkv.models.seq2seq_config import Seq2SeqConfig
from qkv.nn.positions import SinusoidalPositionalEncoding

__all__ = ["SplitSinusoidalEncoding", "stack_positions"]


class SplitSinusoidalEncoding(SinusoidalPositionalEncoding):
    """Sinusoidal positions with the columns split: ``[sin(p·w_0) .. sin(p·w_{n-1}) |
    cos(p·w_0) .. cos(p·w_{m-1})]``, ``w_i = base^(-2i/E)``, ``n = ceil(E/2)``, ``m = E // 2``.

    The same values as :class:`~qkv.nn.positions.SinusoidalPositionalEncoding` (columns
    ``0, 2, 4, ...`` then ``1, 3, 5, ...`` of its table), in Marian's and fairseq's order.
    Arguments and the ``forward(x (B, T, E), offset) -> (B, T, E)`` call are the parent's.
    """

    def table(self, T: int, offset: int = 0, *, dtype: torch.dtype | None = None) -> Tensor:
        """Rows ``offset .. offset + T - 1`` in the split layout, ``(T, E)``."""
        rows = super().table(T, offset, dtype=dtype)  # (T, E) interleaved
        return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=-1)  # (T, E) split


def stack_positions(c: Seq2SeqConfig, *, encoder: bool) -> PositionParts:
    """The position parts of the encoder (``encoder=True``: bidirectional ALiBi and relative
    bias) or the decoder stack.

    ``parts.limit`` is the number of usable positions (``max_len`` for a learned table, the
    ``position_offset`` rows excluded), None when any position works.
    """
    learned_rows = c.max_len + c.position_offset
    parts = make_positions(
        c.positions, d_model=c.d_model, d_head=c.head_width, max_len=learned_rows,
        symmetric=encoder, num_heads=c.num_heads, relative_buckets=c.relative_buckets,
        relative_max_distance=c.relative_max_distance,
    )
    if c.positions == "sinusoidal" and c.sinusoidal_layout == "split":
        parts = replace(parts, added=SplitSinusoidalEncoding(c.d_model, learned_rows))
    if parts.limit is not None:
        parts = replace(parts, limit=parts.limit - c.position_offset)
    return parts
