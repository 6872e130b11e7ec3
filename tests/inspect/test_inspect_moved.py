"""The inspection tools on a model moved to another device by hand (``model.to``), as a user
with a GPU does: each gives what it gives on the CPU.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does: the
rollout's identity, the report that draws it, and the induction training's batches were
made on the CPU before. A tiny random decoder in float64.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import qkv.inspect as qi
from helpers import assert_close
from qkv.inspect.induction import repeated_tokens, train_on_repeats
from qkv.models import DecoderLM, DecoderLMConfig

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


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert_close(b.cpu(), a, atol=1e-9, rtol=1e-9, name=where)
    elif dataclasses.is_dataclass(a):
        _same(dataclasses.asdict(a), dataclasses.asdict(b), where)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        # float64 work, but a loss is float32: another device's rounding differs there
        assert b == pytest.approx(a, rel=1e-6, abs=1e-9), f"{where}: {a} on the CPU, {b} moved"
    else:
        assert a == b, f"{where}: {a!r} on the CPU, {b!r} moved"


@pytest.mark.parametrize("name", CASES)
def test_equals_the_cpu_run(moved, tmp_path, name):
    run = CASES[name]
    (tmp_path / "cpu").mkdir()
    (tmp_path / "moved").mkdir()
    on_cpu = run(_model(), IDS, tmp_path / "cpu")
    on_device = run(_model().to(moved), IDS.to(moved), tmp_path / "moved")
    _same(on_cpu, on_device, name)
