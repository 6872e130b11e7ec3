"""The residual stream as a sum of what wrote into it: embeddings, heads, biases, feed-forwards.

In a pre-norm block (GPT-2, Llama, a pre-norm encoder) every sublayer *adds* to the stream:

    resid_pre_l+1 = resid_pre_l + attn_out_l (+ cross_out_l) + ffn_out_l

and an attention output is its heads' outputs times their slices of ``out_proj`` plus a bias:

    attn_out = Σ_h z_h · W_Oᵀ[h·D:(h+1)·D]  +  b_O        z_h = hook_out[:, h]   (B, T, D)

(Elhage et al., 2021, "A Mathematical Framework for Transformer Circuits"). So the stream
entering block ``l`` is, exactly up to float rounding, the embeddings (with positions, the
value of ``{stack}.0.hook_resid_pre``) plus, for every earlier block, one term per head, the
bias, and the feed-forward output. Post-norm blocks normalise the stream after each sum, so it
has no such decomposition and :func:`decompose_resid` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

__all__ = ["ResidComponents", "decompose_resid", "head_contributions"]


@dataclass(frozen=True)
class ResidComponents:
    """Terms that sum to a residual stream.

    Attributes:
        components: ``(N, B, T, E)``, one row per term.
        labels: ``N`` names: ``"embed"``, ``"L{l}H{h}"`` (self-attention head),
            ``"L{l}.attn_bias"``, ``"L{l}.attn"`` (a whole layer, with ``heads=False``),
            ``"L{l}.cross.H{h}"``, ``"L{l}.cross_bias"``, ``"L{l}.cross"``, ``"L{l}.ffn"``.
        stream: ``(B, T, E)`` the residual stream itself, as cached.
        heads: ``{(layer, head): row}`` for the self-attention heads' rows.
    """

    components: Tensor
    labels: list[str]
    stream: Tensor
    heads: dict[tuple[int, int], int] = field(default_factory=dict)

    def total(self) -> Tensor:
        """``(B, T, E)``: the sum of the components (equals :attr:`stream` to float error)."""
        return self.components.sum(0)

    def head_table(self, values: Tensor) -> Tensor:
        """``values (N, ...)`` (one row per component) -> ``(L, H, ...)`` of the self-attention
        heads' rows (zeros where a layer has fewer heads)."""
        L = max(l for l, _ in self.heads) + 1
        H = max(h for _, h in self.heads) + 1
        out = values.new_zeros((L, H, *values.shape[1:]))
        for (l, h), row in self.heads.items():
            out[l, h] = values[row]
        return out


def head_contributions(z: Tensor, out_proj: nn.Linear) -> Tensor:
    """Each head's write into the stream: ``z (B, H, T, D)`` (``hook_out``) through its slice of
    ``out_proj (E, H·D)``, without the bias.

    Returns:
        ``(H, B, T, E)``.
    """
    H, D = z.shape[1], z.shape[3]
    w = out_proj.weight.detach().view(out_proj.weight.shape[0], H, D)  # (E, H, D)
    return torch.einsum("bhtd,ehd->hbte", z, w)  # (H, B, T, E)


def _attention_terms(cache, prefix: str, module: nn.Module, heads: bool, whole: str,
                     tag: str) -> tuple[list[Tensor], list[str]]:  # fmt: skip
    """One attention layer's terms: per head and bias (``tag + "H{h}"``, ``tag + "_bias"``), or
    its whole output (``tag``)."""
    if not heads:
        return [cache[whole]], [tag]
    z = cache[f"{prefix}.hook_out"]  # (B, H, T, D)
    per_head = head_contributions(z, module.out_proj)  # (H, B, T, E)
    terms, labels = list(per_head), [f"{tag}H{h}" for h in range(per_head.shape[0])]
    if module.out_proj.bias is not None:
        terms.append(module.out_proj.bias.detach().expand_as(per_head[0]))  # (B, T, E)
        labels.append(f"{tag}_bias")
    return terms, labels


def decompose_resid(cache, layer: int | None = None, *, heads: bool = True,
                    stack: str | None = None) -> ResidComponents:  # fmt: skip
    """Split the residual stream entering block ``layer`` into the terms that wrote it.

    Args:
        cache: an :class:`~qkv.inspect.cache.ActivationCache` of a pre-norm model in eval mode,
            holding ``{stack}.*.hook_resid_pre``/``hook_resid_post``, ``hook_ffn_out`` and
            ``self_attn.hook_out`` (``hook_attn_out`` with ``heads=False``), and the
            ``cross_attn`` ones where blocks have cross-attention.
        layer: ``0 .. L``; the stream entering that block (``L`` or None: the last block's
            output, before the final norm).
        heads: split each attention layer into its heads and its bias (else one term per layer).
        stack: which block stack (default: the one that feeds the output).

    Returns:
        a :class:`ResidComponents` whose components sum to the stream.

    Raises:
        ValueError: post-norm blocks, per-head terms of a block with ``sandwich_norm``, a cache
            recorded in training mode, ``layer`` out of range.
        KeyError: a needed hook point is not in the cache (its name is given).
    """
    s, L = cache.default_stack(stack), cache.num_layers(stack)
    layer = L if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= L:
        raise ValueError(f"layer must be an int in [0, {L}] or None, got {layer!r}")
    if cache.training:
        raise ValueError(
            "decompose_resid needs a cache recorded in eval mode (dropout makes the terms not "
            "sum to the stream): call model.eval() before run_with_cache"
        )
    terms, labels = [cache[f"{s}.0.hook_resid_pre"]], ["embed"]
    head_rows: dict[tuple[int, int], int] = {}
    for l in range(layer):
        block = cache.model.get_submodule(f"{s}.{l}")
        if getattr(block, "norm", "pre") != "pre":
            raise ValueError(
                f"{s}.{l} is a post-norm block: its output is normalised after each residual "
                "sum, so the stream is not a sum of components (use a norm='pre' model)"
            )
        if heads and getattr(block, "attn_out_norm", None) is not None:
            raise ValueError(
                f"{s}.{l} normalises its attention output (sandwich_norm, Gemma 2), so the "
                "output is not a sum of per-head terms: use heads=False"
            )
        p = f"{s}.{l}"
        t, names = _attention_terms(cache, f"{p}.self_attn", block.self_attn, heads,
                                    f"{p}.hook_attn_out", f"L{l}" if heads else f"L{l}.attn")
        if heads:
            names = [n.replace(f"L{l}_bias", f"L{l}.attn_bias") for n in names]
            for h in range(block.self_attn.num_heads):
                head_rows[(l, h)] = len(terms) + h
        terms, labels = terms + t, labels + names
        if getattr(block, "cross_attn", None) is not None:
            t, names = _attention_terms(cache, f"{p}.cross_attn", block.cross_attn, heads,
                                        f"{p}.hook_cross_out", f"L{l}.cross" + "." * heads)
            names = [n.replace("._bias", "_bias") for n in names]
            terms, labels = terms + t, labels + names
        if getattr(block, "ffn", None) is not None:  # blocks without a feed-forward add none
            terms.append(cache[f"{p}.hook_ffn_out"])
            labels.append(f"L{l}.ffn")
    stream = cache.resid(layer, "pre", s)
    components = torch.stack([t.expand_as(stream) for t in terms])  # (N, B, T, E)
    return ResidComponents(components, labels, stream, head_rows)
