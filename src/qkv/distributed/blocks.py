"""One query chunk against one key chunk: forward with log-sum-exp, backward given the global
statistics. The fastest exact kernel that can serve the block does.

torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) returns the
log-sum-exp and its backward takes the output and log-sum-exp as arguments, so given the
*merged* output and log-sum-exp of the whole row it returns exactly this block's share of the
gradients, as qkv's flash backward does. It serves plain blocks (no mask, ALiBi or window;
causal only on the diagonal, ``H = Hkv``, float32/float64 on CPU); qkv's flash kernel serves
every other block (grouped heads without copies, ALiBi at global offsets, windows, key masks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.backends import flash
from qkv.attention.backends.torch_kernel import CPU_FLASH, CPU_FLASH_BACKWARD
from qkv.attention.call import AttentionCall

__all__ = ["block_backward", "block_forward"]



def _torch_serves(call: AttentionCall) -> bool:
    q, k, v = call.query, call.key, call.value
    return (
        CPU_FLASH is not None and CPU_FLASH_BACKWARD is not None and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and call.mask is None and call.alibi is None and call.window is None
        and call.causal in (None, 0) and (call.causal is None or call.T == call.S)
        and q.shape[1] == k.shape[1] and q.shape[-1] == v.shape[-1]
    )


def block_forward(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T, Dv), lse (B, H, T))`` of one block."""
    if _torch_serves(call):
        return CPU_FLASH(call.query, call.key, call.value, 0.0, call.causal == 0, scale=call.scale)
    return flash.attend(call)


def block_backward(
    call: AttentionCall, out: Tensor, lse: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share ``(dq, dk, dv)`` given the whole row's ``out`` and ``lse``."""
    if _torch_serves(call):
        return CPU_FLASH_BACKWARD(
            dout, call.query, call.key, call.value, out, lse.to(call.query.dtype), 0.0,
            call.causal == 0, scale=call.scale,
        )
    return flash.attend_backward(call, out, lse, dout)
