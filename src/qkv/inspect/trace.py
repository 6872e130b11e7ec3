"""A token's journey: what happens to one position in every layer, as a table and as JSON.

    t = qkv.inspect.trace(model, ids, position=5, tokens=["The", "cat", ...])
    print(t.table())          # one line per stage
    t.to_json()               # the same numbers, machine-readable

Stages, in order: the token embedding; the stream entering the first block (embedding +
position, and whatever else the model adds there); then per layer the most-attended tokens
of each head (self-attention, and cross-attention in a decoder), the stream after the
attention's residual sum (and norm, in post-norm blocks), and after the feed-forward. Each
stream stage gives the vector's L2 norm, the norm of its change from the previous stage and
the cosine with it. The numbers come from :func:`qkv.inspect.capture` and the blocks' hook
points, so they equal what those report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from qkv.inspect.adapters import Stack, key_side, run_model, stacks
from qkv.inspect.capture import capture

__all__ = ["Trace", "TraceStep", "trace"]


@dataclass
class TraceStep:
    """One stage of the journey.

    Attributes:
        stage: what it is (``"embedding"``, ``"layer 0 self-attention"``, ...).
        layer: the block index, or None before the first block.
        norm: L2 norm of the position's vector (stream stages), else None.
        change: L2 norm of the difference from the previous stream stage.
        cosine: cosine similarity with the previous stream stage.
        heads: for attention stages, ``[{"head", "top": [{"index", "token", "weight"}]}]``.
    """

    stage: str
    layer: int | None = None
    norm: float | None = None
    change: float | None = None
    cosine: float | None = None
    heads: list[dict[str, Any]] | None = None


@dataclass
class Trace:
    """The journey of ``tokens[position]``; see :func:`trace`."""

    position: int
    token: str
    steps: list[TraceStep] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "token": self.token,
                "steps": [asdict(s) for s in self.steps]}  # fmt: skip

    def to_json(self, indent: int | None = 1) -> str:
        """The trace as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def table(self) -> str:
        """A plain-text table, one line per stage."""
        head = f"{'stage':<48} {'norm':>9} {'change':>9} {'cos':>6}  most attended"
        lines = [f"journey of position {self.position} ({self.token!r})", head,
                 "-" * len(head)]  # fmt: skip
        for s in self.steps:
            num = (
                f"{s.norm:9.3f} {s.change if s.change is not None else float('nan'):9.3f} "
                f"{s.cosine if s.cosine is not None else float('nan'):6.3f}"
                if s.norm is not None else " " * 26
            )
            tops = ""
            if s.heads:
                tops = "  ".join(
                    f"h{h['head']}:"
                    + ",".join(f"{t['token']}({t['weight']:.2f})" for t in h["top"])
                    for h in s.heads
                )
            lines.append(f"{s.stage:<48} {num}  {tops}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _labels(tokens: Any, n: int, name: str) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    labels = [str(t) for t in tokens]
    if len(labels) < n:
        raise ValueError(f"{name} has {len(labels)} labels but the sequence has {n} positions")
    return labels


def _length(x: Any) -> int:
    return int(x.shape[1]) if isinstance(x, Tensor) and x.dim() >= 2 else 0


@torch.no_grad()
def trace(
    model: nn.Module,
    input_ids: Any,
    position: int,
    *,
    target: Tensor | None = None,
    tokens: Any = None,
    target_tokens: Any = None,
    top_k: int = 3,
    batch: int = 0,
    model_kwargs: dict[str, Any] | None = None,
) -> Trace:
    """Follow one position through every layer of ``model``.

    Args:
        model: a qkv model (or any module with a ``blocks`` stack of
            :class:`~qkv.nn.TransformerBlock`, or ``encoder_blocks`` and ``decoder_blocks``).
        input_ids: the model's input, ``(B, T)`` ids (images for a ViT).
        position: the position to follow (negative counts from the end); in the decoder when
            ``target`` is given, else in the input.
        target: an encoder-decoder's decoder input ``(B, T_tgt)``.
        tokens, target_tokens: labels of the input and target positions (default indices).
        top_k: most-attended tokens listed per head.
        batch: which batch row to follow.
        model_kwargs: more arguments of the model's forward (e.g. ``attention_mask``).

    Returns:
        a :class:`Trace`.

    Raises:
        ValueError: a position or batch row out of range, ``top_k < 1``, too few labels, the
            errors of running the model.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    all_stacks = stacks(model)
    stack = all_stacks[-1] if target is not None else all_stacks[0]
    recorded: list[Tensor] = []
    handle = None
    if stack.embed is not None:
        handle = stack.embed.register_forward_hook(
            lambda m, a, out: recorded.append(out.detach())
        )
    names = [f"{stack.prefix}.0.hook_resid_pre"] + [
        f"{stack.prefix}.{i}.{h}" for i, block in enumerate(stack.blocks)
        for h in ("hook_resid_mid", "hook_resid_cross", "hook_resid_post")
        if getattr(block, h, None) is not None
    ]  # fmt: skip
    followed = target if target is not None else input_ids  # the sequence position is in
    ids_2d = isinstance(followed, Tensor) and followed.dim() == 2
    T_in = int(followed.shape[-1]) if ids_2d else None
    # Only the followed query row's weights are kept (not every layer's (T, S) matrices),
    # when the row is known to exist; otherwise all rows, and the check below says why.
    rows = position if T_in is None or -T_in <= position < T_in else None
    try:
        with capture(model, layers=f"{stack.prefix}.*", record=names, rows=rows) as cap:
            run_model(model, input_ids, target, model_kwargs)
    finally:
        if handle is not None:
            handle.remove()
    B, T = cap.values[names[0]][0].shape[:2]  # the traced stack's (B, T, E) input
    if not -T <= position < T:
        raise ValueError(f"position={position} is out of range for a sequence of {T} positions")
    if not 0 <= batch < B:
        raise ValueError(f"batch={batch} is out of range for a batch of {B}")
    # Labels: ids give one label per input position; images (a ViT) are labelled by index.
    n_src = _length(input_ids) if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else T
    sides = {"source": _labels(tokens, n_src, "tokens")}
    if target is not None:
        sides["target"] = _labels(target_tokens, T, "target_tokens")
    own = sides[stack.side]
    result = Trace(position % T, own[position % T])
    return _fill(result, cap, stack, recorded, names, sides, batch, top_k, one_row=rows is not None)


def _fill(result: Trace, cap, stack: Stack, embeds, names, sides, batch: int, top_k: int,
          one_row: bool = False) -> Trace:  # fmt: skip
    """Append the stages to ``result`` from the captured weights (of the followed row only,
    ``one_row``, or of every row) and recorded streams."""
    p = result.position
    previous: list[Tensor | None] = [None]

    def vector_step(stage: str, layer: int | None, v: Tensor) -> None:
        v = v.double()
        step = TraceStep(stage, layer, norm=float(v.norm()))
        prev = previous[0]
        if prev is not None:
            step.change = float((v - prev).norm())
            denom = float(v.norm() * prev.norm())
            step.cosine = float(v @ prev) / denom if denom > 0 else 0.0
        previous[0] = v
        result.steps.append(step)

    T = cap.values[names[0]][0].shape[1]
    if embeds and embeds[0].dim() == 3 and embeds[0].shape[1] == T:
        vector_step("embedding", None, embeds[0][batch, p])
    vector_step("embedding + position (block input)", None, cap.values[names[0]][0][batch, p])
    for i, block in enumerate(stack.blocks):
        for attr, what in (("self_attn", "self-attention"), ("cross_attn", "cross-attention")):
            name = f"{stack.prefix}.{i}.{attr}"
            if name not in cap.calls or not cap.calls[name]:
                continue
            w = cap.weights[name][batch, :, 0 if one_row else p]  # (H, S)
            keys = sides[key_side(name, cap.kinds[name])]
            heads = []
            for hi, h in enumerate(cap.heads[name]):
                vals, idx = w[hi].topk(min(top_k, w.shape[-1]))
                heads.append({"head": h, "top": [
                    {"index": int(j), "token": keys[int(j)] if int(j) < len(keys) else str(int(j)),
                     "weight": float(x)} for x, j in zip(vals, idx, strict=True)
                ]})  # fmt: skip
            result.steps.append(TraceStep(f"layer {i} {what}", i, heads=heads))
            hook = "hook_resid_mid" if attr == "self_attn" else "hook_resid_cross"
            # Post-norm blocks normalise after the residual sum; pre-norm ones before the sublayer.
            summed = "residual + norm" if getattr(block, "norm", "post") == "post" else "residual"
            label = f"after {what} ({summed})"
            vector_step(f"layer {i} {label}", i,
                        cap.values[f"{stack.prefix}.{i}.{hook}"][0][batch, p])  # fmt: skip
        summed = "residual + norm" if getattr(block, "norm", "post") == "post" else "residual"
        vector_step(f"layer {i} after feed-forward ({summed})", i,
                    cap.values[f"{stack.prefix}.{i}.hook_resid_post"][0][batch, p])  # fmt: skip
    return result
