"""``qkv embed``, ``qkv generate`` and ``qkv chat``: the printed results are the library's.

Each pretrained model is loaded once for the whole file: ``qkv.pretrained.load`` is replaced by
a caching wrapper around the real loader (SmolLM2 takes seconds to read), so every command
still goes through ``load`` but shares one bundle. Checkpoints are tiny models saved (or
trained for a few steps) into ``tmp_path``.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli import chat_cmd
from qkv.cli.app import app
from qkv.cli.chat_cmd import ASSISTANT, USER, Conversation, run_chat
from qkv.cli.embed_cmd import short
from qkv.cli.generate_cmd import decoding_options, resolve_source
from qkv.data import CharTokenizer
from qkv.generate import complete, translate
from qkv.models import (
    DecoderLM,
    DecoderLMConfig,
    Encoder,
    EncoderConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
)
from qkv.train import TrainConfig, save_checkpoint, train_lm

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
SMOL, MINILM = "SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"
TEXT = "the cat sat on the mat. the dog sat on the log. "
TOK = CharTokenizer.fit(TEXT)
_REAL_LOAD = qkv.pretrained.load
_LOADED: dict[str, object] = {}


def _cached_load(name, **options):
    options = {k: v for k, v in options.items() if v is not None}  # (device=None: the CPU)
    if options:
        return _REAL_LOAD(name, **options)
    key = str(name)
    if key not in _LOADED:
        _LOADED[key] = _REAL_LOAD(name)
    return _LOADED[key]


@pytest.fixture(autouse=True)
def _load_once(monkeypatch):
    monkeypatch.setattr(qkv.pretrained, "load", _cached_load)


def _ok(args, **kw):
    result = runner.invoke(app, args, **kw)
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result


def _fails(args, message, **kw):
    result = runner.invoke(app, args, **kw)
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
    assert "error:" in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    return result


def _decoder(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    # Untied: a random model with tied embeddings just repeats the last prompt token.
    config = DecoderLMConfig(
        TOK.vocab_size, d_model=32, num_layers=2, num_heads=2, max_len=64, tie_embeddings=False
    )
    return DecoderLM(config).eval()


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    model = _decoder()
    path = save_checkpoint(tmp_path_factory.mktemp("lm") / "ckpt", model, tokenizers={"text": TOK})
    return path, model


# ---------------------------------------------------------------- qkv embed


def test_embed_prints_the_library_s_cosine_table():
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock prices fell [sharply]."]
    out = _ok(["embed", *texts]).stdout
    embeddings, cosine = qkv.pretrained.embed(texts, _cached_load(MINILM))
    assert embeddings.shape == (3, 384)
    assert "3 texts -> embeddings (3, 384), L2-normalised" in out, out
    rows = [line for line in out.splitlines() if re.match(r"│ \d ", line)]
    assert len(rows) == 3, out
    for i, (row, text) in enumerate(zip(rows, texts, strict=True)):
        label, *cells = [c.strip() for c in row.strip("│").split("│")]
        assert label == f"{i + 1} {text}", label  # markup-like "[sharply]" printed as is
        printed = torch.tensor([float(c) for c in cells], dtype=torch.float64)
        err = float((printed - cosine[i].double()).abs().max())
        assert err <= 5e-5 + 1e-7, f"row {i}: printed {cells} vs {cosine[i].tolist()} ({err:.2e})"
    # The two sentences about cats are the closest pair, and the table says so.
    assert float(cosine[0, 1]) > 0.5 > float(cosine[0, 2])
    assert f"most similar: 1 and 2 ({float(cosine[0, 1]):.4f})" in out


def test_embed_one_text_and_long_labels():
    long = "word " * 30
    out = _ok(["embed", long]).stdout
    assert "1 text -> embeddings (1, 384)" in out and "1.0000" in out
    assert "most similar" not in out
    assert short(long) in out and len(short(long)) == 40 and short(long).endswith("…")
    assert short("  a\n b  ") == "a b"


def test_embed_errors():
    _fails(["embed", "--model", "no-such-model", "x"], "known names: ['all-MiniLM-L6-v2'")
    _fails(["embed", "--model", SMOL, "x"], "is a language model, not a sentence encoder")
    bad = runner.invoke(app, ["embed"])
    assert bad.exit_code == 2 and "give at least one text" in bad.output


# ---------------------------------------------------------------- qkv generate, pretrained


def test_generate_model_greedy_equals_bundle_generate():
    bundle = _cached_load(SMOL)
    prompt = "What is the capital of France?"
    chat = _ok(["generate", "--model", SMOL, "--prompt", prompt, "--max-new-tokens", "8"])
    expected = bundle.generate([{"role": "user", "content": prompt}], 8)
    assert expected and chat.stdout == expected + "\n", (chat.stdout, expected)
    raw = _ok(["generate", "-m", SMOL, "-p", "The capital of France is", "-n", "8", "--no-chat"])
    expected_raw = bundle.generate("The capital of France is", 8, chat=False)
    assert raw.stdout == expected_raw + "\n", (raw.stdout, expected_raw)


def test_generate_model_seeded_sampling_equals_bundle_and_positional_name():
    bundle = _cached_load(SMOL)
    args = ["-p", "Tell me a story.", "-n", "6", "-t", "0.9", "--top-k", "40", "--top-p", "0.95",
            "--seed", "7"]  # fmt: skip
    out = _ok(["generate", SMOL, *args]).stdout  # a packaged name works in place of a path
    expected = bundle.generate([{"role": "user", "content": "Tell me a story."}], 6,
                               temperature=0.9, top_k=40, top_p=0.95, seed=7)  # fmt: skip
    assert out == expected + "\n", (out, expected)


def test_generate_model_errors():
    _fails(["generate", "--model", "no-such-model", "-p", "hi"],
           "known names: ['all-MiniLM-L6-v2', 'SmolLM2-135M-Instruct', 'whisper-tiny.en']")  # fmt: skip
    _fails(["generate", "--model", MINILM, "-p", "hi"], "is a sentence encoder")
    _fails(["generate", "--model", SMOL], "give at least one prompt: --prompt TEXT")
    _fails(["generate", "-m", SMOL, "-p", "hi", "--beam", "2", "-t", "0.5"],
           "--beam 2 searches and --temperature 0.5 samples: pick one")  # fmt: skip


# ---------------------------------------------------------------- qkv generate, checkpoints


@pytest.mark.parametrize(
    ("extra", "options"),
    [
        ([], {}),
        (["--beam", "3"], {"beam_size": 3}),
        (
            ["-t", "1.3", "--top-k", "5", "--seed", "11"],
            {"temperature": 1.3, "top_k": 5, "seed": 11},
        ),
        (["--no-bos"], {"add_bos": False}),
    ],
    ids=["greedy", "beam", "sample", "no-bos"],
)
def test_generate_checkpoint_equals_complete(lm_checkpoint, extra, options):
    path, model = lm_checkpoint
    prompts = ["the c", "a dog s"]
    args = ["generate", str(path), "-p", prompts[0], "-p", prompts[1], "-n", "12", *extra]
    out = _ok(args).stdout
    expected = complete(model, prompts, TOK, max_new_tokens=12, **options)
    if options:  # the option changes the output, so the command must have passed it on
        assert expected != complete(model, prompts, TOK, max_new_tokens=12), options
    assert out == f"> {prompts[0]}\n{expected[0]}\n\n> {prompts[1]}\n{expected[1]}\n", (
        out,
        expected,
    )


def test_generate_checkpoint_given_as_model_option(lm_checkpoint):
    path, model = lm_checkpoint
    out = _ok(["generate", "--model", str(path), "-p", "the", "-n", "5"]).stdout
    assert out == complete(model, ["the"], TOK, max_new_tokens=5)[0] + "\n"


def test_generate_from_a_trained_run_folder(tmp_path):
    model = _decoder(seed=1).train()
    run = str(tmp_path / "run")
    config = TrainConfig(
        steps=3, batch_size=4, block_size=16, warmup=1, run_dir=run, progress=False, plot=False
    )
    train_lm(model, TOK.encode(TEXT * 3), config, tokenizer=TOK)
    result = _ok(["generate", str(tmp_path / "run"), "-p", "the ", "-n", "10"])
    assert f"using {tmp_path / 'run' / 'last'}" in result.stderr, result.stderr
    expected = complete(model.eval(), ["the "], TOK, max_new_tokens=10)
    assert result.stdout == expected[0] + "\n"


def test_generate_seq2seq_checkpoint_equals_translate(tmp_path):
    torch.manual_seed(2)  # a seed whose random model does not emit EOS at once
    config = Seq2SeqConfig(TOK.vocab_size, TOK.vocab_size, d_model=16, num_heads=2, d_ff=32,
                           max_len=40, dropout=0.0)  # fmt: skip
    model = Seq2SeqTransformer(config).eval()
    path = save_checkpoint(tmp_path / "s2s", model, tokenizers={"src": TOK, "tgt": TOK})
    outputs = []
    for extra, options in (
        ([], {}),
        (["--beam", "2", "-n", "7"], {"beam_size": 2, "max_new_tokens": 7}),
    ):
        out = _ok(["generate", str(path), "-p", "the cat", *extra]).stdout
        expected = translate(model, ["the cat"], TOK, TOK, **options)[0]
        assert out == expected + "\n", (out, expected)
        outputs.append(expected)
    assert outputs[0] and outputs[0] != outputs[1], outputs


def test_generate_checkpoint_errors(tmp_path, lm_checkpoint):
    missing = tmp_path / "nowhere"
    _fails(["generate", str(missing), "-p", "hi"], f"no checkpoint at {str(missing)!r}: no such")
    _fails(["generate", str(lm_checkpoint[0]), "--model", SMOL, "-p", "hi"], "got both")
    _fails(["generate", "-p", "hi"], "got neither")
    enc = Encoder(EncoderConfig(TOK.vocab_size, d_model=16, num_layers=1, num_heads=2, d_ff=32))
    save_checkpoint(tmp_path / "enc", enc, tokenizers={"text": TOK})
    _fails(["generate", str(tmp_path / "enc"), "-p", "hi"], "holds a Encoder, which does not")
    save_checkpoint(tmp_path / "notok", _decoder())
    _fails(["generate", str(tmp_path / "notok"), "-p", "hi"], "holds no 'text' tokenizer")
    broken = save_checkpoint(tmp_path / "broken", _decoder(), tokenizers={"text": TOK})
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    _fails(["generate", str(broken), "-p", "hi"], "truncated or corrupt")
    _fails(["generate", str(lm_checkpoint[0]), "-p", "hi", "-n", "100"], "max_len=64")


def test_resolve_source_and_options(tmp_path, lm_checkpoint):
    path = str(lm_checkpoint[0])
    assert resolve_source(path, None) == resolve_source(None, path)
    assert resolve_source(path, None).kind == "checkpoint"
    assert resolve_source("smollm2-135m-instruct", None).kind == "pretrained"
    assert resolve_source(None, "anything").kind == "pretrained"  # load() says what is wrong
    assert resolve_source(str(tmp_path), None).kind == "pretrained"  # an existing other folder
    with pytest.raises(ValueError, match="got both"):
        resolve_source(path, SMOL)
    assert decoding_options(0.0, 5, None, 1, None) == dict(temperature=0.0, top_k=5, top_p=None,
                                                           seed=1)  # fmt: skip
    assert decoding_options(0.0, None, None, None, 4) == {"beam_size": 4}


# ---------------------------------------------------------------- qkv chat


def test_chat_two_turns_reset_and_exit_keep_the_conversation(monkeypatch):
    bundle = _cached_load(SMOL)
    seen: list[list[dict[str, str]]] = []
    real_stream = bundle.stream

    def recording_stream(messages, *args, **kw):
        seen.append([dict(m) for m in messages])
        return real_stream(messages, *args, **kw)

    monkeypatch.setattr(bundle, "stream", recording_stream)
    system = {"role": "system", "content": "You are terse."}
    lines = "My name is Ana.\nWhat is my name?\n/reset\nHello\n/exit\nnever read\n"
    result = _ok(["chat", "--system", "You are terse.", "-n", "6"], input=lines)
    u1, u2, u3 = (
        {"role": "user", "content": t} for t in ("My name is Ana.", "What is my name?", "Hello")
    )
    assert len(seen) == 3, seen  # nothing after /exit was sent
    assert seen[0] == [system, u1]
    reply1 = seen[1][2]["content"]
    assert seen[1] == [system, u1, {"role": "assistant", "content": reply1}, u2]
    assert reply1 == bundle.generate([system, u1], 6) and reply1
    assert seen[2] == [system, u3], "/reset keeps the system prompt and forgets the turns"
    # The second prompt's token ids begin with the whole first exchange.
    first = bundle.tokenizer.encode_chat(seen[1][:3], add_generation_prompt=False)
    second = bundle.prompt_ids(seen[1])
    assert second[: len(first)] == first and len(second) > len(first)
    out = result.stdout
    assert out.startswith(f"{USER}My name is Ana.\n{ASSISTANT}{reply1}\n{USER}What is my name?\n")
    assert f"{USER}/reset\n(conversation cleared)\n{USER}Hello\n{ASSISTANT}" in out
    assert out.endswith(f"{USER}/exit\n") and "never read" not in out


def test_chat_streams_pieces_that_join_to_generate():
    bundle = _cached_load(SMOL)
    pieces: list[str] = []
    conv = Conversation(bundle, options={"max_new_tokens": 8})
    reply = conv.reply("Count to five.", pieces.append)
    assert len(pieces) > 1, f"the reply came in one piece: {pieces}"
    assert (
        "".join(pieces)
        == reply
        == bundle.generate([{"role": "user", "content": "Count to five."}], 8)
    )
    assert conv.messages[-1] == {"role": "assistant", "content": reply}


def _fake_stream(replies):
    """A stand-in for qkv.pretrained.stream_chat: yields the words of the next reply."""
    calls = []

    def stream_chat(messages, bundle, **options):
        calls.append([dict(m) for m in messages])
        reply = replies[len(calls) - 1]
        if isinstance(reply, Exception):
            raise reply
        for word in reply.split(" "):
            if word == "^C":
                raise KeyboardInterrupt
            yield word + " "

    return stream_chat, calls


def test_run_chat_loop_commands_errors_and_interrupt(monkeypatch):
    stream_chat, calls = _fake_stream(
        ["hello there", ValueError("too long for max_len"), "a b ^C c"]
    )
    monkeypatch.setattr(qkv.pretrained, "stream_chat", stream_chat)
    conv = Conversation(bundle=None)
    lines = iter(["hi\n", "\n", "/what\n", "boom\n", "stop me\n", ""])
    out, errors = io.StringIO(), io.StringIO()
    n = run_chat(conv, lambda: next(lines), out, echo=True, errors=Console(file=errors))
    assert n == 2, out.getvalue()
    text = out.getvalue()
    assert f"{ASSISTANT}hello there \n" in text
    assert "(unknown command /what: /reset clears the conversation, /exit quits)" in text
    assert "error: too long for max_len" in errors.getvalue()
    # the failed turn left no trace; the interrupted reply keeps what was shown
    assert calls[2] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there "},
        {"role": "user", "content": "stop me"},
    ]
    assert conv.messages[-1] == {"role": "assistant", "content": "a b "}
    assert text.endswith(f"{USER}\n"), "end of input ends the chat"


def test_chat_errors(lm_checkpoint):
    _fails(["chat", "--model", MINILM], "is a sentence encoder, not a chat model")
    _fails(["chat", "--model", "no-such-model"], "known names:")
    _fails(["chat", "--model", str(lm_checkpoint[0])], "has no chat template")
    assert chat_cmd.NAME == "chat"


def test_chat_endless_holds_the_conversation_in_a_sink_cache(monkeypatch):
    """``--endless --window 64``: five turns in flat memory; the first reply is the plain
    chat's; /reset starts the cache over."""
    from qkv.pretrained import endless_chat

    bundle = _cached_load(SMOL)
    chats: list = []
    real = endless_chat.EndlessChat

    def recording(*args, **kw):
        chats.append(real(*args, **kw))
        return chats[-1]

    monkeypatch.setattr(endless_chat, "EndlessChat", recording)
    lines = "Hello.\nHow are you?\nTell me a fact.\nAnother one.\nThanks.\n/reset\nHi\n/exit\n"
    result = _ok(["chat", "--endless", "--window", "64", "-n", "8"], input=lines)
    chat = chats[0]
    assert chat.recent == 64 and chat.held <= 68, (chat.recent, chat.held)
    first = bundle.generate([{"role": "user", "content": "Hello."}], 8)
    assert result.stdout.startswith(f"{USER}Hello.\n{ASSISTANT}{first}\n"), result.stdout
    assert "(conversation cleared)" in result.stdout and chat.fed.count("Hello.") == 0
