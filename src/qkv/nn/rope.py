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

:class:`RotaryEmbedding` also takes two options of today's checkpoints: ``scaling`` (a
:class:`~qkv.nn.rope_scaling.RopeScaling`: Llama 3's, linear, dynamic NTK or YaRN frequencies)
and ``rotary_dim`` (partial rotary: only the first ``rotary_dim`` columns of each head turn, in
the rotate-half layout within them; the rest pass through, as in GPT-NeoX, Phi).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.nn.rope_scaling import RopeScaling, inverse_frequencies

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
    return _rotate(x, cos, sin).to(x.dtype)  # (..., T, D)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rotary` without its checks (callers have checked): ``x·cos +
    rotate_half(x)·sin`` as ``addcmul`` over the two halves."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]  # (..., T, D/2) each
    rotated = torch.cat((-b, a), dim=-1)  # (..., T, D)
    return torch.addcmul(x * cos, rotated, sin)  # (..., T, D)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries or keys ``(B, H, T, D)``; a module so caches follow the device.

    The cos/sin tables for positions ``0 .. max_len - 1`` are float32 non-persistent buffers
    ``cos_cached`` and ``sin_cached`` ``(max_len, rotary_dim)``, rebuilt larger when an input
    goes beyond them (and in float32 again if the module was cast to another dtype). With
    ``dynamic`` scaling, a call reaching past ``original_max_len`` computes its own tables
    from the frequencies of its length ``max(position) + 1``.

    Args:
        d_head: head width ``D``.
        base: frequency base.
        max_len: positions computed up front.
        scaling: None (plain RoPE) or a :class:`~qkv.nn.rope_scaling.RopeScaling`.
        rotary_dim: columns rotated (even, at most ``D``; default ``D``); the others pass
            through unchanged (partial rotary).

    Raises:
        ValueError: ``d_head`` not a positive int, ``rotary_dim`` odd or outside
            ``[2, d_head]`` (``d_head`` odd without ``rotary_dim``), ``base <= 0``,
            ``max_len < 1``.
        TypeError: ``scaling`` that is not a ``RopeScaling``.
    """

    cos_cached: Tensor
    sin_cached: Tensor

    def __init__(
        self,
        d_head: int,
        *,
        base: float = 10000.0,
        max_len: int = 2048,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(d_head, bool) or not isinstance(d_head, int) or d_head < 1:
            raise ValueError(f"d_head must be a positive int, got {d_head!r}")
        self.d_head = d_head
        if rotary_dim is None:
            self.rotary_dim = _check_d_head(d_head)
        elif not (isinstance(rotary_dim, int) and not isinstance(rotary_dim, bool)
                  and 2 <= rotary_dim <= d_head and rotary_dim % 2 == 0):  # fmt: skip
            raise ValueError(
                f"rotary_dim must be None or an even int in [2, d_head={d_head}], got "
                f"{rotary_dim!r}"
            )
        else:
            self.rotary_dim = rotary_dim
        self.base = _check_base(base)
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling must be a RopeScaling or None, got {type(scaling).__name__}")
        self.scaling = scaling
        cos, sin = self._build(max_len, None)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)
        self._qkv_last: tuple | None = None  # ((offset, T, device, table), (cos, sin)) of _tables

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype, length: int | None = None,
                 device: torch.device | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(cos, sin)`` of shape ``P + (rotary_dim,)`` for positions of shape ``P``."""
        device = positions.device if device is None else device
        work = _angle_dtype(dtype)
        inv_freq = inverse_frequencies(self.rotary_dim, self.base, self.scaling, length)
        inv_freq = inv_freq.to(device=device, dtype=work)  # (d/2,), rounded once
        freqs = positions.to(device=device, dtype=work)[..., None] * inv_freq  # (P..., d/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P..., d)
        factor = 1.0 if self.scaling is None else self.scaling.cos_sin_factor
        cos, sin = emb.cos(), emb.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.to(dtype), sin.to(dtype)

    def _build(self, n: int, device: torch.device | None) -> tuple[Tensor, Tensor]:
        positions = torch.arange(n, device=device)  # (n,)
        return self._cos_sin(positions, torch.float32)  # (n, d) each

    def _tables(self, offset: int, T: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Float32 ``(T, d)`` cos/sin for positions ``offset .. offset + T - 1``.

        The last slice is remembered: a decoding step asks for the same ``(offset, T)`` once
        for the queries and once for the keys of every layer (one module serves them all)."""
        tracing = torch.compiler.is_compiling()  # a trace keeps no Python-side memo
        key = None if tracing else (offset, T, device, self.cos_cached.data_ptr())
        if key is not None and self._qkv_last is not None and self._qkv_last[0] == key:
            return self._qkv_last[1]
        n = self.cos_cached.shape[0]
        stale = self.cos_cached.dtype != torch.float32 or self.cos_cached.device != device
        if stale or offset + T > n:
            # Grow geometrically so a decoding loop does not rebuild at every step.
            n = max(offset + T, 2 * n) if offset + T > n else n
            self.cos_cached, self.sin_cached = self._build(n, device)
        tables = self.cos_cached[offset : offset + T], self.sin_cached[offset : offset + T]
        if not tracing:
            self._qkv_last = ((offset, T, device, self.cos_cached.data_ptr()), tables)
        return tables

    def _scaled_length(self, length: int) -> int | None:
        """The length the frequencies depend on (dynamic scaling past its training length),
        or None when the fixed tables apply."""
        s = self.scaling
        if s is None or not s.depends_on_length():
            return None
        assert s.original_max_len is not None
        return length if length > s.original_max_len else None

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
            length = self._scaled_length(offset + T)
            if x.dtype == torch.float64 or length is not None:
                pos = torch.arange(offset, offset + T, device=x.device)  # (T,)
                cos, sin = self._cos_sin(pos, _angle_dtype(x.dtype), length)  # (T, d) each
            else:
                cos, sin = self._tables(offset, T, x.device)  # (T, d) each
        # Multiply in the angle precision, then round once to x's dtype.
        r = self.rotary_dim
        work = x.to(cos.dtype)
        if r == self.d_head:
            return _rotate(work, cos, sin).to(x.dtype)  # (B, H, T, D)
        turned = _rotate(work[..., :r], cos, sin)  # (B, H, T, d)
        return torch.cat((turned, work[..., r:]), dim=-1).to(x.dtype)  # (B, H, T, D)

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
        length = None
        if self.scaling is not None and self.scaling.depends_on_length() and positions.numel():
            length = self._scaled_length(int(positions.max()) + 1)
        cos, sin = self._cos_sin(positions, _angle_dtype(x.dtype), length, x.device)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, d): shared by every head
        return cos, sin

    def extra_repr(self) -> str:
        parts = [f"d_head={self.d_head}", f"base={self.base:g}",
                 f"max_len={self.cos_cached.shape[0]}"]  # fmt: skip
        if self.rotary_dim != self.d_head:
            parts.append(f"rotary_dim={self.rotary_dim}")
        if self.scaling is not None:
            parts.append(f"scaling={self.scaling.kind!r}")
        return ", ".join(parts)
