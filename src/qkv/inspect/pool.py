"""Shrinking attention matrices for pictures: exact means over non-overlapping blocks.

Thousands of tokens do not fit in a figure or a thumbnail. A ``(T, S)`` matrix becomes
``(R, C)`` with ``R = min(T, max_rows)``: row ``i`` goes to bin ``i·R // T`` (so bins differ
in size by at most one row) and each cell is the mean of its block. Rows can be fed a block
at a time (:class:`Pooler`), so a ``(T, S)`` matrix never has to exist whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Pooler", "bin_edges", "pool"]


def _bins(n: int, m: int, device: torch.device | None = None) -> Tensor:
    """Bin index ``(n,)`` of each of ``n`` positions among ``m`` bins."""
    return torch.arange(n, device=device) * m // max(n, 1)


def bin_edges(n: int, m: int) -> list[int]:
    """First position of each of the ``min(n, m)`` bins, then ``n``: ``len == bins + 1``."""
    k = max(1, min(n, m))
    return [-(-b * n // k) for b in range(k)] + [n]


class Pooler:
    """Accumulate row blocks of ``(..., T, S)`` into block means ``(..., R, C)``.

    Args:
        T, S: the full matrix's rows and columns.
        max_rows, max_cols: the most rows and columns of the result (``R = min(T, max_rows)``).
        lead: leading dimensions of every block (e.g. ``(H,)``).
    """

    def __init__(
        self, T: int, S: int, max_rows: int, max_cols: int, lead: tuple[int, ...] = ()
    ) -> None:
        if max_rows < 1 or max_cols < 1:
            raise ValueError(f"max_rows and max_cols must be >= 1, got {max_rows}, {max_cols}")
        self.T, self.S = T, S
        self.R, self.C = max(1, min(T, max_rows)), max(1, min(S, max_cols))
        self.row_bin, self.col_bin = _bins(T, self.R), _bins(S, self.C)
        self.sums = torch.zeros(*lead, self.R, self.C, dtype=torch.float32)
        counts_r = torch.bincount(self.row_bin, minlength=self.R).double()  # (R,)
        counts_c = torch.bincount(self.col_bin, minlength=self.C).double()  # (C,)
        self.counts = (counts_r[:, None] * counts_c[None, :]).clamp(min=1)  # (R, C)

    def add(self, first_row: int, block: Tensor) -> None:
        """Add rows ``first_row .. first_row + n - 1`` given as ``block (..., n, S)``."""
        b = block.detach().to("cpu", torch.float32)
        n = b.shape[-2]
        cols = torch.zeros(*b.shape[:-1], self.C, dtype=torch.float32)  # (..., n, C)
        cols.index_add_(b.dim() - 1, self.col_bin, b)
        self.sums.index_add_(b.dim() - 2, self.row_bin[first_row : first_row + n], cols)

    def result(self) -> Tensor:
        """Block means ``(..., R, C)``: sums kept in float32 (ample for pictures, half the
        memory and time of float64), divided by exact counts in float64."""
        return self.sums / self.counts


def pool(matrix: Tensor, max_rows: int, max_cols: int) -> Tensor:
    """Block means of ``matrix (..., T, S)`` as ``(..., min(T, max_rows), min(S, max_cols))``
    (float64; the matrix itself, to float32 precision, when it already fits).

    Raises:
        ValueError: a matrix with fewer than 2 dimensions, or limits below 1.
    """
    if not isinstance(matrix, Tensor) or matrix.dim() < 2:
        raise ValueError(f"matrix must be a tensor (..., T, S), got {matrix!r:.60}")
    T, S = matrix.shape[-2:]
    p = Pooler(T, S, max_rows, max_cols, tuple(matrix.shape[:-2]))
    if T:
        p.add(0, matrix)
    return p.result()
