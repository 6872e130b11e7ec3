"""Size budget and layering: no file over 500 lines, imports flow downward only."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"
MAX_LINES = 500
# Each layer may import only the layers listed for it (and itself).
_CORE = {"reference", "attention", "nn", "models"}
ALLOWED = {
    "reference": {"reference"},
    "attention": {"attention", "reference"},
    "nn": {"nn", "attention", "reference"},
    "models": {"models", "nn", "attention", "reference"},
    "data": {"data", "attention"},
    "generate": {"generate"} | _CORE,
    "train": {"train", "data", "generate"} | _CORE,
    "pretrained": {"pretrained", "data", "generate", "train"} | _CORE,
    "inspect": {"inspect", "data", "generate", "train", "pretrained"} | _CORE,
}


def test_no_source_file_over_500_lines():
    too_long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"files over {MAX_LINES} lines (split along a concept): {too_long}"


def _qkv_imports(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "qkv" and len(parts) > 1:
                layers.add(parts[1])
    return layers


def test_layers_import_downward_only():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in (SRC / layer).rglob("*.py") if (SRC / layer).exists() else []:
            bad = _qkv_imports(path) - allowed
            if bad:
                wrong.append(f"{path.relative_to(SRC)} imports {sorted(bad)}")
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


def test_reference_never_imports_torch():
    for path in (SRC / "reference").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(m.split(".")[0] == "torch" for m in mods), f"{path} imports torch"
