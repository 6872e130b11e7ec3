"""Induction heads (Olsson et al., 2022, "In-context Learning and Induction Heads"): data, a
small training loop, the prefix-matching score, and head ablation.

An induction head completes ``[A][B] ... [A] -> [B]``: at the second ``A`` it attends to the
token *after* the earlier ``A`` and copies it. On a sequence ``BOS, s_1..s_n, s_1..s_n`` of
random tokens, the first half is unpredictable (loss ``≈ ln V``), while the second half is
predictable only by such a head, so a model that has one gets the second half nearly free.

* :func:`repeated_tokens`: those sequences.
* :func:`attention_only`: a :class:`~qkv.models.DecoderLM` with its feed-forwards removed (the
  two-layer attention-only model of Elhage et al., 2021). :class:`~qkv.models.DecoderLMConfig`
  has no option for this, so each block's ``ffn`` is replaced by :class:`NoFeedForward`, which
  adds exactly zero to the residual stream (its ``hook_ffn_out`` still fires, with zeros).
* :func:`train_on_repeats`: next-token training with plain ``torch.optim.AdamW``.
* :func:`prefix_matching_scores`: for every head, the mean attention from a token of the second
  half to the token after its first occurrence (Olsson et al.'s score); induction heads score
  near 1, :func:`previous_token_scores` finds the previous-token heads they compose with.
* :func:`ablate_heads`: zero chosen heads' outputs (``self_attn.hook_out``), or replace them by
  their mean over a reference batch (:func:`head_means`), while the model runs.
* :func:`half_losses`: the loss on the first and on the repeated half.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.inspect.cache import run_with_cache
from qkv.inspect.capture import capture
from qkv.inspect.hookpoints import hooks

__all__ = [
    "NoFeedForward",
    "ablate_heads",
    "attention_only",
    "half_losses",
    "head_means",
    "prefix_matching_scores",
    "previous_token_scores",
    "repeated_tokens",
    "token_losses",
    "train_on_repeats",
]


def repeated_tokens(batch: int, seg_len: int, vocab_size: int, *, bos: int = 0,
                    generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """``(B, 1 + 2·seg_len)`` rows ``bos, s_1..s_n, s_1..s_n`` with ``s_i`` uniform over the
    tokens other than ``bos``.

    Raises:
        ValueError: sizes that are not positive ints, ``vocab_size < 3``, ``bos`` out of range.
    """
    for name, v in (("batch", batch), ("seg_len", seg_len), ("vocab_size", vocab_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if vocab_size < 3 or not 0 <= bos < vocab_size:
        raise ValueError(
            f"need vocab_size >= 3 and bos in [0, vocab_size), got {vocab_size} and {bos}"
        )
    seg = torch.randint(0, vocab_size - 1, (batch, seg_len), generator=generator)  # (B, n)
    seg = seg + (seg >= bos).long()  # skip the bos id
    first = torch.full((batch, 1), bos, dtype=torch.long)
    return torch.cat([first, seg, seg], dim=1)  # (B, 1 + 2n)


class NoFeedForward(nn.Module):
    """A feed-forward that adds nothing: ``(..., E) -> zeros (..., E)``."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)


def attention_only(model: nn.Module, stack: str = "blocks") -> nn.Module:
    """Remove every block's feed-forward (in place): each ``block.ffn`` becomes
    :class:`NoFeedForward`, so a pre-norm block computes ``x + attn(norm(x))`` only.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has no ``stack`` of blocks with an ``ffn``.
    """
    blocks = getattr(model, stack, None)
    if not isinstance(blocks, nn.ModuleList) or not all(hasattr(b, "ffn") for b in blocks):
        raise ValueError(f"{type(model).__name__}.{stack} is not a list of blocks with an ffn")
    for block in blocks:
        block.ffn = NoFeedForward()
    return model


def token_losses(logits: Tensor, ids: Tensor) -> Tensor:
    """``(B, T-1)`` cross-entropy of predicting ``ids[:, 1:]`` from ``logits (B, T, V)``."""
    V = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)  # (B, T-1)


def half_losses(logits: Tensor, ids: Tensor, seg_len: int) -> tuple[float, float]:
    """Mean loss on the first half (predicting ``s_2..s_n``) and on the repeated half
    (predicting the second ``s_2..s_n``) of :func:`repeated_tokens` rows.

    The prediction of each half's first token is left out: the first ``s_1`` is the first
    token after ``BOS`` and the second ``s_1`` follows ``s_n`` (neither is predictable from
    the pattern alone for the first half, and the second one is the boundary).
    """
    loss = token_losses(logits, ids)  # (B, 2n): loss[:, i] predicts ids[:, i + 1]
    first = loss[:, 1:seg_len]  # predicting s_2..s_n
    second = loss[:, seg_len + 1 : 2 * seg_len]  # predicting the repeated s_2..s_n
    return first.mean().item(), second.mean().item()


def train_on_repeats(model: nn.Module, *, steps: int, min_len: int, max_len: int,
                     batch: int = 32, lr: float = 3e-3, seed: int = 0) -> list[float]:  # fmt: skip
    """Train ``model`` (a causal LM ``ids (B, T) -> logits (B, T, V)`` with a ``config.
    vocab_size``) on fresh :func:`repeated_tokens` batches with AdamW, next-token loss on
    every position; the model is left in eval mode.

    Each step draws its segment length uniformly from ``[min_len, max_len]``. With one fixed
    length the repeated token sits at a fixed distance and the first layer learns to attend
    there by position alone (no induction needed); varying it leaves induction (a
    previous-token head, then a head matching on it) as the way to the repeated half. Positions
    before ``min_len`` are never repeats, so evaluate with ``seg_len = min_len`` to see the
    first half as truly unpredictable.

    Returns:
        the loss of each step.

    Raises:
        ValueError: ``steps``, ``batch`` or lengths that are not positive ints, or
            ``min_len > max_len``.
    """
    for name, v in (("steps", steps), ("batch", batch), ("min_len", min_len),
                    ("max_len", max_len)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if min_len > max_len:
        raise ValueError(f"min_len ({min_len}) must be <= max_len ({max_len})")
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)  # batches drawn on the CPU, then moved
    device = next(iter(model.parameters())).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    history = []
    for _ in range(steps):
        # 1) a fresh batch; 2) next-token loss on every position; 3) one optimiser step.
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        ids = repeated_tokens(batch, n, vocab, generator=gen).to(device)  # (B, 1 + 2n)
        loss = token_losses(model(ids), ids).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # spikes would undo the phase change
        opt.step()
        history.append(loss.item())
    model.eval()
    return history


def _layer_weights(model: nn.Module, ids: Tensor) -> Tensor:
    """``(L, B, H, T, T)`` the self-attention weights of every layer of a one-stack model."""
    with torch.no_grad(), capture(model, layers="*self_attn") as cap:
        model(ids)
    return torch.stack([cap.weights[name] for name in cap.layers])  # (L, B, H, T, T)


def _diagonal_score(weights: Tensor, rows: range, offset: int) -> Tensor:
    """``(L, H)``: mean over batch and ``rows`` of the weight of row ``i`` on key ``i - offset``."""
    rows_t = torch.tensor(list(rows))
    picked = weights[..., rows_t, rows_t - offset]  # (L, B, H, R)
    return picked.mean(dim=(1, 3))  # (L, H)


def prefix_matching_scores(model: nn.Module, ids: Tensor, seg_len: int) -> Tensor:
    """``(L, H)``: each head's mean attention, from every token of the repeated half, to the
    token that followed that token's first occurrence (Olsson et al., 2022).

    Args:
        ids: :func:`repeated_tokens` rows ``(B, 1 + 2·seg_len)``.
    """
    if ids.dim() != 2 or ids.shape[1] != 1 + 2 * seg_len:
        raise ValueError(f"ids must be (B, 1 + 2·seg_len) = (B, {1 + 2 * seg_len}), got "
                         f"{tuple(ids.shape)}")  # fmt: skip
    # Query 1 + n + k holds s_{k+1}; its first occurrence is at 1 + k, followed by 2 + k.
    return _diagonal_score(_layer_weights(model, ids), range(1 + seg_len, 1 + 2 * seg_len),
                           seg_len - 1)  # fmt: skip


def previous_token_scores(model: nn.Module, ids: Tensor) -> Tensor:
    """``(L, H)``: each head's mean attention from position ``i`` to ``i - 1`` (``i >= 1``)."""
    return _diagonal_score(_layer_weights(model, ids), range(1, ids.shape[1]), 1)


def head_means(model: nn.Module, ids: Tensor, stack: str = "blocks") -> dict[int, Tensor]:
    """``{layer: (H, T, D)}``: every self-attention head's output (``self_attn.hook_out``)
    averaged over the batch of ``ids (B, T)``, per position: what :func:`ablate_heads`
    writes for a *mean* ablation (the head keeps its average, loses what depends on the input).
    """
    with torch.no_grad():
        _, cache = run_with_cache(model, ids, names=f"{stack}.*.self_attn.hook_out")
    return {int(name.split(".")[-3]): value.mean(0) for name, value in cache.items()}


@contextmanager
def ablate_heads(model: nn.Module, heads: Iterable[tuple[int, int]], *,
                 means: dict[int, Tensor] | None = None,
                 stack: str = "blocks") -> Iterator[None]:  # fmt: skip
    """Ablate ``heads`` (``(layer, head)`` pairs) while the ``with`` block runs.

    Args:
        heads: the heads to ablate.
        means: None for a zero ablation (``{stack}.{layer}.self_attn.hook_out[:, head] = 0``),
            or :func:`head_means` of a reference batch for a mean ablation (the head's output
            becomes its batch mean at each position: a zeroed head also loses the constant
            part of its output, which the rest of the model relies on, so a mean ablation
            isolates what the head computes *from the input*).
        stack: the block stack.

    Raises:
        ValueError: a layer without self-attention, a head out of range, ``means`` missing a
            layer or made for another sequence length.
    """
    chosen: dict[int, list[int]] = {}
    for layer, head in heads:
        name = f"{stack}.{layer}.self_attn"
        try:
            H = model.get_submodule(name).num_heads
        except AttributeError:
            kind = type(model).__name__
            raise ValueError(f"heads: {kind} has no attention layer {name}") from None
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < H:
            raise ValueError(f"heads: head {head!r} of {name} is out of range [0, {H})")
        if means is not None and layer not in means:
            raise ValueError(f"means has no layer {layer} (it has {sorted(means)})")
        chosen.setdefault(int(layer), []).append(head)

    def ablate(value: Tensor, layer: int, heads: list[int]) -> Tensor:
        out = value.clone()  # (B, H, T, D)
        if means is None:
            out[:, heads] = 0.0
        elif means[layer].shape[1:] != value.shape[2:]:
            raise ValueError(
                f"means[{layer}] is {tuple(means[layer].shape)} (H, T, D) but the heads' "
                f"outputs are {tuple(value.shape)} (B, H, T, D): make them from ids of this length"
            )
        else:
            out[:, heads] = means[layer][heads].to(out.dtype)  # (H', T, D) broadcast over B
        return out

    functions = {
        f"{stack}.{layer}.self_attn.hook_out": (lambda v, _n, l=layer, hs=hs: ablate(v, l, hs))
        for layer, hs in chosen.items()
    }
    with hooks(model, functions):
        yield
