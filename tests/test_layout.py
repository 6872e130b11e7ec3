"""Size budget and layering: no file over 500 lines, imports flow downward only, no cycles.

The layers and what each may import (besides itself) are the table in docs/layout.md's "Layout"
section; ``ALLOWED`` below is that table, and the tests hold the code to it exactly:

* every folder (or single-file module) under ``src/qkv/`` is a layer named here;
* a layer imports only the layers listed for it, counting imports inside functions too;
* nothing but ``cli`` (and ``python -m qkv``'s ``__main__``) imports ``qkv.cli``;
* inside a layer, no two modules import each other, directly or round a longer loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"
MAX_LINES = 500
ROOT_FILES = {"__init__.py", "__main__.py"}
# What ``import qkv`` / ``from qkv import name`` brings in eagerly (qkv/__init__.py re-exports
# the attention functions; subpackages load lazily, and ``from qkv import nn`` counts as nn).
ROOT_LAYER = "attention"

_CORE = {"reference", "attention", "nn", "models"}
# Each layer may import only the layers listed for it (and itself). ``checks`` (argument
# guards) imports nothing, so every layer may use it.
ALLOWED: dict[str, set[str]] = {
    "checks": set(),
    "masks": {"attention"},  # qkv.masks: attention/masks.py under a short public name
    "reference": {"checks"},
    "attention": {"reference", "checks"},
    "nn": {"attention", "reference", "checks"},
    "models": {"nn", "attention", "reference", "checks"},
    "data": {"checks"},  # torch only: tokenizers, tasks, corpora, batching, file readers
    "checkpoint": _CORE | {"data", "checks"},  # the format below train and pretrained
    "generate": _CORE | {"checks"},
    "inspect": _CORE | {"checks"},
    "bench": {"attention", "nn", "reference", "checks"},  # nn: the paged cache's GPU case
    "train": _CORE | {"data", "checkpoint", "generate", "distributed", "pretrained", "checks"},
    "pretrained": _CORE | {"data", "checkpoint", "generate", "checks"},
    # the HTTP app: above the models it serves, below the command that starts it
    "serve": _CORE | {"data", "generate", "pretrained", "checks"},
    "distributed": {"attention", "nn", "reference", "checks"},  # below models: works on modules
    "integrations": {"nn", "attention", "reference", "inspect", "checks"},
}
EVERYTHING = set(ALLOWED)
ALLOWED["cli"] = EVERYTHING  # the command calls the library; nothing imports it


def _layers_present() -> dict[str, list[Path]]:
    """``{layer: its .py files}`` for every folder and top-level module under ``src/qkv``."""
    found: dict[str, list[Path]] = {}
    for entry in sorted(SRC.iterdir()):
        if entry.is_dir() and (entry / "__init__.py").exists():
            found[entry.name] = sorted(entry.rglob("*.py"))
        elif entry.suffix == ".py" and entry.name not in ROOT_FILES:
            found[entry.stem] = [entry]
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    skip = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (
            (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        ):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported_modules(path: Path, *, runtime_only: bool = False) -> set[str]:
    """Every ``qkv...`` module ``path`` imports, at any depth (lazy imports count); with
    ``runtime_only``, leaving out imports under ``if TYPE_CHECKING:``."""
    modules = set()
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] == "qkv")
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports (qkv.…), not relative ones"
            if node.module and node.module.split(".")[0] == "qkv":
                # ``from qkv.data import tokenizers`` imports the module qkv.data.tokenizers
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    modules.add(sub if _module_file(sub) else node.module)
    return modules


def _module_file(module: str) -> Path | None:
    base = SRC.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_LAYER


def test_no_source_file_over_500_lines():
    too_long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"files over {MAX_LINES} lines (split along a concept): {too_long}"


def test_every_folder_is_a_known_layer():
    unknown = sorted(set(_layers_present()) - set(ALLOWED))
    assert not unknown, f"layers missing from ALLOWED (and docs/layout.md's Layout table): {unknown}"


def test_layers_import_downward_only():
    wrong = []
    for layer, files in _layers_present().items():
        for path in files:
            bad = {_layer_of(m) for m in _imported_modules(path)} - ALLOWED[layer] - {layer}
            if bad:
                wrong.append(f"{path.relative_to(SRC)} imports {sorted(bad)}")
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


def test_nothing_in_the_library_imports_the_cli():
    wrong = [
        str(path.relative_to(SRC))
        for layer, files in _layers_present().items() if layer != "cli"
        for path in files
        if any(_layer_of(m) == "cli" for m in _imported_modules(path))
    ]
    assert not wrong, f"only qkv.cli and qkv/__main__.py may import qkv.cli: {wrong}"
    init = _imported_modules(SRC / "__init__.py")
    assert not any(_layer_of(m) == "cli" for m in init), "qkv/__init__.py imports qkv.cli"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycles_inside_a_layer():
    # A package's __init__ imports its modules to re-export them; a module importing its own
    # package back would close a loop, and so would two modules importing each other.
    # Imports under ``if TYPE_CHECKING:`` never run, so they close no loop.
    cycles = []
    for layer, files in _layers_present().items():
        graph: dict[str, set[str]] = {}
        for path in files:
            rel = path.relative_to(SRC.parent).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            imported = _imported_modules(path, runtime_only=True)
            graph[name] = {m for m in imported if _layer_of(m) == layer} - {name}
        if found := _cycle(graph):
            cycles.append(" -> ".join(found))
    assert not cycles, f"import cycles inside a layer: {cycles}"


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_reference_never_imports_torch():
    for path in (SRC / "reference").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] == "torch" for m in mods), f"{path} imports torch"


def test_data_and_checks_import_no_other_layer_than_checks():
    # DESIGN.md: data imports only torch; checks imports nothing at all.
    for layer in ("data", "checks"):
        for path in _layers_present()[layer]:
            layers = {_layer_of(m) for m in _imported_modules(path)} - {layer}
            assert layers <= ALLOWED[layer], f"{path.relative_to(SRC)} imports {layers}"
