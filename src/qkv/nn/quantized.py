"""Weight-only quantisation for decoding: ``nn.Linear`` with int8 or int4 weights.

Decoding one token reads every weight once and does two flops per weight, so it is bound by
memory traffic, not arithmetic: fewer bytes per weight is the lever (gpt-fast, llama.cpp).
:func:`quantize_` swaps a model's ``nn.Linear`` modules for

* :class:`Int8Linear`: symmetric int8 per output channel, ``W ≈ q · s`` with ``q`` in
  ``[-127, 127]`` and one float scale ``s`` per row (1 byte per weight, 4x fewer than float32);
* :class:`Int4Linear`: asymmetric 4-bit per group of ``group_size`` input columns,
  ``W ≈ (q - z) · s`` with ``q`` in ``[0, 15]``, two codes per byte (0.5 byte per weight plus
  a scale and zero point per group).

Activations stay in floating point (weight-only). Two kernels compute ``x Wᵀ``, chosen per
call by the module's ``kernel`` field (:data:`KERNELS`):

* ``"packed"``: torch's fused CPU kernels, ``_weight_int8pack_mm`` and
  ``_weight_int4pack_mm_for_cpu``, which read the codes straight from memory. They compute
  in bfloat16 (the activations and the result are rounded to bfloat16, the products summed
  in float32), so a float32 call is exact to bfloat16's unit roundoff ``u = 2^-8``, not
  float32's. They apply only on the CPU, to float32 or bfloat16 inputs without autograd, and
  to shapes the kernels take (int8: ``in % 16 == 0``, which torch does not check: other
  widths crash the process; int4: ``out % 16 == 0`` and ``group_size`` in 32, 64, 128, 256).
* ``"float"``: dequantise one block of rows at a time (``_ROWS`` rows, a few MB that stay in
  cache) into the input's dtype and multiply by it, exact to the input dtype.
* ``"auto"`` (the default): packed for at most :data:`PACKED_ROWS` rows of ``x`` (32 for
  int8, 64 for int4: a decoding step, a short prompt), float above, where the float matmul is
  compute-bound and as fast or faster. The rule depends on the shape, never on a timing, so
  one call gives the same bits on a quiet machine and a loaded one.

``benchmarks/quantize.py --rows`` measures the rule: SmolLM2-135M's forward over M tokens
through each kernel. On one AMD EPYC (2 threads, ``AVX512``; and under
``ATEN_CPU_CAPABILITY=avx2``) the packed kernels were faster up to 64 rows for both widths
(int4-float dequantises every group: 2-6x slower than int4-packed there), level or slower
from 128 (up to 1.7x slower at 512 under AVX2).

Exactness: each module's :meth:`~Int8Linear.dequantized` weight is the float matrix it
multiplies by; tests compare both kernels' forward with ``x @ W_deqᵀ + b`` in float64 (the
packed one within the bfloat16 rounding bound), and the quantised model with the float one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qkv.nn.linear import Linear
from qkv.nn.linear import linear as linear_kernel

__all__ = ["KERNELS", "MODES", "PACKED_ROWS", "Int4Linear", "Int8Linear", "quantize_"]

MODES = ("int8", "int4")
KERNELS = ("auto", "packed", "float")
PACKED_ROWS = {"int8": 32, "int4": 64}  # "auto" packs up to this many rows of x, by mode
_ROWS = 4096  # output rows dequantised at a time: 4096 x 576 float32 is 9 MB
_INT4_GROUPS = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu takes


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

    mode: str  # "int8" or "int4"
    kernel: str = "auto"  # one of KERNELS: how forward multiplies (module docstring)
    packable: bool = False  # the weight's shape is one torch's packed CPU kernel takes

    def _packed(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        """``(M, in) bfloat16 -> (M, out)`` in ``dtype`` through torch's packed CPU kernel."""
        raise NotImplementedError

    def _wants_packed(self, x: Tensor) -> bool:
        """Whether this call takes the packed kernel (``kernel``, shape, device, dtype, grad)."""
        if self.kernel == "float" or not self.packable or x.device.type != "cpu":
            return False
        if x.dtype not in (torch.float32, torch.bfloat16):
            return False
        if x.requires_grad and torch.is_grad_enabled():
            return False  # the packed kernels have no backward
        rows = x.numel() // self.in_features
        return self.kernel == "packed" or rows <= PACKED_ROWS[self.mode]

    def _forward_packed(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, in)
        out = self._packed(x2, x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """``(*, in) -> (*, out)``, as ``nn.Linear``."""
        self._check(x)
        if self._wants_packed(x):
            return self._forward_packed(x)
        parts = []
        for a, b in _rows_blocks(self.out_features):
            w = self._block(a, b, x.dtype, _scratch(b - a, self.in_features, x))
            parts.append(linear_kernel(x, w))  # (*, b - a)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (*, out)
        return out if self.bias is None else out + self.bias.to(x.dtype)


class Int8Linear(_QuantLinear):
    """``nn.Linear`` with int8 weights, one scale per output channel (symmetric).

    Args:
        linear: the float layer to quantise (``(out, in)`` weight, optional bias).

    Buffers: ``qweight (out, in)`` int8, ``scale (out,)`` float32, ``bias (out,)`` or None.
    The packed kernel applies when ``in % 16 == 0``.
    """

    mode = "int8"

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (out, in)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype
        self.packable = self.in_features % 16 == 0 and hasattr(torch, "_weight_int8pack_mm")
        # The packed kernel's per-channel scale is ones: the float32 scale is applied to its
        # output instead (one rounding fewer than a bfloat16 scale), and nothing is derived.
        ones = torch.ones(self.out_features, dtype=torch.bfloat16)
        self.register_buffer("_ones", ones, persistent=False)
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

    def _packed(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        out = torch._weight_int8pack_mm(x2, self.qweight, self._ones.to(torch.bfloat16))
        return out.to(dtype) * self.scale.to(dtype)  # (M, out): x qᵀ, then the row scales

    def forward(self, x: Tensor) -> Tensor:
        """``(*, in) -> (*, out)``: ``(x qᵀ) · s + b``, the per-channel scale applied to the
        output (``out`` multiplications, not ``out · in``)."""
        self._check(x)
        if self._wants_packed(x):
            return self._forward_packed(x)
        parts = [linear_kernel(x, self._codes(a, b, x))
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
    ``bias``. Built on the CPU with ``out % 16 == 0`` and ``group_size`` in 32, 64, 128 or
    256, it also holds the packed kernel's copy of the codes (torch's own tiled layout, which
    depends on the CPU; not saved, made again after ``load_state_dict``) and its bfloat16
    scales and zero points: 0.625 more bytes a weight, for a kernel that reads 0.5.

    Raises:
        ValueError: ``in_features`` not divisible by ``group_size`` (or odd).
    """

    mode = "int4"

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
        self._repack()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._repack())

    def codes(self) -> Tensor:
        """The ``(out, in)`` uint8 codes in ``[0, 15]``, unpacked."""
        p = self.packed  # (N, K/2)
        return torch.stack([p & 15, p >> 4], dim=-1).view(self.out_features, self.in_features)

    def _repack(self) -> None:
        """Make (or drop) the packed kernel's copy of the codes, scales and zero points."""
        self.packable = (self.packed.device.type == "cpu" and self.out_features % 16 == 0
                         and self.group_size in _INT4_GROUPS
                         and hasattr(torch, "_weight_int4pack_mm_for_cpu"))  # fmt: skip
        tiled = sz = None
        if self.packable:
            tiled = torch._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32), 1)
            # torch's convention: W = (q - 8) · scale + zero_point, groups first: (G, N, 2)
            point = (8.0 - self.zero) * self.scale  # (N, G)
            sz = torch.stack([self.scale.t(), point.t()], dim=-1).to(torch.bfloat16)
        self.register_buffer("_tiled", tiled, persistent=False)
        self.register_buffer("_scale_zero", None if sz is None else sz.contiguous(),
                             persistent=False)  # fmt: skip

    def _packed(self, x2: Tensor, dtype: torch.dtype) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(x2, self._tiled, self.group_size,
                                                 self._scale_zero.to(torch.bfloat16)).to(dtype)

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
              skip: Callable[[str, nn.Linear], bool] | None = None,
              kernel: str = "auto", head: str | None = None) -> nn.Module:  # fmt: skip
    """Replace ``model``'s ``nn.Linear`` modules by quantised ones, in place.

    A weight shared by two modules (an ``lm_head`` tied to the embedding) is quantised as the
    head's own copy: the embedding keeps its float table (a lookup reads one row per token).
    The output head (the module named ``lm_head``, as in every qkv decoder) takes ``head``'s
    mode: by default int8 under ``"int4"``, as llama.cpp's Q4 files keep their output table
    at 8 bits. On SmolLM2-135M (``benchmarks/quantize.py``) a 4-bit head cost 4.5% perplexity
    on a held-out text, an 8-bit one 0.0%, for ~15% of int4's decoding speed.

    Args:
        model: any module (e.g. a :class:`qkv.models.DecoderLM`).
        mode: ``"int8"`` or ``"int4"``.
        group_size: int4's group of input columns (32, as llama.cpp's Q4 formats); a layer
            whose width it does not divide stays in float.
        skip: ``(name, linear) -> True`` to keep a layer in float.
        kernel: each new module's ``kernel`` (:data:`KERNELS`; the module docstring): ``"auto"``,
            ``"packed"`` (wherever torch's packed CPU kernel applies) or ``"float"``. It can be
            changed later on any module (``module.kernel = "float"``).
        head: the mode of ``lm_head`` (:data:`MODES`); None: ``"int8"``.

    Returns:
        ``model`` (eval mode; quantised modules do not train).

    Raises:
        ValueError: an unknown ``mode``, ``kernel`` or ``head``.
    """
    if mode not in MODES:
        raise ValueError(f"quantize must be one of {MODES}, got {mode!r}")
    if head is not None and head not in MODES:
        raise ValueError(f"head must be None or one of {MODES}, got {head!r:.80}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r:.80}")
    # (exactly these types: a subclass such as a LoRA-wrapped layer is not a plain linear)
    targets = [(name, m) for name, m in model.named_modules() if type(m) in (nn.Linear, Linear)]
    for name, linear in targets:
        if skip is not None and skip(name, linear):
            continue
        kind = (head or "int8") if name == "lm_head" else mode
        if kind == "int4" and linear.in_features % group_size:
            continue
        new = Int8Linear(linear) if kind == "int8" else Int4Linear(linear, group_size)
        new.kernel = kernel
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model.eval()
