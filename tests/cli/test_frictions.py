"""The command-line frictions a new user met (issue 27), one test or more per item.

1. yes/no options are flags (``--causal/--no-causal``), no ``<bool>`` in ``--help``;
2. beam search is ``--beam-size`` everywhere, ``--beam`` a hidden alias;
3. one ``--max-new-tokens`` default per kind of task, said in each option's help;
4. evaluation lines print words, never metric keys (``bleu_ref_tokens``);
5. ``qkv embed --out`` creates its folders and refuses an existing file;
6. ``qkv inspect --input FILE``;
7. a blank generated or translated text gets a hint on stderr;
8. ``qkv translate ""`` prints an empty line and warns, as do unknown characters;
9. ``qkv train --resume --steps N`` says how a new total re-plans the learning rate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
import torch
import typer
from test_train_cmd import TINY as TRAIN_TINY
from typer.testing import CliRunner

import qkv.generate
from qkv.cli.app import COMMANDS, app
from qkv.cli.common import (
    LM_NEW_TOKENS,
    SPEECH_NEW_TOKENS,
    beam_of,
    blank_output_hint,
    usage_hint,
)
from qkv.cli.outputs import check_out_file, write_embeddings
from qkv.cli.train_cmd import metrics_text, resume_notice
from qkv.cli.translate_cmd import input_warnings
from qkv.data import CharTokenizer
from qkv.generate import complete
from qkv.models import DecoderLM, DecoderLMConfig
from qkv.train import TrainConfig, load_checkpoint, save_checkpoint
from qkv.train.metrics import describe_metrics

runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
GROUP = typer.main.get_command(app)


def command_of(name: str) -> click.Command:
    """The click command ``qkv name`` (the group may load its commands lazily)."""
    command = GROUP.get_command(click.Context(GROUP), name)
    assert command is not None, name
    return command


TOK = CharTokenizer.fit("the cat sat on the mat.")

# A copy-task run small enough to train in a second or two, with its evaluation lines shown:
# test_train_cmd's, printing as it goes.
TINY = TRAIN_TINY.replace("progress = false", "log_every = 6")


def one_line_error(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    """``qkv train copy`` on TINY: (its result, the run folder)."""
    root = tmp_path_factory.mktemp("frictions")
    config = root / "tiny.toml"
    config.write_text(TINY, encoding="utf-8")
    result = runner.invoke(app, ["train", "copy", "--config", str(config), "--out",
                                 str(root / "copy"), "--seed", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result, root / "copy"


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    """A tiny untrained language model with room for 300 positions."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(TOK.vocab_size, d_model=16, num_layers=1, num_heads=2,
                                      max_len=300)).eval()  # fmt: skip
    path = save_checkpoint(tmp_path_factory.mktemp("lm") / "ckpt", model,
                           tokenizers={"text": TOK})  # fmt: skip
    return Path(path), model


# ---------------------------------------------------------------- 1. flags


def test_yes_no_options_are_flags_without_a_bool_type_in_help():
    for module in COMMANDS:
        command = command_of(module.NAME)
        for param in command.params:
            if getattr(param, "is_flag", False) and not param.hidden:
                assert param.metavar == "", (module.NAME, param.opts)
        help_text = runner.invoke(app, [module.NAME, "--help"]).stdout
        # typer's own --help option is app.py's (see the report); every option of ours shows
        # no "<bool>" type, which reads as if it took a value
        lines = [line for line in help_text.splitlines() if "<bool>" in line]
        assert all("--help" in line for line in lines), (module.NAME, lines)
    pairs = {"explain": ["--no-causal", "--no-need-weights"], "generate": ["--no-chat", "--no-bos"],
             "train": ["--no-pack", "--no-fsdp"], "bench": ["--no-memory"]}  # fmt: skip
    for name, negatives in pairs.items():
        secondary = {o for p in command_of(name).params for o in p.secondary_opts}
        assert set(negatives) <= secondary, (name, secondary)


def test_flag_pairs_work_and_a_value_after_a_flag_is_one_line_with_a_hint():
    on = runner.invoke(app, ["explain", "--T", "8", "--S", "8", "--causal", "--need-weights"])
    off = runner.invoke(app, ["explain", "--T", "8", "--S", "8", "--no-causal",
                              "--no-need-weights"])  # fmt: skip
    assert on.exit_code == 0 and off.exit_code == 0, (on.output, off.output)
    assert on.stdout != off.stdout
    one_line_error(runner.invoke(app, ["explain", "--causal", "true"]), "true")
    args = ["explain", "--causal", "true"]
    with pytest.raises(typer.TyperException) as info:
        GROUP.main(args, standalone_mode=False)
    assert usage_hint(info.value, args) == ("; --causal is a flag and takes no value: write "
                                            "--causal or --no-causal")  # fmt: skip
    assert usage_hint(info.value, ["explain", "x"]) == ""


# ---------------------------------------------------------------- 2. --beam-size


def test_beam_size_is_the_name_everywhere_and_beam_a_hidden_alias(copy_run):
    for name in ("eval", "generate", "translate", "transcribe"):
        params = {o: p for p in command_of(name).params for o in p.opts}
        assert "--beam-size" in params and not params["--beam-size"].hidden, name
        assert "--beam" in params and params["--beam"].hidden, name
        help_text = runner.invoke(app, [name, "--help"]).stdout
        assert "--beam-size" in help_text and not re.search(r"--beam\b(?!-)", help_text), name
    _, run = copy_run
    new = runner.invoke(app, ["translate", str(run), "--beam-size", "3", "123", "45"])
    old = runner.invoke(app, ["translate", str(run), "--beam", "3", "123", "45"])
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)
    assert new.stdout == old.stdout and len(new.stdout.splitlines()) == 2
    one_line_error(runner.invoke(app, ["translate", str(run), "--beam", "2", "--beam-size", "3",
                                       "1"]), "--beam is the old name of --beam-size")
    assert beam_of(None, 4) == (4, "--beam") and beam_of(4, None) == (4, "--beam-size")
    assert beam_of(4, 4) == (4, "--beam-size") and beam_of(None, None) == (None, "--beam-size")
    # messages name the option as typed
    one_line_error(runner.invoke(app, ["translate", str(run), "--beam", "2", "--compile", "1"]),
                   "--compile", "--beam 2")  # fmt: skip
    one_line_error(runner.invoke(app, ["translate", str(run), "--beam-size", "2", "--compile",
                                       "1"]), "--beam-size 2")  # fmt: skip


# ---------------------------------------------------------------- 3. --max-new-tokens


def test_one_max_new_tokens_default_per_kind_of_task(lm_checkpoint):
    def option(name: str):
        return next(p for p in command_of(name).params if "--max-new-tokens" in p.opts)

    assert option("chat").default == LM_NEW_TOKENS == 256
    assert option("transcribe").default == SPEECH_NEW_TOKENS == 224
    helps = {name: " ".join(option(name).help.split()) for name in ("generate", "translate")}
    assert "256 for a language model" in helps["generate"]
    for name in ("generate", "translate"):
        assert "2 x the source's tokens + 10" in helps[name], helps[name]
    docs = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert "256 tokens" in docs and "2 × the source's tokens + 10" in docs and "224" in docs
    # a checkpoint's language model follows the same default as a pretrained one
    path, model = lm_checkpoint
    result = runner.invoke(app, ["generate", str(path), "-p", "the"])
    assert result.exit_code == 0, result.output
    assert result.stdout == complete(model, ["the"], TOK, max_new_tokens=LM_NEW_TOKENS)[0] + "\n"


# ---------------------------------------------------------------- 4. words, not keys


def test_evaluation_lines_print_words_not_metric_keys(copy_run):
    record = {"step": 15, "loss": 1.937, "perplexity": 6.934, "token_accuracy": 0.2817,
              "exact_match": 0.0, "bleu_ref_tokens": 2.88, "chrf": 10.44}  # fmt: skip
    line = describe_metrics(record)
    assert line == ("step 15  loss 1.937  perplexity 6.934  token accuracy 28.2%  exact match "
                    "0.0%  BLEU n/a (targets average 2.9 tokens; BLEU needs 4-grams)  chrF 10.4")
    assert metrics_text(record) == line
    assert describe_metrics({"bleu": 98.12, "chrf": 99.0}) == "BLEU 98.1  chrF 99.0"
    result, run = copy_run
    evals = [x for x in result.stdout.splitlines() if x.startswith("eval ")]
    assert len(evals) == 2, result.stdout
    for text in (result.stdout, runner.invoke(app, ["eval", str(run)]).stdout):
        assert "exact match" in text and "BLEU n/a (targets average" in text, text
        assert not re.search(r"bleu_ref_tokens|exact_match|token_accuracy", text), text
    # the files keep the keys
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("bleu_ref_tokens" in r for r in records)


# ---------------------------------------------------------------- 5. embed --out


def test_embed_out_creates_its_folders_and_refuses_an_existing_file(tmp_path):
    out = tmp_path / "new" / "deeper" / "vectors.npy"
    result = runner.invoke(app, ["embed", "a cat", "a dog", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and f"to {out}" in result.stderr
    # run again: the file is not overwritten, and the message names it
    one_line_error(runner.invoke(app, ["embed", "a cat", "--out", str(out)]), str(out),
                   "already exists")  # fmt: skip
    one_line_error(runner.invoke(app, ["embed", "a cat", "--out", str(out.parent)]),
                   str(out.parent), "is a folder")  # fmt: skip
    under = out / "v.npy"  # a path under the file
    one_line_error(runner.invoke(app, ["embed", "a cat", "--out", str(under)]),
                   "cannot be created", f"{out} is a file")  # fmt: skip
    with pytest.raises(ValueError, match="unknown extension"):
        check_out_file(tmp_path / "v.txt")
    written = write_embeddings(tmp_path / "a" / "b.jsonl", ["x"], torch.zeros(1, 3))
    assert written.is_file()


# ---------------------------------------------------------------- 6. inspect --input


def test_inspect_reads_its_text_from_input(lm_checkpoint, tmp_path):
    path, _ = lm_checkpoint
    text_file = tmp_path / "text.txt"
    text_file.write_text("the cat\nsat on the mat.\n", encoding="utf-8")
    by_file = runner.invoke(app, ["inspect", str(path), "--input", str(text_file), "--out",
                                  str(tmp_path / "a")])  # fmt: skip
    assert by_file.exit_code == 0, by_file.output
    by_stdin = runner.invoke(app, ["inspect", str(path), "-i", "-", "--out",
                                   str(tmp_path / "b")], input="the cat\nsat on the mat.\n")
    assert by_stdin.exit_code == 0, by_stdin.output
    tokens = [x for x in by_file.stdout.splitlines() if re.match(r"\d+ tokens:", x)]
    assert tokens and tokens == [x for x in by_stdin.stdout.splitlines()
                                 if re.match(r"\d+ tokens:", x)]  # fmt: skip
    assert tokens[0].startswith("23 tokens:"), tokens  # the whole file, its newline inside
    assert (tmp_path / "a" / "viewer.html").is_file()
    one_line_error(runner.invoke(app, ["inspect", str(path), "hi", "--input", str(text_file)]),
                   "TEXT or --input FILE, not both")  # fmt: skip
    one_line_error(runner.invoke(app, ["inspect", str(path)]), "give at least one text")


# ---------------------------------------------------------------- 7. blank outputs


def test_a_blank_output_gets_a_hint_on_stderr(copy_run, lm_checkpoint, monkeypatch):
    assert blank_output_hint(["x", "y"]) is None
    assert blank_output_hint(["  "]) == ("(the output is blank: the model may be undertrained; "
                                         "try more --steps or sampling (--temperature 0.8))")
    assert blank_output_hint(["", "x", " "], skip={0}).startswith("(1 of 3 outputs are blank")
    _, run = copy_run
    monkeypatch.setattr(qkv.generate, "translate", lambda model, texts, *a, **k: ["   "] * len(texts))
    result = runner.invoke(app, ["translate", str(run), "123"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "   \n"
    assert result.stderr == ("(the output is blank: the model may be undertrained; try more "
                             "--steps or sampling (--temperature 0.8))\n")
    path, _ = lm_checkpoint
    monkeypatch.setattr(qkv.generate, "complete", lambda model, prompts, *a, **k: [" \n"])
    result = runner.invoke(app, ["generate", str(path), "-p", "the", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"prompt": "the", "text": " \n"}
    assert "the model may be undertrained" in result.stderr and result.stderr.count("\n") == 1


# ---------------------------------------------------------------- 8. empty, unknown inputs


def test_translate_empty_input_is_an_empty_line_and_unknown_characters_warn(copy_run):
    _, run = copy_run
    ckpt = load_checkpoint(run / "best")
    # the empty text is left out of the batch (its length bounds the outputs: 2 x longest + 10)
    want = qkv.generate.translate(ckpt.model.eval(), ["123", "1é2✓"], ckpt.tokenizers["src"],
                                  ckpt.tokenizers["tgt"])  # fmt: skip
    alone = runner.invoke(app, ["translate", str(run), ""])
    assert alone.exit_code == 0, alone.output
    assert alone.stdout == "\n"
    assert alone.stderr == "warning: the text is empty: its translation is an empty line\n"
    mixed = runner.invoke(app, ["translate", str(run), "", "123", "1é2✓"])
    assert mixed.exit_code == 0, mixed.output
    lines = mixed.stdout.split("\n")
    assert lines == ["", *want, ""], mixed.stdout
    warnings = mixed.stderr.splitlines()
    assert warnings[0] == "warning: text 1 is empty: its translation is an empty line"
    assert warnings[1].startswith("warning: text 3 has 2 characters the model never saw in "
                                  "training ('é' '✓')"), warnings  # fmt: skip
    assert len(warnings) == 2
    # as JSON too: one record per input, the empty one empty
    records = [json.loads(x) for x in runner.invoke(
        app, ["translate", str(run), "", "123", "1é2✓", "--json"]).stdout.splitlines()]
    assert records == [{"source": "", "translation": ""},
                       {"source": "123", "translation": want[0]},
                       {"source": "1é2✓", "translation": want[1]}]  # fmt: skip
    assert input_warnings(["ok", " "]) == ["text 2 is empty: its translation is an empty line"]


# ---------------------------------------------------------------- 9. resume notice


def test_resume_with_other_steps_says_how_the_schedule_changes(copy_run):
    _, run = copy_run
    result = runner.invoke(app, ["train", "--resume", str(run), "--steps", "14"])
    assert result.exit_code == 0, result.output
    notes = [x for x in result.stdout.splitlines() if x.startswith("note: --steps")]
    assert notes == [notes[0]] and re.fullmatch(
        r"note: --steps 14 extends the run, which was planned for 12 steps: the cosine "
        r"learning-rate schedule is re-planned to reach its floor at step 14 instead of 12 "
        r"\(step 13: lr \d\.\d\de-\d\d -> \d\.\d\de-\d\d\)", notes[0]), notes
    again = runner.invoke(app, ["train", "--resume", str(run), "--steps", "16"])
    assert "planned for 14 steps" in again.stdout, again.stdout  # the plan it last ran with
    config = TrainConfig.from_dict(dict(steps=400, lr=2e-3, schedule="cosine", warmup=100))
    line = resume_notice({**config.to_dict(), "steps": 3000}, config, 300)
    assert line == ("note: --steps 400 shortens the run, which was planned for 3,000 steps: the "
                    "cosine learning-rate schedule is re-planned to reach its floor at step 400 "
                    "instead of 3,000 (step 301: lr 1.98e-03 -> 6.42e-04)")
    assert resume_notice(config.to_dict(), config, 300) is None
    flat = TrainConfig.from_dict(dict(steps=400, schedule="inverse_sqrt", warmup=10))
    assert "does not depend on the total" in resume_notice({"steps": 300}, flat, 200)
