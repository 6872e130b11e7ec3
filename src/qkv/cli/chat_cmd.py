"""``qkv chat``: talk with a chat model in the terminal, the reply streamed token by token.

:class:`Conversation` keeps the messages (system prompt, then user and assistant turns) and
sends the whole conversation through the model's chat template every turn
(:func:`qkv.pretrained.stream_chat`), so the model sees what was said before. :func:`run_chat`
is the read-reply loop over any line source: the command gives it stdin, so a conversation
can be piped in (``printf 'Hi\\n/exit\\n' | qkv chat``); piped lines are echoed after the
prompt so the transcript reads as it would on a terminal.

Lines starting with ``/`` are commands: ``/reset`` forgets the conversation (the system prompt
stays), ``/exit`` (or ``/quit``, or end of input) leaves. Ctrl-C during a reply stops it (the
part already shown stays in the conversation); at the prompt it leaves.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TextIO

import typer
from rich.console import Console

from qkv.cli.common import (
    FLAG,
    LM_NEW_TOKENS,
    MinP,
    ModelDevice,
    NoRepeatNgram,
    RepetitionPenalty,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopP,
    status,
)
from qkv.cli.generate_cmd import decoding_record, set_controls

__all__ = ["Conversation", "command", "run_chat"]

NAME = "chat"
USER, ASSISTANT = "you> ", "assistant> "  # the prompts of the two sides in the transcript
HELP_LINE = "/reset clears the conversation, /exit quits"


@dataclass
class Conversation:
    """The messages of one chat with a language model.

    Attributes:
        bundle: a :class:`qkv.pretrained.DecoderBundle` whose tokenizer has a chat template.
        system: the system prompt, kept across :meth:`reset`; None = the template's default.
        options: passed to the model's ``stream`` (max_new_tokens, temperature, top_k,
            top_p, seed; controls, stop): the command gives its record's keywords
            (:meth:`~qkv.generate.engine.SamplingParams.keywords`).
        endless: an :class:`~qkv.pretrained.endless_chat.EndlessChat` holding the
            conversation in an attention-sink cache (flat memory), or None (the whole
            conversation through the model every turn).
        messages: the conversation so far, as the chat template takes it.
    """

    bundle: Any
    system: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    endless: Any = None
    messages: list[dict[str, str]] = field(init=False)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every turn; keep the system prompt."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if self.endless is not None:
            self.endless.reset()

    def reply(self, text: str, write: Callable[[str], None]) -> str:
        """Answer ``text``: stream the reply through ``write`` piece by piece, then keep it.

        Args:
            text: the user's message.
            write: called with each piece of the reply as soon as it is decodable.

        Returns:
            The whole reply (what ``write`` received, joined). Ctrl-C stops it early; the
            part written so far is kept as the assistant's turn.

        Raises:
            ValueError / TypeError: from the model (e.g. the conversation outgrew its
                ``max_len``); the conversation is then left as it was before this turn.
        """
        from qkv import pretrained

        turn = [*self.messages, {"role": "user", "content": text}]
        pieces: list[str] = []
        try:
            pieces_of = (self.endless.reply(turn, **self.options) if self.endless is not None
                         else pretrained.stream_chat(turn, self.bundle, **self.options))
            for piece in pieces_of:
                pieces.append(piece)
                write(piece)
        except KeyboardInterrupt:
            pass  # Ctrl-C stops the reply; what was shown is still the assistant's answer
        reply = "".join(pieces)
        self.messages = [*turn, {"role": "assistant", "content": reply}]
        return reply


def terminal_reader() -> Callable[[], str]:
    """``read_line`` for a terminal: Python's ``input()`` with GNU readline loaded where the
    platform has it, so arrow keys edit the line and recall earlier ones (history lives for
    the session only: nothing is written to disk). Returns "" at end of input (Ctrl-D)."""
    # Importing readline is what turns line editing on; without it (Windows) input() works.
    with contextlib.suppress(ImportError):
        importlib.import_module("readline")

    def read_line() -> str:
        try:
            return input() + "\n"
        except EOFError:
            return ""

    return read_line


def run_chat(
    conversation: Conversation, read_line: Callable[[], str], out: TextIO, *,
    echo: bool = False, errors: Console | None = None,
) -> int:  # fmt: skip
    """The chat loop: read a line, run a command or stream a reply, until /exit or EOF.

    Args:
        conversation: the :class:`Conversation` to continue.
        read_line: returns the next line ("" at end of input), like ``file.readline``.
        out: where the transcript goes (flushed after every piece of a reply).
        echo: write each line read after the prompt (for piped input, which no terminal
            echoes).
        errors: where a failed turn's one-line error goes (default stderr).

    Returns:
        The number of replies given.
    """
    errors = errors or Console(stderr=True, highlight=False)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    replies = 0
    while True:
        write(USER)
        line = read_line()
        if not line:  # end of input
            write("\n")
            return replies
        text = line.rstrip("\r\n")
        if echo:
            write(text + "\n")
        if not text.strip():
            continue
        if text.startswith("/"):
            word = text.split()[0].lower()
            if word in ("/exit", "/quit"):
                return replies
            if word == "/reset":
                conversation.reset()
                write("(conversation cleared)\n")
            else:
                write(f"(unknown command {word}: {HELP_LINE})\n")
            continue
        write(ASSISTANT)
        try:
            conversation.reply(text, write)
            replies += 1
        except (ValueError, TypeError) as err:
            errors.print(f"error: {err}", markup=False)
        write("\n")


ChatModel = Annotated[str, typer.Option(
    "--model", "-m", help="A chat model: packaged name, Hugging Face-format folder or .gguf.",
)]
System = Annotated[str | None, typer.Option(
    "--system", "-s", show_default=False,
    help="System prompt \\[default: the chat template's own].",
)]
ReplyTokens = Annotated[int, typer.Option(
    "--max-new-tokens", "-n", min=1, help="Most tokens per reply (as qkv generate's "
    "language models; EOS ends a reply earlier).",
)]
Endless = Annotated[bool, typer.Option(
    "--endless", metavar=FLAG, help="Hold the conversation in an attention-sink cache "
    "(the first 4 tokens and the last --window): flat memory however long the chat; "
    "each turn feeds only its new text.",
)]
Window = Annotated[int, typer.Option(
    "--window", min=8, help="With --endless: the most recent tokens kept.",
)]


def command(
    model: ChatModel = "SmolLM2-135M-Instruct", system: System = None,
    max_new_tokens: ReplyTokens = LM_NEW_TOKENS, temperature: Temperature = 0.0,
    top_k: TopK = None, top_p: TopP = None, seed: Seed = None,
    repetition_penalty: RepetitionPenalty = None, no_repeat_ngram_size: NoRepeatNgram = None,
    min_p: MinP = None, stop: Stop = None, endless: Endless = False, window: Window = 2044,
    device: ModelDevice = None,
) -> None:  # fmt: skip
    """Chat with a language model; replies stream as they are generated.

    The whole conversation goes through the model's chat template each turn (with
    --endless, only what is new, in flat memory). Type /reset to start over, /exit (or
    Ctrl-D) to leave. Reads stdin, so lines can be piped in.

    [bold]Example:[/bold] qkv chat --system "You are a terse assistant." --temperature 0.7
    --top-p 0.9 --seed 0
    """
    # Expected failures (ValueError, OSError, ...) become one line in common.guard.
    console = Console(stderr=True, highlight=False)
    bundle = _chat_bundle(model, device, console)
    record = decoding_record(max_new_tokens, temperature, top_k, top_p, seed,
                             repetition_penalty, no_repeat_ngram_size, min_p, stop)  # fmt: skip
    if set_controls(record) and endless:
        raise ValueError("--endless decodes with its own loop: no --repetition-penalty, "
                         "--no-repeat-ngram-size, --min-p or --stop with it yet")  # fmt: skip
    held = None
    if endless:
        from qkv.pretrained.endless_chat import EndlessChat

        held = EndlessChat(bundle, recent=window)
    conversation = Conversation(bundle, system=system, options=record.keywords(), endless=held)
    how = "greedy" if temperature == 0 else f"temperature {temperature}"
    console.print(f"chatting with {bundle.name} ({how}, at most {max_new_tokens} tokens a "
                  f"reply); {HELP_LINE}", markup=False)  # fmt: skip
    try:
        tty = sys.stdin.isatty()
        run_chat(conversation, terminal_reader() if tty else sys.stdin.readline, sys.stdout,
                 echo=not tty, errors=console)  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C at the prompt leaves quietly
        sys.stdout.write("\n")


def _chat_bundle(model: str, device: str | None, console: Console) -> Any:
    """The loaded chat model (a spinner on stderr meanwhile).

    Raises:
        ValueError: a sentence encoder, or a model without a chat template.
    """
    from qkv import pretrained

    with status(console, f"loading {model} ..."):
        bundle = pretrained.load(model, device=device)
    if not isinstance(bundle, pretrained.DecoderBundle):
        raise ValueError(f"{model!r} is a sentence encoder, not a chat model")
    if not getattr(bundle.tokenizer, "chat_template", None):
        raise ValueError(f"{model!r} has no chat template; try: qkv generate --model "
                         f"{model} --no-chat --prompt ...")  # fmt: skip
    return bundle
