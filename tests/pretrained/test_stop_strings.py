"""Stop strings and generation controls through a pretrained bundle and the CLI (issue 29):
matched on the text across token boundaries, never shown in part while streaming."""

from __future__ import annotations

from functools import cache

import pytest
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli.app import app
from qkv.generate import GenerationControls, greedy, strip
from qkv.pretrained.stop_text import TextStream, check_stops

PROMPT = "List three fruits, one per line."


@cache
def smollm2():
    return qkv.pretrained.load("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("text,stops,shown", [
    ("abc\n\nd", ["\n\n"], "abc"), ("abc\n", ["\n\n"], "abc\n"), ("ab", ["xyz"], "ab"),
    ("END. The", ["The end", "END"], ""), ("a The e", ["The end"], "a The e"),
])  # fmt: skip
def test_text_is_cut_at_the_first_stop_and_a_possible_stop_is_held(text, stops, shown):
    """Characters as tokens: the text shown while streaming never holds the start of a stop
    string, and at the end is the text up to the first stop."""
    stream = TextStream(lambda ids: "".join(map(chr, ids)), stops)
    pieces = [stream.push(ord(c)) for c in text]
    so_far = ""
    for piece in pieces:
        so_far += piece
        assert not any(so_far.endswith(s[:n]) for s in stops for n in range(1, len(s))) \
            or stream.stopped, so_far  # fmt: skip
    assert "".join(pieces) + stream.close() == shown


def test_bad_stops_are_refused():
    for bad in ([""], [1], 5, None):
        with pytest.raises(ValueError, match="stop must be"):
            check_stops(bad)


@pytest.mark.self_check
def test_stop_cuts_the_text_and_streaming_never_shows_a_partial_stop():
    bundle = smollm2()
    full = bundle.generate(PROMPT, 40)
    assert "\n" in full, full
    assert bundle.generate(PROMPT, 40, stop="\n") == full[: full.index("\n")]
    stop = full[full.index("\n") : full.index("\n") + 3]  # a stop spanning several tokens
    pieces = list(bundle.stream(PROMPT, 40, stop=[stop]))
    assert "".join(pieces) == full[: full.index(stop)]
    shown = ""
    for piece in pieces[:-1]:
        shown += piece
        assert not any(shown.endswith(stop[:n]) for n in range(1, len(stop))), shown


@pytest.mark.self_check
def test_controls_reach_the_model_through_the_bundle():
    bundle = smollm2()
    controls = GenerationControls(repetition_penalty=1.5, no_repeat_ngram_size=3)
    ids = bundle.prompt_ids(PROMPT)
    want = strip(greedy(bundle.model, [ids], max_new_tokens=30, eos_id=bundle.eos_id,
                        controls=controls), bundle.eos_id)[0]  # fmt: skip
    got = bundle.generate(PROMPT, 30, controls=controls)
    assert got == bundle.tokenizer.decode(want, skip_special_tokens=True)
    assert got != bundle.generate(PROMPT, 30)


@pytest.mark.self_check
def test_the_generate_command_takes_controls_and_stops():
    bundle = smollm2()
    full = bundle.generate(PROMPT, 40)
    run = CliRunner().invoke(app, ["generate", "-m", "SmolLM2-135M-Instruct", "-p", PROMPT,
                                   "-n", "40", "--stop", "\n"])  # fmt: skip
    assert run.exit_code == 0, run.output
    assert run.stdout.strip() == full[: full.index("\n")].strip()
    run = CliRunner().invoke(app, ["generate", "-m", "SmolLM2-135M-Instruct", "-p", PROMPT,
                                   "-n", "30", "--repetition-penalty", "1.5",
                                   "--no-repeat-ngram-size", "3"])  # fmt: skip
    controls = GenerationControls(repetition_penalty=1.5, no_repeat_ngram_size=3)
    assert run.stdout.strip() == bundle.generate(PROMPT, 30, controls=controls).strip()
    bad = CliRunner().invoke(app, ["generate", "-m", "SmolLM2-135M-Instruct", "-p", PROMPT,
                                   "--beam-size", "2", "--min-p", "0.1"])  # fmt: skip
    assert bad.exit_code != 0 and "--min-p" in bad.output and "Traceback" not in bad.output
