"""Rotary position embedding (RoPE, Su et al., 2021) in the rotate-half layout.

RoPE rotates each query and key by an angle proportional to its position, so that
``q_m · k_n`` depends on the positions only through ``m - n``. The head width ``D`` is cut into
``D/2`` pairs, pair ``i`` turning at frequency ``θ_i = base^(-2i/D)``.

Which columns form a pair is a convention. Here pair ``i`` is columns ``(i, i + D/2)`` (the
"rotate-half" layout of GPT-NeoX and Hugging Face Llama), not the interleaved ``(2i, 2i+1)``
of the paper and Meta's original Llama code; checkpoints converted between the two permute
the query and key projection rows. In this layout the rotation is

    rope(x)_p = x · cos(p·θ) + rotate_half(x) · sin(p·θ),    rotate_half([a, b]) = [-b, a]

with ``cos``/``sin`` of width ``D`` made of ``cat(freqs, freqs)``. Angles are computed in
float32 (float64 for float64 inputs) and cast to the input dtype at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_cos_sin", "rotate_half"]


def _check_d_head(d_head: object) -> int:
    if isinstance(d_head, bool) or not isinstance(d_head, int) or d_head < 2 or d_head % 2:
        raise ValueError(f"d_head must be a positive even int for RoPE, got {d_head!r}")
    return d_head


def _check_base(base: object) -> float:
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    return float(base)


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 angles for every lower precision: bf16/fp16 angles at position 1000 are off by
    # whole radians.
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotate_half(x: Tensor) -> Tensor:
    """``[a, b] -> [-b, a]`` on the last dimension (halves ``a``, ``b`` of width ``D/2``).

    Args:
        x: ``(..., D)`` with ``D`` even.

    Returns:
        ``(..., D)``.

    Raises:
        ValueError: odd last dimension.
    """
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotate_half needs an even last dimension, got shape {tuple(x.shape)}")
    a, b = x[..., : D // 2], x[..., D // 2 :]  # (..., D/2) each
    return torch.cat((-b, a), dim=-1)  # (..., D)


def rotary_cos_sin(
    positions: Tensor,
    d_head: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """The ``cos`` and ``sin`` tables for the given positions, rotate-half layout.

    Args:
        positions: integer (or float) positions of any shape ``P`` (e.g. ``(T,)``, ``(B, T)``);
            negative values are allowed.
        d_head: head width ``D`` (even).
        base: frequency base (10000 in the paper; Llama 3 uses 500000).
        dtype: dtype of the returned tables; angles use float32, or float64 when ``dtype`` is
            float64.
        device: where to build them (defaults to the device of ``positions``).

    Returns:
        ``(cos, sin)``, each ``P + (D,)``, with ``cos[..., i] = cos[..., i + D/2] =
        cos(p · base^(-2i/D))``.

    Raises:
        TypeError: ``positions`` is not a tensor.
        ValueError: odd or non-positive ``d_head``, ``base <= 0``.
    """
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a Tensor, got {type(positions).__name__}")
    d_head = _check_d_head(d_head)
    base = _check_base(base)
    device = positions.device if device is None else device
    work = _angle_dtype(dtype)
    # The inverse frequencies in float64, rounded once to the working precision.
    even = torch.arange(0, d_head, 2, dtype=torch.float64, device=device)  # (D/2,)
    inv_freq = (base ** (-even / d_head)).to(work)  # (D/2,)
    freqs = positions.to(device=device, dtype=work)[..., None] * inv_freq  # (P..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P..., D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` by the angles in ``cos``/``sin``: ``x·cos + rotate_half(x)·sin``.

    Args:
        x: ``(..., T, D)``, e.g. queries or keys ``(B, H, T, D)``.
        cos: ``(..., T, D)`` broadcastable to ``x`` (from :func:`rotary_cos_sin`).
        sin: same shape as ``cos``.

    Returns:
        ``(..., T, D)`` in the dtype of ``x``.

    Raises:
        ValueError: the last dimensions differ, or ``cos`` and ``sin`` shapes differ.
    """
    if cos.shape != sin.shape or cos.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"cos and sin must share a shape ending in D={x.shape[-1]}, got cos "
            f"{tuple(cos.shape)} and sin {tuple(sin.shape)}"
        )
    return (x * cos + rotate_half(x) * sin).to(x.dtype)  # (..., T, D)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries or keys ``(B, H, T, D)``; a module so caches follow the device.

    The cos/sin tables for positions ``0 .. max_len - 1`` are float32 non-persistent buffers
    ``cos_cached`` and ``sin_cached`` ``(max_len, D)``, rebuilt larger when an input goes
    beyond them (and in float32 again if the module was cast to another dtype).

    Args:
        d_head: head width ``D``, even.
        base: frequency base.
        max_len: positions computed up front.

    Raises:
        ValueError: odd ``d_head``, ``base <= 0``, or ``max_len < 1``.
    """

    cos_cached: Tensor
    sin_cached: Tensor

    def __init__(self, d_head: int, *, base: float = 10000.0, max_len: int = 2048) -> None:
        super().__init__()
        self.d_head = _check_d_head(d_head)
        self.base = _check_base(base)
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        cos, sin = self._build(max_len, None)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def _build(self, n: int, device: torch.device | None) -> tuple[Tensor, Tensor]:
        positions = torch.arange(n, device=device)  # (n,)
        return rotary_cos_sin(positions, self.d_head, self.base, torch.float32)  # (n, D) each

    def _tables(self, offset: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Float32 ``(T, D)`` cos/sin for positions ``offset .. offset + T - 1``."""
        n = self.cos_cached.shape[0]
        stale = self.cos_cached.dtype != torch.float32 or self.cos_cached.device != device
        if stale or offset + T > n:
            # Grow geometrically so a decoding loop does not rebuild at every step.
            n = max(offset + T, 2 * n) if offset + T > n else n
            self.cos_cached, self.sin_cached = self._build(n, device)
        return self.cos_cached[offset : offset + T], self.sin_cached[offset : offset + T]

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """Rotate queries or keys by their positions.

        Args:
            x: ``(B, H, T, D)`` (any leading dimensions when ``positions`` is ``None`` or 1-D).
            offset: position of the first token (the cache length when decoding).
            positions: optional integer positions ``(T,)`` or ``(B, T)``; when given it
                overrides ``offset`` (left-padded batches, packed sequences).

        Returns:
            ``(B, H, T, D)``, same dtype as ``x``.

        Raises:
            TypeError: ``x`` or ``positions`` of the wrong type.
            ValueError: ``x`` not ``(..., T, D)`` with ``D == d_head``, negative ``offset``,
                or ``positions`` whose shape does not match ``(B, T)`` / ``(T,)``.
        """
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point Tensor, got {x!r:.80}")
        if x.dim() < 2 or x.shape[-1] != self.d_head:
            raise ValueError(f"x must have shape (B, H, T, D={self.d_head}), got {tuple(x.shape)}")
        T = x.shape[-2]
        if positions is not None:
            cos, sin = self._from_positions(x, positions)
        else:
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"offset must be a non-negative int, got {offset!r}")
            if x.dtype == torch.float64:
                pos = torch.arange(offset, offset + T, device=x.device)  # (T,)
                cos, sin = rotary_cos_sin(pos, self.d_head, self.base, torch.float64)
            else:
                cos, sin = self._tables(offset, T, x.device)  # (T, D) each
        # Multiply in the angle precision, then round once to x's dtype.
        work = x.to(cos.dtype)
        return apply_rotary(work, cos, sin).to(x.dtype)  # (B, H, T, D)

    def _from_positions(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        if not isinstance(positions, Tensor) or positions.is_floating_point() or (
            positions.dtype == torch.bool or positions.is_complex()
        ):
            raise TypeError(f"positions must be an integer tensor, got {positions!r:.80}")
        T = x.shape[-2]
        ok = positions.dim() == 1 and positions.shape[0] == T
        if positions.dim() == 2:
            ok = x.dim() == 4 and positions.shape[1] == T and positions.shape[0] in (1, x.shape[0])
        if not ok:
            raise ValueError(
                f"positions must have shape (T,) or (B, T) matching x {tuple(x.shape)} "
                f"(B, H, T, D), got {tuple(positions.shape)}"
            )
        work = _angle_dtype(x.dtype)
        cos, sin = rotary_cos_sin(positions, self.d_head, self.base, work, x.device)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D): shared by every head
        return cos, sin

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, base={self.base:g}, max_len={self.cos_cached.shape[0]}"
