"""Induction heads, reproduced on a CPU in about a minute (Olsson et al., 2022).

A 2-layer attention-only qkv DecoderLM learns sequences ``BOS, s_1..s_n, s_1..s_n`` of random
tokens (n from 8 to 16). The first half cannot be predicted (loss ln V); the repeated half can,
but only in context: by an induction head, which at the second ``s_k`` attends to the token
after the first ``s_k`` (found by its prefix-matching score) and reads the previous-token head
of layer 0 to do so. Ablating the induction heads (each replaced by its mean output) destroys
the repeated half's loss and leaves the first half as it was.

    .venv/bin/python examples/induction_heads.py                 # ~1 minute on one core
    .venv/bin/python examples/induction_heads.py --out figs      # also heatmaps (PNG)
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import qkv.inspect as qi
from qkv.inspect.induction import attention_only, half_losses, repeated_tokens, train_on_repeats
from qkv.models import DecoderLM, DecoderLMConfig


def table(name: str, scores: torch.Tensor) -> str:
    rows = [f"  layer {l}: " + "  ".join(f"H{h} {v:.2f}" for h, v in enumerate(row))
            for l, row in enumerate(scores.tolist())]  # fmt: skip
    return f"{name}\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for heatmaps (PNG)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    V, min_len, max_len = 64, 8, 16

    # 1) The model: two attention-only layers, RoPE, untied unembedding.
    torch.manual_seed(args.seed)
    config = DecoderLMConfig(V, d_model=64, num_layers=2, num_heads=4, max_len=2 * max_len + 1,
                             positions="rope", tie_embeddings=False)  # fmt: skip
    model = attention_only(DecoderLM(config))

    # 2) Training on repeated random segments.
    start = time.perf_counter()
    history = train_on_repeats(model, steps=args.steps, min_len=min_len, max_len=max_len,
                               batch=64, lr=3e-3, seed=args.seed)  # fmt: skip
    every = max(1, args.steps // 8)
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.0f} s; loss every "
          f"{every} steps: " + " ".join(f"{x:.2f}" for x in history[::every]))  # fmt: skip

    # 3) Held-out sequences (n = min_len: no position of the first half was ever a repeat).
    gen = torch.Generator().manual_seed(1234)
    ids = repeated_tokens(256, min_len, V, generator=gen)
    reference = repeated_tokens(256, min_len, V, generator=gen)  # for the mean ablation
    with torch.no_grad():
        first, second = half_losses(model(ids), ids, min_len)
    print(f"loss: first half {first:.3f} (chance ln {V - 1} = {math.log(V - 1):.3f}), "
          f"repeated half {second:.3f}")  # fmt: skip

    # 4) Which heads: prefix matching (induction) and previous-token scores.
    scores = qi.prefix_matching_scores(model, ids, min_len)
    previous = qi.previous_token_scores(model, ids)
    print(table("prefix-matching score (attention to the token after the earlier copy):", scores))
    print(table("previous-token score (attention to position i - 1):", previous))
    induction = [(l, h) for l in range(2) for h in range(4) if scores[l, h] > 0.4]
    prev_head = (0, int(previous[0].argmax()))
    print(f"induction heads (score > 0.4): {induction}; previous-token head: {prev_head}")

    # 5) Ablations: a set of heads replaced by its mean output (or by zeros).
    means = qi.head_means(model, reference)
    print(f"{'ablated heads':>30} | first half | repeated half")
    print(f"{'none':>30} | {first:10.3f} | {second:13.3f}")
    for label, heads in (("induction heads", induction), ("previous-token head", [prev_head])):
        for how, m in (("mean", means), ("zero", None)):
            with torch.no_grad(), qi.ablate_heads(model, heads, means=m):
                f, s = half_losses(model(ids), ids, min_len)
            print(f"{label + ', ' + how:>30} | {f:10.3f} | {s:13.3f}")
    single = torch.zeros(2, 4)
    for l in range(2):
        for h in range(4):
            with torch.no_grad(), qi.ablate_heads(model, [(l, h)], means=means):
                single[l, h] = half_losses(model(ids), ids, min_len)[1]
    print(table("repeated-half loss with one head mean-ablated:", single))

    # 6) Pictures.
    if args.out:
        qi.plot_head_attribution(scores, f"{args.out}/prefix_matching.png", center=None,
                                 title="prefix-matching score")  # fmt: skip
        qi.plot_head_attribution(previous, f"{args.out}/previous_token.png", center=None,
                                 title="previous-token score")  # fmt: skip
        with qi.capture(model) as cap:
            model(ids[:1])
        best = int(scores[1].argmax())
        qi.plot_head(cap, f"{args.out}/induction_head.png", layer=1, head=best,
                     title=f"induction head L1H{best}")  # fmt: skip
        print(f"wrote {args.out}/prefix_matching.png, previous_token.png, induction_head.png")


if __name__ == "__main__":
    main()
