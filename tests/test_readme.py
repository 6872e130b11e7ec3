"""The README's code runs as written, and it links to nothing outside the repository.

* Every ```python block is executed, in order, each in a fresh namespace (as if pasted
  alone).
* Every command of every ```sh / ```bash block is either checked or exempt with its reason
  (``EXEMPT``): each ``qkv ...`` command (also under ``torchrun -m qkv``) must name a real
  subcommand whose ``--help`` works and whose options include every ``--option`` used; the
  cheap ones (``RUN``) are also run for real, in a temporary folder.
* ```text blocks are not code to run.

The helpers take a page, so ``tests/test_docs.py`` holds every ``docs/*.md`` page to the same
rules; the performance tables ``benchmarks/readme.py`` generates are in ``docs/performance.md``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
FENCE = re.compile(r"```(\w*)\n(.*?)```", flags=re.S)
LANGUAGES = {"python", "sh", "bash", "text"}

# Commands that are not run or checked here, and why (matched by their first words).
EXEMPT = {
    "make demo": "the main job trains for over a minute; tests/cli/test_demo.py runs its parts",
    "make test": "the test suite itself (make test-gpu: its CUDA subset, on a GPU)",
    "make gpu-check": "needs a CUDA GPU; test_triton.py runs the kernels interpreted and "
    "compiles them without one",
    "pip install": "installs packages from an index; the tests run without a network",
    "PYTHONPATH=/tmp/t36site": "compiles the kernels with another triton, installed from the "
    "index first; test_triton.py compiles them with this checkout's",
    "espeak-ng": "an optional system tool; tests/pretrained/test_whisper_cli.py uses it",
    "jupyter lab": "starts an interactive server; tests/test_notebooks.py runs every notebook "
    "in a kernel instead",
}
# qkv subcommands cheap enough to run for real (the tour: a few seconds).
RUN = {"tour"}
# Under torchrun the commands are only checked (torchrun's options and qkv's): they need
# several processes (or nodes) and train.


def blocks(language: str, page: Path = README) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def block_languages(page: Path = README) -> set[str]:
    return {lang for lang, _ in FENCE.findall(page.read_text())}


def shell_commands(page: Path = README) -> list[str]:
    """Each command of the sh/bash blocks: continuations joined, comments dropped, lines
    split at ``&&``, ``||`` and ``;``."""
    out = []
    for body in blocks("sh", page) + blocks("bash", page):
        for line in body.replace("\\\n", " ").splitlines():
            words: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word in ("&&", "||", ";"):
                    if words:
                        out.append(shlex.join(words))
                    words = []
                else:
                    words.append(word.rstrip(";"))
    return out


def test_readme_has_only_known_block_languages():
    langs = block_languages()
    assert langs <= LANGUAGES, f"unchecked code blocks: {langs}"


def test_readme_python_examples_run(capsys):
    """Every python block runs pasted alone, each in a fresh namespace (issue 27: blocks
    that leaned on an earlier one's imports failed with NameError)."""
    python = blocks("python")
    assert len(python) >= 2, "README lost its python examples"
    namespace: dict = {}
    for block in python:
        namespace = {}
        exec(compile(block, str(README), "exec"), namespace)
        if "logits" in namespace:
            logits = namespace["logits"]
    out = capsys.readouterr().out
    assert out.startswith("auto -> torch"), out[:200]
    assert logits.shape == (2, 16, 1000)
    assert "density=0.188" in out, "the flex example no longer prints the density it quotes"


def _qkv_args(words: list[str]) -> list[str] | None:
    """The arguments after ``qkv`` (or ``python -m qkv`` / ``torchrun ... -m qkv``)."""
    if words[0] == "qkv":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "qkv":
            return words[i + 2 :]
    return None


def check_shell_commands(page: Path) -> int:
    """Checks every command of ``page``'s sh/bash blocks (run in the current folder: files
    the commands write, such as tour.html, land there); returns how many ran for real."""
    commands = shell_commands(page)
    if all(_qkv_args(shlex.split(c)) is None for c in commands):
        group = runner = app = None  # only exempt commands (or none): typer is not needed
    else:
        typer = pytest.importorskip("typer", reason="the qkv command needs the cli extra")
        from typer.testing import CliRunner

        from qkv.cli.app import app

        runner = CliRunner(env={"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"})
        group = typer.main.get_command(app)
    ran = 0
    for line in commands:
        words = shlex.split(line)
        args = _qkv_args(words)
        if args is None:
            reason = next((r for k, r in EXEMPT.items() if line.startswith(k)), None)
            assert reason, f"{page.name} command neither checked nor exempt: {line!r}"
            continue
        if words[0] == "torchrun":  # torchrun's own options parse (the run is not started)
            from torch.distributed.run import get_args_parser

            filled = ["0" if w == "R" else w for w in words[1:]]  # the docs' node rank R
            parsed = get_args_parser().parse_args(filled)
            assert parsed.module and parsed.training_script == "qkv", line
        sub = group.get_command(None, args[0]) if args else None  # (commands load lazily)
        assert sub is not None, f"{line!r}: no qkv command {args[:1]}"
        known = {o for p in sub.params for o in (*p.opts, *p.secondary_opts)}
        unknown = [a.split("=")[0] for a in args[1:]
                   if a.startswith("--") and a.split("=")[0] not in known]  # fmt: skip
        assert not unknown, f"{line!r}: qkv {args[0]} has no option {unknown}"
        result = runner.invoke(app, [args[0], "--help"])
        assert result.exit_code == 0 and "Example" in result.output, (line, result.output)
        if args[0] in RUN and words[0] == "qkv":
            result = runner.invoke(app, args)
            assert result.exit_code == 0, f"{line!r} failed:\n{result.output[-2000:]}"
            ran += 1
    return ran


def test_readme_shell_commands_are_checked_or_exempt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert any(c.startswith("make ") for c in shell_commands()), "README lost its commands"
    check_shell_commands(README)


def check_links(page: Path) -> None:
    """No link leaves the repository; every relative link names a file that exists."""
    text = page.read_text()
    urls = re.findall(r"(?:https?|ftp)://\S+|www\.\S+", text)
    assert not urls, f"{page.name} links outside the repository: {urls}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):  # markdown links [text](target)
        if target.startswith("#"):
            continue  # a heading of the same page
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.name} link to {target!r}"


def test_readme_links_stay_inside_the_repository():
    check_links(README)


def test_performance_tables_are_the_benchmark_results():
    """docs/performance.md's tables are exactly what ``benchmarks/readme.py`` renders from
    ``benchmarks/results/``: every figure there is a labelled run's, never typed in."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import readme as tables  # benchmarks/readme.py (benchmarks/ is not a package)

    assert tables.PAGE == PERFORMANCE
    text = PERFORMANCE.read_text(encoding="utf-8")
    assert tables.replace_in(text) == text, (
        "docs/performance.md's tables differ from benchmarks/results: run "
        "`python benchmarks/readme.py --write`")
    assert "AVX" in tables.render(), "no labelled results in benchmarks/results"
