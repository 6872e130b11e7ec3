"""Decoding with the model moved to another device by hand (``model.to``), as a user with a
GPU does: every method gives the tokens it gives on the CPU, seeded sampling included (its
generators live on the CPU, so one seed draws the same tokens on any device).

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does. A tiny
random decoder in float64 with grouped-query attention.
"""

from __future__ import annotations

import pytest
import torch

import qkv.generate as qg
from qkv.generate.batching import BatchingEngine
from qkv.generate.controls import GenerationControls
from qkv.generate.engine import SamplingParams
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.nn.quantized import quantize_

IDS = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(0), device="cpu")


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=30, d_model=16, num_heads=2, num_kv_heads=1,
                             num_layers=2, d_ff=32, max_len=64, eos_id=29)
    return DecoderLM(config).double().eval()


def _served(model, ids) -> list[list[int]]:
    """Two requests through continuous batching (paged cache), one greedy, one sampled."""
    engine = BatchingEngine(model, max_batch=2, block_size=4, num_blocks=16).start()
    try:
        requests = [engine.submit(ids[0].tolist(), SamplingParams(max_new_tokens=5)),
                    engine.submit(ids[1, :4].tolist(),
                                  SamplingParams(max_new_tokens=6, temperature=0.8, seed=3))]
        return [list(r.tokens(timeout=120)) for r in requests]
    finally:
        engine.shutdown()


CONTROLS = GenerationControls(repetition_penalty=1.3, no_repeat_ngram_size=2,
                              bad_words_ids=((3,), (4, 5)), min_new_tokens=2)
CASES = {
    "greedy": lambda m, ids: qg.greedy(m, ids, max_new_tokens=5),
    "sample": lambda m, ids: qg.sample(m, ids, max_new_tokens=5, seed=1, temperature=0.9,
                                       top_k=5, top_p=0.9),
    "beam_search": lambda m, ids: qg.beam_search(m, ids, beam_size=3, max_new_tokens=5),
    "beam_search_hf": lambda m, ids: qg.beam_search_hf(m, ids, beam_size=3, max_new_tokens=5),
    "controls": lambda m, ids: qg.generate(m, ids, max_new_tokens=6, controls=CONTROLS),
    "controls, sampled": lambda m, ids: qg.generate(
        m, ids, max_new_tokens=6, temperature=0.7, seed=2,
        controls=GenerationControls(repetition_penalty=1.3, min_p=0.05)),
    "ragged prompts": lambda m, ids: qg.generate(m, [ids[0].tolist(), ids[1, :3].tolist()],
                                                 max_new_tokens=4),
    "prompt_lookup": lambda m, ids: qg.prompt_lookup(m, ids[0].tolist() * 2,
                                                     max_new_tokens=6).tokens,
    "stream": lambda m, ids: list(qg.stream(m, ids[0].tolist(), max_new_tokens=5)),
    "continuous batching": _served,
    "int8 weights": lambda m, ids: qg.greedy(quantize_(m, "int8"), ids, max_new_tokens=5),
    "int4 weights": lambda m, ids: qg.greedy(quantize_(m, "int4", group_size=8), ids,
                                             max_new_tokens=3),
}


@pytest.mark.parametrize("name", CASES)
def test_tokens_equal_the_cpu_run(moved, name):
    run = CASES[name]
    on_cpu = run(_model(), IDS)
    on_device = run(_model().to(moved), IDS.to(moved))
    if isinstance(on_cpu, torch.Tensor):
        assert on_device.device.type == moved.type, on_device.device
        on_cpu, on_device = on_cpu.tolist(), on_device.cpu().tolist()
    assert on_device == on_cpu
