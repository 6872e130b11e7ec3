"""``qkv generate``: text from a checkpoint ``qkv train`` wrote, or from a pretrained model.

Two kinds of source, one rule to tell them apart (:func:`resolve_source`):

* a **qkv checkpoint** folder (``config.json`` with ``"format": "qkv.checkpoint"``), or a run
  folder holding ``best/`` or ``last/``: a :class:`~qkv.models.DecoderLM` continues the prompt
  (:func:`qkv.generate.complete`), a :class:`~qkv.models.Seq2SeqTransformer` translates it
  (:func:`qkv.generate.translate`), with greedy search, sampling or beam search;
* anything else goes to :func:`qkv.pretrained.load` (a packaged name such as
  ``SmolLM2-135M-Instruct``, a Hugging Face-format folder, a ``.gguf`` file): a language model
  answers the prompt through its chat template when it has one (``--no-chat``: continue the
  text as is).

:func:`generate_from_checkpoint` and :func:`generate_from_bundle` do the work and return
strings, so tests compare them with the library without parsing output; :func:`command` only
parses, shows a spinner while loading and decoding, and prints the generated text (the new
text only, one block per prompt) on stdout.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from qkv.checkpoint import is_qkv_checkpoint
from qkv.cli.common import (
    FLAG,
    LM_NEW_TOKENS,
    TRANSLATION_NEW_TOKENS,
    BeamAlias,
    BeamSize,
    MinP,
    ModelDevice,
    NoRepeatNgram,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopP,
    beam_of,
    blank_output_hint,
    warn,
)
from qkv.cli.inputs import read_items
from qkv.cli.outputs import print_jsonl
from qkv.cli.progress import Stages

if TYPE_CHECKING:
    from qkv.generate.engine import SamplingParams

__all__ = [
    "Source",
    "command",
    "decoding_options",
    "decoding_record",
    "generate_from_bundle",
    "generate_from_checkpoint",
    "resolve_source",
]

NAME = "generate"
# The flags of the generation controls (their errors are prefixed with the flag).
CONTROL_FLAGS = ("repetition_penalty", "no_repeat_ngram_size", "min_p")


class Quantize(str, Enum):
    """``--quantize`` choices (:data:`qkv.nn.quantized.MODES`)."""

    int8 = "int8"
    int4 = "int4"


@dataclass(frozen=True)
class Source:
    """Where the model comes from: ``kind`` is ``"checkpoint"`` (a folder) or ``"pretrained"``
    (the string :func:`qkv.pretrained.load` is given); ``note`` says what was chosen, or ""."""

    kind: str
    location: str
    note: str = ""


def resolve_source(checkpoint: str | None, model: str | None) -> Source:
    """Decide what to load from the positional ``CHECKPOINT`` and ``--model``.

    A qkv checkpoint folder (or a run folder with ``best/`` or ``last/``, best first) is read as
    a checkpoint whichever way it is given; any other existing path, or any ``--model``, goes
    to :func:`qkv.pretrained.load`. A positional name that is not a path but a packaged model
    name is accepted too.

    Raises:
        ValueError: both or neither given, an empty one; a positional path that does not
            exist and is not a packaged name (the message lists the known names).
    """
    from qkv.pretrained import known_names

    if (checkpoint is None) == (model is None):
        raise ValueError(
            "give exactly one model: a CHECKPOINT folder or --model NAME_OR_PATH, got "
            f"{'both' if checkpoint else 'neither'}"
        )
    given = checkpoint if checkpoint is not None else model
    assert given is not None
    if not given.strip():
        what = "CHECKPOINT" if checkpoint is not None else "--model"
        raise ValueError(f"{what} is empty; name a checkpoint folder, a model folder or a "
                         "packaged name (an empty path would be the current folder)")
    path = Path(given).expanduser()
    if path.is_dir():
        if is_qkv_checkpoint(path):
            return Source("checkpoint", str(path))
        for sub in ("best", "last"):
            if is_qkv_checkpoint(path / sub):
                return Source("checkpoint", str(path / sub), f"using {path / sub}")
    if checkpoint is not None and not path.exists():
        known = {n.lower() for n in known_names()}
        if checkpoint.strip().lower() not in known:
            raise ValueError(
                f"no checkpoint at {checkpoint!r}: no such file or folder (a qkv checkpoint "
                f"is the folder `qkv train` writes); for a pretrained model use --model NAME, "
                f"known names: {known_names()}"
            )
    return Source("pretrained", given)


def decoding_options(
    temperature: float, top_k: int | None, top_p: float | None, seed: int | None,
    beam: int | None, compile: bool = False, typed: str = "--beam-size",
) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of :func:`qkv.generate.generate` for these command options.

    Raises:
        ValueError: ``--beam-size`` together with ``--temperature > 0`` (search or sample:
            pick one) or with ``--compile``.
    """
    if beam is not None and temperature > 0:
        raise ValueError(
            f"{typed} {beam} searches and --temperature {temperature} samples: pick one"
        )
    if beam is not None and compile:
        raise ValueError(f"--compile (a static KV cache) does not serve {typed} {beam}; "
                         "drop one")
    options: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if compile:
        options["compile"] = True
    if beam is not None:
        options = dict(beam_size=beam)
    return options


def generate_from_checkpoint(
    path: str | Path, prompts: list[str], *, max_new_tokens: int | None = None,
    add_bos: bool = True, quantize: str | None = None, device: str | None = None,
    **options: Any,
) -> list[str]:  # fmt: skip
    """Decode ``prompts`` with a qkv checkpoint's model and tokenizers.

    Args:
        path: a checkpoint folder (see :func:`qkv.checkpoint.load_checkpoint`).
        prompts: ``B`` strings: prompts for a DecoderLM, sources for a Seq2SeqTransformer.
        max_new_tokens: per prompt; None = :data:`~qkv.cli.common.LM_NEW_TOKENS` (256) for a
            DecoderLM (fewer when the longest prompt leaves less room within the model's
            ``max_len``), ``2 * source length + 10`` for a Seq2SeqTransformer (capped by the
            model's ``max_len``).
        add_bos: start a DecoderLM's prompt with BOS (as :func:`qkv.generate.complete`).
        quantize: None, ``"int8"`` or ``"int4"``: weight-only quantised linears
            (:func:`qkv.nn.quantized.quantize_`).
        device: None (the CPU) or where the model runs (``"cuda"``, ...).
        **options: :func:`decoding_options`' result (temperature, top_k, top_p, seed, or
            beam_size; ``compile``).

    Returns:
        ``B`` strings: the new text of each prompt (a translation for a Seq2SeqTransformer).

    Raises:
        qkv.train.CheckpointError (a ValueError): unreadable checkpoint.
        ValueError: a model that does not generate text, a missing tokenizer, bad options.
    """
    from qkv.checkpoint import load_checkpoint
    from qkv.generate import complete, translate
    from qkv.models import DecoderLM, Seq2SeqTransformer
    from qkv.nn.quantized import quantize_

    ckpt = load_checkpoint(path, device=device)
    model, toks = ckpt.model.eval(), ckpt.tokenizers
    if quantize is not None:
        quantize_(model, quantize)
    if isinstance(model, Seq2SeqTransformer):
        if "src" not in toks or "tgt" not in toks:
            raise ValueError(f"{path}: a Seq2SeqTransformer checkpoint needs tokenizers 'src' "
                             f"and 'tgt', found {sorted(toks)}")  # fmt: skip
        return translate(model, prompts, toks["src"], toks["tgt"],
                         max_new_tokens=max_new_tokens, **options)  # fmt: skip
    if isinstance(model, DecoderLM):
        tok = toks.get("text") or (next(iter(toks.values())) if len(toks) == 1 else None)
        if tok is None:
            raise ValueError(f"{path}: the checkpoint holds no 'text' tokenizer (found "
                             f"{sorted(toks)}), so prompts cannot be encoded")  # fmt: skip
        if max_new_tokens is None:  # the command's default, as many as fit after the prompt
            from qkv.generate.args import default_new_tokens, length_limit

            longest = max(len(tok.encode(p, add_bos=add_bos)) for p in prompts)
            max_new_tokens = default_new_tokens(length_limit(model), longest, LM_NEW_TOKENS)
        return complete(model, prompts, tok, max_new_tokens=max_new_tokens, add_bos=add_bos,
                        **options)  # fmt: skip
    raise ValueError(
        f"{path}: holds a {type(model).__name__}, which does not generate text; qkv generate "
        "takes DecoderLM and Seq2SeqTransformer checkpoints"
    )


def generate_from_bundle(
    bundle: Any, prompts: list[str], *, max_new_tokens: int | None = None,
    chat: bool | None = None, **options: Any,
) -> list[str]:  # fmt: skip
    """Decode ``prompts`` with a language model :func:`qkv.pretrained.load` returned.

    Args:
        bundle: a :class:`qkv.pretrained.DecoderBundle`.
        prompts: ``B`` strings, decoded one at a time.
        max_new_tokens: per prompt; None = :data:`~qkv.cli.common.LM_NEW_TOKENS` (256), or
            as many as fit after the prompt within the model's ``max_len``.
        chat: True wraps each prompt as one user message of the chat template, False encodes
            it as is, None = True when the tokenizer has a chat template.
        **options: :func:`decoding_options`' result; ``beam_size`` runs
            :func:`qkv.generate.beam_search` on the bundle's model.

    Returns:
        ``B`` strings, special tokens removed (equal to ``bundle.generate(...)`` without beam).

    Raises:
        ValueError: a sentence encoder; ``chat=True`` without a chat template; bad options.
    """
    from qkv.generate import generate, strip
    from qkv.generate.args import default_new_tokens, length_limit
    from qkv.pretrained import DecoderBundle

    if not isinstance(bundle, DecoderBundle):
        raise ValueError(f"{bundle.name!r} is a sentence encoder, not a language model; "
                         "try: qkv embed --model ...")  # fmt: skip
    use_chat = _use_chat(bundle, chat)
    limit = length_limit(bundle.model)
    beam = options.pop("beam_size", None)
    out = []
    for prompt in prompts:
        ids = bundle.prompt_ids(prompt, chat=use_chat)
        n = max_new_tokens or default_new_tokens(limit, len(ids), LM_NEW_TOKENS)
        if beam is None:
            out.append(bundle.generate(ids, n, **options))
            continue
        tokens = generate(bundle.model, [ids], max_new_tokens=n, beam_size=beam,
                          eos_id=bundle.eos_id)  # (1, L)
        out.append(bundle.tokenizer.decode(strip(tokens, bundle.eos_id)[0],
                                           skip_special_tokens=True))  # fmt: skip
    return out


def _use_chat(bundle: Any, chat: bool | None) -> bool:
    """Whether prompts go through the chat template (``--chat/--no-chat``, default: if any).

    Raises:
        ValueError: a sentence encoder, or ``--chat`` without a chat template.
    """
    from qkv.pretrained import DecoderBundle

    if not isinstance(bundle, DecoderBundle):
        raise ValueError(f"{bundle.name!r} is a sentence encoder, not a language model; "
                         "try: qkv embed --model ...")  # fmt: skip
    has_template = bool(getattr(bundle.tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ValueError(f"{bundle.name!r} has no chat template; use --no-chat")
    return has_template if chat is None else chat


Checkpoint = Annotated[str | None, typer.Argument(
    help="A qkv checkpoint folder (or the run folder `qkv train` wrote: best/ or last/ "
         "inside is used).", show_default=False,
)]
Prompts = Annotated[list[str] | None, typer.Option(
    "--prompt", "-p", help="Text to continue, answer or translate; repeat for several; "
    "'-' reads it from standard input.", show_default=False,
)]
InputFile = Annotated[Path | None, typer.Option(
    "--input", "-i", help="A UTF-8 file of prompts, one per line ('-': standard input).",
    show_default=False,
)]
PretrainedModel = Annotated[str | None, typer.Option(
    "--model", "-m", help="A pretrained model instead of a checkpoint: a packaged name "
    "(SmolLM2-135M-Instruct), a Hugging Face-format folder or a .gguf file.",
    show_default=False,
)]
MaxNewTokens = Annotated[int | None, typer.Option(
    "--max-new-tokens", "-n", min=1, show_default=False,
    help=f"Most tokens generated per prompt \\[default: {LM_NEW_TOKENS} for a language "
    f"model, fewer if the prompt leaves less room in its max_len; a translation model: "
    f"{TRANSLATION_NEW_TOKENS}].",
)]
Chat = Annotated[bool | None, typer.Option(
    "--chat/--no-chat", metavar=FLAG, show_default=False,
    help="Pretrained models: wrap the prompt in the chat template, or continue it as is "
    "\\[default: chat if the model has a template].",
)]
Bos = Annotated[bool, typer.Option(
    "--bos/--no-bos", metavar=FLAG,
    help="Checkpoints of language models: start the prompt with BOS.",
)]
StreamFlag = Annotated[bool, typer.Option(
    "--stream", metavar=FLAG,
    help="Pretrained language models: print tokens as they come, then tokens/s on stderr.",
)]
AsJson = Annotated[bool, typer.Option(
    "--json", metavar=FLAG,
    help="Print one JSON object per prompt ({\"prompt\", \"text\"}), one per line.",
)]
Compile = Annotated[bool, typer.Option(
    "--compile", metavar=FLAG,
    help="A static KV cache and torch.compile for the decoding steps "
    "(language and translation models; the first run compiles; needs a C++ compiler, "
    "else eager).",
)]
QuantizeMode = Annotated[Quantize | None, typer.Option(
    "--quantize", help="Weight-only quantised linears (int8: 4x fewer bytes a weight, "
    "int4: about 8x, the output head at int8; faster decoding on a CPU).",
    show_default=False,
)]


def decoding_record(
    max_new_tokens: int | None, temperature: float, top_k: int | None, top_p: float | None,
    seed: int | None, repetition_penalty: float | None, no_repeat_ngram_size: int | None,
    min_p: float | None, stop: list[str] | None,
) -> SamplingParams:  # fmt: skip
    """The :class:`~qkv.generate.engine.SamplingParams` of the decoding flags of ``qkv
    generate`` and ``qkv chat``, built by :func:`~qkv.generate.engine.decoding_params` (as the
    server and the Python API build theirs); ``max_new_tokens`` None: :data:`LM_NEW_TOKENS`
    (``qkv generate`` then fits it to each prompt).

    Raises:
        ValueError: a value the record refuses; a control's message starts with its flag
            (``--min-p: ...``), found by the error's ``param``.
    """
    from qkv.generate.args import ParamError
    from qkv.generate.engine import decoding_params

    if stop and not all(stop):
        raise ValueError("--stop: a stop string cannot be empty")
    try:
        return decoding_params(max_new_tokens or LM_NEW_TOKENS, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                               repetition_penalty=repetition_penalty, min_p=min_p,
                               no_repeat_ngram_size=no_repeat_ngram_size)  # fmt: skip
    except ParamError as err:
        if err.param not in CONTROL_FLAGS:
            raise
        raise ValueError(f"--{err.param.replace('_', '-')}: {err}") from None


def set_controls(record: SamplingParams) -> dict[str, Any]:
    """The record's ``controls`` and ``stop`` keywords, when set (nothing otherwise)."""
    return {k: v for k, v in record.keywords().items() if k in ("controls", "stop")}


def command(
    checkpoint: Checkpoint = None, prompt: Prompts = None, input_file: InputFile = None,
    model: PretrainedModel = None, max_new_tokens: MaxNewTokens = None,
    temperature: Temperature = 0.0, top_k: TopK = None, top_p: TopP = None, seed: Seed = None,
    repetition_penalty: RepetitionPenalty = None, no_repeat_ngram_size: NoRepeatNgram = None,
    min_p: MinP = None, stop: Stop = None, beam_size: BeamSize = None, beam: BeamAlias = None,
    chat: Chat = None, bos: Bos = True, stream: StreamFlag = False, as_json: AsJson = False,
    compile: Compile = False, quantize: QuantizeMode = None, device: ModelDevice = None,
) -> None:  # fmt: skip
    """Generate text from a checkpoint `qkv train` wrote, or from a pretrained model.

    A language model continues the prompt (a chat model answers it through its chat
    template); a translation model translates it. Greedy by default; --temperature, --top-k,
    --top-p and --seed sample; --beam-size searches. Prints the new text of each prompt; a
    blank one gets a hint on stderr.

    [bold]Example:[/bold] qkv generate --model SmolLM2-135M-Instruct --prompt "What is attention?"

    [bold]Example:[/bold] qkv generate runs/copy/best --prompt "hello" --beam-size 4

    [bold]Example:[/bold] echo "Tell me a joke." | qkv generate -m SmolLM2-135M-Instruct -p -
    --stream

    [bold]Example:[/bold] qkv generate -m SmolLM2-135M-Instruct --input prompts.txt --json
    --quantize int8
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    prompts = read_items(prompt, input_file, what="prompt", per_line=False,
                         given_as="--prompt TEXT")  # fmt: skip
    source = resolve_source(checkpoint, model)
    beam, typed = beam_of(beam_size, beam)
    options = decoding_options(temperature, top_k, top_p, seed, beam, compile, typed)
    record = decoding_record(max_new_tokens, temperature, top_k, top_p, seed,
                             repetition_penalty, no_repeat_ngram_size, min_p, stop)  # fmt: skip
    controls = set_controls(record)
    if controls and beam is not None:
        raise ValueError(f"{typed} {beam} (beam search) takes no --repetition-penalty, "
                         "--no-repeat-ngram-size, --min-p or --stop; drop one")  # fmt: skip
    if "stop" in controls and source.kind != "pretrained":
        raise ValueError("--stop needs a pretrained model's tokenizer (--model); a checkpoint "
                         "decodes with its own")  # fmt: skip
    options.update(controls)
    if stream and (source.kind != "pretrained" or beam is not None or as_json):
        raise ValueError("--stream prints a pretrained language model's tokens as they come; "
                         "not with a checkpoint, --beam-size or --json")  # fmt: skip
    texts = _run(source, prompts, options, max_new_tokens=max_new_tokens, chat=chat, bos=bos,
                 stream=stream, compile=compile, device=device,
                 quantize=None if quantize is None else quantize.value)  # fmt: skip
    _show(prompts, texts, as_json=as_json, stream=stream)
    hint = blank_output_hint(texts, sampling=temperature > 0,
                             trained_here=source.kind == "checkpoint")  # fmt: skip
    if hint is not None:
        warn(hint, prefix="")


def _run(source: Source, prompts: list[str], options: dict[str, Any], *,
         max_new_tokens: int | None, chat: bool | None, bos: bool, stream: bool,
         compile: bool, device: str | None, quantize: str | None) -> list[str]:  # fmt: skip
    """Load the model and decode ``prompts`` with ``options`` (spinners on stderr); the texts."""
    console = Console(stderr=True, highlight=False)
    if source.note:
        console.print(source.note, markup=False)
    stages = Stages("generate")  # stderr: spinners on a terminal, a line per stage in a pipe
    doing = "generating" + (" (--compile: the first call compiles the decoding steps, "
                            "about a minute)" if compile else "")
    if source.kind == "checkpoint":
        with stages.stage(f"loading {source.location} and {doing}"):
            return generate_from_checkpoint(source.location, prompts, add_bos=bos,
                                            max_new_tokens=max_new_tokens, quantize=quantize,
                                            device=device, **options)  # fmt: skip
    from qkv import pretrained

    with stages.stage(f"loading {source.location}"):
        bundle = pretrained.load(source.location, device=device,
                                 **({"quantize": quantize} if quantize else {}))
    if stream:
        return stream_from_bundle(bundle, prompts, max_new_tokens=max_new_tokens, chat=chat,
                                  console=console, **options)  # fmt: skip
    with stages.stage(doing):
        return generate_from_bundle(bundle, prompts, max_new_tokens=max_new_tokens,
                                    chat=chat, **options)  # fmt: skip


def _show(prompts: list[str], texts: list[str], *, as_json: bool, stream: bool) -> None:
    """Print the texts on stdout: JSON lines, or each text (after a ``> prompt`` header when
    there are several); nothing more after ``--stream``, which printed them as they came."""
    if as_json:
        print_jsonl({"prompt": p, "text": t} for p, t in zip(prompts, texts, strict=True))
    elif not stream:
        for i, (p, text) in enumerate(zip(prompts, texts, strict=True)):
            if len(prompts) > 1:  # several prompts: a header line before each answer
                print(("\n" if i else "") + f"> {p}")
            print(text, flush=True)


def stream_from_bundle(
    bundle: Any, prompts: list[str], *, max_new_tokens: int | None, chat: bool | None,
    console: Console, **options: Any,
) -> list[str]:  # fmt: skip
    """Print each prompt's new text piece by piece as it is decoded (stdout), then the
    speed (stderr): ``N tokens in S s (T tokens/s)``. Returns the texts (equal to
    :func:`generate_from_bundle`'s)."""
    import time

    from qkv.generate.args import default_new_tokens, length_limit

    use_chat = _use_chat(bundle, chat)
    limit = length_limit(bundle.model)
    texts = []
    for i, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(("\n" if i else "") + f"> {prompt}", flush=True)
        ids = bundle.prompt_ids(prompt, chat=use_chat)
        n = max_new_tokens or default_new_tokens(limit, len(ids), LM_NEW_TOKENS)
        start, pieces, tokens = time.perf_counter(), [], []
        for piece in bundle.stream(ids, n, counter=tokens, **options):
            pieces.append(piece)
            print(piece, end="", flush=True)
        seconds = time.perf_counter() - start
        print(flush=True)
        texts.append("".join(pieces))
        console.print(f"{len(tokens)} tokens in {seconds:.2f} s ({len(tokens) / seconds:.1f} "
                      "tokens/s, the prompt's prefill included)", markup=False)  # fmt: skip
    return texts
