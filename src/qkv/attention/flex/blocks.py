"""Block masks for programmable attention: which tiles a ``mask_mod`` leaves empty, full or partial.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` of head ``h`` in batch
``b`` may attend to key ``kv_idx`` (torch's FlexAttention signature). :func:`create_block_mask`
evaluates it one query block at a time (never the whole ``T×S`` grid at once) and records, per
``(block_q, block_kv)`` tile, whether every entry is masked (*empty*: the kernel skips the
tile), every entry visible (*full*: no mask evaluated) or some of each (*partial*: the kernel
evaluates ``mask_mod`` on that tile's index grid only).

The mod is called with broadcastable index tensors, ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``,
``q_idx (1, 1, bq, 1)``, ``kv_idx (1, 1, 1, bk)``, so any function of torch operations that
would work under torch's ``vmap`` works here (no Python ``if`` on tensor values).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.errors import AttentionArgumentError, AttentionTypeError

__all__ = [
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "full_block_mask",
    "index_grid",
    "noop_mask",
    "or_masks",
    "tile_keep",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK = 128


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """A ``mask_mod`` that hides nothing."""
    return torch.ones((), dtype=torch.bool, device=q_idx.device)


def and_masks(*mods: Callable) -> Callable:
    """A ``mask_mod`` visible where every one of ``mods`` is (no mods: :func:`noop_mask`)."""
    _check_mods(mods, "and_masks")

    def both(b, h, q_idx, kv_idx):
        keep = noop_mask(b, h, q_idx, kv_idx)
        for mod in mods:
            keep = keep & mod(b, h, q_idx, kv_idx)
        return keep

    return both


def or_masks(*mods: Callable) -> Callable:
    """A ``mask_mod`` visible where any one of ``mods`` is (no mods: hides everything)."""
    _check_mods(mods, "or_masks")

    def either(b, h, q_idx, kv_idx):
        keep = ~noop_mask(b, h, q_idx, kv_idx)
        for mod in mods:
            keep = keep | mod(b, h, q_idx, kv_idx)
        return keep

    return either


def _check_mods(mods, name: str) -> None:
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise AttentionTypeError(
                f"{name} takes mask_mod functions, got {type(mod).__name__} as argument {i}"
            )


def index_grid(B: int, H: int, rows: range, cols: range, device=None):
    """Broadcastable index tensors ``(b, h, q_idx, kv_idx)`` for a tile (int64)."""
    return (
        torch.arange(B, device=device).view(B, 1, 1, 1),
        torch.arange(H, device=device).view(1, H, 1, 1),
        torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1),
        torch.arange(cols.start, cols.stop, device=device).view(1, 1, 1, -1),
    )


def tile_keep(mask_mod: Callable, B: int, H: int, rows: range, cols: range, device=None) -> Tensor:
    """``mask_mod`` on a tile's index grid, as a bool tensor ``(B, H, len(rows), len(cols))``."""
    keep = mask_mod(*index_grid(B, H, rows, cols, device))
    if not isinstance(keep, Tensor):
        keep = torch.tensor(bool(keep), device=device)
    if keep.dtype != torch.bool:
        raise AttentionTypeError(
            f"mask_mod must return a bool tensor (True = may attend), got dtype {keep.dtype}"
        )
    try:
        return torch.broadcast_to(keep, (B, H, len(rows), len(cols)))
    except RuntimeError:
        raise AttentionArgumentError(
            f"mask_mod returned shape {tuple(keep.shape)}, which does not broadcast to the tile "
            f"({B}, {H}, {len(rows)}, {len(cols)}): write it with elementwise torch operations "
            "of (b, h, q_idx, kv_idx)"
        ) from None


# What create_block_mask builds at most: the tile states (B·H·nQ·nK bytes) and one row of
# tiles of mask_mod's output at a time (B·H·bq·KV_LEN bools); past these it refuses at once.
MAX_TILES = 1 << 28
MAX_ROW = 1 << 31


def _block_size(block_size: object) -> tuple[int, int]:
    """``(bq, bk)`` from an int or a pair of ints, each >= 1 (not bool, not float)."""
    pair = (block_size, block_size) if not isinstance(block_size, (tuple, list)) else block_size
    ok = len(pair) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in pair)
    if not ok:
        raise AttentionArgumentError(
            f"BLOCK_SIZE must be an int >= 1 or a pair (bq, bk) of them, got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _refuse_bombs(B: int, H: int, T: int, S: int, bq: int, nq: int, nk: int) -> None:
    """Refuse, before allocating anything, a block mask too large to build."""
    if B * H * nq * nk > MAX_TILES:
        raise AttentionArgumentError(
            f"create_block_mask would hold B·H·nQ·nK = {B}·{H}·{nq}·{nk} tile states, over "
            f"{MAX_TILES:,}: use a larger BLOCK_SIZE, or B/H None for a mask that does not "
            f"vary over them (Q_LEN={T}, KV_LEN={S})")
    if B * H * min(bq, T) * S > MAX_ROW:
        raise AttentionArgumentError(
            f"create_block_mask evaluates mask_mod one row of tiles at a time, "
            f"B·H·bq·KV_LEN = {B}·{H}·{min(bq, T)}·{S} values, over {MAX_ROW:,}: use a smaller "
            "BLOCK_SIZE or shorter sequences")


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Which tiles of a ``(B, H, Q_LEN, KV_LEN)`` attention a ``mask_mod`` leaves visible.

    Attributes:
        state: ``(B|1, H|1, ceil(Q_LEN/bq), ceil(KV_LEN/bk))`` uint8: 0 empty, 1 partial,
            2 full.
        mask_mod: the function, evaluated by the kernel on partial tiles.
        q_len, kv_len: ``T`` and ``S``.
        block_size: ``(bq, bk)``.
    """

    state: Tensor
    mask_mod: Callable
    q_len: int
    kv_len: int
    block_size: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.state.shape[0], self.state.shape[1], self.q_len, self.kv_len)

    def density(self) -> float:
        """Fraction of tiles the kernel visits (partial or full), over every (b, h)."""
        return float((self.state > EMPTY).float().mean())

    def sparsity(self) -> float:
        """Percentage of tiles skipped, as torch's ``BlockMask.sparsity()``."""
        return 100.0 * (1.0 - self.density())

    def to_dense(self) -> Tensor:
        """The visited tiles ``(B|1, H|1, nQ, nK)`` as bool."""
        return self.state > EMPTY

    def __repr__(self) -> str:
        full = float((self.state == FULL).float().mean())
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
            f"density={self.density():.3f} (full {full:.3f}), mask_mod="
            f"{getattr(self.mask_mod, '__name__', type(self.mask_mod).__name__)})"
        )


def _check_sizes(**sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AttentionArgumentError(f"{name} must be an int >= 1, got {value!r}")


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: str | torch.device = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK,
) -> BlockMask:
    """Evaluate ``mask_mod`` tile by tile into a :class:`BlockMask` (torch's signature).

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend.
        B, H: batch and heads the mask varies over; None (or 1) = the same for all.
        Q_LEN, KV_LEN: ``T`` and ``S``.
        device: where the index tensors live.
        BLOCK_SIZE: tile size ``bq`` (= ``bk``), or ``(bq, bk)``.

    Memory: one ``(B, H, bq, KV_LEN)`` bool row of tiles at a time.
    """
    if not callable(mask_mod):
        raise AttentionTypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    B = 1 if B is None else B
    H = 1 if H is None else H
    _check_sizes(B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN)
    bq, bk = _block_size(BLOCK_SIZE)
    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bk)
    _refuse_bombs(B, H, Q_LEN, KV_LEN, bq, nq, nk)
    state = torch.empty(B, H, nq, nk, dtype=torch.uint8)
    pad = nk * bk - KV_LEN
    for i in range(nq):
        rows = range(i * bq, min(Q_LEN, (i + 1) * bq))
        keep = tile_keep(mask_mod, B, H, rows, range(KV_LEN), device).cpu()  # (B, H, bq, S)
        if pad:
            keep_any = torch.nn.functional.pad(keep, (0, pad), value=False)
            keep_all = torch.nn.functional.pad(keep, (0, pad), value=True)
        else:
            keep_any = keep_all = keep
        tiles_any = keep_any.reshape(B, H, len(rows), nk, bk).any(dim=4).any(dim=2)  # (B,H,nk)
        tiles_all = keep_all.reshape(B, H, len(rows), nk, bk).all(dim=4).all(dim=2)
        state[:, :, i] = torch.where(
            tiles_all, FULL, torch.where(tiles_any, PARTIAL, EMPTY)
        ).to(torch.uint8)
    return BlockMask(state, mask_mod, Q_LEN, KV_LEN, (bq, bk))


@functools.lru_cache(maxsize=32)
def full_block_mask(Q_LEN: int, KV_LEN: int) -> BlockMask:
    """The block mask of no mask: every ``DEFAULT_BLOCK`` tile of ``(Q_LEN, KV_LEN)`` full
    (no ``mask_mod`` evaluated anywhere), built without evaluating one, and kept (its kernel
    tables are kept with it), for a ready score mod called without a block mask."""
    _check_sizes(Q_LEN=Q_LEN, KV_LEN=KV_LEN)
    nq, nk = -(-Q_LEN // DEFAULT_BLOCK), -(-KV_LEN // DEFAULT_BLOCK)
    state = torch.full((1, 1, nq, nk), FULL, dtype=torch.uint8)  # (1, 1, nQ, nK)
    return BlockMask(state, noop_mask, Q_LEN, KV_LEN, (DEFAULT_BLOCK, DEFAULT_BLOCK))
