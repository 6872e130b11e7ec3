"""``MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` on qkv's attention.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) · W_O,
    head_h = Attention(Q·W_Q,h, K·W_K,h, V·W_V,h)                  (Vaswani et al., 2017)

The module owns the projections, splits heads, merges torch's masks into one SDPA mask
(:mod:`qkv.nn.mha_masks`) and hands the heads to the shared
:class:`~qkv.nn.core.AttentionCore` (hook points, the fastest exact kernel, weights on request),
so it can be captured, traced and ablated like every qkv model. Same constructor, ``forward``,
return values, parameters, ``state_dict`` keys and initialisation as torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from qkv.attention.masks import check_attn_mask
from qkv.nn import mha_masks
from qkv.nn.core import AttentionCore
from qkv.nn.errors import DropInArgumentError, DropInTypeError

__all__ = ["MultiheadAttention"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DropInArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


class MultiheadAttention(AttentionCore):
    """Multi-head attention with the interface of ``torch.nn.MultiheadAttention``.

    Args:
        embed_dim: model width ``E``; each of the ``H`` heads has width ``D = E / H``.
        num_heads: query heads ``H``; must divide ``embed_dim``.
        dropout: dropout on the attention weights, in training mode only.
        bias: learn biases in the input and output projections.
        add_bias_kv: append one learned key and value (``bias_k``, ``bias_v``) to the keys.
        add_zero_attn: append one all-zero key and value (after ``bias_k``/``bias_v``).
        kdim, vdim: widths of the ``key`` and ``value`` inputs (default ``embed_dim``).
        batch_first: inputs and output are ``(N, T, E)`` instead of ``(T, N, E)``.
        device, dtype: where and in what precision to create the parameters.
        num_kv_heads: keyword-only qkv extra, default ``None`` (= ``num_heads``). Grouped-query
            attention: ``Hkv`` key/value heads, each shared by ``H / Hkv`` query heads. When
            ``Hkv != H`` the projections are separate ``q_proj_weight (E, E)``,
            ``k_proj_weight (Hkv·D, kdim)``, ``v_proj_weight (Hkv·D, vdim)``, ``in_proj_bias``
            is ``(E + 2·Hkv·D,)`` and ``bias_k``/``bias_v`` are ``(1, 1, Hkv·D)``.

    Parameters (as torch): ``in_proj_weight (3E, E)`` when ``kdim == vdim == E`` (and no
    grouped-query heads), else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``;
    ``in_proj_bias (3E,)`` when ``bias``; ``out_proj`` (a Linear ``E -> E``); ``bias_k``,
    ``bias_v`` ``(1, 1, E)`` with ``add_bias_kv``. Projections are Xavier-uniform, biases 0.

    Raises:
        ValueError: non-positive sizes, ``num_heads`` not dividing ``embed_dim``,
            ``num_kv_heads`` not dividing ``num_heads``, ``dropout`` outside ``[0, 1]``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        _positive_int("embed_dim", embed_dim)
        _positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise DropInArgumentError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
                f"num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise DropInArgumentError(
                f"num_kv_heads must divide num_heads, got num_kv_heads={num_kv_heads} and "
                f"num_heads={num_heads}"
            )
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
            raise DropInArgumentError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = _positive_int("kdim", kdim) if kdim is not None else embed_dim
        self.vdim = _positive_int("vdim", vdim) if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        # torch's name: one packed (3E, E) projection when every input has width E.
        self._qkv_same_embed_dim = (
            self.kdim == embed_dim and self.vdim == embed_dim and num_kv_heads == num_heads
        )
        kv_width = num_kv_heads * self.head_dim  # Hkv·D rows in each of the K and V projections

        # Created in torch's order, so that one seed gives torch's initial values.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_width, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_width, self.vdim, **kw))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_width, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **kw)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, kv_width, **kw))
            self.bias_v = nn.Parameter(torch.empty(1, 1, kv_width, **kw))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's scheme: Xavier-uniform projections, zero biases, Xavier-normal bias_k/v."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``; torch's arguments and return values.

        Args:
            query: ``(T, N, E)``, ``(N, T, E)`` with ``batch_first``, or ``(T, E)`` unbatched.
            key: ``(S, N, kdim)``, ``(N, S, kdim)`` or ``(S, kdim)``, laid out like ``query``.
            value: ``(S, N, vdim)``, ``(N, S, vdim)`` or ``(S, vdim)``.
            key_padding_mask: ``(N, S)`` (``(S,)`` unbatched); bool True = ignore the key, or
                float added to the scores.
            need_weights: also return the attention weights (computed beside the fused
                output kernel, never instead of it).
            attn_mask: ``(T, S)`` or ``(N·H, T, S)`` (``(H, T, S)`` unbatched); bool True =
                may *not* attend, or float added to the scores.
            average_attn_weights: average the weights over heads.
            is_causal: hint that ``attn_mask`` is the causal mask; needs ``attn_mask``. Read
                as torch does (:func:`qkv.nn.mha_masks.resolve_causal`).

        Returns:
            ``(attn_output, attn_weights)``: output laid out like ``query`` with width ``E``;
            weights ``(N, T, S')`` averaged or ``(N, H, T, S')`` per head (no ``N`` when
            unbatched), or ``None`` without ``need_weights``; ``S'`` counts the keys added by
            ``add_bias_kv``/``add_zero_attn``. Unlike torch, a query row that sees no key
            (e.g. all keys padding) attends to nothing: zero weights and a zero context, so
            its output is ``out_proj.bias`` (zeros without bias), never NaN. In training with
            dropout the weights are the ones applied (after dropout), as torch returns them.

        Raises:
            TypeError: non-tensor inputs, mixed dtypes, masks neither bool nor float.
            ValueError: ranks, widths, lengths, batch sizes or mask shapes that do not fit
                (the message names the argument, the shape received and the one expected),
                masks on another device than ``query``, or ``is_causal=True`` without
                ``attn_mask``.
        """
        batched = self._check_inputs(query, key, value)
        self_attention = query is key and key is value
        # 1) Bring every input to (N, T, E) and a padding mask to (N, S).
        query, key, value = (self._batch_first(x, batched) for x in (query, key, value))
        (N, T, E), S, H = query.shape, key.shape[1], self.num_heads
        mha_masks.check_masks(key_padding_mask, attn_mask, batched=batched, N=N, H=H, T=T, S=S,
                              device=query.device)  # fmt: skip
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask[None]  # (1, S)
        attn_mask, is_causal = mha_masks.resolve_causal(
            attn_mask, is_causal, has_padding=key_padding_mask is not None,
            need_weights=need_weights,
        )

        # 2) Project and split heads; append the bias and zero keys torch appends.
        q, k, v = self._project(query, key, value, self_attention)  # (N, H|Hkv, T|S, D)
        k, v = self._append_keys(k, v)  # (N, Hkv, S', D)

        # 3) One mask in SDPA polarity, with the appended keys visible, checked once.
        mask = mha_masks.merge(key_padding_mask, attn_mask, N=N, H=H)
        mask = mha_masks.append_visible(mask, k.shape[2] - S)  # (N|1, H|1, T, S')
        if mask is not None:
            mask = check_attn_mask(mask, (N, H, T, k.shape[2]), dtype=q.dtype)

        # 4) The shared core: hook points, the fastest kernel, weights on request (rebuilt
        #    exactly from the kernel's log-sum-exp; after dropout, as torch returns them).
        out, weights = self.attend(
            q, k, v, mask=mask, is_causal=is_causal, need_weights=need_weights,
            dropout_p=self.dropout if self.training else 0.0, cross=not self_attention,
        )  # (N, H, T, D), (N, H, T, S') | None

        # 5) Merge heads, project out, restore the caller's layout.
        out = out.transpose(1, 2).reshape(N, T, E)  # (N, T, E)
        out = self.out_proj(out)  # (N, T, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (N, T, S')
        if not batched:
            return out[0], None if weights is None else weights[0]  # (T, E), (H|·, T, S')
        if not self.batch_first:
            out = out.transpose(0, 1)  # (T, N, E)
        return out, weights

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> bool:
        """Check ranks, dtypes and widths; return whether the inputs are batched (3-D)."""
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise DropInTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.is_nested or x.layout != torch.strided:
                kind = "a nested tensor" if x.is_nested else f"a {x.layout} tensor"
                raise DropInTypeError(
                    f"{name} is {kind}; qkv's MultiheadAttention takes dense tensors: pad the "
                    "sequences (torch.nested.to_padded_tensor) and pass key_padding_mask")
        layout = "(N, T, E)" if self.batch_first else "(T, N, E)"
        if query.dim() not in (2, 3):
            raise DropInArgumentError(
                f"query must be 3-D {layout} or 2-D (T, E) unbatched, got shape "
                f"{tuple(query.shape)}"
            )
        if not (key.device == value.device == query.device):
            raise DropInArgumentError(
                f"query, key and value must be on one device, got query on {query.device}, "
                f"key on {key.device}, value on {value.device}"
            )
        if not (key.dim() == value.dim() == query.dim()):
            raise DropInArgumentError(
                f"key and value must have as many dimensions as query ({query.dim()}-D), got "
                f"key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        dtype = self.out_proj.weight.dtype
        autocast = torch.is_autocast_enabled(query.device.type)  # casts inputs itself
        if not autocast and not (query.dtype == key.dtype == value.dtype == dtype):
            raise DropInTypeError(
                f"query, key and value must have the parameters' dtype {dtype}, got query "
                f"{query.dtype}, key {key.dtype}, value {value.dtype}"
            )
        for name, x, width in (
            ("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)
        ):
            if x.shape[-1] != width:
                what = "embed_dim" if name == "query" else name[0] + "dim"
                raise DropInArgumentError(
                    f"{name} must have last dimension {what}={width}, got shape {tuple(x.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise DropInArgumentError(
                "key and value must have the same length S and batch size N, got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)}"
            )
        batch_dim = 0 if self.batch_first else 1
        if query.dim() == 3 and query.shape[batch_dim] != key.shape[batch_dim]:
            raise DropInArgumentError(
                f"query and key must have the same batch size N (dimension {batch_dim} of "
                f"{layout}), got query {tuple(query.shape)} and key {tuple(key.shape)}"
            )
        return query.dim() == 3

    def _batch_first(self, x: Tensor, batched: bool) -> Tensor:
        """``x`` as ``(N, L, width)``: add a batch of one, or move the batch first."""
        if not batched:
            return x[None]  # (1, L, width)
        return x if self.batch_first else x.transpose(0, 1)  # (N, L, width)

    def _project(
        self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Input projections split into heads: ``(N, H, T, D)`` and ``(N, Hkv, S, D)`` twice."""
        E, KV = self.embed_dim, self.num_kv_heads * self.head_dim
        bias = self.in_proj_bias
        if bias is not None and bias.dtype != query.dtype:
            # torch accepts a bias of another dtype (in some layouts) and adds it in the
            # inputs' precision; qkv does so in every layout. Its gradient keeps its dtype.
            bias = bias.to(query.dtype)
        if self._qkv_same_embed_dim and self_attention:
            # One (3E, E) matmul instead of three when query, key and value are one tensor.
            q, k, v = F.linear(query, self.in_proj_weight, bias).split(E, dim=-1)  # (N, T, E)
        else:
            if self._qkv_same_embed_dim:
                weights = self.in_proj_weight.split([E, KV, KV])
            else:
                weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            biases = (None, None, None) if bias is None else bias.split([E, KV, KV])
            inputs = (query, key, value)
            q, k, v = (F.linear(x, w, b) for x, w, b in zip(inputs, weights, biases, strict=True))
        q = self._heads(q, self.num_heads)  # (N, H, T, D)
        return q, self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        N, L, _ = x.shape
        return x.reshape(N, L, heads, self.head_dim).transpose(1, 2)  # (N, heads, L, D)

    def _append_keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``bias_k``/``bias_v`` (``add_bias_kv``), then a zero key (``add_zero_attn``)."""
        N, Hkv, _, D = k.shape
        if self.bias_k is not None:
            bias_k = self.bias_k.reshape(1, Hkv, 1, D).expand(N, -1, -1, -1)  # (N, Hkv, 1, D)
            bias_v = self.bias_v.reshape(1, Hkv, 1, D).expand(N, -1, -1, -1)  # (N, Hkv, 1, D)
            k, v = torch.cat([k, bias_k], dim=2), torch.cat([v, bias_v], dim=2)  # (N, Hkv, S+1, D)
        if self.add_zero_attn:
            zeros = k.new_zeros(N, Hkv, 1, D)  # (N, Hkv, 1, D)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)  # (N, Hkv, S'+1, D)
        return k, v
