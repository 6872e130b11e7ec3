"""Training on another device (``TrainConfig(device=...)``), translation and completion with
a model moved by hand, as a user with a GPU does: each gives what it gives on the CPU.

The device is CUDA under ``QKV_TEST_DEVICE=cuda`` and torch's lazy-tensor device elsewhere
(``tests/second_device.py``), which refuses a CPU tensor in an op as CUDA does. Tiny random
models in float64. A run's first loss is compared, and that the later steps ran: Adam's first
updates move each weight by about ``lr`` times its gradient's sign, so a gradient that is
zero but for rounding moves a weight by ``lr`` one way or the other on each device.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from qkv.data import CharTokenizer, make_task
from qkv.generate import complete, translate
from qkv.models import DecoderLM, DecoderLMConfig, Seq2SeqConfig, Seq2SeqTransformer
from qkv.nn.lora import add_lora, merge_lora
from qkv.train import TrainConfig, load_checkpoint, train_lm, train_seq2seq

TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=6, max_len=4, seed=0)
# made on the CPU even under QKV_TEST_DEVICE=cuda's default-device mode (explicit device)
STREAM = torch.randint(0, TOK.vocab_size, (400,), generator=torch.Generator().manual_seed(0),
                       device="cpu")
DOCS = [torch.randint(0, TOK.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 9, 13, 7, 20, 11)]


def _lm() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig(vocab_size=TOK.vocab_size, d_model=16, num_heads=2,
                             num_kv_heads=1, num_layers=2, d_ff=32, max_len=64)
    return DecoderLM(config).double()


def _s2s() -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(Seq2SeqConfig(
        TOK.vocab_size, TOK.vocab_size, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
        num_decoder_layers=1, dropout=0.0, max_len=16)).double()


def _config(device, **changes) -> TrainConfig:
    fields = dict(steps=2, batch_size=4, block_size=16, lr=1e-3, warmup=1, progress=False,
                  plot=False, device=str(device), eval_every=2, eval_examples=4, eval_batches=1)
    return TrainConfig(**{**fields, **changes})


def _lora(device):
    model = _lm()
    add_lora(model, ["*.q_proj", "*.v_proj"], rank=2)
    result = train_lm(model, STREAM, _config(device), valid_ids=STREAM[:100])
    merge_lora(model)
    return result


def _resumed(device, tmp_path):
    run = tmp_path / str(device).replace(":", "_")
    train_lm(_lm(), STREAM, _config(device, run_dir=str(run), save_every=1))
    result = train_lm(_lm(), STREAM, _config(device, run_dir=str(run), steps=4), resume=True)
    loaded = load_checkpoint(run / "last", _lm(), device=device)
    assert next(loaded.model.parameters()).device.type == torch.device(device).type
    return result


RUNS = {
    "language model": lambda d, tmp: train_lm(_lm(), STREAM, _config(d), valid_ids=STREAM[:100]),
    # (no evaluation: decoding on the device is `qkv eval`'s case in tests/cli)
    "seq2seq": lambda d, tmp: train_seq2seq(_s2s(), TASK, TOK, TOK, _config(d, eval_every=None)),
    "LoRA": lambda d, tmp: _lora(d),
    # the lazy device cannot run these (below); CUDA does
    "packed documents": lambda d, tmp: train_lm(_lm(), DOCS, _config(d, pack=True,
                                                                      block_size=24)),
    "accumulation, checkpointed activations": lambda d, tmp: train_lm(
        _lm(), STREAM, _config(d, accumulate=2, checkpoint_activations=True)),
    "checkpoints and resume": _resumed,
}
LAZY_CANNOT = {  # limits of the stand-in device, not of qkv
    "packed documents": "torch's activation checkpointing has no RNG module for it",
    "accumulation, checkpointed activations": "torch's activation checkpointing has no RNG "
                                              "module for it",
    "checkpoints and resume": "its tensors have no storage address to save from",
}


@pytest.mark.parametrize("name", RUNS)
def test_training_equals_the_cpu_run(moved, tmp_path, name):
    if moved.type == "lazy" and name in LAZY_CANNOT:
        pytest.skip(f"the lazy stand-in device: {LAZY_CANNOT[name]} (runs on CUDA)")
    on_cpu, on_device = RUNS[name]("cpu", tmp_path), RUNS[name](moved, tmp_path)
    first, first_moved = on_cpu.history[0], on_device.history[0]
    assert first_moved["loss"] == pytest.approx(first["loss"], rel=1e-6), (first, first_moved)
    assert len(on_device.history) == len(on_cpu.history)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in on_device.history)


def test_translation_and_completion_equal_the_cpu_run(moved):
    def run(device):
        return (translate(_s2s().to(device).eval(), ["123", "4567"], TOK, TOK,
                          max_new_tokens=8),
                complete(_lm().to(device).eval(), ["12", "345"], TOK, max_new_tokens=4,
                         add_bos=False))

    assert run(moved) == run("cpu")


def test_a_checkpoint_loads_onto_the_device(moved, tmp_path):
    from qkv.train import save_checkpoint

    model = _lm().eval()
    save_checkpoint(tmp_path / "c", model)
    for given in (None, _lm()):  # built from config.json, or loaded into a CPU model
        loaded = load_checkpoint(tmp_path / "c", given, device=moved).model.eval()
        assert {p.device.type for p in loaded.parameters()} == {moved.type}
        with torch.no_grad():  # (built from config.json: float32 weights)
            assert_close(loaded(STREAM[None, :12].to(moved)).cpu().double(),
                         model(STREAM[None, :12]), atol=1e-5, rtol=1e-5, name="logits")
