"""Tour stop on positions: attention alone is blind to order, so positions are added.

    sinusoidal:  PE[p, 2i] = sin(p / 10000^(2i/E)),  PE[p, 2i+1] = cos(p / 10000^(2i/E))
    RoPE:        q_m = R(m·θ) q,  k_n = R(n·θ) k   =>   q_m · k_n = f(q, k, m - n)

The sinusoidal table is checked entry by entry against the formula in plain Python floats,
and so is its relative property (``PE[p + k]`` is a fixed rotation of ``PE[p]``); RoPE's
relative property is checked on live rotations: the score of one query and one key placed at
positions ``(m, n)`` depends only on ``m - n``. Float64 throughout: these are identities.
"""

from __future__ import annotations

import math

import torch

import qkv
from qkv.cli.tour.page import Context, Section

__all__ = ["positions_stop"]

L, E = 24, 16  # positions and model width of the sinusoidal table
D = 8  # RoPE head width


def _formula_table(n: int, width: int, base: float = 10000.0) -> torch.Tensor:
    rows = [[(math.sin if c % 2 == 0 else math.cos)(p / base ** ((c - c % 2) / width))
             for c in range(width)] for p in range(n)]  # fmt: skip
    return torch.tensor(rows, dtype=torch.float64)  # (n, E)


def _shift_matrix(k: int, width: int, base: float = 10000.0) -> torch.Tensor:
    """``M_k`` with ``PE[p + k] = M_k · PE[p]``: one 2x2 rotation per (sin, cos) pair."""
    m = torch.zeros(width, width, dtype=torch.float64)
    for c in range(0, width, 2):
        a = k / base ** (c / width)
        m[c, c], m[c, c + 1] = math.cos(a), math.sin(a)  # sin(x + a) = sin x cos a + cos x sin a
        m[c + 1, c], m[c + 1, c + 1] = -math.sin(a), math.cos(a)  # cos(x + a)
    return m


def _sinusoidal(s: Section) -> torch.Tensor:
    table = qkv.nn.sinusoidal_table(L, E, dtype=torch.float64)  # (L, E)
    s.text(f"1) sinusoidal (Vaswani et al.): qkv.nn.sinusoidal_table({L}, {E}) against the "
           "formula in plain Python floats. Low columns turn fast (local order), high "
           "columns slowly (global position).")  # fmt: skip
    s.matrix("PE[p, c] for the first positions and columns", table[:4, :6],
             rows=tuple(f"p={p}" for p in range(4)),
             cols=("sin c0", "cos c1", "sin c2", "cos c3", "sin c4", "cos c5"))  # fmt: skip
    s.close("table = the formula, every entry", table, _formula_table(L, E), 1e-12)
    k = 3
    shifted = table[:-k] @ _shift_matrix(k, E).T  # (L - k, E)
    s.close(f"PE[p + {k}] = M_{k}·PE[p] for every p (a fixed rotation: relative offsets are "
            "linear)", shifted, table[k:], 1e-12)  # fmt: skip
    return table


def _rope(ctx: Context, s: Section) -> torch.Tensor:
    gen = ctx.generator(30)
    q = torch.randn(D, generator=gen, dtype=torch.float64)  # one query vector
    k = torch.randn(D, generator=gen, dtype=torch.float64)  # one key vector
    n = 12
    cos, sin = qkv.nn.rotary_cos_sin(torch.arange(n), D, dtype=torch.float64)  # (n, D)
    q_at = qkv.nn.apply_rotary(q.expand(n, D), cos, sin)  # (n, D): q placed at 0 .. n-1
    k_at = qkv.nn.apply_rotary(k.expand(n, D), cos, sin)  # (n, D)
    scores = q_at @ k_at.T  # (n, n): score[m, j] = q at position m · k at position j
    s.text(f"2) RoPE (Su et al.): the same query q and key k (D={D}) rotated to positions "
           f"0..{n - 1} by qkv.nn.apply_rotary. score[m, j] = q_m·k_j depends only on the "
           "offset m - j, so every diagonal of the score matrix is constant.")  # fmt: skip
    spread = max(float(scores.diagonal(o).max() - scores.diagonal(o).min())
                 for o in range(-n + 1, n))  # fmt: skip
    s.at_most("q_m·k_j depends only on m - j: max spread along any diagonal", spread, 1e-12)
    s.close("at offset 0 the rotation cancels: q_m·k_m = q·k", scores.diagonal(),
            (q @ k).expand(n), 1e-12)  # fmt: skip
    s.matrix(
        "score[m, j] for the first positions",
        scores[:5, :5],
        rows=tuple(f"m={m}" for m in range(5)),
        cols=tuple(f"j={j}" for j in range(5)),
    )
    return scores


def positions_stop(ctx: Context, s: Section) -> None:
    """The sinusoidal table against its formula; RoPE's scores depend only on the offset."""
    table = _sinusoidal(s)
    scores = _rope(ctx, s)
    s.heatmaps("sinusoidal table (position x column) and RoPE scores (constant diagonals)", [
        (f"sinusoidal PE ({L}, {E})", table), ("RoPE q_m·k_j", scores),
    ])  # fmt: skip
