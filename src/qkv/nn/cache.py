"""Key/value cache for incremental decoding.

A decoder that generates one token at a time would recompute the keys and values of the whole
prefix at every step; the cache keeps them instead, so a step costs O(S) rather than O(S²).
:class:`LayerKVCache` holds one attention layer's keys ``(B, Hkv, S, D)`` and values
``(B, Hkv, S, Dv)``; :class:`KVCache` is one per layer plus the operations generation needs
(``reset``, ``reorder`` for beam search, ``crop`` for rolling back).

Storage: a buffer with spare capacity and a length. Without ``max_len`` the capacity doubles
when full (amortised O(1) per token, like a Python list); with ``max_len`` it is allocated
once. ``update`` writes the new tokens in place and returns views of the first ``length``
positions, so no step copies the whole past. When autograd is tracking the keys/values (a
cached forward in training) the cache concatenates out of place instead, because writing in
place would invalidate tensors that earlier steps saved for backward.

Rolling cache (``window=w``, for sliding-window attention: Mistral, Gemma 2's local layers):
a layer whose queries see only the last ``w`` keys needs no older ones, so after each update
the cache keeps only the last ``w`` positions. ``length`` still counts every token seen (the
position of the next one, for RoPE); ``held`` is what is stored. ``update`` returns the held
keys plus the new ones (a prefill longer than ``w`` sees all of its own keys), so attention
with the same window over them equals full recompute. A ``(B, S)`` padding mask over all
positions is cut to the returned keys by :meth:`LayerKVCache.visible`.

Cross-attention keys/values do not grow: they are projected once from the encoder output and
stored with ``set_static``; one ``LayerKVCache`` can serve a decoder layer's self-attention
(``update``) and cross-attention (``static``) together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["KVCache", "LayerKVCache"]

_MIN_CAPACITY = 16  # first allocation without max_len: avoids regrowing on the first tokens


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_pair(k: object, v: object, what: str) -> tuple[Tensor, Tensor]:
    """Validate a key/value pair: 4-D float tensors agreeing on B, Hkv, length, dtype, device."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{what}: {name} must be 4-D (B, Hkv, T, D), got shape {_shape(t)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{what}: {name} must be floating point, got dtype {t.dtype}")
    assert isinstance(k, Tensor) and isinstance(v, Tensor)
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{what}: k and v must agree on (B, Hkv, T), got k {_shape(k)} and v {_shape(v)}"
        )
    if k.dtype != v.dtype or k.device != v.device:
        raise TypeError(
            f"{what}: k and v must share dtype and device, got k {k.dtype} on {k.device} "
            f"and v {v.dtype} on {v.device}"
        )
    return k, v


def _check_window(window: object) -> int | None:
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return window


def _check_max_len(max_len: object) -> int | None:
    if max_len is not None and (
        not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1
    ):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    return max_len


def _check_indices(indices: Tensor | Sequence[int], batch: int | None) -> Tensor:
    idx = torch.as_tensor(indices)
    if idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(
            f"indices must be a 1-D integer tensor (B',) of batch rows, got shape "
            f"{tuple(idx.shape)} and dtype {idx.dtype}"
        )
    if batch is not None and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= batch):
        raise ValueError(
            f"indices must lie in [0, {batch}) (the cached batch size), got "
            f"min {int(idx.min())} and max {int(idx.max())}"
        )
    return idx.long()


class LayerKVCache:
    """Keys and values of one attention layer, grown one step at a time.

    Args:
        max_len: if given, the buffers are allocated once for ``max_len`` tokens and going
            past it raises; if None, capacity grows geometrically. Not used by a rolling
            cache (it holds at most ``window`` positions between steps).
        window: None, or roll: keep only the last ``window`` positions after each update
            (see the module docstring).

    Attributes:
        length: number of tokens seen (by ``update``; static entries do not count); with
            ``window`` only the last ``held`` of them are stored.
        static: ``None`` or the cross-attention pair ``(k (B, Hkv, S, D), v (B, Hkv, S, Dv))``
            stored by :meth:`set_static`.
    """

    def __init__(self, *, max_len: int | None = None, window: int | None = None) -> None:
        self.max_len = _check_max_len(max_len)
        self.window = _check_window(window)
        self._start = 0  # position of the first held token (> 0 only when rolling)
        self._k: Tensor | None = None  # (B, Hkv, capacity, D)
        self._v: Tensor | None = None  # (B, Hkv, capacity, Dv)
        self._length = 0
        self.static: tuple[Tensor, Tensor] | None = None

    @property
    def length(self) -> int:
        return self._length

    @property
    def held(self) -> int:
        """Tokens stored (``length`` minus those a rolling cache has dropped)."""
        return self._length - self._start

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before they must grow (0 before the first update)."""
        return 0 if self._k is None else self._k.shape[2]

    def __repr__(self) -> str:
        static = "" if self.static is None else f", static S={self.static[0].shape[2]}"
        roll = "" if self.window is None else f", window={self.window}, held={self.held}"
        return f"LayerKVCache(length={self._length}, capacity={self.capacity}{roll}{static})"

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``T_new`` tokens and return every cached key and value.

        Args:
            k: ``(B, Hkv, T_new, D)`` new keys.
            v: ``(B, Hkv, T_new, Dv)`` new values.

        Returns:
            ``(k_all (B, Hkv, S, D), v_all (B, Hkv, S, Dv))`` with ``S = length`` after the
            update; views of the cache buffers (not copies) unless autograd is tracking.
            Rolling: ``S = held + T_new`` (the held positions, then the new ones).

        Raises:
            TypeError: non-tensors, non-float dtypes, a dtype or device different from the
                cached one.
            ValueError: not 4-D, k/v disagreeing on ``(B, Hkv, T_new)``, a batch size, head
                count or width different from the cached one, or going past ``max_len``.
        """
        k, v = _check_pair(k, v, "LayerKVCache.update")
        self._check_matches(k, v)
        if self.window is not None:
            return self._roll(k, v)
        start, stop = self._length, self._length + k.shape[2]
        if self.max_len is not None and stop > self.max_len:
            raise ValueError(
                f"LayerKVCache.update: {start} cached + {k.shape[2]} new tokens = {stop} "
                f"exceeds max_len={self.max_len}; create the cache with a larger max_len"
            )
        tracked = (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)) or (
            self._k is not None and self._k.requires_grad
        )
        if tracked:
            # Out of place, so tensors saved for backward by earlier steps stay valid.
            self._k = k if self._k is None else torch.cat([self._k[:, :, :start], k], 2)
            self._v = v if self._v is None else torch.cat([self._v[:, :, :start], v], 2)
        else:
            if stop > self.capacity:
                self._grow(k, v, stop)
            assert self._k is not None and self._v is not None
            self._k[:, :, start:stop] = k  # (B, Hkv, T_new, D) written in place
            self._v[:, :, start:stop] = v  # (B, Hkv, T_new, Dv)
        self._length = stop
        return self._k[:, :, :stop], self._v[:, :, :stop]  # (B, Hkv, S, D), (B, Hkv, S, Dv)

    def _roll(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Rolling update: return held + new, then keep the last ``window`` positions."""
        assert self.window is not None
        keys = k if self._k is None else torch.cat([self._k, k], 2)  # (B, Hkv, S, D)
        values = v if self._v is None else torch.cat([self._v, v], 2)  # (B, Hkv, S, Dv)
        self._length += k.shape[2]
        keep = min(keys.shape[2], self.window)
        self._start = self._length - keep
        # A copy when positions are dropped, so the dropped ones are freed.
        self._k, self._v = (keys, values) if keep == keys.shape[2] else (
            keys[:, :, -keep:].clone(), values[:, :, -keep:].clone())  # fmt: skip
        return keys, values

    def visible(self, mask: Tensor, S: int) -> Tensor:
        """``mask`` cut to the keys the last :meth:`update` returned.

        A rolling cache returns the last ``S`` of the ``length`` positions; a mask whose last
        dimension counts all ``length`` positions (a ``(B, 1, 1, length)`` padding mask) keeps
        its last ``S`` columns. Any other mask is returned as it is.
        """
        if (isinstance(mask, Tensor) and mask.dim() >= 1 and S < self._length
                and mask.shape[-1] == self._length):  # fmt: skip
            return mask[..., self._length - S :]  # (..., S)
        return mask

    def set_static(self, k: Tensor, v: Tensor) -> None:
        """Store cross-attention keys ``(B, Hkv, S, D)`` and values ``(B, Hkv, S, Dv)``.

        They are computed once from the encoder output and reused at every decoding step.

        Raises:
            TypeError / ValueError: as :meth:`update` for malformed pairs.
        """
        self.static = _check_pair(k, v, "LayerKVCache.set_static")

    def reset(self) -> None:
        """Forget everything (buffers, length, static); the next update may change shapes."""
        self._k = self._v = None
        self._length = self._start = 0
        self.static = None

    def reorder(self, indices: Tensor | Sequence[int]) -> None:
        """Keep batch rows ``indices (B',)`` in that order (beam search); static included.

        Raises:
            ValueError: indices not 1-D integers, or out of ``[0, B)``.
        """
        idx = _check_indices(indices, self._batch())
        if self._k is not None and self._v is not None:
            idx_d = idx.to(self._k.device)
            n = self.held
            k, v = self._k, self._v
            # Copy only the filled part; the new buffers keep the old capacity.
            self._k = k.new_empty((idx.numel(), *k.shape[1:]))  # (B', Hkv, capacity, D)
            self._v = v.new_empty((idx.numel(), *v.shape[1:]))  # (B', Hkv, capacity, Dv)
            self._k[:, :, :n] = k[:, :, :n].index_select(0, idx_d)  # (B', Hkv, S, D)
            self._v[:, :, :n] = v[:, :, :n].index_select(0, idx_d)  # (B', Hkv, S, Dv)
        if self.static is not None:
            sk, sv = self.static
            idx_d = idx.to(sk.device)
            self.static = (sk.index_select(0, idx_d), sv.index_select(0, idx_d))

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` cached tokens (static entries are untouched).

        Raises:
            ValueError: ``n`` not an int in ``[0, length]`` (``[length - held, length]`` for
                a rolling cache: dropped positions cannot come back).
        """
        if not isinstance(n, int) or isinstance(n, bool) or not self._start <= n <= self._length:
            raise ValueError(
                f"crop: n must be an int in [{self._start}, {self._length}], got {n!r}"
                + (" (a rolling cache has dropped the positions before)" if self._start else "")
            )
        if self.window is not None and self._k is not None and self._v is not None:
            self._k = self._k[:, :, : n - self._start]  # (B, Hkv, held', D)
            self._v = self._v[:, :, : n - self._start]  # (B, Hkv, held', Dv)
        self._length = n

    def _batch(self) -> int | None:
        """Cached batch size, or None when nothing is cached."""
        if self._k is not None:
            return self._k.shape[0]
        return None if self.static is None else self.static[0].shape[0]

    def _grow(self, k: Tensor, v: Tensor, needed: int) -> None:
        """Reallocate to hold at least ``needed`` tokens, copying the cached ones."""
        if self.max_len is not None:
            capacity = self.max_len
        else:
            capacity = max(needed, 2 * self.capacity, _MIN_CAPACITY)
        B, Hkv, _, D = k.shape
        new_k = k.new_empty((B, Hkv, capacity, D))  # (B, Hkv, capacity, D)
        new_v = v.new_empty((B, Hkv, capacity, v.shape[3]))  # (B, Hkv, capacity, Dv)
        if self._k is not None and self._v is not None and self._length:
            new_k[:, :, : self._length] = self._k[:, :, : self._length]
            new_v[:, :, : self._length] = self._v[:, :, : self._length]
        self._k, self._v = new_k, new_v

    def _check_matches(self, k: Tensor, v: Tensor) -> None:
        """The new tokens must have the cached batch size, heads, widths, dtype and device."""
        if self._k is None or self._v is None:
            return
        ck, cv = self._k, self._v
        for field, i in (("batch size B", 0), ("key/value heads Hkv", 1)):
            if k.shape[i] != ck.shape[i]:
                raise ValueError(
                    f"LayerKVCache.update: {field} changed between steps: cached "
                    f"{ck.shape[i]}, got k {_shape(k)}; reset() before starting a new batch"
                )
        if k.shape[3] != ck.shape[3] or v.shape[3] != cv.shape[3]:
            raise ValueError(
                f"LayerKVCache.update: head width changed between steps: cached D={ck.shape[3]}"
                f", Dv={cv.shape[3]}, got k {_shape(k)} and v {_shape(v)}"
            )
        if k.dtype != ck.dtype or k.device != ck.device:
            raise TypeError(
                f"LayerKVCache.update: dtype/device changed between steps: cached {ck.dtype} "
                f"on {ck.device}, got {k.dtype} on {k.device}"
            )


class KVCache:
    """One :class:`LayerKVCache` per layer of a model.

    Args:
        num_layers: number of attention layers; ``cache[i]`` is layer ``i``'s cache.
        max_len: passed to every layer (preallocate for ``max_len`` tokens), or None to grow.
        windows: None, or one entry per layer: None (keep every position) or ``w`` (a rolling
            layer keeping the last ``w`` positions: its attention's sliding window).

    Raises:
        ValueError: ``num_layers`` not a positive int, ``max_len`` not a positive int or None,
            ``windows`` not ``num_layers`` entries of None or positive ints.
    """

    def __init__(self, num_layers: int, *, max_len: int | None = None,
                 windows: Sequence[int | None] | None = None) -> None:  # fmt: skip
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.max_len = _check_max_len(max_len)
        if windows is None:
            windows = [None] * num_layers
        if isinstance(windows, (str, bytes)) or len(windows) != num_layers:
            raise ValueError(
                f"windows must hold one entry per layer ({num_layers}), got {windows!r}"
            )
        self.layers = [LayerKVCache(max_len=max_len, window=w) for w in windows]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerKVCache:
        if not isinstance(i, int) or not -len(self.layers) <= i < len(self.layers):
            raise IndexError(f"layer index must be an int in [0, {len(self.layers)}), got {i!r}")
        return self.layers[i]

    def __iter__(self) -> Iterator[LayerKVCache]:
        return iter(self.layers)

    def __repr__(self) -> str:
        return f"KVCache(num_layers={len(self.layers)}, length={self.length})"

    @property
    def length(self) -> int:
        """Tokens cached in layer 0 (every layer holds the same number between steps)."""
        return self.layers[0].length

    def reset(self) -> None:
        """Empty every layer."""
        for layer in self.layers:
            layer.reset()

    def reorder(self, indices: Tensor | Sequence[int]) -> None:
        """Select batch rows ``indices (B',)`` in every layer (beam search).

        Raises:
            ValueError: as :meth:`LayerKVCache.reorder`; checked on every layer before any
                layer changes.
        """
        for layer in self.layers:
            _check_indices(indices, layer._batch())
        for layer in self.layers:
            layer.reorder(indices)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens in every layer (see :meth:`LayerKVCache.crop`).

        Raises:
            ValueError: ``n`` not an int in ``[0, L]`` with ``L`` the shortest layer's length;
                checked before any layer changes.
        """
        shortest = min(layer.length for layer in self.layers)
        dropped = max(layer.length - layer.held for layer in self.layers)  # rolling layers
        if not isinstance(n, int) or isinstance(n, bool) or not dropped <= n <= shortest:
            raise ValueError(f"crop: n must be an int in [{dropped}, {shortest}], got {n!r}")
        for layer in self.layers:
            layer.crop(n)
