"""Every Hugging Face family qkv loads, moved to another device after loading
(``qkv.pretrained.load(folder, device=...)``): greedy tokens equal the CPU's. What a family
adds (RoPE scalings, sliding windows, soft-caps, partial rotary, biases, T5's buckets,
Marian's positions) must follow the model when it moves.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does. The folders
are transformers' models with random weights (``test_hf_decoders``, ``test_hf_seq2seq``),
loaded in float64.
"""

from __future__ import annotations

import pytest
import test_hf_decoders as decoders
import test_hf_seq2seq as seq2seq
import torch

import qkv.pretrained
from qkv.generate import greedy

IDS = torch.randint(1, decoders.V, (2, 12), generator=torch.Generator().manual_seed(0),
                    device="cpu")


@pytest.mark.parametrize("kind", decoders.FAMILIES)
def test_decoder_tokens_equal_the_cpu_run(moved, tmp_path, kind):
    decoders._reference(kind, tmp_path)

    def run(device):
        model = qkv.pretrained.load(tmp_path).model.double().to(device)
        return greedy(model, IDS.to(device), max_new_tokens=8).cpu().tolist()

    assert run(moved) == run("cpu")


@pytest.mark.parametrize("family", seq2seq.FAMILIES)
def test_seq2seq_translations_equal_the_cpu_run(moved, tmp_path, family):
    folder, _ = seq2seq._folder(family, tmp_path)

    def run(device):
        bundle = seq2seq._load(folder)
        bundle.model.double().to(device)
        return bundle.translate(seq2seq.SOURCES, max_new_tokens=8)

    assert run(moved) == run("cpu")
