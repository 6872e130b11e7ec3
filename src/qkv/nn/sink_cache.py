"""Attention sinks: a cache that keeps the first tokens and the recent ones, for endless
generation in flat memory (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks").

Language models put much of every query's attention on the first few tokens whatever they
say (on SmolLM2, 99.8% of a row's rollout lands on key 0): they serve as a "sink" for
attention that has nowhere better to go. A plain rolling window drops them once the text is
longer than the window, and the model's outputs fall apart. :class:`SinkLayerKVCache` keeps
``sinks`` first positions plus the last ``recent`` ones.

Positions are re-based, as StreamingLLM does for rotary embeddings: the cache stores keys
*before* rotation, and each step rotates the held keys at their places in the cache
(``0 .. S-1``) and the new queries after them, so no distance ever exceeds the cache's size
(the model never sees a position it was not trained on, however long the text). The attention
layer does the rotation when its cache says ``rebased`` (:meth:`qkv.nn.Attention`).
``sinks=0`` is the plain rolling window with re-based positions (the baseline that fails).

Shapes: ``B`` rows, ``Hkv`` key/value heads, ``S`` held + new positions, ``D`` head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.nn.cache import KVCache, LayerKVCache, _check_pair

__all__ = ["SinkLayerKVCache", "sink_cache"]


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class SinkLayerKVCache(LayerKVCache):
    """One layer's keys (unrotated) and values: the first ``sinks`` positions and the last
    ``recent`` ones (see the module docstring).

    Args:
        sinks: first positions always kept (StreamingLLM uses 4).
        recent: most recent positions kept (>= 1).

    Attributes:
        length: tokens seen; ``held``: tokens stored (at most ``sinks + recent`` between
            steps).
    """

    rebased = True  # the attention layer rotates keys at their places in this cache

    def __init__(self, sinks: int, recent: int) -> None:
        super().__init__()
        self.sinks, self.recent = _count("sinks", sinks, 0), _count("recent", recent, 1)

    def __repr__(self) -> str:
        return (f"SinkLayerKVCache(length={self._length}, held={self.held}, sinks={self.sinks},"
                f" recent={self.recent})")  # fmt: skip

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k (B, Hkv, T, D)`` (unrotated) and ``v``; returns held + new keys and
        values (``S = held + T``), then keeps the sinks and the last ``recent``."""
        k, v = _check_pair(k, v, "SinkLayerKVCache.update")
        self._check_matches(k, v)
        keys = k if self._k is None else torch.cat([self._k, k], 2)  # (B, Hkv, S, D)
        values = v if self._v is None else torch.cat([self._v, v], 2)  # (B, Hkv, S, Dv)
        self._length += k.shape[2]
        S, n = keys.shape[2], self.sinks
        if S > n + self.recent:  # drop the middle; copies, so the dropped ones are freed
            self._k = torch.cat([keys[:, :, :n], keys[:, :, S - self.recent :]], 2)
            self._v = torch.cat([values[:, :, :n], values[:, :, S - self.recent :]], 2)
        else:
            self._k, self._v = keys, values
        self._start = self._length - self._k.shape[2]  # tokens dropped so far
        return keys, values

    def visible(self, mask: Tensor, S: int) -> Tensor:
        """A mask over all ``length`` positions cut to the sinks and the last ``S - sinks``."""
        if isinstance(mask, Tensor) and mask.dim() >= 1 and S < self._length \
                and mask.shape[-1] == self._length:  # fmt: skip
            return torch.cat([mask[..., : self.sinks], mask[..., self._length - S + self.sinks :]],
                             dim=-1)  # fmt: skip
        return mask

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens; only while nothing was dropped.

        Raises:
            ValueError: ``n`` not in ``[0, length]``, or positions already dropped.
        """
        if self._start:
            raise ValueError(f"crop: this sink cache has dropped {self._start} positions; "
                             "they cannot come back")  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length:
            raise ValueError(f"crop: n must be an int in [0, {self._length}], got {n!r}")
        if self._k is not None and self._v is not None:
            self._k, self._v = self._k[:, :, :n], self._v[:, :, :n]
        self._length = n


def sink_cache(num_layers: int, sinks: int, recent: int) -> KVCache:
    """A :class:`~qkv.nn.KVCache` of ``num_layers`` :class:`SinkLayerKVCache` layers.

    Raises:
        ValueError: ``num_layers`` < 1, ``sinks`` < 0 or ``recent`` < 1.
    """
    cache = KVCache(num_layers)
    cache.layers = [SinkLayerKVCache(sinks, recent) for _ in range(num_layers)]
    return cache
