"""Modules for the attention of RNN encoder-decoders: Bahdanau (additive) and Luong.

Each module owns its parameters and calls the functions of :mod:`qkv.attention.additive`;
the arithmetic lives there. Both take one decoder state per example, ``query (B, Dq)``, the
way an RNN decoder calls attention once per step, or a whole sequence ``(B, T, Dq)`` (teacher
forcing), and attend over encoder states ``keys (B, S, Dk)``.

    BahdanauAttention:  e[t, s] = vᵀ tanh(W_q q_t + b + W_k k_s)      (Bahdanau et al., 2014)
    LuongAttention:     e[t, s] = q_t · k_s  or  q_t W k_sᵀ           (Luong et al., 2015)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.attention.additive import KINDS, additive_attention, luong_attention

__all__ = ["BahdanauAttention", "LuongAttention"]


def _positive(name: str, n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _prepare(
    query: Tensor, keys: Tensor, values: Tensor | None, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """Bring a single decoder step ``(B, Dq)`` to ``(B, 1, Dq)``; default values to keys.

    Returns ``(query (B, T, Dq), values (B, S, Dv), mask, single_step)``.
    """
    for name, t in (("query", query), ("keys", keys), ("values", values), ("mask", mask)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() not in (2, 3):
        raise ValueError(
            f"query must be (B, Dq) for one decoder step or (B, T, Dq), got {_shape(query)}"
        )
    if keys.dim() != 3:
        raise ValueError(f"keys must be (B, S, Dk), got {_shape(keys)}")
    values = keys if values is None else values
    single = query.dim() == 2
    if single:
        query = query.unsqueeze(-2)  # (B, 1, Dq)
        if mask is not None:
            B, S = query.shape[0], keys.shape[-2]
            try:
                fits = torch.broadcast_shapes(mask.shape, (B, S)) == (B, S)
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(
                    f"for a single decoder step (query {_shape(query[:, 0])}) mask must "
                    f"broadcast to (B, S) = ({B}, {S}), got {_shape(mask)}"
                )
            mask = mask.unsqueeze(-2) if mask.dim() else mask  # (B, 1, S)
    return query, values, mask, single


def _finish(context: Tensor, weights: Tensor, single: bool) -> tuple[Tensor, Tensor]:
    if single:
        return context.squeeze(-2), weights.squeeze(-2)  # (B, Dv), (B, S)
    return context, weights  # (B, T, Dv), (B, T, S)


class BahdanauAttention(nn.Module):
    """Additive attention ``e[t, s] = vᵀ tanh(W_q q_t + b + W_k k_s)`` (Bahdanau et al., 2014).

    Args:
        query_dim: ``Dq``, the width of the decoder state.
        key_dim: ``Dk``, the width of the encoder states.
        hidden_dim: ``A``, the width of the scoring network.
        bias: give the query projection a bias ``b`` (the key projection has none: one bias
            on the sum is all the formula has).

    Attributes:
        w_query: ``nn.Linear(Dq, A)``; ``w_query.weight`` is ``W_qᵀ``, ``(A, Dq)``.
        w_key: ``nn.Linear(Dk, A, bias=False)``.
        v: ``(A,)``, initialised like a ``Linear(A, 1)`` weight.

    Raises:
        ValueError: a width that is not a positive int.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.query_dim = _positive("query_dim", query_dim)
        self.key_dim = _positive("key_dim", key_dim)
        self.hidden_dim = _positive("hidden_dim", hidden_dim)
        factory = dict(device=device, dtype=dtype)
        self.w_query = nn.Linear(query_dim, hidden_dim, bias=bias, **factory)
        self.w_key = nn.Linear(key_dim, hidden_dim, bias=False, **factory)
        self.v = nn.Parameter(torch.empty(hidden_dim, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.w_query.reset_parameters()
        self.w_key.reset_parameters()
        bound = 1.0 / math.sqrt(self.hidden_dim)
        nn.init.uniform_(self.v, -bound, bound)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attend from decoder state(s) to encoder states.

        Args:
            query: ``(B, Dq)`` for one decoder step, or ``(B, T, Dq)``.
            keys: ``(B, S, Dk)``.
            values: ``(B, S, Dv)``; defaults to ``keys`` (the encoder states, as in the paper).
            mask: bool (True = may attend) or float (added), broadcastable to ``(B, S)`` for
                one step or ``(B, T, S)`` otherwise; e.g. ``qkv.masks.padding(lengths)[:, 0]``
                is ``(B, 1, S)`` and ``[:, 0, 0]`` is ``(B, S)``.

        Returns:
            ``(context, weights)``: ``(B, Dv)`` and ``(B, S)`` for one step, else
            ``(B, T, Dv)`` and ``(B, T, S)``. Rows with no visible key are zero.

        Raises:
            TypeError, ValueError: wrong ranks or widths, bad masks (see
            :func:`qkv.attention.additive.additive_attention`).
        """
        query, values, mask, single = _prepare(query, keys, values, mask)
        context, weights = additive_attention(
            query,
            keys,
            values,
            self.w_query.weight.T,  # (Dq, A)
            self.w_key.weight.T,  # (Dk, A)
            self.v,
            self.w_query.bias,
            mask,
        )
        return _finish(context, weights, single)

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, hidden_dim={self.hidden_dim}"


class LuongAttention(nn.Module):
    """Luong's multiplicative attention: ``"general"`` ``q W kᵀ`` or ``"dot"`` ``q·k``.

    Only the score and the context (Luong et al., 2015, section 3.1); the paper's attentional
    state ``tanh(W_c [c_t ; h_t])`` is left to the decoder that uses this module. Luong's
    ``"concat"`` score is :class:`BahdanauAttention`.

    Args:
        query_dim: ``Dq``, the width of the decoder state.
        key_dim: ``Dk``, the width of the encoder states; defaults to ``query_dim``.
        kind: ``"general"`` (a learned ``weight (Dq, Dk)``) or ``"dot"`` (no parameters,
            needs ``Dq == Dk``).

    Attributes:
        weight: ``(Dq, Dk)`` for ``"general"``, initialised like a ``Linear(Dk, Dq)`` weight;
            None for ``"dot"``.

    Raises:
        ValueError: a width that is not a positive int, an unknown ``kind``, or
            ``kind="dot"`` with ``key_dim != query_dim``.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int | None = None,
        kind: str = "general",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.query_dim = _positive("query_dim", query_dim)
        self.key_dim = query_dim if key_dim is None else _positive("key_dim", key_dim)
        if kind not in KINDS:
            raise ValueError(
                f"kind must be one of {KINDS}, got {kind!r} (Luong's 'concat' is "
                "BahdanauAttention)"
            )
        if kind == "dot" and self.key_dim != self.query_dim:
            raise ValueError(
                f"kind='dot' needs key_dim == query_dim, got query_dim={query_dim} and "
                f"key_dim={key_dim}; use kind='general'"
            )
        self.kind = kind
        if kind == "general":
            self.weight = nn.Parameter(
                torch.empty(self.query_dim, self.key_dim, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            bound = 1.0 / math.sqrt(self.key_dim)
            nn.init.uniform_(self.weight, -bound, bound)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attend from decoder state(s) to encoder states.

        Args:
            query: ``(B, Dq)`` for one decoder step, or ``(B, T, Dq)``.
            keys: ``(B, S, Dk)``.
            values: ``(B, S, Dv)``; defaults to ``keys``.
            mask: as in :meth:`BahdanauAttention.forward`.

        Returns:
            ``(context, weights)``: ``(B, Dv)`` and ``(B, S)`` for one step, else
            ``(B, T, Dv)`` and ``(B, T, S)``.

        Raises:
            TypeError, ValueError: wrong ranks or widths, bad masks (see
            :func:`qkv.attention.additive.luong_attention`).
        """
        query, values, mask, single = _prepare(query, keys, values, mask)
        context, weights = luong_attention(
            query, keys, values, kind=self.kind, weight=self.weight, mask=mask
        )
        return _finish(context, weights, single)

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, kind={self.kind!r}"
