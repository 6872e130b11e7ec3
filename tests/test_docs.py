"""The pages under ``docs/`` run as written, by the README's rules (``tests/test_readme.py``).

* Every ```python block runs on its own, as a user would paste it into a file: a fresh
  namespace, in a temporary working folder, so each block carries its own imports.
* Every command of every ```sh / ```bash block is checked or exempt, as in the README
  (``test_readme.EXEMPT``, ``RUN``): ``qkv ...`` commands name real subcommands and options,
  the cheap ones run for real.
* ```text blocks are not code to run (the context-parallel sketch needs ``torchrun`` and a
  process group; ``tests/distributed/`` runs the same calls).
* Every relative link of the README and the pages names a file that exists, and none leaves
  the repository.
"""

from __future__ import annotations

import runpy

import pytest

from test_readme import (
    LANGUAGES,
    ROOT,
    block_languages,
    blocks,
    check_links,
    check_shell_commands,
)

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# (page, block number counted from 1): why the block is not run here. Empty: every block runs.
EXEMPT_BLOCKS: dict[tuple[str, int], str] = {}
PYTHON_BLOCKS = [
    pytest.param(page, i, body, id=f"{page.name}-{i}")
    for page in PAGES
    for i, body in enumerate(blocks("python", page), start=1)
]


def test_docs_pages_exist():
    assert len(PAGES) >= 10, [p.name for p in PAGES]
    for page in PAGES:
        first = page.read_text().splitlines()
        assert first[0].startswith("# "), f"{page.name} has no title"
        assert "](../README.md" in "\n".join(first[:4]), f"{page.name}: no link back to README"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_have_only_known_block_languages(page):
    langs = block_languages(page)
    assert langs <= LANGUAGES, f"{page.name}: unchecked code blocks {langs}"


@pytest.mark.parametrize(("page", "number", "body"), PYTHON_BLOCKS)
def test_docs_python_block_runs_on_its_own(page, number, body, tmp_path, monkeypatch):
    reason = EXEMPT_BLOCKS.get((page.name, number))
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / f"{page.stem}_{number}.py"
    script.write_text(body)
    runpy.run_path(str(script), run_name="__main__")


def test_docs_shell_commands_are_checked_or_exempt(tmp_path, monkeypatch):
    ran = 0
    for page in PAGES:
        folder = tmp_path / page.stem
        folder.mkdir()
        monkeypatch.chdir(folder)  # files the commands write (tour.html) land here
        ran += check_shell_commands(page)
    assert ran >= 1, "no docs command was run for real"
    assert (tmp_path / "inspection" / "tour.html").stat().st_size > 10_000


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_exist(page):
    check_links(page)
