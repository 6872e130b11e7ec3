"""Attention one head at a time: the teaching modules.

:class:`AttentionHead` is a single head with its own query, key and value projections;
:class:`SelfAttention` is one input projected to Q, K and V; :class:`HeadList` is multi-head
attention written the long way, a list of heads whose outputs are concatenated and projected.
They compute exactly what :class:`~qkv.nn.attention.Attention` computes (``HeadList.to_attention``
makes the equivalent ``Attention``) but keep each head visible, and always return weights.
Each head is an :class:`~qkv.nn.core.AttentionCore` with ``H = 1``: it has the hook points of
every attention module, so :mod:`qkv.inspect` captures it (``heads.0``, ``heads.1``, ...).

Every head scales its scores by ``1/√D`` as in Vaswani et al. (2017).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.attention import masks
from qkv.attention.masks import check_attn_mask
from qkv.checks import positive_int
from qkv.nn.attention import Attention
from qkv.nn.core import AttentionCore

__all__ = ["AttentionHead", "HeadList", "SelfAttention"]



def _check_input(name: str, t: object, width: int, weight: Tensor) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3 or t.shape[-1] != width:
        length = "T" if name == "x" else "S"
        raise ValueError(f"{name} must have shape (B, {length}, E={width}), got {tuple(t.shape)}")
    if t.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the parameters are {weight.dtype}")
    return t


class _SingleHead(AttentionCore):
    """A one-head :class:`~qkv.nn.core.AttentionCore` on ``(B, T, D)`` tensors."""

    num_heads = num_kv_heads = 1

    def _one_head(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """``(B, T, D)`` queries -> ``(out (B, T, Dv), weights (B, T, S))``; ``mask`` is
        checked here (the public boundary) against the scores ``(B, 1, T, S)``."""
        q, k, v = q[:, None], k[:, None], v[:, None]  # (B, 1, T|S, D)
        if mask is not None:
            shape = (q.shape[0], 1, q.shape[2], k.shape[2])
            mask = check_attn_mask(mask, shape, name="mask", dtype=q.dtype)
        out, weights = self.attend(q, k, v, mask=mask, need_weights=True)  # (B, 1, T, Dv)
        return out[:, 0], weights[:, 0]  # (B, T, Dv), (B, T, S)


class AttentionHead(_SingleHead):
    """One attention head with its own ``query``, ``key`` and ``value`` projections.

    Args:
        d_model: input width ``E`` (of ``x`` and of the context).
        d_head: head width ``D`` (queries, keys and values).
        causal: hide later positions (self-attention only).
        max_len: if given, the causal mask is a precomputed lower-triangular ``(max_len,
            max_len)`` buffer ``tril`` (sliced per call) and longer inputs raise; if None it
            is built per call with :func:`qkv.masks.causal`.
        bias: biases in the three projections.

    Raises:
        ValueError: non-positive ``d_model``, ``d_head`` or ``max_len``.
    """

    tril: Tensor | None

    def __init__(
        self,
        d_model: int,
        d_head: int,
        *,
        causal: bool = False,
        max_len: int | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.d_head = positive_int("d_head", d_head)
        self.causal = bool(causal)
        self.max_len = None if max_len is None else positive_int("max_len", max_len)
        self.query = nn.Linear(d_model, d_head, bias=bias)
        self.key = nn.Linear(d_model, d_head, bias=bias)
        self.value = nn.Linear(d_model, d_head, bias=bias)
        tril = None
        if self.causal and self.max_len is not None:
            tril = torch.ones(self.max_len, self.max_len, dtype=torch.bool).tril()  # (L, L)
        # Non-persistent: a function of max_len, not a learned or saved quantity.
        self.register_buffer("tril", tril, persistent=False)

    def forward(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``context`` (or to itself).

        Args:
            x: ``(B, T, E)``.
            context: ``(B, S, E)`` or None for self-attention (``S = T``).

        Returns:
            ``(out (B, T, D), weights (B, T, S))``.

        Raises:
            TypeError: non-tensors or a dtype different from the parameters'.
            ValueError: wrong shapes, a context on a causal head, ``T`` over ``max_len``.
        """
        weight = self.query.weight
        _check_input("x", x, self.d_model, weight)
        if context is not None:
            _check_input("context", context, self.d_model, weight)
            if self.causal:
                raise ValueError(
                    "causal=True hides later positions of the same sequence; a causal head "
                    "cannot attend to a context (cross-attention)"
                )
            if context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context batch size {context.shape[0]} must equal x's {x.shape[0]}"
                )
        source = x if context is None else context
        q = self.query(x)  # (B, T, D)
        k = self.key(source)  # (B, S, D)
        v = self.value(source)  # (B, S, D)
        return self._one_head(q, k, v, self._causal_mask(x.shape[1], x.device))

    def _causal_mask(self, T: int, device: torch.device) -> Tensor | None:
        if not self.causal:
            return None
        if self.tril is None:
            return masks.causal(T, device=device)  # (T, T)
        if self.tril.shape[0] < T:
            raise ValueError(f"sequence length T={T} exceeds max_len={self.max_len}")
        return self.tril[:T, :T]  # (T, T)

    def extra_repr(self) -> str:
        extra = ", causal=True" if self.causal else ""
        extra += f", max_len={self.max_len}" if self.max_len is not None else ""
        return f"d_model={self.d_model}, d_head={self.d_head}{extra}"


class SelfAttention(_SingleHead):
    """Single-head self-attention: ``x`` projected to Q, K and V, no output projection.

    Args:
        d_model: input width ``E``.
        d_head: width ``D`` of Q, K, V and of the output (default ``E``).
        bias: biases in ``q_proj``, ``k_proj``, ``v_proj``.

    Raises:
        ValueError: non-positive ``d_model`` or ``d_head``.
    """

    def __init__(self, d_model: int, *, d_head: int | None = None, bias: bool = False) -> None:
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.d_head = positive_int("d_head", d_model if d_head is None else d_head)
        self.q_proj = nn.Linear(d_model, self.d_head, bias=bias)
        self.k_proj = nn.Linear(d_model, self.d_head, bias=bias)
        self.v_proj = nn.Linear(d_model, self.d_head, bias=bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Every position attends to every (unmasked) position of ``x``.

        Args:
            x: ``(B, T, E)``.
            mask: keep mask (True = may attend) or float mask, broadcastable to ``(B, T, T)``;
                4-D masks ``(B, 1, T|1, T)`` (as from :func:`qkv.masks.padding`) are accepted.

        Returns:
            ``(out (B, T, D), weights (B, T, T))``.

        Raises:
            TypeError: non-tensor ``x`` or ``mask``, or a dtype different from the parameters'.
            ValueError: ``x`` not ``(B, T, E)``; a mask that does not broadcast.
        """
        _check_input("x", x, self.d_model, self.q_proj.weight)
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
            if mask.dim() == 3:
                mask = mask[:, None]  # (B, 1, T, T): the single head dimension
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, D) each
        return self._one_head(q, k, v, mask)


class HeadList(nn.Module):
    """Multi-head attention as a list of :class:`AttentionHead` plus an output projection.

    ``out = out_proj(concat_h head_h(x))``. Equal to :class:`Attention` with head ``h``'s
    query/key/value weights as rows ``h·D .. (h+1)·D - 1`` of ``q_proj``/``k_proj``/``v_proj``
    (see :meth:`to_attention`); slower (one small matmul per head) but every head is a module.

    Args:
        d_model: model width ``E``; each head has width ``E / num_heads``.
        num_heads: number of heads ``H``.
        causal: causal self-attention.
        bias: biases in the heads' projections and in ``out_proj``.

    Raises:
        ValueError: non-positive sizes or ``d_model % num_heads != 0``.
    """

    def __init__(
        self, d_model: int, num_heads: int, *, causal: bool = False, bias: bool = True
    ) -> None:
        super().__init__()
        self.d_model = positive_int("d_model", d_model)
        self.num_heads = positive_int("num_heads", num_heads)
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.causal = bool(causal)
        d_head = d_model // num_heads
        self.heads = nn.ModuleList(
            AttentionHead(d_model, d_head, causal=causal, bias=bias) for _ in range(num_heads)
        )
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run every head, concatenate, project.

        Args:
            x: ``(B, T, E)``.
            context: ``(B, S, E)`` or None for self-attention.

        Returns:
            ``(out (B, T, E), weights (B, H, T, S))``.

        Raises:
            As :meth:`AttentionHead.forward`.
        """
        outs, weights = zip(*(head(x, context) for head in self.heads), strict=True)
        out = torch.cat(outs, dim=-1)  # (B, T, H·D)
        return self.out_proj(out), torch.stack(weights, dim=1)  # (B, T, E), (B, H, T, S)

    def to_attention(self) -> Attention:
        """The :class:`Attention` computing the same function, with these weights copied in."""
        head = self.heads[0]
        bias = head.query.bias is not None
        attn = Attention(self.d_model, self.num_heads, bias=bias)
        attn = attn.to(device=self.out_proj.weight.device, dtype=self.out_proj.weight.dtype)
        with torch.no_grad():
            pairs = (("query", attn.q_proj), ("key", attn.k_proj), ("value", attn.v_proj))
            for name, proj in pairs:
                layers = [getattr(h, name) for h in self.heads]
                proj.weight.copy_(torch.cat([lin.weight for lin in layers], 0))  # (H·D, E)
                if bias:
                    proj.bias.copy_(torch.cat([lin.bias for lin in layers], 0))  # (H·D,)
            attn.out_proj.load_state_dict(self.out_proj.state_dict())
        return attn
