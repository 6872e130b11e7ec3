"""The viewer's data: each layer's weights compressed to what the pictures need.

A ``(H', T, S)`` block of weights would be far too big for a web page at thousands of tokens,
and the pictures never need all of it:

* the head view draws, for each query and head, lines to its ``k`` most-attended keys: the
  top-``k`` indices (uint16, or uint32 past 65,535 keys) and weights as uint8 codes
  ``round(255·sqrt(w))`` (decoded ``(code/255)²``: within about ``sqrt(w)/255`` of ``w``; weights
  down to ~4e-6 keep a non-zero code, which a long input's diffuse attention needs);
* the model view shows each head as a thumbnail and, on a click, a larger picture: block
  means (:mod:`qkv.inspect.pool`) at most ``thumb`` and ``detail`` cells a side, as uint8
  scaled to the head's maximum.

Rows arrive a block at a time (:meth:`LayerSummary.add`), so the full matrix never has to be
held. Arrays travel as base64 in the page's JSON.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.inspect.pool import Pooler

__all__ = ["TOPK_BUDGET", "LayerSummary", "b64", "choose_top_k", "time_labels", "weight_codes"]

# Top-k entries (query × head × k) the whole page may hold: 3 bytes each, 4/3 of that in base64:
# ~6 MB at most (a 30-layer, 9-head model at 4,096 tokens keeps 1-2 lines per query and head).
TOPK_BUDGET = 1_500_000


def b64(a: np.ndarray) -> str:
    """The bytes of ``a`` (C order, its own dtype) as base64 text."""
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def weight_codes(w: Tensor) -> np.ndarray:
    """Weights in ``[0, 1]`` as uint8 codes ``round(255·sqrt(w))`` (decoded ``(code/255)²``)."""
    return torch.round(w.detach().double().cpu().clamp(0, 1).sqrt() * 255).to(torch.uint8).numpy()


def time_labels(n: int, seconds: float) -> list[str]:
    """Labels of ``n`` frames ``seconds`` apart: ``"0.00 s", "0.02 s", ...``, with as many
    decimals as ``seconds`` needs (at least 2, at most 6)."""
    digits = next((d for d in range(2, 7) if abs(round(seconds, d) - seconds) < 1e-12), 6)
    return [f"{i * seconds:.{digits}f} s" for i in range(n)]


def choose_top_k(top_k: int, S: int, rows: int) -> int:
    """Lines per query and head: ``top_k``, but at most ``S`` and within :data:`TOPK_BUDGET`
    for ``rows`` (query × head pairs on the page)."""
    return max(1, min(top_k, S, TOPK_BUDGET // max(rows, 1)))


class LayerSummary:
    """Top-k lines and block-mean pictures of one layer's ``(H', T, S)`` weights.

    Args:
        name: the layer's module name.
        kind: ``"self"``, ``"causal self"`` or ``"cross"``.
        heads: the model's head numbers of the ``H'`` rows.
        T, S: queries and keys.
        k: lines kept per query and head.
        thumb, detail: cells a side of the thumbnail and of the detail picture, at most.
    """

    def __init__(self, name: str, kind: str, heads: list[int], T: int, S: int, *, k: int,
                 thumb: int = 48, detail: int = 96) -> None:  # fmt: skip
        self.name, self.kind, self.heads, self.T, self.S = name, kind, list(heads), T, S
        H = len(self.heads)
        self.k = max(1, min(k, S)) if S else 0
        self.idx = np.zeros((H, T, self.k), dtype="<u2" if S <= 65535 else "<u4")
        self.w = np.zeros((H, T, self.k), dtype=np.uint8)
        self.thumb = Pooler(T, max(S, 1), thumb, thumb, (H,))
        self.detail = Pooler(T, max(S, 1), detail, detail, (H,))
        self.rows_seen = 0
        self.focus_sum = torch.zeros(H, dtype=torch.float64)  # see focus()
        self.focus_rows = 0

    def add(self, first_row: int, block: Tensor) -> None:
        """Add query rows ``first_row ..`` given as ``block (H', n, S)``.

        Raises:
            ValueError: a block of the wrong shape.
        """
        H, n, S = block.shape
        if H != len(self.heads) or S != self.S or first_row + n > self.T:
            raise ValueError(
                f"{self.name}: block of shape {tuple(block.shape)} at row {first_row} does not "
                f"fit ({len(self.heads)}, {self.T}, {self.S})"
            )
        self.rows_seen += n
        if not S or not n:
            return
        b = block.detach().float().cpu()
        vals, idx = torch.topk(b, self.k, dim=-1)  # (H', n, k)
        rows = slice(first_row, first_row + n)
        self.idx[:, rows] = idx.numpy().astype(self.idx.dtype)
        self.w[:, rows] = weight_codes(vals)  # (H', n, k)
        self.thumb.add(first_row, b)
        self.detail.add(first_row, b)
        if S > 1:  # how sharply each row attends once the first key (a sink) is set aside
            rest = b[..., 1:]  # (H', n, S - 1)
            mass = rest.sum(-1).clamp(min=1e-12)  # (H', n)
            self.focus_sum += (rest.amax(-1) / mass).double().sum(-1)
            self.focus_rows += n

    def focus(self) -> list[float]:
        """Per head: the mean over query rows of ``max_j w_ij / Σ_j w_ij`` over the keys after
        the first (an attention sink set aside): 1 = every row looks at one key, ``1/S`` =
        uniform. The page opens on the most focused head."""
        n = max(self.focus_rows, 1)
        return [float(x) / n for x in self.focus_sum]

    @staticmethod
    def _picture(p: Pooler) -> dict[str, Any]:
        m = p.result()  # (H', R, C)
        top = m.flatten(1).amax(1) if m.numel() else torch.zeros(m.shape[0])  # (H',)
        # the maximum without the first key column: what "discount the sink" scales to
        rest = m[..., 1:].flatten(1).amax(1) if m.shape[-1] > 1 else top  # (H',)
        scaled = (m / top.clamp(min=1e-30)[:, None, None] * 255).round().clamp(0, 255)
        return {"r": p.R, "c": p.C, "max": [float(x) for x in top],
                "maxRest": [float(x) for x in rest],
                "data": b64(scaled.to(torch.uint8).numpy())}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The layer's entry in the page's JSON."""
        return {
            "name": self.name, "kind": self.kind, "heads": self.heads, "T": self.T,
            "S": self.S, "k": self.k, "idxBytes": self.idx.dtype.itemsize,
            "idx": b64(self.idx), "w": b64(self.w),
            "thumb": self._picture(self.thumb), "detail": self._picture(self.detail),
            "focus": self.focus(),
        }  # fmt: skip


def time_bins(block: Tensor, bq: int, bk: int) -> Tensor:
    """``block (H', n, S)`` with keys grouped ``bk`` at a time (summed: each row still sums
    to 1) and rows ``bq`` at a time (averaged): ``(H', ceil(n / bq), ceil(S / bk))``. How a
    time axis of many frames (Whisper: 1,500 for 30 s) fits one screen."""
    n, S = block.shape[1:]
    if bk > 1:
        block = F.pad(block, (0, -S % bk)).unflatten(-1, (-1, bk)).sum(-1)  # (H', n, S')
    if bq > 1:
        groups = F.pad(block, (0, 0, 0, -n % bq)).unflatten(1, (-1, bq)).sum(2)  # (H', n', S')
        counts = torch.full((groups.shape[1],), float(bq), dtype=block.dtype,
                            device=block.device)
        counts[-1] = n - (groups.shape[1] - 1) * bq  # the last group may be short
        block = groups / counts[None, :, None]
    return block
