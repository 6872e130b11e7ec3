"""A static key/value cache: buffers of one fixed shape, written at slot indices.

:class:`~qkv.nn.cache.KVCache` returns views of its first ``length`` positions, so every
decoding step attends over a new ``S``; that is the fastest eager path, but each new shape is
a new graph for ``torch.compile``. :class:`StaticKVCache` is the compiler's form (as in
gpt-fast): every layer's keys ``(B, Hkv, L, D)`` and values ``(B, Hkv, L, Dv)`` are allocated
once, a step writes its ``T`` new keys at the slots ``slots (T,)`` (a tensor set before the
step with :meth:`StaticKVCache.set_slots`, so no Python number changes between steps), and
attention covers all ``L`` slots under a keep mask (:meth:`StaticKVCache.keep_mask`): query
``t`` sees slot ``j`` exactly when ``j <= slots[t]`` (and, with padding, when ``j`` holds a
real token). Slots not yet written are hidden, so the outputs equal the dynamic cache's.

A model takes it where it takes a ``KVCache`` (``model(ids, cache=static, positions=...)``);
the positions of the new tokens must be given (default: the slots), and sliding windows,
ALiBi and relative biases (whose masks depend on ``S - T``) are not supported by it:
:meth:`qkv.models.DecoderLM.new_cache` says so.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["StaticKVCache", "StaticLayerKVCache"]


class StaticLayerKVCache:
    """One attention layer's preallocated keys and values (see the module docstring).

    Attributes:
        k, v: ``(B, Hkv, L, D)`` and ``(B, Hkv, L, Dv)`` buffers (zeros until written).
        slots: ``(T,)`` long, where the next :meth:`update` writes (set by the owner).
        static: None, or the cross-attention pair kept by :meth:`set_static`.
        window: always None (no rolling).
    """

    static = None
    window = None

    def __init__(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        self.k, self.v, self.slots = k, v, slots

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k (B, Hkv, T, D)`` and ``v (B, Hkv, T, Dv)`` at the slots; returns every
        slot ``(B, Hkv, L, D)``, ``(B, Hkv, L, Dv)`` (the keep mask hides unwritten ones).

        Raises:
            ValueError: keys of another batch size, head count or width than the cache was
                made for (``index_copy_`` said only "same slice shapes").
        """
        want, got = self.k.shape, k.shape
        if (got[0], got[1], got[3]) != (want[0], want[1], want[3]):
            raise ValueError(
                f"the static cache holds (B, Hkv, L, D) = {tuple(want)} but this step's keys "
                f"are {tuple(got)}: make the cache for this batch (new_cache(static=True, "
                f"batch_size={got[0]}))")
        self.k.index_copy_(2, self.slots, k.to(self.k.dtype))
        self.v.index_copy_(2, self.slots, v.to(self.v.dtype))
        return self.k, self.v

    def set_static(self, k: Tensor, v: Tensor) -> None:
        """Keep a cross-attention pair ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``, projected
        once from the encoder's memory (at the first step) and reused by every later one."""
        self.static = (k, v)

    def visible(self, mask: Tensor, S: int) -> Tensor:
        """The mask as given: a static cache holds every slot (``S == L``)."""
        return mask


class StaticKVCache:
    """One :class:`StaticLayerKVCache` per layer, sharing one slot tensor.

    Args:
        num_layers: attention layers.
        batch_size: rows ``B``.
        capacity: slots ``L`` (the prompt plus every new token).
        num_kv_heads, d_head, d_value: ``Hkv``, ``D``, ``Dv`` (``Dv`` default ``D``).
        dtype, device: of the buffers (the model's).

    Raises:
        ValueError: a size that is not a positive int.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
                 d_head: int, d_value: int | None = None, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        sizes = dict(num_layers=num_layers, batch_size=batch_size, capacity=capacity,
                     num_kv_heads=num_kv_heads, d_head=d_head, d_value=d_value or d_head)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        B, L, Hkv = batch_size, capacity, num_kv_heads
        self.capacity = L
        self.slots = torch.zeros(1, dtype=torch.long, device=device)  # (T,)
        self._index = torch.arange(L, device=device)  # (L,)
        self.layers = [
            StaticLayerKVCache(
                torch.zeros(B, Hkv, L, d_head, dtype=dtype, device=device),  # (B, Hkv, L, D)
                torch.zeros(B, Hkv, L, sizes["d_value"], dtype=dtype, device=device),
                self.slots,
            )
            for _ in range(num_layers)
        ]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> StaticLayerKVCache:
        return self.layers[i]

    def set_slots(self, slots: Tensor) -> None:
        """Where the next step writes: ``slots (T,)`` long, each in ``[0, L)``.

        Raises:
            ValueError: not a 1-D integer tensor, or a slot outside ``[0, L)``.
        """
        if not isinstance(slots, Tensor) or slots.dim() != 1 or slots.is_floating_point():
            raise ValueError(f"slots must be a 1-D integer tensor (T,), got {slots!r:.80}")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise ValueError(f"slots must lie in [0, {self.capacity}) (the cache's capacity), "
                             f"got [{int(slots.min())}, {int(slots.max())}]")  # fmt: skip
        slots = slots.to(self._index.device, torch.long)
        self.slots = slots
        for layer in self.layers:
            layer.slots = slots

    def reset(self) -> None:
        """The cache as new, at the same addresses: every buffer zeroed, the slots back to
        ``[0]``, cross-attention pairs dropped (a compiled step replayed from a CUDA graph
        reads and writes these buffers in place, so a new session reuses them)."""
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()
            layer.static = None
        self.set_slots(torch.zeros(1, dtype=torch.long, device=self._index.device))

    def mark_static(self) -> None:
        """Tell ``torch.compile`` that every layer's buffers keep their address from call to
        call (``torch._dynamo.mark_static_address``, unguarded): a CUDA graph then writes the
        new keys into them in place, where it would otherwise refuse a graph that mutates
        its inputs. A new cache (other addresses) makes the graph re-record, not recompile."""
        for layer in self.layers:
            torch._dynamo.mark_static_address(layer.k, guard=False)
            torch._dynamo.mark_static_address(layer.v, guard=False)

    def keep_mask(self, padding: Tensor | None = None) -> Tensor:
        """``(B|1, 1, T, L)`` bool: query ``t`` sees slot ``j <= slots[t]`` (and, with a
        ``(B, 1, 1, L)`` padding keep mask, only real tokens)."""
        keep = self._index[None, :] <= self.slots[:, None]  # (T, L)
        keep = keep[None, None]  # (1, 1, T, L)
        return keep if padding is None else keep & padding  # (B|1, 1, T, L)
