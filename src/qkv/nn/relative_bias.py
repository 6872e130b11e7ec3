"""T5's learned, bucketed relative position bias as a module (Raffel et al., 2020, section 2.1).

Each head ``h`` adds a learned scalar to every attention score, chosen by the bucket of the
key's offset from the query (:func:`qkv.attention.score_mods.relative_position_bucket`):

    scores[b, h, i, j] += weight[bucket(j - i), h]

Near offsets get a bucket each, far ones share logarithmically wider buckets, and every offset
beyond ``max_distance`` shares the last. A bidirectional bias (encoders) gives keys before and
after the query separate buckets; a causal one (decoders) only looks back.

T5 computes the bias once per stack, in the first layer, and every layer of that stack adds the
same ``(1, H, T, S)`` tensor: a model holds one :class:`RelativePositionBias` per stack, calls it
once per forward pass and passes the result to each block as a float mask (see
:class:`qkv.models.Seq2SeqTransformer` with ``positions="relative"``). The same bias as a
FlexAttention ``score_mod`` is :func:`qkv.attention.score_mods.relative_bias` (same table).

Shapes: ``H`` heads, ``T`` queries, ``S`` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention.score_mods import relative_position_bucket
from qkv.checks import positive_int

__all__ = ["RelativePositionBias"]


class RelativePositionBias(nn.Module):
    """Learned bucketed relative position bias ``(1, H, T, S)`` (T5).

    Args:
        num_heads: heads ``H`` (one bias per head and bucket).
        num_buckets: buckets in all (both directions together when ``bidirectional``).
        max_distance: offset from which every position shares the last bucket.
        bidirectional: True for encoders (keys on both sides), False for causal decoders.

    The parameter ``weight`` is ``(num_buckets, H)``, the layout of Hugging Face T5's
    ``relative_attention_bias`` embedding, so a checkpoint's table is copied as it is.
    Initialised ``N(0, 1)`` like an ``nn.Embedding``.

    Raises:
        ValueError: a non-positive ``num_heads``; ``num_buckets`` or ``max_distance`` that
            leave no exact bucket (from :func:`relative_position_bucket`).
        TypeError: ``bidirectional`` not a bool.
    """

    def __init__(
        self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, *,
        bidirectional: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = positive_int("num_heads", num_heads)
        # Validates the bucket arguments (raises naming them) before any parameter exists.
        relative_position_bucket(torch.zeros(1, dtype=torch.long), num_buckets, max_distance,
                                 bidirectional)  # fmt: skip
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def buckets(self, T: int, S: int, offset: int = 0) -> Tensor:
        """Bucket of each (query, key) pair: ``(T, S)`` long, queries at ``offset ..
        offset + T - 1`` (after ``offset`` cached tokens), keys at ``0 .. S - 1``."""
        device = self.weight.device
        q = torch.arange(offset, offset + T, device=device)  # (T,)
        k = torch.arange(S, device=device)  # (S,)
        return relative_position_bucket(k[None, :] - q[:, None], self.num_buckets,
                                        self.max_distance, self.bidirectional)  # (T, S)

    def forward(
        self, T: int, S: int, offset: int = 0, *, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The bias to add to the scores of ``T`` queries against ``S`` keys.

        Args:
            T: queries, at positions ``offset .. offset + T - 1``.
            S: keys, at positions ``0 .. S - 1`` (``offset + T`` for self-attention with a
                cache).
            offset: position of the first query (the cache length when decoding).
            dtype: dtype of the result (default the weight's).

        Returns:
            ``(1, H, T, S)``.

        Raises:
            ValueError: ``T`` or ``S`` not a positive int, ``offset`` not an int >= 0.
        """
        positive_int("T", T)
        positive_int("S", S)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {offset!r}")
        bias = self.weight[self.buckets(T, S, offset)]  # (T, S, H)
        bias = bias.permute(2, 0, 1)[None]  # (1, H, T, S)
        return bias if dtype is None else bias.to(dtype)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}")
