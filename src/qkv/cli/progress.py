"""Words on long work: what a command is doing while it loads, computes and writes.

On a terminal each stage is a live status line (a spinner, then ``✓ stage (3.1 s)``) and
counted work a progress bar; through a pipe or into a file a stage that takes longer than
:data:`SLOW_SECONDS` is one plain line on stderr when that much time has passed and one when
it ends (quick stages print nothing: a fast failure stays the one ``error:`` line, a fast
command's stderr stays empty), and counted work a line about every tenth of the way.
Always stderr: stdout carries the command's results, so ``qkv inspect ... > out.txt`` and
``| jq`` see only them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["SLOW_SECONDS", "Stages"]

# Through a pipe, a stage still running after this long says that it started.
SLOW_SECONDS = 2.0

T = TypeVar("T")


class Stages:
    """The stages of one command's work, shown on stderr.

    Args:
        command: the command's name, which starts each plain line (``qkv inspect: ...``).
        console: where to write (default: a stderr console; a test passes its own).
    """

    def __init__(self, command: str, console: Console | None = None) -> None:
        self.command = command
        self.console = console if console is not None else Console(stderr=True)

    @property
    def live(self) -> bool:
        """Whether stderr is a terminal (spinners and bars) rather than a pipe (lines)."""
        return self.console.is_terminal

    def _line(self, text: str) -> None:
        self.console.print(f"qkv {self.command}: {escape(text)}", highlight=False,
                           soft_wrap=True)  # fmt: skip

    @contextmanager
    def stage(self, text: str) -> Iterator[None]:
        """Show ``text`` while the block runs, then how long it took."""
        start = time.perf_counter()
        if self.live:
            with self.console.status(escape(text)):
                yield
        else:
            started = threading.Timer(SLOW_SECONDS, self._line, (f"{text} ...",))
            started.daemon = True
            started.start()
            try:
                yield
            finally:
                started.cancel()
        took = time.perf_counter() - start
        if self.live:
            self.console.print(f"[green]✓[/green] {escape(text)} ({took:.1f} s)",
                               highlight=False)  # fmt: skip
        elif took >= SLOW_SECONDS:
            self._line(f"{text}: done in {took:.1f} s")

    def track(self, items: Iterable[T], total: int, text: str) -> Iterator[T]:
        """``items`` (``total`` of them), counted as they are consumed."""
        if total <= 0:
            yield from items
            return
        if self.live:
            columns = (TextColumn(escape(text)), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn())  # fmt: skip
            with Progress(*columns, console=self.console, transient=True) as bar:
                task = bar.add_task(text, total=total)
                for item in items:
                    yield item
                    bar.advance(task)
            self.console.print(f"[green]✓[/green] {escape(text)} ({total}/{total})",
                               highlight=False)  # fmt: skip
            return
        step = max(1, total // 10)
        self._line(f"{text}: 0/{total}")
        for done, item in enumerate(items, 1):
            yield item
            if done % step == 0 or done == total:
                self._line(f"{text}: {done}/{total}")

    def note(self, text: str) -> None:
        """One line of information (a result summary, a hint)."""
        if self.live:
            self.console.print(escape(text), highlight=False)
        else:
            self._line(text)
