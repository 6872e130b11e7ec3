"""``qkv transcribe FILE...``: speech to text with Whisper tiny.en (or any CTranslate2 Whisper
folder), offline.

Each file is read at its own sample rate, resampled to 16 kHz and decoded 30 s window by
window (:meth:`qkv.pretrained.whisper.SpeechBundle.transcribe`). On a terminal the words appear
as they are decoded (greedy); piped, each file's text is printed once. ``--align PNG`` draws
the cross-attention alignment of the tokens against audio time (first 30 s window).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from qkv.cli.common import (
    FLAG,
    SPEECH_NEW_TOKENS,
    BeamAlias,
    BeamSize,
    beam_of,
    check_out_folder,
)
from qkv.cli.inputs import read_items
from qkv.cli.outputs import print_jsonl
from qkv.cli.progress import Stages

__all__ = ["align_path", "command"]

NAME = "transcribe"


def align_path(path: Path, audio: Path, several: bool) -> Path:
    """The PNG for ``audio``: ``path`` itself, or ``<stem>-<audio stem>.png`` with several files."""
    return path.with_name(f"{path.stem}-{audio.stem}{path.suffix or '.png'}") if several else path


def _align(bundle, audio: Path, png: Path) -> Path:
    """Greedy tokens of the first window, teacher-forced under capture, drawn against time."""
    from qkv.inspect.alignment import cross_attention_alignment, plot_time_alignment
    from qkv.pretrained import audio as audio_mod

    samples = next(audio_mod.audio_windows(audio))  # the first 30 s, read alone
    features = bundle.features(samples)  # (1, n_mels, 3000)
    output = bundle.tokens(features)[0]
    tokens = [*bundle.prompt, *output]
    heads = bundle.alignment_heads or None
    matrix = cross_attention_alignment(bundle.model, features, tokens, heads)  # (T, S)
    labels = [bundle.tokenizer.decode([t]) for t in tokens]
    seconds = min(samples.shape[0] / audio_mod.SAMPLE_RATE, audio_mod.WINDOW_SECONDS)
    return plot_time_alignment(matrix, png, tokens=labels, duration=seconds,
                               seconds_per_frame=audio_mod.FRAME_SECONDS,
                               title=f"{audio.name}: cross-attention, "
                                     f"{len(heads or [])} alignment heads averaged")  # fmt: skip


def command(
    files: Annotated[list[Path] | None, typer.Argument(
        help="Audio files (WAV, FLAC, OGG; any rate).", show_default=False,
    )] = None,
    model: Annotated[str, typer.Option(
        "--model", "-m", help="Packaged name or CTranslate2 Whisper folder.",
    )] = "whisper-tiny.en",
    beam_size: BeamSize = None,
    beam: BeamAlias = None,
    max_new_tokens: Annotated[int, typer.Option(
        "--max-new-tokens", "-n", min=1, help="Most tokens per 30 s window of audio "
        "(Whisper's own default: half its 448 positions).",
    )] = SPEECH_NEW_TOKENS,
    align: Annotated[Path | None, typer.Option(
        "--align", help="Write the cross-attention alignment (tokens x seconds) to this PNG.",
    )] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", help="A UTF-8 file of audio paths, one per line ('-': standard input).",
        show_default=False,
    )] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", metavar=FLAG,
        help="Print one JSON object per file ({\"file\", \"text\"}), one per line.",
    )] = False,
    compile: Annotated[bool, typer.Option(
        "--compile", metavar=FLAG,
        help="A static KV cache and torch.compile for the decoding steps (the "
        "first file compiles; needs a C++ compiler, else eager; not with --beam-size).",
    )] = False,
) -> None:
    """Transcribe speech to text, offline, with Whisper on qkv's attention.

    [bold]Example:[/bold] espeak-ng -w hello.wav "Hello world" && qkv transcribe hello.wav
    --align hello.png

    [bold]Example:[/bold] ls *.wav | qkv transcribe --input - --json
    """
    from qkv import pretrained
    from qkv.pretrained.whisper import SpeechBundle

    console = Console(highlight=False, soft_wrap=True)
    stderr = Console(stderr=True, highlight=False)
    beam_size, typed = beam_of(beam_size, beam)
    files = [Path(f) for f in read_items([str(f) for f in files or []], input_file,
                                         what="audio file")]  # fmt: skip
    for file in files:
        if not file.is_file():
            what = "is a folder" if file.is_dir() else "does not exist"
            raise FileNotFoundError(f"FILE {file} {what} (expected an audio file)")
    if compile and beam_size is not None:
        raise ValueError(f"--compile (a static KV cache) does not serve {typed} {beam_size}; "
                         "drop one")  # fmt: skip
    if align is not None:  # refused now, not after the transcription
        if align.is_dir():
            raise ValueError(f"--align {align} is a folder; expected a .png file path")
        check_out_folder(align.parent, "--align")
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    stages = Stages("transcribe")  # stderr: spinners on a terminal, a line per stage in a pipe
    with stages.stage(f"loading {model}"):
        bundle = pretrained.load(model)
    if not isinstance(bundle, SpeechBundle):
        raise ValueError(f"--model {model!r} is not a speech model (expected a Whisper folder)")
    several = len(files) > 1
    for n, file in enumerate(files, 1):
        prefix = f"{escape(str(file))}: " if several else ""
        doing = f"transcribing {file}" + (f" ({n}/{len(files)})" if several else "")
        if as_json:
            with stages.stage(doing):
                text = bundle.transcribe(file, beam_size=beam_size, compile=compile,
                                         max_new_tokens=max_new_tokens)  # fmt: skip
            print_jsonl([{"file": str(file), "text": text}])
        elif console.is_terminal and beam_size is None and not compile:
            console.print(prefix, end="")
            for piece in bundle.stream(file, max_new_tokens=max_new_tokens):
                console.print(escape(piece), end="")
                sys.stdout.flush()
            console.print()
        else:
            with stages.stage(doing):
                text = bundle.transcribe(file, beam_size=beam_size, compile=compile,
                                         max_new_tokens=max_new_tokens)  # fmt: skip
            console.print(prefix + escape(text))
        if align is not None:
            with stages.stage("drawing the alignment"):
                written = _align(bundle, file, align_path(align, file, several))
            stderr.print(f"alignment: {escape(str(written))}")
