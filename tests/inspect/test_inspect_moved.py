"""The inspection tools on a model moved to another device by hand (``model.to``), as a user
with a GPU does: each gives what it gives on the CPU.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does: the
rollout's identity, the report that draws it, and the induction training's batches were
made on the CPU before. A tiny random decoder in float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkv.inspect as qi
from qkv.inspect.induction import repeated_tokens, train_on_repeats
from qkv.models import DecoderLM, DecoderLMConfig
from second_device import assert_same_run

IDS = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(1), device="cpu")


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=30, d_model=16, num_heads=2, num_layers=2, d_ff=32,
                             max_len=32)
    return DecoderLM(config).double().eval()


def _captured(model, ids):
    with torch.no_grad(), qi.capture(model) as cap:
        model(ids)
    return cap


def _metric(logits):
    return logits[:, -1, 3] - logits[:, -1, 4]


def _files(written) -> list[str]:
    return sorted(Path(p).name for p in (written.values() if isinstance(written, dict)
                                         else written))


CASES = {
    "rollout": lambda m, ids, tmp: qi.rollout(_captured(m, ids)),
    "plot_rollout": lambda m, ids, tmp: qi.plot_rollout(_captured(m, ids), tmp / "r.png").name,
    "write_report": lambda m, ids, tmp: _files(qi.write_report(m, ids, tmp / "report")),
    # the loss before any step (Adam's first steps move by the gradients' signs: ill-posed
    # to compare after one), and that a second step ran on the device
    "train_on_repeats": lambda m, ids, tmp: [len(h := train_on_repeats(
        m, steps=2, min_len=3, max_len=5, batch=2)), h[0]],
    "prefix_matching_scores": lambda m, ids, tmp: qi.prefix_matching_scores(
        m, repeated_tokens(2, 4, 30).to(ids.device), 4),
    "patch_heads": lambda m, ids, tmp: qi.patch_heads(m, ids[:1], ids[1:], _metric),
    "patch_residual": lambda m, ids, tmp: qi.patch_residual(m, ids[:1], ids[1:], _metric),
    "direct_logit_attribution": lambda m, ids, tmp: qi.direct_logit_attribution(
        qi.run_with_cache(m, ids)[1], (3, 4)).values,
    "record_generation": lambda m, ids, tmp: qi.record_generation(
        m, ids[0].tolist(), 4).new_ids,
    "trace": lambda m, ids, tmp: qi.trace(m, ids[:1], 5).steps,
}


@pytest.mark.parametrize("name", CASES)
def test_equals_the_cpu_run(moved, tmp_path, name):
    run = CASES[name]
    (tmp_path / "cpu").mkdir()
    (tmp_path / "moved").mkdir()
    on_cpu = run(_model(), IDS, tmp_path / "cpu")
    on_device = run(_model().to(moved), IDS.to(moved), tmp_path / "moved")
    assert_same_run(on_cpu, on_device, name)
