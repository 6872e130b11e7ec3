"""ALiBi: attention with linear biases (Press, Smith and Lewis, 2022, "Train Short, Test Long").

No position is added to the embeddings. Instead each head ``h`` adds a penalty proportional to
the query-key distance to its scores:

    scores[h, i, j] += -m_h · (pos_i - j)

with a fixed slope ``m_h`` per head. For ``n`` heads, ``n`` a power of two, the slopes are the
geometric sequence ``m_h = 2^(-8(h+1)/n)`` (8 heads: 1/2, 1/4, ..., 1/256). For other ``n`` the
paper's reference code takes the ``c`` slopes of the largest power of two ``c < n`` and fills
the remaining ``n - c`` heads with every other slope of the ``2c`` sequence (the odd powers of
its ratio), as BLOOM's ``build_alibi_tensor`` does too.

Softmax ignores a constant added to a whole row, so this bias and BLOOM's ``+m_h · j`` give
the same attention on every visible key.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ALiBi", "alibi_bias", "alibi_slopes"]


def _check_heads(num_heads: object) -> int:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return num_heads


def _power_of_two_slopes(n: int) -> list[float]:
    # 2^(-8/n), 2^(-16/n), ..., 2^(-8): exact in float64 for every power of two n.
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]


def alibi_slopes(
    num_heads: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The ALiBi slope of each head.

    Args:
        num_heads: number of heads ``H``.
        dtype: dtype of the result (computed in float64 first).
        device: where to put it.

    Returns:
        ``(H,)``: ``2^(-8(h+1)/H)`` when ``H`` is a power of two; otherwise the ``c`` slopes
        for ``c`` = the largest power of two below ``H``, followed by slopes ``0, 2, 4, ...``
        of the ``2c`` sequence until there are ``H``.

    Raises:
        ValueError: ``num_heads`` is not a positive int.
    """
    slopes = _slope_values(_check_heads(num_heads))
    # Rounded once from float64 on the CPU (some devices have no float64), then moved.
    return torch.tensor(slopes, dtype=torch.float64).to(dtype=dtype, device=device)


def _slope_values(n: int) -> list[float]:
    c = 1 << (n.bit_length() - 1)  # largest power of two <= n
    slopes = _power_of_two_slopes(c)
    if c != n:
        slopes += _power_of_two_slopes(2 * c)[0::2][: n - c]
    return slopes


def _check_length(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return n


def _bias(
    num_heads: int,
    T: int,
    S: int,
    offset: int | None,
    symmetric: bool,
    device: torch.device | str | None,
    dtype: torch.dtype,
) -> Tensor:
    T, S = _check_length("T", T), _check_length("S", S)
    if offset is None:
        offset = S - T
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset must be an int or None, got {offset!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    _check_fits(num_heads, T, S, offset, dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    slopes = alibi_slopes(num_heads, dtype=work, device=device)  # (H,)
    pos_q = torch.arange(T, device=device) + offset  # (T,)  query i sits at key position i+offset
    dist = (pos_q[:, None] - torch.arange(S, device=device)[None, :]).to(work)  # (T, S)
    if symmetric:
        dist = dist.abs()
    return (-slopes[:, None, None] * dist).to(dtype)  # (H, T, S)


def _check_fits(num_heads: int, T: int, S: int, offset: int, dtype: torch.dtype) -> None:
    """Refuse a bias whose largest entry ``max_h m_h · max |i + offset - j|`` is beyond
    ``dtype``'s range: it would be ``±inf``, which hides keys (or makes NaN) silently.
    Closed form over the grid's corners, so it costs nothing at any ``T`` and ``S``."""
    if T == 0 or S == 0:
        return
    distance = max(abs(offset + T - 1), abs(offset - (S - 1)))
    largest = max(_slope_values(_check_heads(num_heads))) * distance
    if largest > torch.finfo(dtype).max:
        raise ValueError(
            f"the ALiBi bias for T={T}, S={S}, offset={offset} reaches {largest:.4g} in "
            f"magnitude, beyond {dtype}'s largest value {torch.finfo(dtype).max:.4g}; build "
            "it in float32 (dtype=torch.float32)"
        )


def alibi_bias(
    num_heads: int,
    T: int,
    S: int,
    *,
    offset: int | None = None,
    symmetric: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The additive ALiBi bias for ``T`` queries against ``S`` keys.

    Args:
        num_heads: number of heads ``H``.
        T: number of queries.
        S: number of keys.
        offset: query ``i`` sits at key position ``i + offset``; ``None`` means ``S - T``
            (the queries are the last ``T`` positions, as when decoding after ``S - T`` cached
            keys).
        symmetric: use ``-m_h·|pos_i - j|`` (bidirectional encoders) instead of
            ``-m_h·(pos_i - j)``.
        device: where to build it.
        dtype: dtype of the result (computed in float32, or float64 for float64).

    Returns:
        ``(H, T, S)`` float, ``bias[h, i, j] = -m_h·(i + offset - j)``; add it to the scores
        (it broadcasts against ``(B, H, T, S)``). Without ``symmetric`` the entries for future
        keys ``j > pos_i`` are positive: combine with a causal mask, which hides them.

    Raises:
        ValueError: non-positive ``num_heads``, negative ``T``/``S``, non-int ``offset``, a
            non-float ``dtype``, or a bias too large for ``dtype`` (float16 holds distances
            up to ~92 000 at most: larger entries would be ``±inf``).
    """
    return _bias(num_heads, T, S, offset, symmetric, device, dtype)


class ALiBi(nn.Module):
    """ALiBi slopes as a module, so they follow ``.to(device)`` and show up in ``repr``.

    ``slopes`` ``(H,)`` is a non-persistent buffer (a function of ``num_heads``, not saved).
    Calling the module is the same as calling :meth:`bias`.

    Args:
        num_heads: number of heads ``H``.

    Raises:
        ValueError: ``num_heads`` is not a positive int.
    """

    slopes: Tensor

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = _check_heads(num_heads)
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def bias(
        self,
        T: int,
        S: int,
        offset: int | None = None,
        *,
        symmetric: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """The ``(H, T, S)`` bias on the device of ``slopes``; see :func:`alibi_bias`.

        Raises:
            ValueError: negative ``T``/``S``, non-int ``offset``, a bias too large for
                ``dtype`` (see :func:`alibi_bias`).
        """
        # Slopes recomputed exactly: the buffer may have been cast to a lower precision.
        return _bias(self.num_heads, T, S, offset, symmetric, self.slopes.device, dtype)

    def forward(
        self,
        T: int,
        S: int,
        offset: int | None = None,
        *,
        symmetric: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Same as :meth:`bias`."""
        return self.bias(T, S, offset, symmetric=symmetric, dtype=dtype)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
