"""Programmable attention with a Python ``score_mod`` on torch's compiled FlexAttention.

qkv's block-sparse Triton kernels (:mod:`qkv.attention.triton.flex`) run the ready score mods
(ALiBi, soft-capping, T5's relative bias) inside the kernel; an arbitrary Python
``score_mod`` cannot enter them. On a GPU such a call would otherwise take the tile loop of
small PyTorch ops (correct, slow there); this path hands it to
``torch.compile(torch.nn.attention.flex_attention.flex_attention)`` instead, which traces the
``score_mod`` and the block mask's ``mask_mod`` into generated Triton kernels, forward and
backward, so tensors the ``score_mod`` captures (a learned bias) get their gradients.

qkv's block mask becomes torch's (:func:`torch_block_mask`: the same partial and full blocks,
the same ``mask_mod``, kept with the mask); qkv's rules stay: a non-finite query row gives a
NaN output row (:func:`qkv.attention.rows.poison_rows`), a row with no visible key zeros and
``lse = -inf`` (torch's own rule too).

``auto`` takes it on CUDA tensors only: on the CPU torch compiles FlexAttention for inference
alone (no backward, no log-sum-exp), and qkv's tile loop is the fast path there
(docs/performance.md). ``kernel_options={"backend": "compiled"}`` names it on either.

Shapes: ``query (B, H, T, D)``, ``key (B, Hkv, S, D)``, ``value (B, Hkv, S, Dv)``; output
``(B, H, T, Dv)``, lse ``(B, H, T)`` float32.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from qkv.attention.flex.blocks import DEFAULT_BLOCK, FULL, PARTIAL, BlockMask
from qkv.attention.rows import poison_rows
from qkv.checks import values_unknown

__all__ = ["attend", "gives_lse", "torch_block_mask", "why_not"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def why_not(query: Tensor, value: Tensor, block_mask: BlockMask | None, grad: bool,
            lse: bool, named: bool) -> str | None:
    """Why torch's compiled FlexAttention cannot (or, unless ``named``, should not) serve a
    call; ``grad``: the inputs require gradients; ``lse``: the call needs the log-sum-exp."""
    if values_unknown(query) or torch._C._functorch.is_functorch_wrapped_tensor(query):
        return "tracing or torch.func transforms: the tile loop traces with the caller"
    if query.device.type not in ("cuda", "cpu"):
        return f"torch's compiled FlexAttention runs on CUDA and CPU, not {query.device.type}"
    if query.device.type == "cpu" and not named:
        return "on the CPU the tile loop is the fast path (torch compiles flex for GPUs)"
    if (grad or lse) and not gives_lse(query.device):
        return ("torch compiles FlexAttention on the CPU for inference only (no backward, "
                "no log-sum-exp or weights)")
    if query.dtype not in _DTYPES:
        return f"torch's compiled FlexAttention takes float32, bfloat16, float16, not {query.dtype}"
    widths = (query.shape[-1], value.shape[-1])
    if any(w < 16 or w > 256 or w & (w - 1) for w in widths):
        return f"head widths {widths}: torch's compiled kernels take powers of two, 16 to 256"
    if block_mask is not None and block_mask.block_size != (DEFAULT_BLOCK, DEFAULT_BLOCK):
        return (f"block size {block_mask.block_size}: torch's compiled kernels divide "
                f"{DEFAULT_BLOCK}×{DEFAULT_BLOCK} blocks (create_block_mask's default)")
    return None


_TORCH_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def torch_block_mask(block_mask: BlockMask, device: torch.device):
    """``block_mask`` as torch's ``BlockMask`` on ``device`` (the same visited blocks, partial
    ones evaluating the same ``mask_mod``), built on first use and kept with the mask."""
    per_device = _TORCH_MASKS.setdefault(block_mask, {})
    if str(device) not in per_device:
        per_device[str(device)] = _convert(block_mask, device)
    return per_device[str(device)]


def _listed(chosen: Tensor) -> tuple[Tensor, Tensor]:
    """``(count (..., nQ), indices (..., nQ, nK))`` int32: each row's chosen key blocks
    first, ascending, as torch's block tables list them."""
    order = torch.sort((~chosen).to(torch.uint8), dim=-1, stable=True).indices
    return chosen.sum(-1).to(torch.int32), order.to(torch.int32)


def _convert(block_mask: BlockMask, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    state = block_mask.state  # (B', H', nQ, nK) uint8
    kv_num, kv_idx = _listed(state == PARTIAL)
    full_num, full_idx = _listed(state == FULL)
    return TorchBlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
        BLOCK_SIZE=block_mask.block_size, mask_mod=block_mask.mask_mod,
        seq_lengths=(block_mask.q_len, block_mask.kv_len),
    )


def gives_lse(device: torch.device) -> bool:
    """Whether torch's compiled FlexAttention returns the log-sum-exp on ``device`` (not on
    the CPU, whose build is for inference only)."""
    return device.type != "cpu"


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def attend(query: Tensor, key: Tensor, value: Tensor, score_mod, block_mask: BlockMask | None,
           scale: float | None, enable_gqa: bool, lse: bool) -> tuple[Tensor, Tensor | None]:
    """``(out (B, H, T, Dv), lse (B, H, T) float32 or None)`` from torch's compiled kernels,
    differentiable as torch's are; ``lse``: also compute the log-sum-exp (where
    :func:`gives_lse`)."""
    torch_mask = None if block_mask is None else torch_block_mask(block_mask, query.device)
    result = _compiled()(query, key, value, score_mod=score_mod, block_mask=torch_mask,
                         scale=scale, enable_gqa=enable_gqa, **(_lse_request() if lse else {}))
    out, lse_out = result if lse else (result, None)
    lse_out = getattr(lse_out, "lse", lse_out)  # (an AuxOutput where torch has return_aux)
    return poison_rows(out, query), lse_out


def _lse_request() -> dict:
    """The keyword asking torch's FlexAttention for the lse: ``return_aux`` where this torch
    has it (``return_lse`` is deprecated there), else ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}
