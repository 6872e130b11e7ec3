"""``qkv transcribe FILE...``: speech to text with Whisper tiny.en (or any CTranslate2 Whisper
folder), offline; subtitles and JSON files too.

The files are transcribed by :meth:`qkv.pretrained.whisper.model.SpeechBundle.transcripts`
(``--batch-size`` of them at a time, 30 s window by window), each printed as soon as it is
done, in the order given: its text (after its name when there are several), or with
``--json`` one JSON object per line (``{"file", "text", "segments"}``). On a terminal, one
file decoded greedily without ``--json`` or ``--format`` is printed segment by
segment as it is decoded (:meth:`~qkv.pretrained.whisper.model.SpeechBundle.segments`).

``--format srt,vtt`` (any of txt, srt, vtt, json, or all) also writes each file's transcript
to ``<--out>/<audio stem>.<format>`` (:mod:`qkv.pretrained.whisper.subtitles`), atomically; the
paths written are listed on stderr. Everything that can be refused (a missing file, an
unknown format, two files with one stem, an ``--out`` under a file) is refused before the
model is loaded: the options travel as one :class:`TranscribeOptions`, checked once when it is
built. ``--align PNG`` draws the cross-attention alignment of the tokens against audio time
(first 30 s window).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from qkv.cli.common import (
    FLAG,
    SPEECH_NEW_TOKENS,
    BeamAlias,
    BeamSize,
    ModelDevice,
    beam_of,
    check_out_folder,
)
from qkv.cli.inputs import read_items
from qkv.cli.outputs import print_jsonl
from qkv.cli.progress import Stages

__all__ = ["TranscribeOptions", "align_path", "command", "output_paths", "parse_formats"]

NAME = "transcribe"

Files = Annotated[list[Path] | None, typer.Argument(
    help="Audio files (WAV, FLAC, OGG; any rate).", show_default=False,
)]
Model = Annotated[str, typer.Option(
    "--model", "-m", help="Packaged name or CTranslate2 Whisper folder.",
)]
MaxNewTokens = Annotated[int, typer.Option(
    "--max-new-tokens", "-n", min=1, help="Most tokens per 30 s window of audio "
    "(Whisper's own default: half its 448 positions).",
)]
Formats = Annotated[str | None, typer.Option(
    "--format", "-f", show_default=False, help="Also write each file's transcript as "
    "<--out>/<audio stem>.<format>: txt, srt, vtt, json, comma-separated, or all.",
)]
OutDir = Annotated[Path | None, typer.Option(
    "--out", "-o", show_default=False,
    help="The folder --format writes into (created if missing) \\[default: the current "
    "folder].",
)]
WordTimestamps = Annotated[bool, typer.Option(
    "--word-timestamps", metavar=FLAG,
    help="Time every word too (in --json and the json format).",
)]
BatchSize = Annotated[int, typer.Option(
    "--batch-size", "-b", min=1, help="Files transcribed together (their 30 s windows "
    "decoded in one batch).",
)]
Align = Annotated[Path | None, typer.Option(
    "--align", help="Write the cross-attention alignment (tokens x seconds) to this PNG.",
)]
InputFile = Annotated[Path | None, typer.Option(
    "--input", "-i", help="A UTF-8 file of audio paths, one per line ('-': standard input).",
    show_default=False,
)]
AsJson = Annotated[bool, typer.Option(
    "--json", metavar=FLAG, help="Print one JSON object per file ({\"file\", \"text\", "
    "\"segments\"}), one per line.",
)]


def align_path(path: Path, audio: Path, several: bool) -> Path:
    """The PNG for ``audio``: ``path`` itself, or ``<stem>-<audio stem>.png`` with several files."""
    return path.with_name(f"{path.stem}-{audio.stem}{path.suffix or '.png'}") if several else path


def _align(bundle, audio: Path, png: Path) -> Path:
    """Greedy tokens of the first window, teacher-forced under capture, drawn against time,
    with the window's words timed (word timestamps) marked."""
    from qkv.inspect.alignment import cross_attention_alignment, plot_time_alignment
    from qkv.pretrained.whisper import audio as audio_mod

    samples = next(audio_mod.audio_windows(audio))  # the first 30 s, read alone
    weight = next(bundle.model.parameters())  # features go to the model's device and dtype
    features = bundle.features(samples).to(weight)  # (1, n_mels, 3000)
    output = bundle.tokens(features)[0]
    tokens = [*bundle.prompt, *output]
    heads = bundle.alignment_heads or None
    matrix = cross_attention_alignment(bundle.model, features, tokens, heads)  # (T, S)
    labels = [bundle.tokenizer.decode([t]) for t in tokens]
    seconds = min(samples.shape[0] / audio_mod.SAMPLE_RATE, audio_mod.WINDOW_SECONDS)
    words = [(w.text, w.start, w.end) for w in
             bundle.transcript(samples, word_timestamps=True).words]  # fmt: skip
    return plot_time_alignment(matrix, png, tokens=labels, duration=seconds, words=words,
                               seconds_per_frame=audio_mod.FRAME_SECONDS,
                               title=f"{audio.name}: cross-attention, "
                                     f"{len(heads or [])} alignment heads averaged")  # fmt: skip


def parse_formats(spec: str) -> tuple[str, ...]:
    """The formats of ``--format``: comma-separated names of
    :data:`qkv.pretrained.whisper.subtitles.FORMATS`, or ``all``, in the order given, each once.

    Raises:
        ValueError: an unknown name, or none, naming ``--format``.
    """
    from qkv.pretrained.whisper.subtitles import FORMATS

    names = [n.strip().lower() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in (*FORMATS, "all")]
    if unknown or not names:
        what = f"unknown format {unknown[0]!r}" if unknown else "no format named"
        raise ValueError(f"--format {spec!r}: {what}; expected {', '.join(FORMATS)} or all "
                         "(several: --format srt,vtt)")  # fmt: skip
    chosen = [f for n in names for f in (FORMATS if n == "all" else (n,))]
    return tuple(dict.fromkeys(chosen))


def output_paths(files: list[Path], formats: tuple[str, ...], folder: Path) -> list[list[Path]]:
    """Each file's outputs, ``<folder>/<audio stem>.<format>`` per format, in order.

    Returns:
        one list of paths per file (empty lists when ``formats`` is empty).

    Raises:
        ValueError: two files with one stem (they would write the same files), naming both.
    """
    seen: dict[str, Path] = {}
    for file in files if formats else ():
        other = seen.setdefault(file.stem, file)
        if other is not file:
            raise ValueError(f"--format: FILE {other} and FILE {file} would both write "
                             f"{folder / file.stem}.{formats[0]}; transcribe them in separate "
                             "runs with different --out folders")  # fmt: skip
    return [[folder / f"{file.stem}.{fmt}" for fmt in formats] for file in files]


def _out_folder(out: Path | None, formats: tuple[str, ...]) -> Path:
    """Where ``--format`` writes: ``--out`` (checked, created later) or the current folder.

    Raises:
        ValueError: ``--out`` without ``--format``, or under a file.
    """
    if out is not None and not formats:
        raise ValueError(f"--out {out} says where --format writes its files; add --format "
                         "(txt, srt, vtt, json or all)")  # fmt: skip
    if out is None or Path(out) == Path("."):
        return Path(".")
    return check_out_folder(out, "--out")


def _check_align(align: Path | None) -> None:
    """Refuse ``--align`` now, not after the transcription: a folder, or a path under a file."""
    if align is None:
        return
    if align.is_dir():
        raise ValueError(f"--align {align} is a folder; expected a .png file path")
    if align.parent != Path("."):  # a PNG in the working folder is fine (--align hello.png)
        check_out_folder(align.parent, "--align")


def _check_files(files: list[Path]) -> None:
    """Every audio path is a file (its contents are read later)."""
    for file in files:
        if not file.is_file():
            what = "is a folder" if file.is_dir() else "does not exist"
            raise FileNotFoundError(f"FILE {file} {what} (expected an audio file)")


def _write(transcript, paths: list[Path], stderr: Console) -> None:
    """``transcript`` rendered to each path (its format is its extension), atomically."""
    from qkv.inspect.files import atomic_write
    from qkv.pretrained.whisper.subtitles import render

    for path in paths:
        written = atomic_write(path, render(transcript, path.suffix[1:]))
        stderr.print(f"wrote {escape(str(written))}")


def _stream(console: Console, bundle, file: Path, options: dict) -> None:
    """Print ``file``'s segments as they are decided (the first one without its space)."""
    shown = False
    for segment in bundle.segments(file, **options):
        text = segment.text if shown else segment.text.lstrip()
        if text:
            console.print(escape(text), end="")
            sys.stdout.flush()
            shown = True
    console.print()


def _print(console: Console, file: Path, transcript, *, as_json: bool, several: bool) -> None:
    """stdout: ``transcript``'s text (after ``file``'s name when several) or one JSON line."""
    if as_json:
        print_jsonl([{"file": str(file), "text": transcript.text,
                      "segments": transcript.to_dict()["segments"]}])  # fmt: skip
    else:
        console.print((f"{escape(str(file))}: " if several else "") + escape(transcript.text))


def _draw(stages: Stages, stderr: Console, bundle, file: Path, png: Path) -> None:
    """``--align``: the alignment of ``file``'s first window drawn to ``png``."""
    with stages.stage("drawing the alignment"):
        written = _align(bundle, file, png)
    stderr.print(f"alignment: {escape(str(written))}")


@dataclass(frozen=True)
class TranscribeOptions:
    """What ``qkv transcribe`` does, checked once, when built, before any model is loaded.

    Attributes:
        chosen: the formats of ``formats`` (:func:`parse_formats`), each once; () without.
        outputs: each file's output paths, one list per file (:func:`output_paths`).

    Raises:
        FileNotFoundError: a file that is missing or a folder. ValueError: an unknown format,
            two files with one stem, ``--out`` without ``--format`` or under a file, an
            ``--align`` that is a folder or under a file.
    """

    files: tuple[Path, ...]  # the audio files, FILE... and --input's, in order
    model: str = "whisper-tiny.en"
    beam_size: int | None = None  # --beam-size or --beam; None: greedy
    max_new_tokens: int = SPEECH_NEW_TOKENS  # per 30 s window
    formats: str | None = None  # --format as typed
    out: Path | None = None  # where --format writes; None: the current folder
    word_timestamps: bool = False
    batch_size: int = 1
    align: Path | None = None  # the alignment PNG (several files: one per file beside it)
    as_json: bool = False
    device: str | None = None  # None: the CPU
    chosen: tuple[str, ...] = field(init=False)
    outputs: list[list[Path]] = field(init=False)

    def __post_init__(self) -> None:
        _check_files(list(self.files))
        chosen = parse_formats(self.formats) if self.formats is not None else ()
        folder = _out_folder(self.out, chosen)
        object.__setattr__(self, "chosen", chosen)
        object.__setattr__(self, "outputs", output_paths(list(self.files), chosen, folder))
        _check_align(self.align)

    @property
    def several(self) -> bool:
        """More than one file: each printed after its name, each alignment in its own PNG."""
        return len(self.files) > 1

    @property
    def streams(self) -> bool:
        """Printed segment by segment as decoded, on a terminal: one file, decoded greedily,
        without --json or --format."""
        return (not self.several and self.beam_size is None and not self.as_json
                and not self.chosen)

    @property
    def decoding(self) -> dict[str, Any]:
        """The keyword arguments of the bundle's ``transcripts`` and ``segments``."""
        # beam_size only when asked: the default is greedy
        return {"word_timestamps": self.word_timestamps, "max_new_tokens": self.max_new_tokens,
                **({"beam_size": self.beam_size} if self.beam_size is not None else {})}


def command(
    files: Files = None,
    model: Model = "whisper-tiny.en",
    beam_size: BeamSize = None,
    beam: BeamAlias = None,
    max_new_tokens: MaxNewTokens = SPEECH_NEW_TOKENS,
    formats: Formats = None,
    out_dir: OutDir = None,
    word_timestamps: WordTimestamps = False,
    batch_size: BatchSize = 1,
    align: Align = None,
    input_file: InputFile = None,
    as_json: AsJson = False,
    device: ModelDevice = None,
) -> None:
    """Transcribe speech to text, offline, with Whisper on qkv's attention.

    With --format, each file's transcript is also written as subtitles (SRT, WebVTT), text
    or JSON, one file per format, under --out.

    [bold]Example:[/bold] espeak-ng -w hello.wav "Hello world" && qkv transcribe hello.wav
    --align hello.png

    [bold]Example:[/bold] qkv transcribe talk.wav interview.flac --format srt --out subs/
    (writes subs/talk.srt and subs/interview.srt)

    [bold]Example:[/bold] ls *.wav | qkv transcribe --input - --json --word-timestamps
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    beam_size, _ = beam_of(beam_size, beam)
    paths = read_items([str(f) for f in files or []], input_file, what="audio file")
    options = TranscribeOptions(
        files=tuple(Path(f) for f in paths), model=model, beam_size=beam_size,
        max_new_tokens=max_new_tokens, formats=formats, out=out_dir,
        word_timestamps=word_timestamps, batch_size=batch_size, align=align, as_json=as_json,
        device=device,
    )
    transcribe(options)


def transcribe(options: TranscribeOptions) -> None:
    """Load the model, then print (and write) every file's transcript: streamed segment by
    segment on a terminal for one file decoded greedily, else file by file."""
    from qkv import pretrained
    from qkv.pretrained.whisper.model import SpeechBundle

    console = Console(highlight=False, soft_wrap=True)
    stderr = Console(stderr=True, highlight=False)
    stages = Stages("transcribe")  # stderr: spinners on a terminal, a line per stage in a pipe
    with stages.stage(f"loading {options.model}"):
        bundle = pretrained.load(options.model, device=options.device)
    if not isinstance(bundle, SpeechBundle):
        raise ValueError(f"--model {options.model!r} is not a speech model (expected a Whisper "
                         "folder)")  # fmt: skip
    if console.is_terminal and options.streams:
        _stream(console, bundle, options.files[0], options.decoding)
        if options.align is not None:
            _draw(stages, stderr, bundle, options.files[0], options.align)
        return
    _transcribe_files(options, bundle, stages, console, stderr)


def _transcribe_files(options: TranscribeOptions, bundle: Any, stages: Stages,
                      console: Console, stderr: Console) -> None:  # fmt: skip
    """Each file's transcript (``batch_size`` files decoded together) printed and written as
    soon as it is done, in the order given; its alignment drawn with ``--align``."""
    o = options
    transcripts = iter(bundle.transcripts(list(o.files), batch_size=o.batch_size, **o.decoding))
    for n, (file, paths) in enumerate(zip(o.files, o.outputs, strict=True), 1):
        count = f" ({n}/{len(o.files)})" if o.several else ""
        with stages.stage(f"transcribing {file}" + count):
            transcript = next(transcripts, None)  # decoded batch_size files at a time
        if transcript is None:
            raise RuntimeError(f"{o.model}: no transcript for {file} ({n - 1} for "
                               f"{len(o.files)})")  # fmt: skip
        _print(console, file, transcript, as_json=o.as_json, several=o.several)
        _write(transcript, paths, stderr)
        if o.align is not None:
            _draw(stages, stderr, bundle, file, align_path(o.align, file, o.several))
