"""``qkv inspect``: attention pictures, a token's journey and the viewer for one input text.

With ``--generate N`` a decoder-only model first greedy-decodes ``N`` tokens after the text
with its KV cache (:func:`qkv.inspect.timeline.record_generation`); everything is then drawn
on the prompt and the generated text, and the viewer gains the generation timeline.

The model is a qkv checkpoint folder (:func:`qkv.checkpoint.load_checkpoint`, any of
the four model classes) or anything :func:`qkv.pretrained.load` accepts (a packaged name, a
Hugging Face-format folder, a ``.gguf`` file). The files come from
:func:`qkv.inspect.write_report`. The command's options travel as one :class:`InspectOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.markup import escape

from qkv.checkpoint import is_qkv_checkpoint, load_checkpoint
from qkv.cli.common import ModelDevice
from qkv.cli.inputs import read_items
from qkv.cli.inspect_speech import inspect_speech
from qkv.cli.progress import Stages
from qkv.generate.session import model_device
from qkv.inspect.labels import readable_tokens

__all__ = ["InspectOptions", "Prepared", "add_generation", "command", "load_model",
           "prepare_inputs"]

NAME = "inspect"

Model = Annotated[str, typer.Argument(
    help="A qkv checkpoint folder, or a model qkv.pretrained.load knows (packaged name, "
         "Hugging Face-format folder, .gguf file).", metavar="CHECKPOINT_OR_MODEL_NAME",
)]
Text = Annotated[str | None, typer.Argument(
    help="The input text ('-': read it from standard input; for a speech model such as "
         "whisper-tiny.en: an audio file); or give --input FILE.", show_default=False,
)]
InputFile = Annotated[Path | None, typer.Option(
    "--input", "-i", help="A UTF-8 file whose whole text is the input text ('-': "
    "standard input), instead of TEXT (text models).",
    show_default=False,
)]
Target = Annotated[str | None, typer.Option(
    "--target", help="Target text for an encoder-decoder (default: its greedy output).",
)]
Out = Annotated[Path, typer.Option("--out", help="Folder for the PNGs, trace and viewer.")]
MaxTokens = Annotated[int, typer.Option(
    "--max-tokens", help="Use at most this many tokens of the text.", min=1,
)]
Generate = Annotated[int, typer.Option(
    "--generate", help="Decoder-only models: greedy-generate this many tokens after the "
    "text (KV cache on) and add the generation timeline to the viewer.", min=0,
)]


@dataclass(frozen=True)
class InspectOptions:
    """What ``qkv inspect`` draws, and how; checked once, when built.

    Raises:
        ValueError: not exactly one text (TEXT and --input both give one).
    """

    model: str  # a checkpoint or run folder, or what qkv.pretrained.load takes
    texts: tuple[str, ...]  # TEXT and --input's, read: exactly one
    input_file: Path | None = None  # --input as given (a text model's only)
    target: str | None = None  # an encoder-decoder's target text (None: its greedy output)
    out: Path = Path("qkv-inspect")
    max_tokens: int = 512
    generate: int = 0  # greedy tokens generated after the text first (0: none)
    device: str | None = None  # None: the CPU

    def __post_init__(self) -> None:
        if len(self.texts) != 1:
            raise ValueError("qkv inspect draws one text: give TEXT or --input FILE, not both")

    @property
    def text(self) -> str:
        """The input text (a speech model's: the audio file's path)."""
        return self.texts[0]

    @property
    def title(self) -> str:
        """The pictures' and the viewer's title: the model and the text's start."""
        return f"{self.model}: {self.text[:60]}"


@dataclass
class Prepared:
    """A model with its inputs and position labels, ready for :func:`write_report`."""

    model: torch.nn.Module
    input_ids: torch.Tensor
    tokens: list[str]
    target: torch.Tensor | None = None
    target_tokens: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def load_model(name: str, device: str | None = None) -> tuple[Any, torch.nn.Module, Any, Any]:
    """``(bundle or None, model in eval mode, source tokenizer, target tokenizer or None)``,
    the model on ``device`` (None: the CPU).

    The bundle is what :func:`qkv.pretrained.load` returned (None for a qkv checkpoint).

    Raises:
        ValueError, FileNotFoundError, ImportError: from the loaders (the message says what
            is missing).
    """
    path = Path(name).expanduser()
    if path.is_dir() and not is_qkv_checkpoint(path):
        # a run folder `qkv train` wrote: its best/ (else last/) checkpoint, as generate does
        path = next((path / sub for sub in ("best", "last") if is_qkv_checkpoint(path / sub)),
                    path)  # fmt: skip
    if path.is_dir() and is_qkv_checkpoint(path):
        ck = load_checkpoint(path, device=device)
        toks = ck.tokenizers
        src = toks.get("src") or toks.get("text") or next(iter(toks.values()), None)
        return None, ck.model.eval(), src, toks.get("tgt")
    from qkv.pretrained import load

    bundle = load(name, device=device)
    return bundle, bundle.model.eval(), bundle.tokenizer, None


def _encode(tokenizer: Any, text: str, **kw: Any) -> list[int]:
    try:
        return list(tokenizer.encode(text, **kw))
    except TypeError:  # pretrained tokenizers take no add_eos/add_bos
        return list(tokenizer.encode(text))


def _piece(tokenizer: Any, i: int) -> str:
    piece = tokenizer.id_to_token(i) if hasattr(tokenizer, "id_to_token") else None
    if piece is None:
        piece = tokenizer.decode([i]) if tokenizer is not None else str(i)
    return piece


def _labels(tokenizer: Any, ids: list[int]) -> list[str]:
    """Readable labels of ``ids`` (:func:`qkv.inspect.labels.readable_tokens`: ``Ġprinting``
    -> ``·printing``, one marker per kind of space, special tokens as ``⟨s⟩``)."""
    return readable_tokens([_piece(tokenizer, i) for i in ids])


def prepare_inputs(model: torch.nn.Module, src_tok: Any, tgt_tok: Any, text: str,
                   target: str | None, max_tokens: int) -> Prepared:  # fmt: skip
    """Tokenise ``text`` (and ``target``) for ``model``; an encoder-decoder without a target
    text decodes its own greedy output as the target.

    Raises:
        ValueError: no tokenizer, an empty text, ``--target`` for a model without a decoder.
    """
    if src_tok is None:
        raise ValueError("the model came without a tokenizer, so text cannot be encoded")
    seq2seq = hasattr(model, "encoder_blocks") and hasattr(model, "decoder_blocks")
    if target is not None and not seq2seq:
        raise ValueError("--target is only for encoder-decoder models (this one has no decoder)")
    ids = _encode(src_tok, text, add_eos=True) if seq2seq else _encode(src_tok, text)
    if not ids:
        raise ValueError(f"the text {text!r} encodes to no tokens")
    notes = []
    if len(ids) > max_tokens:
        notes.append(f"input cut to its first {max_tokens} of {len(ids)} tokens (--max-tokens)")
        ids = ids[:max_tokens]
    device = model_device(model)  # the inputs go where the model is
    p = Prepared(model, torch.tensor([ids], device=device), _labels(src_tok, ids), notes=notes)
    if seq2seq:
        tgt_tok = tgt_tok or src_tok
        bos = model.config.bos_id
        if target is None:
            from qkv.generate import greedy, strip

            out = greedy(model, p.input_ids, max_new_tokens=min(2 * len(ids) + 10, 128))
            tgt = strip(out, model.config.eos_id)[0]
            p.notes.append(f"target: the model's own greedy output {tgt_tok.decode(tgt)!r}")
        else:
            tgt = _encode(tgt_tok, target)
        row = [bos, *tgt][:max_tokens]
        p.target = torch.tensor([row], device=device)
        p.target_tokens = ["⟨bos⟩", *_labels(tgt_tok, row[1:])]
    return p


def add_generation(p: Prepared, tokenizer: Any, new_tokens: int) -> Any:
    """Greedy-decode ``new_tokens`` after ``p``'s text, recording each step's attention, and
    extend ``p`` to the prompt plus the generated tokens. Returns the
    :class:`~qkv.inspect.timeline.Generation`.

    Raises:
        ValueError: an encoder-decoder model, or a text plus ``--generate`` beyond the
            model's ``max_len``.
    """
    from qkv.inspect.timeline import record_generation

    if p.target is not None or hasattr(p.model, "encoder_blocks"):
        raise ValueError("--generate is for decoder-only models (this one is an "
                         "encoder-decoder; its target is already its greedy output)")  # fmt: skip
    limit = getattr(getattr(p.model, "config", None), "max_len", None)
    P = p.input_ids.shape[1]
    if limit is not None and P + new_tokens > limit:
        raise ValueError(f"--generate {new_tokens} after {P} tokens exceeds the model's "
                         f"max_len={limit}; lower --generate or --max-tokens")  # fmt: skip
    gen = record_generation(p.model, p.input_ids, new_tokens)
    new = gen.new_ids.tolist()
    p.input_ids = gen.ids[None].to(p.input_ids.device)  # (1, P + N)
    p.tokens = p.tokens + _labels(tokenizer, new)
    p.notes.append(f"generated {len(new)} tokens greedily with the KV cache: "
                   f"{tokenizer.decode(new)!r}")  # fmt: skip
    return gen


def command(
    model: Model,
    text: Text = None,
    input_file: InputFile = None,
    target: Target = None,
    out: Out = Path("qkv-inspect"),
    max_tokens: MaxTokens = 512,
    generate: Generate = 0,
    device: ModelDevice = None,
) -> None:
    """Draw a model's attention for one text: PNGs, the last token's journey, the viewer.

    MODEL may be a qkv checkpoint, a run folder `qkv train` wrote (its best/ or last/
    checkpoint) or a pretrained model.

    Writes into --out: a layers × heads grid per attention kind, heatmaps of single heads,
    the rollout, an encoder-decoder's alignment, masks, positions, trace.txt/trace.json and
    viewer.html (one offline file: open it in a browser). With --generate N the model first
    continues the text by N greedy tokens and the viewer shows each step's attention.

    [bold]Example:[/bold] qkv inspect all-MiniLM-L6-v2 "The cat sat on the mat." --out inspect

    [bold]Example:[/bold] qkv inspect SmolLM2-135M-Instruct "The capital of France is" --generate 8

    [bold]Example:[/bold] qkv inspect whisper-tiny.en speech.wav --out inspect-speech

    [bold]Example:[/bold] qkv inspect runs/notes --input paragraph.txt --out inspect
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    texts = read_items([text] if text is not None else [], input_file, what="text",
                       per_line=False, given_as="TEXT", whole_file=True)  # fmt: skip
    options = InspectOptions(model=model, texts=tuple(texts), input_file=input_file,
                             target=target, out=out, max_tokens=max_tokens, generate=generate,
                             device=device)  # fmt: skip
    stages = Stages("inspect")  # stderr: a spinner on a terminal, a line per stage in a pipe
    with stages.stage(f"loading {model}"):
        bundle, net, src_tok, tgt_tok = load_model(model, device)
    if getattr(net, "encodes_tokens", True) is False:  # a speech model: TEXT is an audio file
        inspect_audio(options, bundle, stages)
    else:
        inspect_text(options, net, src_tok, tgt_tok, stages)


def inspect_audio(options: InspectOptions, bundle: Any, stages: Stages) -> None:
    """A speech model: the audio file's transcript drawn against time, and the viewer.

    Raises:
        ValueError: ``--target``, ``--generate`` or ``--input`` (a text model's options).
    """
    if options.target is not None or options.generate or options.input_file is not None:
        raise ValueError("--target, --generate and --input are for text models; a speech "
                         "model takes an audio file as TEXT and transcribes it")  # fmt: skip
    files, transcript = inspect_speech(bundle, Path(options.text), options.out,
                                       title=options.title, stages=stages)  # fmt: skip
    console = Console(highlight=False, soft_wrap=True)  # paths are never broken across lines
    console.print(f"transcript (first 30 s): {transcript}", markup=False)
    _print_files(console, files)


def inspect_text(options: InspectOptions, net: torch.nn.Module, src_tok: Any, tgt_tok: Any,
                 stages: Stages) -> None:  # fmt: skip
    """A text model: tokenise (and generate), run under capture, draw, print what was written."""
    from qkv.inspect.report import write_report
    from qkv.inspect.viewer import view

    o = options
    with stages.stage("preparing the inputs" + (" and generating" if o.generate else "")):
        p = prepare_inputs(net, src_tok, tgt_tok, o.text, o.target, o.max_tokens)
        gen = add_generation(p, src_tok, o.generate) if o.generate else None
    with stages.stage(f"running the model on {len(p.tokens)} tokens and drawing "
                      f"(PNGs, journey, viewer) in {o.out}"):
        files = write_report(p.model, p.input_ids, o.out, tokens=p.tokens, target=p.target,
                             target_tokens=p.target_tokens, title=o.title)  # fmt: skip
        if gen is not None:  # the same viewer, with the timeline
            view(p.model, p.tokens, files["viewer"], input_ids=p.input_ids, timeline=gen,
                 title=o.title)  # fmt: skip
    # Tokens, names and paths are the user's: printed as text, never as rich markup.
    console = Console(highlight=False, soft_wrap=True)  # paths are never broken across lines
    for note in p.notes:
        console.print(f"note: {note}", markup=False)
    console.print(f"{len(p.tokens)} tokens: {' '.join(p.tokens[:24])}" +
                  (" ..." if len(p.tokens) > 24 else ""), markup=False)  # fmt: skip
    _print_files(console, files)


def _print_files(console: Console, files: dict[str, Path]) -> None:
    """One line per file written, then how to open the viewer."""
    for what, path in files.items():
        console.print(f"  {what:<34} {path}", markup=False)
    console.print(f"[bold]viewer:[/bold] {escape(str(files['viewer']))} (open it in a browser; "
                  "no network)")  # fmt: skip
