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
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from qkv.checkpoint import is_qkv_checkpoint
from qkv.cli.common import Seed, Temperature, TopK, TopP, fail, status

__all__ = [
    "Source",
    "command",
    "decoding_options",
    "generate_from_bundle",
    "generate_from_checkpoint",
    "resolve_source",
]

NAME = "generate"
DECODER_DEFAULT_TOKENS = 64  # --max-new-tokens for language models when not given


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
        ValueError: both or neither given; a positional path that does not exist and is not a
            packaged name (the message lists the known names).
    """
    from qkv.pretrained import known_names

    if (checkpoint is None) == (model is None):
        raise ValueError(
            "give exactly one model: a CHECKPOINT folder or --model NAME_OR_PATH, got "
            f"{'both' if checkpoint else 'neither'}"
        )
    given = checkpoint if checkpoint is not None else model
    assert given is not None
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
    beam: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of :func:`qkv.generate.generate` for these command options.

    Raises:
        ValueError: ``--beam`` together with ``--temperature > 0`` (search or sample: pick one).
    """
    if beam is not None and temperature > 0:
        raise ValueError(
            f"--beam {beam} searches and --temperature {temperature} samples: pick one"
        )
    options: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if beam is not None:
        options = dict(beam_size=beam)
    return options


def generate_from_checkpoint(
    path: str | Path, prompts: list[str], *, max_new_tokens: int | None = None,
    add_bos: bool = True, **options: Any,
) -> list[str]:  # fmt: skip
    """Decode ``prompts`` with a qkv checkpoint's model and tokenizers.

    Args:
        path: a checkpoint folder (see :func:`qkv.checkpoint.load_checkpoint`).
        prompts: ``B`` strings: prompts for a DecoderLM, sources for a Seq2SeqTransformer.
        max_new_tokens: per prompt; None = 64 for a DecoderLM (fewer when the longest prompt
            leaves less room within the model's ``max_len``), ``2 * source length + 10`` for
            a Seq2SeqTransformer (capped by the model's ``max_len``).
        add_bos: start a DecoderLM's prompt with BOS (as :func:`qkv.generate.complete`).
        **options: :func:`decoding_options`' result (temperature, top_k, top_p, seed, or
            beam_size).

    Returns:
        ``B`` strings: the new text of each prompt (a translation for a Seq2SeqTransformer).

    Raises:
        qkv.train.CheckpointError (a ValueError): unreadable checkpoint.
        ValueError: a model that does not generate text, a missing tokenizer, bad options.
    """
    from qkv.checkpoint import load_checkpoint
    from qkv.generate import complete, translate
    from qkv.models import DecoderLM, Seq2SeqTransformer

    ckpt = load_checkpoint(path)
    model, toks = ckpt.model.eval(), ckpt.tokenizers
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
        # None: complete() generates up to 64 tokens, as many as fit after the longest prompt
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
        max_new_tokens: per prompt; None = 64, or as many as fit after the prompt within the
            model's ``max_len``.
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
    from qkv.generate.args import default_new_tokens
    from qkv.pretrained import DecoderBundle

    if not isinstance(bundle, DecoderBundle):
        raise ValueError(f"{bundle.name!r} is a sentence encoder, not a language model; "
                         "try: qkv embed --model ...")  # fmt: skip
    has_template = bool(getattr(bundle.tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ValueError(f"{bundle.name!r} has no chat template; use --no-chat")
    use_chat = has_template if chat is None else chat
    limit = getattr(getattr(bundle.model, "config", None), "max_len", None)
    beam = options.pop("beam_size", None)
    out = []
    for prompt in prompts:
        inputs: Any = [{"role": "user", "content": prompt}] if use_chat else prompt
        ids = bundle.prompt_ids(inputs)
        n = max_new_tokens or default_new_tokens(limit, len(ids), DECODER_DEFAULT_TOKENS)
        if beam is None:
            out.append(bundle.generate(ids, n, **options))
            continue
        tokens = generate(bundle.model, [ids], max_new_tokens=n, beam_size=beam,
                          eos_id=bundle.eos_id)  # (1, L)
        out.append(bundle.tokenizer.decode(strip(tokens, bundle.eos_id)[0],
                                           skip_special_tokens=True))  # fmt: skip
    return out


def command(
    checkpoint: Annotated[str | None, typer.Argument(
        help="A qkv checkpoint folder (or the run folder `qkv train` wrote: best/ or last/ "
             "inside is used).", show_default=False,
    )] = None,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", help="Text to continue, answer or translate; repeat for several.",
        show_default=False,
    )] = None,
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A pretrained model instead of a checkpoint: a packaged name "
        "(SmolLM2-135M-Instruct), a Hugging Face-format folder or a .gguf file.",
        show_default=False,
    )] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", "-n", min=1, show_default=False,
        help="Most tokens generated per prompt \\[default: 64, or what fits in the model's "
        "max_len after the prompt; translation: 2 x source + 10].",
    )] = None,
    temperature: Temperature = 0.0,
    top_k: TopK = None,
    top_p: TopP = None,
    seed: Seed = None,
    beam: Annotated[int | None, typer.Option(
        "--beam", min=1, help="Beam search with this many beams (instead of greedy/sampling).",
    )] = None,
    chat: Annotated[bool | None, typer.Option(
        "--chat/--no-chat", show_default=False, help="Pretrained models: wrap the prompt in "
        "the chat template, or continue it as is \\[default: chat if the model has a template].",
    )] = None,
    bos: Annotated[bool, typer.Option(
        "--bos/--no-bos", help="Checkpoints of language models: start the prompt with BOS.",
    )] = True,
) -> None:
    """Generate text from a checkpoint `qkv train` wrote, or from a pretrained model.

    A language model continues the prompt (a chat model answers it through its chat
    template); a translation model translates it. Greedy by default; --temperature, --top-k,
    --top-p and --seed sample; --beam searches. Prints the new text of each prompt.

    [bold]Example:[/bold] qkv generate --model SmolLM2-135M-Instruct --prompt "What is attention?"

    [bold]Example:[/bold] qkv generate runs/copy/best --prompt "hello" --beam 4
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    console = Console(stderr=True, highlight=False)
    if not prompt:
        raise fail("give at least one --prompt TEXT")
    source = resolve_source(checkpoint, model)
    options = decoding_options(temperature, top_k, top_p, seed, beam)
    if source.note:
        console.print(source.note, markup=False)
    if source.kind == "checkpoint":
        with status(console, f"loading {source.location} and generating ..."):
            texts = generate_from_checkpoint(source.location, prompt, add_bos=bos,
                                             max_new_tokens=max_new_tokens, **options)
    else:
        from qkv import pretrained

        with status(console, f"loading {source.location} ..."):
            bundle = pretrained.load(source.location)
        with status(console, "generating ..."):
            texts = generate_from_bundle(bundle, prompt, max_new_tokens=max_new_tokens,
                                         chat=chat, **options)  # fmt: skip
    for i, (p, text) in enumerate(zip(prompt, texts, strict=True)):
        if len(prompt) > 1:  # several prompts: a header line before each answer
            print(("\n" if i else "") + f"> {p}")
        print(text, flush=True)
