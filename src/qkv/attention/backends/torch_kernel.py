"""The fused backend: ``torch.nn.functional.scaled_dot_product_attention``.

On CPU torch picks its flash-attention kernel (blockwise, O(T) memory) when it can, else its
math kernel. It never returns weights. Structured masks (a causal diagonal other than
top-left, sliding windows, ALiBi) are materialised into a dense ``(T, S)`` mask first.
Grouped-query attention without a mask on the CPU folds the query heads of a group into the
query length, so K and V are not repeated; with a mask, or on a GPU, it uses torch's own
``enable_gqa``. A row with no visible key gets zeros on every device (torch's CUDA kernels do
not zero it themselves).

Precision: torch's kernels accumulate half-precision inputs in float32. On CPU a float mask
(ALiBi, a float user mask) is passed in float32 too, which torch's CPU kernels accept for
half-precision queries; elsewhere it would be rounded to the query's dtype, the one float mask
dtype torch's GPU kernels take, so ``auto`` leaves such calls to a backend that adds it in
float32 (``triton`` or ``flash``); named explicitly, ``torch`` rounds it.

Non-finite inputs: without a mask torch's CPU kernel turns a NaN query row into a zero row
(with one it gives NaN), so every output is passed through
:func:`~qkv.attention.masks.poison_rows`, which marks such rows NaN on any device and
version: one reduction over ``q`` and one add over the output, no host sync.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.call import AttentionCall
from qkv.attention.masks import (
    accumulation_dtype,
    dead_rows,
    dense_mask,
    poison_rows,
    to_additive,
)

NAME = "torch"

# torch >= 2.5 gives rows with no visible key zero outputs and zero gradients itself (its
# "safe softmax"); older versions give NaN, so the rows are opened up and zeroed here.
NATIVE_DEAD_ROWS = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


# torch's CPU flash kernel, which also returns the log-sum-exp the weights are rebuilt from,
# and its backward, which takes the output and log-sum-exp (so given a whole row's statistics
# it returns one key block's share: flex spans and ring blocks use it). None where missing.
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CPU_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def why_not(call: AttentionCall) -> str | None:
    """Reasons torch's kernel cannot honour ``call``, or ``None``."""
    if call.T == 0 or call.S == 0:
        return "empty sequence (T or S is 0)"
    if call.need_weights:
        if not call.query.is_cpu or CPU_FLASH is None or not NATIVE_DEAD_ROWS:
            return "the fused kernel does not return attention weights"
        if call.dropout_p > 0.0:
            return "weights after dropout cannot be rebuilt from the log-sum-exp"
        if call.value.shape[-1] != call.query.shape[-1]:
            return "torch's CPU kernel returns the log-sum-exp only when Dv == D"
        if call.groups > 1 and not call.plain:
            return "weights of grouped-query heads under a mask are rebuilt by flash"
    if call.need_lse:
        return _why_not_lse(call)
    return None


def _why_not_lse(call: AttentionCall) -> str | None:
    """Why torch's CPU flash kernel cannot give this call's log-sum-exp, or ``None``."""
    if not call.query.is_cpu or CPU_FLASH is None or not NATIVE_DEAD_ROWS:
        return "only torch's CPU flash kernel returns the log-sum-exp"
    if call.dropout_p > 0.0:
        return "torch's CPU flash kernel (the one returning the log-sum-exp) has no dropout"
    if call.value.shape[-1] != call.query.shape[-1]:
        return "torch's CPU kernel returns the log-sum-exp only when Dv == D"
    if call.groups > 1 and not call.plain:
        return "the log-sum-exp of grouped-query heads under a mask comes from flash"
    return None


def prefer_not(call: AttentionCall) -> str | None:
    """Why ``auto`` should leave a call it could run to another backend, or ``None``."""
    parts = []
    if call.alibi is not None:
        parts.append("ALiBi")
    if call.window is not None:
        parts.append("a sliding window")
    if call.causal not in (None, 0):
        parts.append("a causal offset")
    if call.need_lse and torch.is_grad_enabled() and any(
        t.requires_grad for t in (call.query, call.key, call.value)
    ):
        # torch's kernel gives its lse no gradient; flash's lse differentiates.
        return "torch's log-sum-exp carries no gradient; flash's does"
    if parts:
        return (
            f"{' and '.join(parts)} would be materialised as a dense (T, S) mask; "
            "flash computes them per tile"
        )
    if _rounds_mask(call):
        return (
            f"torch's GPU kernels take a float mask only in the query's "
            f"dtype: the {call.mask.dtype} mask would be rounded to {call.query.dtype}"
        )
    half = call.query.dtype in (torch.float16, torch.bfloat16)
    if half and call.query.is_cpu and not half_precision_units():
        # Measured (qkv/bench/suite.py, 2-core AVX2 CPU): torch's half-precision CPU backward
        # is ~4x slower than flash's, and its one-query decode ~1.6x slower up to S = 8192.
        # With AVX-512 (bf16, fp16) and AMX units torch's kernel wins everywhere instead:
        # on a 2-core AVX-512 + AMX CPU, bf16 decode at S = 4096 took 0.34 ms against
        # flash's 4.8, and forward + backward at T = 1024 22 ms against 54.
        grads = torch.is_grad_enabled() and any(
            t.requires_grad for t in (call.query, call.key, call.value)
        )
        if grads:
            return "torch's half-precision backward on CPU is slower than flash's"
        if call.T <= 16 and call.S <= 8192:
            return "torch's half-precision decoding on CPU is slower than flash's"
    return None


@functools.cache
def half_precision_units() -> bool:
    """Whether this CPU computes half precision natively (AVX-512, with or without BF16 and
    AMX), where torch's fused half-precision kernels beat flash's float32 path; ``False`` on
    AVX2 and older, where flash's path is the faster one."""
    try:
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    except (AttributeError, RuntimeError):
        return False


def _rounds_mask(call: AttentionCall) -> bool:
    """Whether handing ``call``'s float mask to torch would round it (off the CPU, a float32
    mask with half-precision queries: up to 2⁻⁹ of each entry lost, 0.25 at a logit of 100)."""
    m = call.mask
    return (not call.query.is_cpu and m is not None and m.is_floating_point()
            and m.dtype != call.query.dtype)


def _mask_dtype(call: AttentionCall) -> torch.dtype:
    """Dtype of a float mask handed to torch: float32 for half-precision queries on CPU."""
    q = call.query
    return accumulation_dtype(q.dtype) if q.is_cpu else q.dtype


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Output ``(B, H, T, Dv)`` from torch's fused kernel and, when asked (on CPU), exact
    weights ``(B, H, T, S)`` rebuilt from its log-sum-exp. A non-finite query row gives a
    NaN output row."""
    if call.need_weights:
        return _run_with_weights(call)
    return poison_rows(_output(call), call.query), None


def _output(call: AttentionCall) -> Tensor:
    """torch's kernel on ``call``: ``(B, H, T, Dv)``."""
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    G = call.groups
    if call.plain and G > 1 and q.is_cpu:
        # No mask depends on the query index, so the G query heads of a group can ride
        # along the query length: one call, K and V read once and never copied. Not on a GPU,
        # whose kernels take grouped heads themselves: there the fold hid a decoding step from
        # torch's split-key kernel (H200, S = 32768, H = 32, Hkv = 8: 0.44 ms against 0.15).
        q_folded = q.reshape(B, k.shape[1], G * T, D)  # (B, Hkv, G·T, D)
        out = F.scaled_dot_product_attention(
            q_folded, k, v, dropout_p=call.dropout_p, scale=call.scale
        )  # (B, Hkv, G·T, Dv)
        return out.reshape(B, H, T, v.shape[-1])  # (B, H, T, Dv)
    top_left_only = call.mask is None and call.alibi is None and call.window is None
    if call.causal == 0 and top_left_only:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=call.dropout_p, is_causal=True, scale=call.scale,
            enable_gqa=G > 1,
        )  # (B, H, T, Dv)
    mask = dense_mask(call, _mask_dtype(call))
    # Rows with no visible key are opened up so the kernel never sees an all -inf row, then
    # zeroed: torch before 2.5 gives them NaN, and its CUDA kernels still do not give them
    # zeros (first H200 run, torch 2.11: a bf16 error of 1.4 on such rows). On the CPU the
    # check costs one host read and is skipped where torch zeroes them itself; on a GPU the
    # rows are opened unconditionally (no host sync).
    dead = None
    if mask is not None and (not NATIVE_DEAD_ROWS or not q.is_cpu):
        dead = dead_rows(mask)  # (B|1, H|1, T, 1)
        if q.is_cpu and not bool(dead.any()):
            dead = None
    if dead is not None:
        mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=call.dropout_p, scale=call.scale, enable_gqa=G > 1
    )  # (B, H, T, Dv)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out


def run_lse(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`run` plus the log-sum-exp ``(B, H, T)`` of torch's CPU flash kernel (float32,
    float64 for float64 inputs; ``-inf`` on rows with no visible key). The lse carries no
    gradient (torch's kernel does not differentiate it); the output does."""
    out, lse, mask = _cpu_flash(call)
    if mask is not None:
        dead = dead_rows(mask).squeeze(-1)  # (B|1, H|1, T): the kernel gives these lse 0
        lse = lse.masked_fill(dead, float("-inf"))
    weights = None
    if call.need_weights:
        from qkv.attention.weights import rebuild

        weights = rebuild(call, lse, lse_differentiable=False)
    return out, weights, lse


def _cpu_flash(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor | None]:
    """torch's CPU flash kernel on ``call``: ``(out (B, H, T, Dv), lse (B, H, T), mask)``,
    ``mask`` the dense additive mask it was given (None when the call needed none). The lse
    is 0 on rows with no visible key."""
    q, k, v = call.query, call.key, call.value
    B, H, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    if call.groups > 1:  # plain (why_not): fold the group into the query length
        q = q.reshape(B, Hkv, call.groups * T, D)  # (B, Hkv, G·T, D)
    top_left = call.causal == 0 and call.window is None and call.mask is None
    top_left = top_left and call.alibi is None
    mask = None
    if not (top_left or call.plain):  # float32 for half precision: CPU_FLASH takes it
        mask = to_additive(dense_mask(call), accumulation_dtype(q.dtype))
    out, lse = CPU_FLASH(q, k, v, 0.0, top_left, attn_mask=mask, scale=call.scale)
    out = poison_rows(out.reshape(B, H, T, Dv), call.query)  # (B, H, T, Dv)
    return out, lse.reshape(B, H, T), mask  # lse (B, H, T)


def _run_with_weights(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """torch's CPU flash kernel for the output and lse, then the weights rebuilt exactly
    (:func:`qkv.attention.weights.rebuild`), as the flash backend does with its own lse.

    Measured (1 thread, B=8, H=8, D=64, float32): 0.8 / 11 / 244 ms at T=S=32 / 128 / 512,
    against 1.2 / 12 / 308 ms for flash + rebuild. Its lse carries no gradient; rebuild adds
    that path, so the weights differentiate as the softmax does.
    """
    from qkv.attention.weights import rebuild

    out, lse, _ = _cpu_flash(call)  # lse 0 on rows with no visible key: their scores are -inf
    return out, rebuild(call, lse, lse_differentiable=False)
