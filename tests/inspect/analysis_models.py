"""Small random models shared by the analysis tests (run_with_cache, lens, patching)."""

from __future__ import annotations

import torch

from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)

V = 37


def gpt2(num_layers: int = 2):
    """GPT-2 style: learned positions, LayerNorm with bias, biases everywhere, tied head."""
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.gpt2_style(V, d_model=24, num_layers=num_layers,
                                                num_heads=3, max_len=32)).eval()  # fmt: skip


def llama():
    """Llama style: RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases."""
    torch.manual_seed(1)
    return DecoderLM(DecoderLMConfig.llama_style(V, d_model=32, num_layers=3, num_heads=4,
                                                 num_kv_heads=2, max_len=32)).eval()  # fmt: skip


def encoder(norm: str = "pre"):
    torch.manual_seed(2)
    return Encoder(EncoderConfig(V, d_model=24, num_layers=2, num_heads=2, max_len=32,
                                 dropout=0.0, norm=norm)).eval()  # fmt: skip


def seq2seq():
    """Pre-norm encoder-decoder (cross-attention; an lm_head with a bias)."""
    torch.manual_seed(3)
    return Seq2SeqTransformer(Seq2SeqConfig(V, V, d_model=24, num_heads=2, d_ff=32,
                                            num_encoder_layers=2, num_decoder_layers=2,
                                            dropout=0.0, norm="pre")).eval()  # fmt: skip


def ids(B: int = 2, T: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
