"""The ``triton`` backend: qkv's blockwise attention as Triton GPU kernels
(:mod:`qkv.attention.triton.kernels`), forward and backward.

It honours what the ``flash`` backend honours, on CUDA tensors in float32, bfloat16 and
float16: every mask part computed or read per tile (causal in both alignments, sliding windows,
ALiBi, boolean and float user masks through their broadcast strides), grouped-query attention
without repeating K or V, dropout as :mod:`qkv.attention.dropout` defines it (the same seed
drops the same weights as every backend; on a GPU the kernels compute the mask from a seed, so
no ``(B, H, T, S)`` tensor exists), the log-sum-exp out (differentiable), weights rebuilt
exactly from it (:func:`qkv.attention.weights.rebuild`), and the rules of the backend contract:
zero output and gradients for a row with no visible key, NaN for a non-finite query row, empty
batches. Decoding (``G·T`` packed rows in one tile) splits the keys across programs and merges
the splits by log-sum-exp (flash-decoding).

On CPU tensors it runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter, for the test
suite), and ``auto`` never picks it there. Under ``torch.compile`` or ``torch.func``
transforms it declines, and ``auto`` moves on.

Precision: scores and sums in float32; half-precision probabilities are rounded to the input
dtype before the ``P·V`` product, as FlashAttention and torch's CUDA kernels do; float32 inputs
multiply in full float32 (``"ieee"``) unless ``torch.backends.cuda.matmul.allow_tf32`` is set.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from qkv.attention import dropout
from qkv.attention.call import AttentionCall
from qkv.attention.masks import dropout_keep, safe_lse
from qkv.attention.triton import installed, interpreting
from qkv.checks import values_unknown

NAME = "triton"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_WIDTH = 256


def why_not(call: AttentionCall) -> str | None:
    """Reasons the triton backend cannot honour ``call``, or ``None``."""
    q = call.query
    if not q.is_cuda and not (q.is_cpu and interpreting()):
        return f"runs on CUDA tensors (got {q.device.type}; TRITON_INTERPRET=1 runs it on CPU)"
    if values_unknown(q):  # before the import check: a trace must not reach an import
        return "tracing (torch.compile, export or the meta device): the kernels run eagerly"
    if not installed():
        return "the triton package is not installed (pip install triton)"
    if q.dtype not in _DTYPES:
        return f"computes float32, bfloat16 and float16, not {q.dtype}"
    if max(q.shape[-1], call.value.shape[-1]) > MAX_HEAD_WIDTH:
        return f"head width above {MAX_HEAD_WIDTH}"
    if call.T == 0 or call.S == 0:
        return "empty sequence (T or S is 0)"
    if call.need_weights and call.dropout_p > 0.0:
        return "weights after dropout cannot be rebuilt from the log-sum-exp"
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if wrapped(q) or wrapped(call.key) or wrapped(call.value) or (
            call.mask is not None and wrapped(call.mask)):
        return "torch.func transforms (vmap, grad) do not reach into Triton kernels"
    return None


def prefer_not(call: AttentionCall) -> str | None:
    """Why ``auto`` leaves a call it could run to the next backend, or ``None``."""
    if call.query.is_cpu:
        return "interpreted on the CPU (TRITON_INTERPRET=1): for testing, not speed"
    return None


class _Spec(NamedTuple):
    """What a launch needs besides the tensors (a tuple: built on every call, in 0.3 us where
    a frozen dataclass takes 1)."""

    scale: float
    causal: int | None
    window: int | None
    alibi_shift: int
    dropout_p: float


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` and, when asked, exact weights ``(B, H, T, S)``."""
    out, weights, _ = run_lse(call)
    return out, weights


def run_lse(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run` plus the log-sum-exp ``(B, H, T)`` in float32 (``-inf`` on dead rows),
    differentiable like the output."""
    out, lse = attend(call)  # the kernel itself gives a non-finite query row a NaN output
    weights = None
    if call.need_weights:
        from qkv.attention.weights import rebuild

        weights = rebuild(call, lse)
    return out, weights, lse


def attend(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv), lse (B, H, T) float32)`` of ``call``, autograd-aware."""
    q, k, v = call.query, call.key, call.value
    if q.shape[0] == 0:
        from qkv.attention.backends.flash import empty_result

        out, lse = empty_result(call)
        return out, lse.float()
    keep = None
    if call.dropout_p > 0.0:  # on a GPU a seed: the kernels compute the mask (no (B,H,T,S))
        keep = (dropout.dropout_state(call.dropout_p, q.device)
                if dropout.counter_based(q.device) else dropout_keep(call))
    spec = _Spec(
        scale=call.scale, causal=call.causal, window=call.window,
        alibi_shift=call.alibi_shift, dropout_p=call.dropout_p,
    )
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _TritonFunction.apply(q, k, v, call.mask, call.alibi, keep, spec)
    return _launches().forward(q, k, v, call.mask, call.alibi, keep, spec)


def _launches():
    """:mod:`qkv.attention.triton.launch`, imported at the first call (it imports triton),
    and from then on read from here (an import statement costs ~0.5 µs a call)."""
    global _LAUNCHES
    if _LAUNCHES is None:
        from qkv.attention.triton import launch as triton_launch

        _LAUNCHES = triton_launch
    return _LAUNCHES


_LAUNCHES = None


class _TritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, alibi, keep, spec):
        out, lse = _launches().forward(q, k, v, mask, alibi, keep, spec)
        ctx.save_for_backward(q, k, v, out, lse, mask, alibi, keep)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask, alibi, keep = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _launches().backward(q, k, v, out, safe_lse(lse), dout, dlse, mask,
                                          alibi, keep, ctx.spec)
        return dq, dk, dv, None, None, None, None
