"""Reading the residual stream as logits: the logit lens and direct logit attribution.

* :func:`logit_lens` (nostalgebraist, 2020): the model's final norm and unembedding applied to
  the stream entering every block, so each layer gives next-token logits ``(L+1, B, T, V)``;
  the last row is the model's own logits.
* :func:`direct_logit_attribution`: each term of the final stream (embeddings, every head,
  the biases, the feed-forwards: :mod:`qkv.inspect.decompose`) projected on a token direction
  ``W_U[a]`` (or ``W_U[a] - W_U[b]`` for a logit difference). The final norm is not linear, so,
  as TransformerLens does, its scale is *frozen* at the value the whole stream gives: with
  ``σ`` LayerNorm's standard deviation of the stream ``x``,

      LN(x)·d = Σ_c ((c - mean c) / σ) ⊙ w · d  +  b · d

  (RMSNorm: ``c / rms(x) ⊙ w``, no mean), so the terms plus the constant (norm bias and
  unembedding bias, labelled ``"bias"``) sum to the logit (difference) exactly.

The final norm and the unembedding are found by name (``norm_f`` or ``decoder_norm``, and
``lm_head``); pass ``norm=`` / ``unembed=`` for other models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.inspect.decompose import ResidComponents, decompose_resid

__all__ = ["Attribution", "LogitLens", "direct_logit_attribution", "logit_lens", "readout"]

# The final norm after each block stack, by the stack's name (qkv's models).
_FINAL_NORMS = {
    "blocks": "norm_f", "decoder_blocks": "decoder_norm", "encoder_blocks": "encoder_norm",
}


def readout(model: nn.Module, stack: str, norm: object = "auto", unembed: object = "auto"):
    """``(final norm or None, unembedding nn.Linear)`` of ``model`` after block stack ``stack``.

    Raises:
        ValueError: no ``lm_head`` (e.g. an :class:`~qkv.models.Encoder`) and no ``unembed``.
        TypeError: a ``norm`` or ``unembed`` that is not a module.
    """
    if norm == "auto":
        norm = getattr(model, _FINAL_NORMS.get(stack, "norm_f"), None)
    if unembed == "auto":
        unembed = getattr(model, "lm_head", None)
        if unembed is None:
            raise ValueError(
                f"{type(model).__name__} has no lm_head to read logits with: pass unembed= "
                "(an nn.Linear(E, V))"
            )
    if norm is not None and not isinstance(norm, nn.Module):
        raise TypeError(f"norm must be a module or None, got {type(norm).__name__}")
    if not isinstance(unembed, nn.Linear):
        raise TypeError(f"unembed must be an nn.Linear(E, V), got {type(unembed).__name__}")
    return norm, unembed


@dataclass(frozen=True)
class LogitLens:
    """Logits read from every layer's residual stream.

    Attributes:
        logits: ``(L+1, B, T, V)``; row ``l`` reads the stream entering block ``l``, row ``L``
            the last block's output (the model's logits).
    """

    logits: Tensor

    def probs(self) -> Tensor:
        """``(L+1, B, T, V)`` softmax over the vocabulary."""
        return self.logits.float().softmax(-1)

    def top(self, k: int = 1) -> tuple[Tensor, Tensor]:
        """``(probs, token ids)``, each ``(L+1, B, T, k)``: each layer's ``k`` likeliest tokens."""
        return self.probs().topk(k, dim=-1)

    def prob_of(self, tokens: Tensor) -> Tensor:
        """``(L+1, B, T)``: each layer's probability of ``tokens (B, T)`` (e.g. the next ids)."""
        p = self.probs()
        index = tokens.to(torch.long)[None, ..., None].expand(p.shape[0], *tokens.shape, 1)
        # index: (L+1, B, T, 1)
        return p.gather(-1, index)[..., 0]  # (L+1, B, T)


def logit_lens(cache, *, stack: str | None = None, norm: object = "auto",
               unembed: object = "auto") -> LogitLens:  # fmt: skip
    """The final norm and unembedding applied to every layer's residual stream.

    Args:
        cache: an :class:`~qkv.inspect.cache.ActivationCache` with the ``hook_resid_pre`` of
            every block and the last ``hook_resid_post``.
        stack: the block stack (default: the one feeding the output).
        norm, unembed: override the final norm (None: none) and the unembedding.

    A model whose config has ``logit_softcap`` gets its logits soft-capped the same way, so the
    last row equals the model's logits.

    Returns:
        a :class:`LogitLens` with logits ``(L+1, B, T, V)``.
    """
    s = cache.default_stack(stack)
    norm, unembed = readout(cache.model, s, norm, unembed)
    cap = getattr(getattr(cache.model, "config", None), "logit_softcap", None)
    with torch.no_grad():
        resid = cache.accumulated_resid(s)  # (L+1, B, T, E)
        logits = unembed(resid if norm is None else norm(resid))  # (L+1, B, T, V)
        if cap is not None:  # the model's own soft-capping of its logits (Gemma 2)
            logits = cap * torch.tanh(logits / cap)
        return LogitLens(logits)


@dataclass(frozen=True)
class Attribution:
    """Direct logit attribution of each residual-stream term.

    Attributes:
        values: ``(N+1, B)``: each term's share of the logit (difference); the last row is the
            constant ``"bias"`` (final norm's bias and the unembedding's bias on the direction).
        labels: ``N+1`` names (see :class:`~qkv.inspect.decompose.ResidComponents`).
        parts: the decomposition the values came from.
    """

    values: Tensor
    labels: list[str]
    parts: ResidComponents

    def total(self) -> Tensor:
        """``(B,)``: the sum of every term, which is the logit (difference)."""
        return self.values.sum(0)

    def heads(self) -> Tensor:
        """``(L, H, B)``: the self-attention heads' values."""
        return self.parts.head_table(self.values[:-1])

    def __getitem__(self, label: str) -> Tensor:
        if label not in self.labels:
            raise KeyError(f"no term {label!r}; terms: {self.labels}")
        return self.values[self.labels.index(label)]


def _direction(tokens: object, unembed: nn.Linear, B: int) -> tuple[Tensor, Tensor]:
    """``(directions (B, E), unembedding bias on them (B,))`` for a token or a token pair."""
    t = torch.as_tensor(tokens)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 2:
        raise TypeError(
            "tokens must be a token id, a (correct, wrong) pair, or int tensors (B,) / (B, 2), "
            f"got {tokens!r:.80}"
        )
    if isinstance(tokens, (tuple, list)) and t.dim() == 1:
        t = t[None]  # a Python (correct, wrong) pair or [token]: the same for every sequence
    t = t.reshape(-1, 1) if t.dim() <= 1 else t
    t = t.expand(B, t.shape[1]) if t.shape[0] == 1 else t
    V = unembed.weight.shape[0]
    if t.shape[0] != B or t.shape[1] not in (1, 2) or t.min() < 0 or t.max() >= V:
        raise ValueError(
            f"tokens must give 1 or 2 token ids in [0, {V}) for each of the {B} sequences, got "
            f"shape {tuple(t.shape)} with values {t.min().item()}..{t.max().item()}"
        )
    w = unembed.weight.detach()
    b = unembed.bias.detach() if unembed.bias is not None else w.new_zeros(V)
    d, bias = w[t[:, 0]], b[t[:, 0]]  # (B, E), (B,)
    if t.shape[1] == 2:
        d, bias = d - w[t[:, 1]], bias - b[t[:, 1]]
    return d, bias


def _frozen_norm(norm: nn.Module | None, x: Tensor, parts: Tensor) -> tuple[Tensor, Tensor]:
    """``(each part through the norm with x's scale frozen (N, B, E), the norm's bias (E,))``."""
    E = x.shape[-1]
    if norm is None:
        return parts, x.new_zeros(E)
    eps = getattr(norm, "eps", None)
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    weight = norm.weight.detach() if getattr(norm, "weight", None) is not None else x.new_ones(E)
    if isinstance(norm, nn.LayerNorm):
        scale = (x.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()  # (B, 1)
        bias = norm.bias.detach() if norm.bias is not None else x.new_zeros(E)
        return (parts - parts.mean(-1, keepdim=True)) * scale * weight, bias
    if isinstance(norm, getattr(nn, "RMSNorm", ())):
        scale = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()  # (B, 1)
        return parts * scale * weight, x.new_zeros(E)
    raise TypeError(
        f"direct logit attribution freezes a LayerNorm or RMSNorm; got {type(norm).__name__}"
    )


def direct_logit_attribution(cache, tokens: object, *, position: int = -1, heads: bool = True,
                             stack: str | None = None, norm: object = "auto",
                             unembed: object = "auto") -> Attribution:  # fmt: skip
    """Each residual-stream term's direct contribution to a logit or a logit difference.

    Args:
        cache: an :class:`~qkv.inspect.cache.ActivationCache` of a pre-norm model in eval
            mode (what :func:`~qkv.inspect.decompose.decompose_resid` needs).
        tokens: a token id (its logit), a Python ``(correct, wrong)`` pair (their logit
            difference), or per-sequence int tensors ``(B,)`` / ``(B, 2)``.
        position: the query position whose logits are explained.
        heads: one term per head (else one per attention layer).
        stack, norm, unembed: as :func:`logit_lens`.

    Returns:
        an :class:`Attribution`; ``values.sum(0)`` is the logit (difference) the model gives.

    Raises:
        TypeError, ValueError: bad ``tokens``, an unsupported final norm, a position out of
            range; those of :func:`decompose_resid`.
    """
    s = cache.default_stack(stack)
    norm, unembed = readout(cache.model, s, norm, unembed)
    parts = decompose_resid(cache, None, heads=heads, stack=s)
    B, T = parts.stream.shape[:2]
    if isinstance(position, bool) or not isinstance(position, int) or not -T <= position < T:
        raise ValueError(f"position must be an int in [-{T}, {T}), got {position!r}")
    direction, unembed_bias = _direction(tokens, unembed, B)  # (B, E), (B,)
    x = parts.stream[:, position]  # (B, E)
    with torch.no_grad():
        normed, norm_bias = _frozen_norm(norm, x, parts.components[:, :, position])  # (N, B, E)
        values = torch.einsum("nbe,be->nb", normed, direction)  # (N, B)
        constant = direction @ norm_bias + unembed_bias  # (B,)
    return Attribution(torch.cat([values, constant[None]]), [*parts.labels, "bias"], parts)
