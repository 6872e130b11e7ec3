"""The ``qkv`` command: a thin typer layer that parses arguments, calls the library, prints.

The command line needs the optional extra ``cli`` (typer and rich). :func:`main` checks for it
before importing anything that needs it, so a bare ``pip install qkv`` gets one clear line
instead of a traceback. The commands themselves live one per module in this package and are
registered in :mod:`qkv.cli.app`; what they share is in :mod:`qkv.cli.common`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["EXTRA_MODULES", "DTypeName", "main", "missing_extra"]

# The modules the ``cli`` extra installs; ``main`` refuses to start without them.
EXTRA_MODULES: tuple[str, ...] = ("typer", "rich")

MISSING_EXTRA_MESSAGE = (
    "qkv: the command line needs the optional extra 'cli' (missing module {module!r}); "
    "install it with: pip install 'qkv[cli]'"
)


def missing_extra() -> str | None:
    """Name of the first module of the ``cli`` extra that cannot be imported, or ``None``."""
    for name in EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``qkv`` console script.

    Args:
        argv: the arguments after the program name; ``None`` reads ``sys.argv[1:]``.

    Raises:
        SystemExit: always, with the command's exit status; status 2 with a one-line message
            on stderr when typer or rich (the ``cli`` extra) is not installed.
    """
    module = missing_extra()
    if module is not None:
        print(MISSING_EXTRA_MESSAGE.format(module=module), file=sys.stderr)
        raise SystemExit(2)
    from qkv.cli.app import app

    app(args=None if argv is None else list(argv), prog_name="qkv")


def __getattr__(name: str):
    # ``from qkv.cli import DTypeName`` without importing typer at ``import qkv.cli``.
    if name == "DTypeName":
        from qkv.cli.common import DTypeName

        return DTypeName
    raise AttributeError(f"module 'qkv.cli' has no attribute {name!r}")
