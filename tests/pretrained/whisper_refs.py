"""Shared pieces of the Whisper tests: the packaged model (loaded once per process), the
transformers reference built from the same model.bin tensors, and speech from espeak-ng.

The reference is transformers' ``WhisperForConditionalGeneration`` built from a
``WhisperConfig`` equal to tiny.en's and loaded with the CTranslate2 file's tensors through a
name map written here independently of qkv's (so a wrong qkv map cannot hide in both).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qkv.pretrained
from qkv.pretrained.whisper.ct2_reader import read_ct2

# Sentences espeak-ng reads aloud; each is transcribed and scored by word error rate.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things from the store.",
    "She sells fresh fruit and vegetables at the market every Saturday morning.",
    "We will meet at the library after lunch to finish the project.",
    "Artificial intelligence is changing how people work and learn.",
]


@cache
def whisper() -> Any:
    return qkv.pretrained.load("whisper-tiny.en")


def espeak(text: str, folder: Path, name: str) -> Path:
    """``text`` spoken by espeak-ng into ``folder/name.wav`` (22.05 kHz mono)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng (the Debian package) is not installed: no speech to transcribe")
    out = folder / f"{name}.wav"
    subprocess.run([exe, "-w", str(out), text], check=True, capture_output=True, timeout=60)
    return out


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (how WER is usually normalised)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level Levenshtein distance / reference length."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[len(hyp)] / max(1, len(ref))


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    """model.bin's tensors under transformers' Whisper names (float32)."""
    f = read_ct2(path)
    t = {k: v.float() for k, v in f.tensors.items() if v.dim() > 0}
    E = t["decoder/embeddings/weight"].shape[1]
    sd = {
        "model.encoder.conv1.weight": t["encoder/conv1/weight"],
        "model.encoder.conv1.bias": t["encoder/conv1/bias"],
        "model.encoder.conv2.weight": t["encoder/conv2/weight"],
        "model.encoder.conv2.bias": t["encoder/conv2/bias"],
        "model.encoder.embed_positions.weight": t["encoder/position_encodings/encodings"],
        "model.decoder.embed_tokens.weight": t["decoder/embeddings/weight"],
        "model.decoder.embed_positions.weight": t["decoder/position_encodings/encodings"],
        "proj_out.weight": t["decoder/embeddings/weight"],
    }
    for stack in ("encoder", "decoder"):
        sd[f"model.{stack}.layer_norm.weight"] = t[f"{stack}/layer_norm/gamma"]
        sd[f"model.{stack}.layer_norm.bias"] = t[f"{stack}/layer_norm/beta"]
        layers = {int(m.group(1)) for k in t if (m := re.match(rf"{stack}/layer_(\d+)/", k))}
        for i in sorted(layers):
            src, dst = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            groups = [("self_attention", "self_attn", "linear_1")]
            if stack == "decoder":
                groups.append(("attention", "encoder_attn", "linear_2"))
            for ct2_name, hf_name, out in groups:
                w, b = t[f"{src}/{ct2_name}/linear_0/weight"], t[f"{src}/{ct2_name}/linear_0/bias"]
                if hf_name == "encoder_attn":  # cross-attention: k|v fused in linear_1
                    kv_w, kv_b = t[f"{src}/attention/linear_1/weight"], t[f"{src}/attention/linear_1/bias"]
                    w, b = torch.cat([w, kv_w]), torch.cat([b, kv_b])
                for j, p in enumerate(("q", "k", "v")):
                    sd[f"{dst}.{hf_name}.{p}_proj.weight"] = w[j * E : (j + 1) * E]
                    if p != "k":  # Whisper's key projection has no bias
                        sd[f"{dst}.{hf_name}.{p}_proj.bias"] = b[j * E : (j + 1) * E]
                sd[f"{dst}.{hf_name}.out_proj.weight"] = t[f"{src}/{ct2_name}/{out}/weight"]
                sd[f"{dst}.{hf_name}.out_proj.bias"] = t[f"{src}/{ct2_name}/{out}/bias"]
                sd[f"{dst}.{hf_name}_layer_norm.weight"] = t[f"{src}/{ct2_name}/layer_norm/gamma"]
                sd[f"{dst}.{hf_name}_layer_norm.bias"] = t[f"{src}/{ct2_name}/layer_norm/beta"]
            sd[f"{dst}.fc1.weight"] = t[f"{src}/ffn/linear_0/weight"]
            sd[f"{dst}.fc1.bias"] = t[f"{src}/ffn/linear_0/bias"]
            sd[f"{dst}.fc2.weight"] = t[f"{src}/ffn/linear_1/weight"]
            sd[f"{dst}.fc2.bias"] = t[f"{src}/ffn/linear_1/bias"]
            sd[f"{dst}.final_layer_norm.weight"] = t[f"{src}/ffn/layer_norm/gamma"]
            sd[f"{dst}.final_layer_norm.bias"] = t[f"{src}/ffn/layer_norm/beta"]
    return sd


@cache
def hf_whisper() -> Any:
    """transformers' WhisperForConditionalGeneration (tiny.en sizes, eager, float32) holding
    the packaged model.bin's tensors."""
    transformers = pytest.importorskip("transformers")
    config = transformers.WhisperConfig(
        vocab_size=51864, num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
        decoder_ffn_dim=1536, max_source_positions=1500, max_target_positions=448,
        activation_function="gelu", scale_embedding=False, pad_token_id=50256,
        bos_token_id=50257, eos_token_id=50256, decoder_start_token_id=50257,
        attn_implementation="eager",
    )
    model = transformers.WhisperForConditionalGeneration(config).eval()
    path = qkv.pretrained.locate("whisper-tiny.en") / "model.bin"
    missing, unexpected = model.load_state_dict(_hf_state(path), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


@cache
def hf_features() -> Any:
    """transformers' WhisperFeatureExtractor with tiny.en's parameters (no hub)."""
    transformers = pytest.importorskip("transformers")
    return transformers.WhisperFeatureExtractor(
        feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400,
        padding_value=0.0,
    )


@torch.no_grad()
def hf_greedy(features: torch.Tensor, prompt: list[int], suppress: tuple, suppress_first: tuple,
              eos: int, max_new_tokens: int) -> list[int]:
    """Greedy decoding on the reference with its own KV cache and the same suppressions."""
    model = hf_whisper()
    ids = torch.tensor([prompt])
    out, past = [], None
    enc = model.model.encoder(features).last_hidden_state
    for step in range(max_new_tokens):
        res = model(encoder_outputs=(enc,), decoder_input_ids=ids, past_key_values=past,
                    use_cache=True)
        logits, past = res.logits[0, -1].clone(), res.past_key_values
        logits[list(suppress)] = float("-inf")
        if step == 0:
            logits[list(suppress_first)] = float("-inf")
        token = int(logits.argmax())
        if token == eos:
            break
        out.append(token)
        ids = torch.tensor([[token]])
    return out


def noise(seconds: float, seed: int) -> np.ndarray:
    return (0.05 * np.random.default_rng(seed).standard_normal(int(16000 * seconds))).astype(np.float32)
