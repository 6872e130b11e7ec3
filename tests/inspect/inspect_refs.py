"""Small models of every attention kind, and the reference weights of their layers."""

from __future__ import annotations

import torch

import qkv
import qkv.inspect as qi
from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    ViT,
    ViTConfig,
)

V = 37


def _ids(B: int, T: int, seed: int, low: int = 3, high: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (B, T), generator=g)


def build(kind: str, dtype: torch.dtype = torch.float32):
    """``(model, run)``: a small model of ``kind`` in eval mode and ``run(other=None)``, which
    runs it (or ``other``, a modified copy) on a fixed batch (with padding where the model has
    a padding mask). ``run.args`` / ``run.kwargs`` are that batch."""
    torch.manual_seed(0)
    kwargs: dict = {}
    if kind == "gpt2":
        m = DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=24, num_layers=2, num_heads=3))
        args = (_ids(2, 11, 1),)
    elif kind == "llama_gqa":
        m = DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=2, num_heads=4,
                                                  num_kv_heads=2))  # fmt: skip
        args = (_ids(2, 13, 2),)
        keep = torch.ones(2, 13, dtype=torch.bool)
        keep[1, :4] = False  # left padding in row 1
        kwargs = {"attention_mask": keep, "positions": (keep.long().cumsum(1) - 1).clamp(min=0)}
    elif kind == "alibi":
        m = DecoderLM(DecoderLMConfig(V, d_model=24, num_layers=2, num_heads=4,
                                      positions="alibi"))  # fmt: skip
        args = (_ids(2, 9, 3),)
    elif kind == "encoder":
        m = Encoder(EncoderConfig(V, d_model=24, num_layers=2, num_heads=3, dropout=0.0))
        ids = _ids(2, 10, 4)
        ids[0, 7:] = 0  # padding (pad_id 0)
        args = (ids,)
    elif kind == "encoder_alibi":
        m = Encoder(EncoderConfig(V, d_model=24, num_layers=1, num_heads=4, dropout=0.0,
                                  positions="alibi"))  # fmt: skip
        args = (_ids(1, 8, 5),)
    elif kind == "seq2seq":
        m = Seq2SeqTransformer(Seq2SeqConfig(V, V + 2, d_model=24, num_heads=3, d_ff=40,
                                             dropout=0.0))  # fmt: skip
        src = _ids(2, 9, 6)
        src[1, 6:] = 0  # source padding
        args = (src, _ids(2, 7, 7))
    elif kind == "vit":
        m = ViT(ViTConfig(image_size=8, patch_size=4, d_model=16, num_layers=2, num_heads=2))
        args = (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(8)).to(dtype),)
    else:  # pragma: no cover
        raise ValueError(kind)
    m = m.to(dtype).eval()

    def run(other=None):
        return (m if other is None else other)(*args, **kwargs)

    run.args, run.kwargs = args, kwargs
    return m, run


KINDS = ["gpt2", "llama_gqa", "alibi", "encoder", "encoder_alibi", "seq2seq", "vit"]


def math_weights(model, run) -> dict[str, list[torch.Tensor]]:
    """Each layer's weights per call from the math backend with ``need_weights=True``, on the
    exact arguments the layer handed to SDPA."""
    calls: dict[str, list] = {}
    with qi.hooks(model, {"*.hook_inputs": lambda v, n: calls.setdefault(
            n.rsplit(".", 1)[0], []).append(v)}), torch.no_grad():  # fmt: skip
        run()
    return {
        name: [
            qkv.scaled_dot_product_attention(
                i.query, i.key, i.value, i.attn_mask, is_causal=i.is_causal,
                enable_gqa=i.enable_gqa, alibi_slopes=i.alibi_slopes, need_weights=True,
                backend="math",
            )[1]
            for i in inputs
        ]
        for name, inputs in calls.items()
    }
