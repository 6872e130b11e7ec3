"""``score_mod`` / ``mask_mod`` given to :func:`qkv.scaled_dot_product_attention` and ``explain``.

SDPA's own mask arguments are turned into mods so one flex call serves them all:
``is_causal`` becomes a causal ``mask_mod`` (top-left or bottom-right), a boolean ``attn_mask``
is AND-ed in (read by index, broadcast as SDPA broadcasts it), a float ``attn_mask`` is added
to the scores after ``score_mod`` (so a soft cap cannot unmask a ``-inf`` entry). Dropout,
ALiBi slopes and windows have mods of their own (:mod:`qkv.attention.mods`) and are refused
here, with a message saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError
from qkv.attention.flex import flex_attention, flex_path
from qkv.attention.flex.blocks import BlockMask, and_masks, create_block_mask

__all__ = ["FlexExplanation", "explain_flex", "sdpa_flex"]


def _mods(query, key, attn_mask, is_causal, score_mod, mask_mod):
    """``(score_mod, mask_mod)`` with SDPA's mask arguments folded in."""
    T, S = query.shape[-2], key.shape[-2]
    masks = [] if mask_mod is None else [mask_mod]
    if is_causal:
        if is_causal not in (True, "top-left", "bottom-right"):
            raise AttentionArgumentError(
                f"is_causal must be a bool, 'top-left' or 'bottom-right', got {is_causal!r}"
            )
        shift = S - T if is_causal == "bottom-right" else 0
        masks.append(lambda b, h, q, k: k <= q + shift)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise AttentionTypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        m = attn_mask
        while m.dim() < 4:
            m = m[None]
        if m.dim() != 4:
            raise AttentionArgumentError(
                f"with score_mod/mask_mod, attn_mask must broadcast to (B, H, T, S) with at "
                f"most 4 dimensions, got {tuple(attn_mask.shape)}"
            )
        m = m.expand(query.shape[0], query.shape[1], T, S)  # (B, H, T, S), a view
        if m.dtype == torch.bool:
            masks.append(lambda b, h, q, k: m[b, h, q, k])
        elif m.is_floating_point():
            # Added after score_mod, as the modules do: a soft cap never unmasks a -inf entry.
            inner = score_mod
            score_mod = (
                (lambda s, b, h, q, k: inner(s, b, h, q, k) + m[b, h, q, k])
                if inner is not None else (lambda s, b, h, q, k: s + m[b, h, q, k])
            )
        else:
            raise AttentionTypeError(f"attn_mask must be bool or float, got {m.dtype}")
    mask = None if not masks else masks[0] if len(masks) == 1 else and_masks(*masks)
    return score_mod, mask


def _refuse(dropout_p, window, alibi_slopes, backend) -> None:
    if dropout_p:
        raise AttentionArgumentError(
            "score_mod/mask_mod take no dropout_p (flex attention has none); got "
            f"dropout_p={dropout_p!r}"
        )
    if window is not None or alibi_slopes is not None:
        raise AttentionArgumentError(
            "with score_mod/mask_mod, write the window or ALiBi as mods too "
            "(qkv.masks.sliding_window_mask, qkv.masks.alibi) instead of window=/alibi_slopes="
        )
    if backend not in ("auto", "flash"):
        raise AttentionArgumentError(
            f"score_mod/mask_mod run on qkv's blockwise kernel: backend must be 'auto' or "
            f"'flash', got {backend!r}"
        )


def _block_mask(query, key, mask_mod: Callable | None) -> BlockMask | None:
    if mask_mod is None:
        return None
    B, H, T = query.shape[:3]
    return create_block_mask(mask_mod, B, H, T, key.shape[-2], device=query.device)


def sdpa_flex(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              need_weights, backend, window, alibi_slopes, score_mod, mask_mod):
    """:func:`qkv.scaled_dot_product_attention` with a ``score_mod`` and/or ``mask_mod``."""
    _refuse(dropout_p, window, alibi_slopes, backend)
    score_mod, mask_mod = _mods(query, key, attn_mask, is_causal, score_mod, mask_mod)
    block_mask = _block_mask(query, key, mask_mod)
    return flex_attention(query, key, value, score_mod, block_mask, scale, enable_gqa,
                          need_weights=need_weights)


@dataclass(frozen=True)
class FlexExplanation:
    """Which path a flex call takes (``path``: ``"triton"``, the block-sparse kernels,
    ``"compiled"``, torch's compiled FlexAttention for a Python ``score_mod`` on a GPU, or
    ``"tiles"``, the tile loop; ``why``), and what it costs: the block mask's density and the
    predicted work."""

    path: str
    why: str
    shapes: str
    tiles: int
    visited: int
    full: int
    flops: float
    dense_flops: float
    peak_bytes: int

    @property
    def density(self) -> float:
        return self.visited / self.tiles

    def __str__(self) -> str:
        return (
            f"flex -> {self.path} ({self.why})  ({self.shapes})\n"
            f"  block mask: {self.visited}/{self.tiles} tiles visited (density "
            f"{self.density:.3f}), {self.full} full (no mask evaluated)\n"
            f"  predicted {self.flops / 1e9:.3g} GFLOP ({self.flops / self.dense_flops:.1%} of "
            f"dense), peak {self.peak_bytes / 2**20:.1f} MiB of tiles"
        )


def explain_flex(query, key, value, attn_mask, is_causal, score_mod, mask_mod,
                 dropout_p=0.0, window=None, alibi_slopes=None, backend="auto"):
    """The :class:`FlexExplanation` of the call :func:`sdpa_flex` would run."""
    _refuse(dropout_p, window, alibi_slopes, backend)
    score_mod, mask_mod = _mods(query, key, attn_mask, is_causal, score_mod, mask_mod)
    B, H, T, D = query.shape
    S, Dv = key.shape[-2], value.shape[-1]
    bm = _block_mask(query, key, mask_mod)
    bq, bk = (128, 128) if bm is None else bm.block_size
    nq, nk = -(-T // bq), -(-S // bk)
    if bm is None:
        visited_tiles = torch.ones(nq, nk, dtype=torch.bool)
        full_tiles = visited_tiles
    else:
        visited_tiles = (bm.state > 0).flatten(0, 1).any(dim=0)  # (nQ, nK)
        full_tiles = (bm.state == 2).flatten(0, 1).all(dim=0)
    rows = torch.full((nq,), float(bq)).index_fill_(0, torch.tensor([nq - 1]), T - (nq - 1) * bq)
    cols = torch.full((nk,), float(bk)).index_fill_(0, torch.tensor([nk - 1]), S - (nk - 1) * bk)
    pairs = float((visited_tiles * rows[:, None] * cols[None, :]).sum())  # (query, key) pairs
    elt = 4 if query.dtype in (torch.float16, torch.bfloat16) else query.element_size()
    path, why = flex_path(query, value, score_mod, bm)
    return FlexExplanation(
        path=path, why=why,
        shapes=f"B={B}, H={H}, Hkv={key.shape[1]}, T={T}, S={S}, D={D}, Dv={Dv}",
        tiles=nq * nk, visited=int(visited_tiles.sum()), full=int(full_tiles.sum()),
        flops=2.0 * B * H * pairs * (D + Dv), dense_flops=2.0 * B * H * T * S * (D + Dv),
        peak_bytes=4 * B * H * min(bq, T) * min(bk, S) * elt,
    )
