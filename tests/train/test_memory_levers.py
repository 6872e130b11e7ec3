"""Memory levers of training (``qkv.train.memory``): activation checkpointing per block gives
the same losses and weights as the plain forward (dropout on, gradient accumulation, bf16,
an encoder-decoder, DDP and FSDP2 on two gloo ranks), recomputes each block once per step,
leaves evaluation, generation and saved checkpoints plain; ``qkv train --checkpoint-activations
--bf16`` reach the TrainConfig; bf16's note on a CPU without native bfloat16, both ways."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from helpers import DEVICE, assert_close
from qkv.cli.app import app
from qkv.data import CharTokenizer, LMBatch, make_task
from qkv.generate import greedy
from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)
from qkv.train import Job, TrainConfig, fit, load_checkpoint, memory, token_loss, train_seq2seq
from qkv.train.memory import bf16_note, checkpointed_blocks, native_bf16, transformer_blocks

V = 20
TOK = CharTokenizer.fit("0123456789")
TASK = make_task("copy", n_train=40, n_valid=6, n_test=6, max_len=4, seed=0)
QUIET = dict(progress=False, plot=False, device=str(DEVICE))
runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})


def _lm(dropout: float = 0.2) -> DecoderLM:
    torch.manual_seed(1)
    return DecoderLM(DecoderLMConfig(V, d_model=32, num_layers=2, num_heads=2, max_len=16,
                                     dropout=dropout))  # fmt: skip


def _s2s() -> Seq2SeqTransformer:
    torch.manual_seed(1)
    return Seq2SeqTransformer(Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16,
                                            num_heads=2, d_ff=32, num_encoder_layers=2,
                                            num_decoder_layers=2, dropout=0.2, max_len=16))  # fmt: skip


def _lm_job(model: DecoderLM) -> Job:
    rows = torch.randint(0, V, (16, 13), generator=torch.Generator().manual_seed(5))
    batches = [LMBatch(rows[i : i + 4, :-1], rows[i : i + 4, 1:]) for i in range(0, 16, 4)]
    return Job(model=model, epoch_batches=lambda epoch: batches,
               batch_tokens=lambda b: b.targets.numel(),
               loss=lambda m, b: token_loss(m(b.inputs), b.targets, pad_id=None))  # fmt: skip


def _count_block_forwards(model: torch.nn.Module) -> list[int]:
    """Calls of each block's feed-forward: once per forward pass, twice when recomputed."""
    counts = [0] * len(transformer_blocks(model))
    for i, block in enumerate(transformer_blocks(model)):
        block.ffn.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def _assert_same_run(plain, ckpt, plain_model, ckpt_model, what: str) -> None:
    losses = [h["loss"] for h in plain.history]
    ckpt_losses = [h["loss"] for h in ckpt.history]
    err = max(abs(a - b) for a, b in zip(losses, ckpt_losses, strict=True))
    assert err <= 1e-6, f"{what}: losses differ by up to {err:.3e}: {losses} vs {ckpt_losses}"
    want = plain_model.state_dict()
    got = ckpt_model.state_dict()
    assert got.keys() == want.keys(), f"{what}: parameter names changed"
    for name, tensor in want.items():
        assert_close(got[name], tensor, atol=1e-6, name=f"{what}: {name}")


# ---------------------------------------------------------------- same results, recomputed


@pytest.mark.parametrize(("accumulate", "bf16"), [(1, False), (2, False), (2, True)])
def test_checkpointing_a_decoder_lm_with_dropout_changes_no_loss_and_no_weight(accumulate, bf16):
    config = TrainConfig(steps=4, batch_size=4, lr=1e-2, warmup=1, accumulate=accumulate,
                         bf16=bf16, **QUIET)  # fmt: skip
    plain_model, ckpt_model = _lm(), _lm()
    plain_calls, ckpt_calls = _count_block_forwards(plain_model), _count_block_forwards(ckpt_model)
    plain = fit(_lm_job(plain_model), config)
    ckpt = fit(_lm_job(ckpt_model), config.replace(checkpoint_activations=True))
    _assert_same_run(plain, ckpt, plain_model, ckpt_model, f"accumulate={accumulate} bf16={bf16}")
    passes = config.steps * accumulate
    assert plain_calls == [passes] * 2, plain_calls
    assert ckpt_calls == [2 * passes] * 2, f"each block recomputed once per pass: {ckpt_calls}"
    assert all("forward" not in vars(b) for b in ckpt_model.blocks), "checkpointing left behind"
    assert (ckpt_model.embed.weight - _lm().embed.weight).abs().max() > 1e-3, "no training"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_checkpointing_an_encoder_decoder_changes_no_loss_weight_or_evaluation(accumulate):
    config = TrainConfig(steps=4, batch_size=8, lr=3e-3, warmup=1, accumulate=accumulate,
                         eval_every=2, eval_examples=6, **QUIET)  # fmt: skip
    plain_model, ckpt_model = _s2s(), _s2s()
    plain = train_seq2seq(plain_model, TASK, TOK, TOK, config)
    ckpt_calls = _count_block_forwards(ckpt_model)
    ckpt = train_seq2seq(ckpt_model, TASK, TOK, TOK,
                         config.replace(checkpoint_activations=True))  # fmt: skip
    _assert_same_run(plain, ckpt, plain_model, ckpt_model, f"seq2seq accumulate={accumulate}")
    assert ckpt.evals == plain.evals
    assert len(ckpt_calls) == 4 and min(ckpt_calls) > 0, ckpt_calls  # encoder and decoder


def test_a_checkpoint_written_with_it_on_has_the_plain_names_and_loads_into_a_plain_model(
    tmp_path,
):
    config = TrainConfig(steps=2, batch_size=4, lr=1e-2, warmup=1, **QUIET)
    plain_model, ckpt_model = _lm(), _lm()
    fit(_lm_job(plain_model), config.replace(run_dir=str(tmp_path / "plain")))
    fit(_lm_job(ckpt_model), config.replace(run_dir=str(tmp_path / "ckpt"),
                                            checkpoint_activations=True))  # fmt: skip
    plain_files = sorted(p.name for p in (tmp_path / "plain" / "last").iterdir())
    assert sorted(p.name for p in (tmp_path / "ckpt" / "last").iterdir()) == plain_files
    for name in (n for n in plain_files if n.endswith(".safetensors")):
        saved = load_file(str(tmp_path / "ckpt" / "last" / name))
        assert saved.keys() == load_file(str(tmp_path / "plain" / "last" / name)).keys(), name
    fresh = _lm()
    load_checkpoint(tmp_path / "ckpt" / "last", fresh)
    for name, tensor in ckpt_model.state_dict().items():
        assert_close(fresh.state_dict()[name], tensor, atol=0.0, name=name)
    saved = load_checkpoint(tmp_path / "ckpt" / "last").train_state["config"]
    assert saved["checkpoint_activations"] is True


def test_evaluation_and_generation_run_the_plain_forward(monkeypatch):
    calls = []
    real = memory.checkpoint
    monkeypatch.setattr(memory, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _lm(dropout=0.0).to(DEVICE)
    ids = torch.randint(0, V, (2, 8)).to(DEVICE)
    with checkpointed_blocks(model) as blocks:
        assert blocks == list(model.blocks)
        model.train()
        with torch.no_grad():
            no_grad = model(ids)
        assert calls == []
        model.eval()
        plain = model(ids)
        greedy(model, ids, max_new_tokens=3)
        assert calls == [], "evaluation or generation checkpointed"
        model.train()
        trained = model(ids)
        assert len(calls) == 2  # one per block
    assert_close(trained, plain, atol=0.0, name="checkpointed forward")
    assert_close(no_grad, plain, atol=0.0, name="no_grad forward")
    assert all("forward" not in vars(b) for b in model.blocks)


def test_the_blocks_are_the_outermost_module_lists_elements():
    lm = _lm()
    assert transformer_blocks(lm) == list(lm.blocks)
    s2s = _s2s()
    assert transformer_blocks(s2s) == [*s2s.encoder_blocks, *s2s.decoder_blocks]
    encoder = Encoder(EncoderConfig(V, d_model=16, num_heads=2, num_layers=3))
    assert transformer_blocks(encoder) == list(encoder.blocks)
    assert transformer_blocks(torch.nn.Linear(2, 2)) == []


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_values_are_clear_errors(value):
    with pytest.raises(ValueError, match=f"checkpoint_activations must be a bool, got {value!r}"):
        TrainConfig(checkpoint_activations=value)


def test_a_model_without_blocks_and_a_block_checkpointed_twice_are_clear_errors():
    model = torch.nn.Linear(4, V)
    job = Job(model=model, epoch_batches=lambda e: [torch.randn(2, 4)], batch_tokens=lambda b: 2,
              loss=lambda m, b: token_loss(m(b)[:, None], torch.zeros(2, 1, dtype=torch.long),
                                           pad_id=None))  # fmt: skip
    config = TrainConfig(steps=1, warmup=1, checkpoint_activations=True, **QUIET)
    with pytest.raises(ValueError, match=r"outermost nn.ModuleList .*got a Linear with none"):
        fit(job, config)
    lm = _lm()
    with checkpointed_blocks(lm), pytest.raises(ValueError, match="already has a forward"):
        fit(_lm_job(lm), config)


# ---------------------------------------------------------------- bf16 on this CPU


def _onednn(monkeypatch, answer):
    def supported():
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", supported, raising=False)


@pytest.mark.parametrize(("onednn", "capability", "native"), [
    (True, "AVX2", True), (False, "AVX512", False),  # oneDNN's answer wins
    (RuntimeError("no oneDNN"), "AVX512", True), (RuntimeError("no oneDNN"), "AVX2", False),
])  # fmt: skip
def test_native_bf16_follows_onednn_else_the_cpu_capability(monkeypatch, onednn, capability,
                                                            native):  # fmt: skip
    _onednn(monkeypatch, onednn)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert native_bf16("cpu") is native
    assert native_bf16("cuda") is True  # nothing to say about other devices
    note = bf16_note("cpu")
    assert (note is None) is native
    if note is not None:
        assert note.startswith(f"note: bf16 on this CPU ({capability}, no native bfloat16")
        assert "\n" not in note


# ---------------------------------------------------------------- qkv train's flags

TINY = """
batch_size = 8
eval_examples = 6
progress = false
[data]
n_train = 40
n_valid = 6
n_test = 6
max_len = 4
[model]
d_model = 16
num_heads = 2
d_ff = 32
"""


@pytest.mark.parametrize("native", [True, False])
def test_qkv_train_flags_reach_the_train_config(tmp_path, monkeypatch, native):
    monkeypatch.setattr(memory, "native_bf16", lambda device="cpu": native)
    (tmp_path / "tiny.toml").write_text(TINY, encoding="utf-8")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "copy", "--config", str(tmp_path / "tiny.toml"),
                                 "--steps", "2", "--checkpoint-activations", "--bf16",
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    saved = load_checkpoint(out / "last").train_state["config"]
    assert saved["checkpoint_activations"] is True and saved["bf16"] is True
    notes = [line for line in result.output.splitlines() if line.startswith("note: bf16")]
    assert len(notes) == (0 if native else 1), result.output


def test_qkv_train_flags_default_to_the_config_file_and_refuse_resume(tmp_path):
    toml = tmp_path / "on.toml"
    toml.write_text("checkpoint_activations = true\n" + TINY, encoding="utf-8")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "copy", "--config", str(toml), "--steps", "1",
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert load_checkpoint(out / "last").train_state["config"]["checkpoint_activations"] is True
    off = runner.invoke(app, ["train", "copy", "--config", str(toml), "--steps", "1",
                              "--no-checkpoint-activations", "--out", str(tmp_path / "off")])  # fmt: skip
    assert off.exit_code == 0, off.output
    saved = load_checkpoint(tmp_path / "off" / "last").train_state["config"]
    assert saved["checkpoint_activations"] is False
    bad = runner.invoke(app, ["train", "--resume", str(out), "--steps", "3", "--bf16"])
    assert bad.exit_code == 2 and "drop --bf16" in bad.stderr, bad.output
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.stderr


# ---------------------------------------------------------------- DDP and FSDP2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of 2: LM runs with and without checkpointing under DDP and FSDP2
    (accumulating 2 micro-batches); writes its losses and weights' digests."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    from qkv.distributed.data_parallel import init_distributed, shutdown

    record: dict = {}
    try:
        record["world"] = init_distributed("cpu", timeout=60.0).size
        config = TrainConfig(steps=3, batch_size=4, lr=1e-2, warmup=1, accumulate=2,
                             progress=False, plot=False)  # fmt: skip
        for fsdp in (False, True):
            for ckpt in (False, True):
                model = _lm()
                result = fit(_lm_job(model), config.replace(fsdp=fsdp, checkpoint_activations=ckpt))
                record[f"fsdp={fsdp} ckpt={ckpt}"] = {
                    "losses": [h["loss"] for h in result.history],
                    "weights": {k: v.tolist() for k, v in model.state_dict().items()},
                }
    except Exception as err:  # the test reports it
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        shutdown()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    os._exit(0)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks on the CPU")
def test_checkpointing_under_ddp_and_fsdp_equals_the_plain_run(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path)), daemon=True)
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
        if p.is_alive():
            p.kill()
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert "error" not in rec, f"rank {r}: {rec['error']}"
        assert rec["world"] == 2, f"rank {r} trained in a group of {rec['world']}"
    for fsdp in (False, True):
        plain, ckpt = records[0][f"fsdp={fsdp} ckpt=False"], records[0][f"fsdp={fsdp} ckpt=True"]
        err = max(abs(a - b) for a, b in zip(plain["losses"], ckpt["losses"], strict=True))
        assert err <= 1e-6, f"fsdp={fsdp}: losses differ by {err:.3e}"
        for name, tensor in plain["weights"].items():
            assert_close(torch.tensor(ckpt["weights"][name]), torch.tensor(tensor), atol=1e-6,
                         name=f"fsdp={fsdp}: {name}")  # fmt: skip
        assert records[1][f"fsdp={fsdp} ckpt=True"] == ckpt, "ranks disagree"
