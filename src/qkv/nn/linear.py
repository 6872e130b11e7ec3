"""``Linear``: ``nn.Linear`` whose inference matmuls of several rows run on oneDNN on a CPU.

A float32 ``F.linear`` on a CPU goes to MKL's GEMM. On an AMD EPYC (AVX-512, 2 threads) that
reached 178-198 GFLOPS on SmolLM2-135M's shapes at 512 rows, where oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, the kernel inductor's CPU backend calls for frozen
linear layers, here on the plain weight) reached 418-434: a prompt's forward pass is bound
by these matmuls. :class:`Linear` is ``nn.Linear`` (same parameters, ``state_dict``, ``repr``
and ``isinstance``) whose forward takes that kernel where :func:`uses_onednn` says so:

* the input and weight are float32 CPU tensors with ``K >= 1`` features and at least
  :data:`MIN_ROWS` rows (a prompt: compute-bound), or one row (a decoding step's GEMV) on
  an x86 CPU not made by Intel (:data:`ONE_ROW`): MKL picks its kernels by the CPU's vendor,
  and on the AMD EPYC its one-row GEMV read SmolLM2's matrices at 15.6 GB/s against
  oneDNN's 27.1-27.6 (eager float32 decoding 28 -> 44 tokens/s); on an Intel Xeon MKL's read
  28.7 GB/s, the bus's limit there, at 1.9 µs a call against oneDNN's ~12.5, so one row stays
  on MKL (a compiled step generates its own GEMV, see :mod:`qkv.generate.gemv_pass`);
* no gradient is wanted (the oneDNN op has no backward: training runs ``F.linear``);
* the call is not being traced (inductor chooses its own kernels) and :data:`KERNEL` is
  ``"auto"``; ``"blas"`` sends every call to ``F.linear`` (for comparison), ``"onednn"``
  takes oneDNN for every eligible call, one row included.

Both kernels compute the same products in float32 in different orders: they agree within a
dot product's rounding (``~K·eps·|x|·|w|``), tested against a float64 reference.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["KERNEL", "KERNELS", "MIN_ROWS", "ONE_ROW", "Linear", "linear", "uses_onednn"]

KERNELS = ("auto", "blas", "onednn")
KERNEL = "auto"  # which kernel Linear's inference calls take (see the module docstring)
MIN_ROWS = 2  # "auto": calls with at least this many rows (tokens) take oneDNN


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                             "_linear_pointwise")  # fmt: skip


_ONEDNN = _available()


def _intel_or_not_x86() -> bool:
    """Whether this CPU is an Intel one or not x86 at all (where MKL's one-row GEMV keeps up):
    the vendor the kernel reports, the string MKL's dispatch reads."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return True  # unknown: keep MKL


ONE_ROW = not _intel_or_not_x86()  # "auto": one-row calls take oneDNN too (see above)


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether ``Linear`` computes ``x (..., K) @ weight (N, K)ᵀ + bias (N,)`` with oneDNN
    (see the module docstring).

    Raises:
        ValueError: :data:`KERNEL` not one of :data:`KERNELS`.
    """
    if KERNEL not in KERNELS:
        raise ValueError(f"qkv.nn.linear.KERNEL must be one of {KERNELS}, got {KERNEL!r}")
    if KERNEL == "blas" or not _ONEDNN or torch.compiler.is_compiling():
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if x.dim() == 0 or x.shape[-1] == 0 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return False  # (a shape F.linear refuses gets its message)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return False
    rows = x.numel() // x.shape[-1]
    return KERNEL == "onednn" or rows >= MIN_ROWS or (rows == 1 and ONE_ROW)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x (..., K), weight (N, K), bias (N,)) -> (..., N)`` on the kernel
    :func:`uses_onednn` names (also the quantised linears' dequantised blocks)."""
    if uses_onednn(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (``y = x Wᵀ + b``: ``x (..., in_features) -> (..., out_features)``)
    whose inference calls of several rows run on oneDNN on a CPU (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
