"""A paged KV cache: fixed-size blocks in one pool, a block table per sequence, for serving
many sequences of different lengths at once (Kwon et al., 2023, "PagedAttention").

The pool of each layer holds ``num_blocks`` blocks of ``block_size`` positions,
``(num_blocks, Hkv, block_size, D)``. A sequence owns a list of block ids (its block table);
position ``p`` of the sequence lives in block ``table[p // block_size]`` at offset
``p % block_size``. Blocks are taken from a free list when a sequence starts and given back
when it ends, so memory is bounded by the pool and no sequence's cache is ever copied to grow.

Before each forward the caller says which sequences are in the batch (:meth:`PagedKVCache.
set_batch`: their tables and how many positions each has cached). The attention layer then
hands its new queries, keys and values to :meth:`PagedLayer.attend`, which writes the keys and
values into their slots and attends over the sequence's pages a chunk of blocks at a time
through qkv's attention core, merging the chunks by log-sum-exp (flash-decoding over pages: no
sequence's whole cache is gathered at once). Each query sees its sequence's positions up to
its own (causal), so a prompt (``T > 1``) and decoding steps (``T = 1``) use the same path.
On a GPU one Triton kernel does the same reading each page in place
(:mod:`qkv.attention.triton.paged`; ``kernel=``).

Shapes: ``B`` sequences in the batch, ``T`` new tokens each, ``H`` / ``Hkv`` heads, ``D``
head width, ``N`` blocks, ``b`` block size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.sdpa import scaled_dot_product_attention
from qkv.attention.weights import merge_partials
from qkv.checks import values_unknown
from qkv.nn.cache import KVCache, LayerKVCache

__all__ = ["PagedKVCache", "PagedLayer"]

CHUNK_BLOCKS = 32  # blocks attended per core call (512 positions of 16)
_KERNELS = ("auto", "triton", "chunks")
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PagedLayer(LayerKVCache):
    """One layer's block pools; its attention goes through :meth:`attend`."""

    paged = True

    def __init__(self, owner: PagedKVCache, shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device) -> None:  # fmt: skip
        super().__init__()
        self.owner = owner
        self.k_pool = torch.zeros(shape, dtype=dtype, device=device)  # (N, Hkv, b, D)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=device)  # (N, Hkv, b, D)

    @property
    def length(self) -> int:
        """The longest cached sequence of the batch (read from the host's copy: no device
        read, which on a GPU would wait for the step before)."""
        return self.owner.longest

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
        """Store ``k, v (B, Hkv, T, D)`` at the batch's next positions, then attend ``q (B, H,
        T, D)`` over each sequence's positions up to each query's; returns ``(B, H, T, D)``.

        Raises:
            ValueError: no :meth:`PagedKVCache.set_batch` for this batch, or a sequence whose
                blocks have no room for ``T`` more positions.
        """
        o = self.owner
        if o.tables is None or o.lengths is None or o.tables.shape[0] != q.shape[0]:
            raise ValueError("PagedKVCache.set_batch must name this batch's sequences first")
        T = q.shape[2]
        if T > o.room:  # checked on the host: the kernel would read past a table
            b = min(range(len(o.room_each)), key=o.room_each.__getitem__)
            raise ValueError(
                f"sequence {b} of the batch has room for {o.room_each[b]} more positions in "
                f"its blocks, and this forward adds {T}: allocate its table more blocks "
                "(PagedKVCache.blocks_for)")
        pos = o.lengths[:, None] + torch.arange(T, device=q.device)  # (B, T)
        block = o.tables.gather(1, pos // o.block_size)  # (B, T)
        self.k_pool[block, :, pos % o.block_size] = k.transpose(1, 2)  # (B, T, Hkv, D)
        self.v_pool[block, :, pos % o.block_size] = v.transpose(1, 2)
        if o.fused(q):  # on a GPU: one Triton kernel reads the pages in place
            from qkv.attention.triton.launch import paged_forward

            scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
            return paged_forward(q, self.k_pool, self.v_pool, o.tables, pos, scale)
        needed = int(pos.max()) // o.block_size + 1  # blocks holding positions 0 .. max
        parts = [self._chunk(q, pos, c, min(c + CHUNK_BLOCKS, needed), scale)
                 for c in range(0, needed, CHUNK_BLOCKS)]  # fmt: skip
        return _merge(parts)

    def _chunk(self, q: Tensor, pos: Tensor, first: int, last: int, scale: float | None):
        """Partial attention over blocks ``first .. last - 1`` of every table: ``(out, lse)``.

        One new token per sequence, all at one position (a single request decoding, or a
        batch in step): every key up to that position is visible, so the keys are cut there
        and attended with no mask (the core then splits them over the threads). Otherwise a
        mask keeps each query to its own sequence's positions up to its own."""
        o = self.owner
        ids = o.tables[:, first:last]  # (B, c)
        B, c = ids.shape
        Hkv, b, D = self.k_pool.shape[1:]
        keys = self.k_pool[ids].transpose(1, 2).reshape(B, Hkv, c * b, D)  # (B, Hkv, c·b, D)
        values = self.v_pool[ids].transpose(1, 2).reshape(B, Hkv, c * b, -1)
        if q.shape[2] == 1 and o.uniform:
            seen = min(c * b, o.longest + 1 - first * b)  # keys of positions <= the query's
            return scaled_dot_product_attention(
                q, keys[:, :, :seen], values[:, :, :seen], scale=scale,
                enable_gqa=q.shape[1] != Hkv, return_lse=True)  # (B, H, 1, D), (B, H, 1)
        key_pos = first * b + torch.arange(c * b, device=q.device)  # (c·b,)
        keep = key_pos[None, None, :] <= pos[:, :, None]  # (B, T, c·b): causal, own sequence
        return scaled_dot_product_attention(
            q, keys, values, attn_mask=keep[:, None], scale=scale,
            enable_gqa=q.shape[1] != Hkv, return_lse=True)  # (B, H, T, D), (B, H, T)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Partial outputs with their log-sum-exps merged into one ``(B, H, T, D)``
    (:func:`~qkv.attention.weights.merge_partials`, chunk after chunk)."""
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_partials(out, lse, *part)
    return out


class PagedKVCache(KVCache):
    """Block pools for ``num_layers`` layers and the free list of their blocks.

    Args:
        num_layers: attention layers.
        num_blocks, block_size: the pool: ``num_blocks`` blocks of ``block_size`` positions.
        kv_heads, head_dim: ``Hkv`` and ``D`` of the model's keys and values.
        dtype, device: of the pools.
        kernel: how attention reads the pages: ``"auto"`` (the Triton kernel of
            :mod:`qkv.attention.triton.paged` on CUDA tensors when triton is installed and no
            gradient is wanted, reading each page in place; else ``"chunks"``), ``"triton"``
            (that kernel; on CPU tensors only under ``TRITON_INTERPRET=1``) or ``"chunks"``
            (gather 32 blocks at a time and attend through qkv's attention core).

    Raises:
        ValueError: sizes that are not positive ints, an unknown ``kernel``.
    """

    def __init__(self, num_layers: int, *, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None,
                 kernel: str = "auto") -> None:  # fmt: skip
        super().__init__(num_layers)
        if kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(_KERNELS)}, got {kernel!r}")
        self.kernel = kernel
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.layers = [PagedLayer(self, shape, dtype, device) for _ in range(num_layers)]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: Tensor | None = None  # (B, blocks) of the current batch
        self.lengths: Tensor | None = None  # (B,) positions cached before this forward
        self.longest = 0  # their largest, on the host
        self.uniform = True  # all of them equal
        self.room_each: list[int] = []
        self.room = 0

    def fused(self, q: Tensor) -> bool:
        """Whether attention over ``q (B, H, T, D)`` runs on the Triton kernel (``kernel``)."""
        if self.kernel == "chunks" or (self.kernel == "auto" and q.device.type != "cuda"):
            return False  # (the CPU's every call decides here, at once)
        from qkv.attention.triton import installed, interpreting

        grad = torch.is_grad_enabled() and q.requires_grad
        usable = (installed() and not grad and q.dtype in _FUSED_DTYPES
                  and max(q.shape[-1], self.layers[0].v_pool.shape[-1]) <= 256
                  and not values_unknown(q))  # fmt: skip
        if self.kernel == "auto":
            return usable and q.device.type == "cuda"
        if not usable or (q.device.type == "cpu" and not interpreting()):
            raise ValueError(
                "PagedKVCache(kernel='triton') needs triton, float32/bfloat16/float16 queries "
                "with no gradient wanted, head widths up to 256, and CUDA tensors (CPU ones "
                f"only under TRITON_INTERPRET=1); got {q.dtype} on {q.device}")
        return True

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks.

        Raises:
            MemoryError: fewer than ``n`` free (the caller waits and tries again).
        """
        if n > len(self.free):
            raise MemoryError(f"{n} blocks asked, {len(self.free)} free of {self.num_blocks}")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Give ``blocks`` back to the pool."""
        self.free.extend(reversed(blocks))

    def set_batch(self, tables: list[list[int]], lengths: list[int]) -> None:
        """The next forward's sequences: their block tables and cached positions (each table
        must cover the cached and the new positions).

        Raises:
            ValueError: no sequences, a table and length count that differ, an empty table,
                a block id outside the pool, or a length that is not an int >= 0 (checked
                here, on the host: attention reads the pool through these ids).
        """
        self._check_batch(tables, lengths)
        width = max(len(t) for t in tables)
        device = self.layers[0].k_pool.device
        self.tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables],
                                   device=device)  # (B, blocks), padded with a real id
        self.lengths = torch.tensor(lengths, device=device)  # (B,)
        self.longest = max(lengths)
        self.uniform = min(lengths) == self.longest  # every sequence at one position
        self.room_each = [len(t) * self.block_size - n for t, n in zip(tables, lengths,
                                                                      strict=True)]
        self.room = min(self.room_each)  # new positions every sequence still has blocks for

    def _check_batch(self, tables: list[list[int]], lengths: list[int]) -> None:
        if not tables or len(tables) != len(lengths):
            raise ValueError(f"set_batch needs one table per length and at least one: got "
                             f"{len(tables)} tables and {len(lengths)} lengths")
        for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
            if not table:
                raise ValueError(f"sequence {b}'s block table is empty")
            bad = [i for i in table if isinstance(i, bool) or not isinstance(i, int)
                   or not 0 <= i < self.num_blocks]
            if bad:
                raise ValueError(f"sequence {b}'s block table holds {bad[0]!r}, not a block "
                                 f"id of this pool (0 .. {self.num_blocks - 1})")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"sequence {b}'s length must be an int >= 0, got {n!r}")
