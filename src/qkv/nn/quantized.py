"""Weight-only quantisation for decoding: ``nn.Linear`` with int8 or int4 weights.

Decoding one token reads every weight once and does two flops per weight, so it is bound by
memory traffic, not arithmetic: fewer bytes per weight is the lever (gpt-fast, llama.cpp).
:func:`quantize_` swaps a model's ``nn.Linear`` modules for

* :class:`Int8Linear`: symmetric int8 per output channel, ``W ≈ q · s`` with ``q`` in
  ``[-127, 127]`` and one float scale ``s`` per row (1 byte per weight, 4x fewer than float32);
* :class:`Int4Linear`: asymmetric 4-bit per group of ``group_size`` input columns,
  ``W ≈ (q - z) · s`` with ``q`` in ``[0, 15]``, two codes per byte (0.5 byte per weight plus
  a scale and zero point per group).

Activations stay in floating point (weight-only). The forward dequantises one block of rows
at a time (``_ROWS`` rows: a few MB that stay in cache) and multiplies it at once: on a CPU
this reads the weights as int8 or int4 from memory and was measured ~2.3x faster than float32
for a 1-token step on this project's 2-core machine (``benchmarks/quantize.py``). torch's
fused low-bit CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) were
measured 2.5x and 5x *slower* than float32 there (AVX2, no VNNI), so they are not used.

Exactness: each module's :meth:`~Int8Linear.dequantized` weight is the float matrix it
multiplies by; tests compare the forward with ``x @ W_deqᵀ + b`` in plain torch, and the
quantised model with the float one (logit error, greedy agreement).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MODES", "Int4Linear", "Int8Linear", "quantize_"]

MODES = ("int8", "int4")
_ROWS = 4096  # output rows dequantised at a time: 4096 x 576 float32 is 9 MB


def _rows_blocks(out_features: int) -> list[tuple[int, int]]:
    return [(i, min(out_features, i + _ROWS)) for i in range(0, out_features, _ROWS)]


_SCRATCH: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _scratch(rows: int, cols: int, like: Tensor) -> Tensor | None:
    """A reused ``(rows, cols)`` buffer for one dequantised block, or None while tracing.

    Allocating a fresh block of megabytes at every call goes through the system allocator's
    mmap path (pages zeroed by the kernel each time) and made int8 decoding up to 2x slower,
    depending on the allocator's state; one buffer per dtype and device avoids it. Not for
    concurrent use from several threads.
    """
    if torch.compiler.is_compiling() or like.requires_grad:
        return None
    key = (like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # an ordinary tensor: writable in and out of it
            buf = torch.empty(rows * cols, dtype=like.dtype, device=like.device)
        _SCRATCH[key] = buf
    return buf[: rows * cols].view(rows, cols)


class _QuantLinear(nn.Module):
    """Common forward: ``y = x Wᵀ + b`` with ``W`` dequantised block by block."""

    in_features: int
    out_features: int
    bias: Tensor | None
    weight_dtype: torch.dtype  # the float layer's dtype: what inputs must have

    def _block(self, start: int, stop: int, dtype: torch.dtype,
               out: Tensor | None = None) -> Tensor:  # fmt: skip
        """Rows ``start:stop`` of the dequantised weight (written into ``out`` if given)."""
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The ``(out, in)`` float weight this module multiplies by."""
        return torch.cat([self._block(a, b, dtype) for a, b in _rows_blocks(self.out_features)])

    def _check(self, x: Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: x must end in in_features="
                             f"{self.in_features}, got shape {tuple(x.shape)}")  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        """``(*, in) -> (*, out)``, as ``nn.Linear``."""
        self._check(x)
        parts = []
        for a, b in _rows_blocks(self.out_features):
            w = self._block(a, b, x.dtype, _scratch(b - a, self.in_features, x))
            parts.append(F.linear(x, w))  # (*, b - a)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (*, out)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class Int8Linear(_QuantLinear):
    """``nn.Linear`` with int8 weights, one scale per output channel (symmetric).

    Args:
        linear: the float layer to quantise (``(out, in)`` weight, optional bias).

    Buffers: ``qweight (out, in)`` int8, ``scale (out,)`` float32, ``bias (out,)`` or None.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (out,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def _block(self, start: int, stop: int, dtype: torch.dtype,
               out: Tensor | None = None) -> Tensor:  # fmt: skip
        scale = self.scale[start:stop, None].to(dtype)  # (rows, 1)
        if out is None:
            return self.qweight[start:stop].to(dtype) * scale  # (rows, in)
        return out.copy_(self.qweight[start:stop]).mul_(scale)  # (rows, in)

    def _codes(self, start: int, stop: int, like: Tensor) -> Tensor:
        """Rows ``start:stop`` of the int8 codes as floats (into the scratch buffer)."""
        buf = _scratch(stop - start, self.in_features, like)
        q = self.qweight[start:stop]
        return q.to(like.dtype) if buf is None else buf.copy_(q)

    def forward(self, x: Tensor) -> Tensor:
        """``(*, in) -> (*, out)``: ``(x qᵀ) · s + b``, the per-channel scale applied to the
        output (``out`` multiplications, not ``out · in``)."""
        self._check(x)
        parts = [F.linear(x, self._codes(a, b, x))
                 for a, b in _rows_blocks(self.out_features)]  # fmt: skip
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (*, out)
        out = out * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 per-channel")  # fmt: skip


class Int4Linear(_QuantLinear):
    """``nn.Linear`` with 4-bit weights in groups of ``group_size`` input columns.

    Args:
        linear: the float layer to quantise.
        group_size: input columns sharing a scale and zero point; must divide ``in``.

    Buffers: ``packed (out, in/2)`` uint8 (two codes per byte, low nibble first),
    ``scale (out, in/g)`` and ``zero (out, in/g)`` float32 (``W ≈ (q - zero) · scale``),
    ``bias``.

    Raises:
        ValueError: ``in_features`` not divisible by ``group_size`` (or odd).
    """

    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        K, N = linear.in_features, linear.out_features
        if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2
                or group_size % 2 or K % group_size):  # fmt: skip
            raise ValueError(f"int4 needs an even group_size dividing in_features={K}, got "
                             f"group_size={group_size!r}")  # fmt: skip
        self.in_features, self.out_features, self.group_size = K, N, group_size
        self.weight_dtype = linear.weight.dtype
        w = linear.weight.detach().float().view(N, K // group_size, group_size)  # (N, G, g)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, G)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)  # (N, G)
        zero = -lo / scale  # (N, G): code of the value 0
        q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
        q = q.view(N, K)  # (N, K)
        self.register_buffer("packed", q[:, 0::2] | (q[:, 1::2] << 4))  # (N, K/2)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def _block(self, start: int, stop: int, dtype: torch.dtype,
               out: Tensor | None = None) -> Tensor:  # fmt: skip
        rows, g = stop - start, self.group_size
        p = self.packed[start:stop]  # (rows, K/2)
        if out is None:
            out = torch.empty(rows, self.in_features, dtype=dtype, device=p.device)
        pairs = out.view(rows, -1, 2)  # (rows, K/2, 2): low nibble first
        pairs[..., 0].copy_(p & 15)
        pairs[..., 1].copy_(p >> 4)
        w = out.view(rows, -1, g)  # (rows, G, g)
        w.sub_(self.zero[start:stop, :, None].to(dtype)).mul_(
            self.scale[start:stop, :, None].to(dtype))  # (q - zero) · scale
        return out  # (rows, K)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int4 group_size={self.group_size}")  # fmt: skip


def quantize_(model: nn.Module, mode: str = "int8", *, group_size: int = 32,
              skip: Callable[[str, nn.Linear], bool] | None = None) -> nn.Module:  # fmt: skip
    """Replace ``model``'s ``nn.Linear`` modules by quantised ones, in place.

    A weight shared by two modules (an ``lm_head`` tied to the embedding) is quantised as the
    head's own copy: the embedding keeps its float table (a lookup reads one row per token).

    Args:
        model: any module (e.g. a :class:`qkv.models.DecoderLM`).
        mode: ``"int8"`` or ``"int4"``.
        group_size: int4's group of input columns (32, as llama.cpp's Q4 formats); a layer
            whose width it does not divide stays in float.
        skip: ``(name, linear) -> True`` to keep a layer in float.

    Returns:
        ``model`` (eval mode; quantised modules do not train).

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"quantize must be one of {MODES}, got {mode!r}")
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        if skip is not None and skip(name, linear):
            continue
        if mode == "int4" and linear.in_features % group_size:
            continue
        new = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model.eval()
