"""Absolute positional encodings added to the token embeddings: sinusoidal and learned.

Sinusoidal (Vaswani et al., 2017, section 3.5), for position ``p`` and column pair ``i``:

    PE[p, 2i]     = sin(p / base^(2i/E))
    PE[p, 2i + 1] = cos(p / base^(2i/E))

so each pair of columns is a clock with wavelength ``2π·base^(2i/E)``, and ``PE[p + k]`` is a
fixed linear function (a rotation per pair) of ``PE[p]``. Learned positions (GPT-2, BERT) are
one trained vector per position, so they cannot go beyond ``max_len``.

Relative schemes that act on queries and keys instead live in :mod:`qkv.nn.rope` and
:mod:`qkv.nn.alibi`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.checks import values_unknown

__all__ = ["LearnedPositionalEmbedding", "SinusoidalPositionalEncoding", "sinusoidal_table"]


def _check_size(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    return float(base)


def _check_x(x: object, d_model: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape (B, T, E={d_model}), got {tuple(x.shape)}")
    return x


def _sinusoid(positions: Tensor, d_model: int, base: float) -> Tensor:
    """Rows of the sinusoidal table for the given float64 ``positions`` ``(N,)`` -> ``(N, E)``."""
    even = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)  # 2i
    inv_freq = base ** (-even / d_model)  # (ceil(E/2),)  1 / base^(2i/E)
    angles = positions[:, None] * inv_freq[None, :]  # (N, ceil(E/2))
    table = torch.empty(positions.shape[0], d_model, dtype=torch.float64, device=positions.device)
    table[:, 0::2] = torch.sin(angles)
    # With odd E the last column is a sine with no cosine partner.
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table


def sinusoidal_table(
    max_len: int,
    d_model: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The sinusoidal table of Vaswani et al. (2017) for positions ``0 .. max_len - 1``.

    Computed in float64 and rounded once to ``dtype``.

    Args:
        max_len: number of positions (rows), ``>= 0``.
        d_model: model width ``E`` (columns), ``>= 1``; odd widths end with a sine column.
        base: the wavelength base (10000 in the paper).
        dtype: dtype of the result.
        device: where to build the table.

    Returns:
        ``(max_len, E)`` with ``PE[p, 2i] = sin(p / base^(2i/E))`` and
        ``PE[p, 2i+1] = cos(p / base^(2i/E))``.

    Raises:
        ValueError: a non-int or too small ``max_len``/``d_model``, or ``base <= 0``.
    """
    _check_size("max_len", max_len, minimum=0)
    _check_size("d_model", d_model, minimum=1)
    base = _check_base(base)
    positions = torch.arange(max_len, dtype=torch.float64, device=device)  # (max_len,)
    return _sinusoid(positions, d_model, base).to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal table to embeddings; the table grows when a longer input comes.

    The table is a non-persistent buffer named ``pe`` (``(max_len, E)``): it follows
    ``.to(device)`` but is not saved in the ``state_dict``, since it is a function of the
    constructor arguments. Dropout, if any, belongs to the caller (it is applied to the sum).

    Args:
        d_model: model width ``E``.
        max_len: rows computed up front; longer inputs grow the table (to at least twice).
        base: the wavelength base (10000 in the paper).

    Raises:
        ValueError: bad ``d_model``, ``max_len`` or ``base``.
    """

    pe: Tensor

    def __init__(self, d_model: int, max_len: int = 5000, *, base: float = 10000.0) -> None:
        super().__init__()
        self.d_model = _check_size("d_model", d_model, minimum=1)
        _check_size("max_len", max_len, minimum=1)
        self.base = _check_base(base)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model, base=base), persistent=False)

    @property
    def max_len(self) -> int:
        """Number of rows currently held (grows on demand)."""
        return self.pe.shape[0]

    def table(
        self, T: int, offset: int = 0, *, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Rows ``offset .. offset + T - 1`` of the table, ``(T, E)``, in ``dtype``.

        Float64 requests are computed afresh in float64 (the buffer holds float32 values,
        even after ``module.double()`` casts it), so double precision inputs get double
        precision positions.

        Raises:
            ValueError: negative or non-int ``T`` or ``offset``.
        """
        _check_size("T", T, minimum=0)
        _check_size("offset", offset, minimum=0)
        dtype = self.pe.dtype if dtype is None else dtype
        if dtype == torch.float64:
            positions = torch.arange(offset, offset + T, dtype=torch.float64, device=self.pe.device)
            return _sinusoid(positions, self.d_model, self.base)  # (T, E)
        if offset + T > self.max_len:
            # Grow geometrically so a decoding loop does not rebuild the table at every step.
            new_len = max(offset + T, 2 * self.max_len)
            self.pe = sinusoidal_table(
                new_len, self.d_model, base=self.base, dtype=self.pe.dtype, device=self.pe.device
            )
        return self.pe[offset : offset + T].to(dtype)  # (T, E)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """Return ``x + PE[offset : offset + T]``.

        Args:
            x: embeddings ``(B, T, E)`` (any leading dimensions).
            offset: position of the first token (the cache length when decoding).

        Returns:
            ``(B, T, E)``, same dtype as ``x``.

        Raises:
            TypeError: ``x`` is not a tensor.
            ValueError: ``x`` is not ``(..., T, E)`` with ``E == d_model``; negative ``offset``.
        """
        x = _check_x(x, self.d_model)
        return x + self.table(x.shape[-2], offset, dtype=x.dtype)  # (B, T, E)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, base={self.base:g}"


class LearnedPositionalEmbedding(nn.Module):
    """One trained vector per position (GPT-2's ``wpe``, BERT's ``position_embeddings``).

    The table is the parameter ``weight`` ``(max_len, E)``, so inside a model attribute ``wpe``
    its ``state_dict`` key is ``wpe.weight``, the same as an ``nn.Embedding`` there.
    Initialised from ``N(0, 0.02²)`` as in GPT-2 and BERT.

    Args:
        max_len: number of positions; inputs may not go beyond it.
        d_model: model width ``E``.

    Raises:
        ValueError: bad ``max_len`` or ``d_model``.
    """

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.max_len = _check_size("max_len", max_len, minimum=1)
        self.d_model = _check_size("d_model", d_model, minimum=1)
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Return ``x + weight[offset : offset + T]``, or ``x + weight[positions]``.

        Args:
            x: embeddings ``(B, T, E)``.
            offset: position of the first token (the cache length when decoding).
            positions: optional integer ``(B, T)`` or ``(T,)`` positions, e.g. for left-padded
                batches; when given it overrides ``offset``.

        Returns:
            ``(B, T, E)``.

        Raises:
            TypeError: ``x`` is not a tensor, or ``positions`` is not an integer tensor.
            ValueError: wrong shapes, a negative ``offset``, or positions at or beyond
                ``max_len`` (learned tables cannot extrapolate).
        """
        x = _check_x(x, self.d_model)
        T = x.shape[-2]
        if positions is None:
            _check_size("offset", offset, minimum=0)
            if offset + T > self.max_len:
                raise ValueError(
                    f"positions {offset}..{offset + T - 1} (offset={offset}, T={T}) go beyond "
                    f"max_len={self.max_len} of the learned position table"
                )
            return x + self.weight[offset : offset + T]  # (B, T, E)
        if not isinstance(positions, Tensor) or positions.is_floating_point() or (
            positions.dtype == torch.bool or positions.is_complex()
        ):
            raise TypeError(f"positions must be an integer tensor, got {positions!r:.80}")
        if positions.dim() not in (1, 2) or positions.shape[-1] != T:
            raise ValueError(
                f"positions must have shape (B, T) or (T,) with T={T}, got {tuple(positions.shape)}"
            )
        if positions.numel() > 0 and not values_unknown(positions):
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= self.max_len:
                raise ValueError(
                    f"positions must lie in [0, max_len={self.max_len}), got values in "
                    f"[{lo}, {hi}]"
                )
        return x + self.weight[positions]  # (B, T, E)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"
