"""qkv.reference's pieces: softmax, head split/merge, its error messages, and its no-torch rule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv.reference
from helpers import assert_close
from qkv.reference import attention, attention_backward, merge_heads, softmax, split_heads

REFERENCE_DIR = Path(qkv.reference.__file__).parent


# ---------------------------------------------------------------------------- no torch


def _forbidden_imports(path: Path) -> list[str]:
    """Imports in ``path`` that break the layering: torch, or qkv outside qkv.reference."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:  # ``from .. import x`` reaches above qkv.reference
                bad.append(f"line {node.lineno}: relative import from level {node.level}")
            names = [node.module or ""] if node.level == 0 else []
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "__import__", "import_module"
            )
        ):
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        else:
            continue
        for name in names:
            top = str(name).split(".")[0]
            if top == "torch" or (top == "qkv" and not str(name).startswith("qkv.reference")):
                bad.append(f"line {node.lineno}: imports {name}")
    return bad


def test_reference_never_imports_torch():
    files = sorted(REFERENCE_DIR.rglob("*.py"))
    assert len(files) >= 4, f"expected the reference package, found {files}"
    bad = {f.name: _forbidden_imports(f) for f in files}
    assert not any(bad.values()), f"qkv.reference must be NumPy only: {bad}"


def test_import_checker_catches_torch(tmp_path):
    """The checker above must not pass vacuously."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import numpy\nimport torch.nn\nfrom torch import nn\nfrom qkv.attention import x\n"
        "import importlib\nimportlib.import_module('torch')\nfrom .. import y\n"
    )
    assert len(_forbidden_imports(sample)) == 5


# ---------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("shape,axis", [((7,), -1), ((3, 113), -1), ((4, 5, 6), 1), ((2, 3), 0)])
def test_softmax_matches_torch_and_sums_to_one(shape, axis):
    x = np.random.default_rng(0).standard_normal(shape) * 5
    y = softmax(x, axis=axis)
    assert_close(y, torch.softmax(torch.from_numpy(x), dim=axis), atol=1e-15, name="softmax")
    assert_close(y.sum(axis=axis), np.ones(np.delete(shape, axis)), atol=1e-14, name="row sums")
    assert y.dtype == np.float64 and (y >= 0).all()


def test_softmax_is_stable_for_huge_inputs():
    x = np.random.default_rng(1).standard_normal((3, 9))
    for shift in (1e4, -1e4):
        assert_close(softmax(x + shift), softmax(x), atol=1e-12, name=f"shift {shift:g}")
    y = softmax(np.array([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4]]))
    assert_close(y, [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]], atol=1e-15, name="huge rows")


def test_softmax_all_neg_inf_rows_give_zeros():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    assert_close(softmax(x), [[0, 0, 0], [0.5, 0, 0.5]], atol=0, name="-inf rows")
    assert_close(softmax(np.zeros((2, 0))), np.zeros((2, 0)), atol=0, name="empty rows")
    assert softmax(np.array([1, 2, 3])).dtype == np.float64  # integers are upcast


@pytest.mark.parametrize(
    "x,axis,exc,match",
    [
        ([1.0, 2.0], -1, TypeError, "x must be a numpy.ndarray.*got list"),
        (np.array(["a"]), -1, TypeError, "real numbers.*dtype <U1"),
        (np.zeros(3), 1, ValueError, r"axis 1 is out of range for x of shape \(3,\)"),
        (np.zeros(3), 0.5, TypeError, "axis must be an int, got float"),
        (np.array([0.0, np.nan]), -1, ValueError, "NaN or \\+inf"),
        (np.array([0.0, np.inf]), -1, ValueError, "NaN or \\+inf"),
    ],
)
def test_softmax_errors(x, axis, exc, match):
    with pytest.raises(exc, match=match):
        softmax(x, axis=axis)


# ---------------------------------------------------------------------------- heads


@pytest.mark.parametrize(
    "shape,H", [((5, 12), 3), ((2, 7, 118), 2), ((2, 3, 1, 8), 8), ((4, 6), 1)]
)
def test_split_merge_round_trip_and_torch_layout(shape, H):
    x = np.random.default_rng(0).standard_normal(shape)
    *lead, T, E = shape
    heads = split_heads(x, H)
    assert heads.shape == (*lead, H, T, E // H)
    t = torch.from_numpy(x).reshape(*lead, T, H, E // H).transpose(-3, -2)  # (..., H, T, D)
    assert_close(heads, t, atol=0, name="split vs torch view+transpose")
    assert_close(merge_heads(heads), x, atol=0, name="merge(split(x))")
    back = t.transpose(-3, -2).reshape(*lead, T, E)  # (..., T, E)
    assert_close(merge_heads(heads), back, atol=0, name="merge vs torch transpose+reshape")
    assert split_heads(x.astype(np.float32), H).dtype == np.float32  # layout only


@pytest.mark.parametrize(
    "fn,args,exc,match",
    [
        (split_heads, (np.zeros((4, 10)), 3), ValueError, r"E=10 .*multiple of num_heads=3"),
        (split_heads, (np.zeros((4, 10)), 0), ValueError, "num_heads must be at least 1, got 0"),
        (split_heads, (np.zeros((4, 10)), 2.0), TypeError, "num_heads must be an int"),
        (split_heads, (np.zeros(10), 2), ValueError, r"at least 2 dimensions .*\(10,\)"),
        (split_heads, ([[1.0]], 1), TypeError, "x must be a numpy.ndarray"),
        (merge_heads, (np.zeros((4, 10)),), ValueError, r"at least 3 dimensions .*\(4, 10\)"),
    ],
)
def test_heads_errors(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


# ---------------------------------------------------------------------------- attention errors

Q, K, V = np.zeros((2, 4, 3, 8)), np.zeros((2, 2, 5, 8)), np.zeros((2, 2, 5, 6))


@pytest.mark.parametrize(
    "args,kw,exc,match",
    [
        ((Q.tolist(), K, V), {}, TypeError, "query must be a numpy.ndarray.*got list"),
        ((Q, K.astype(complex), V), {}, TypeError, "key must hold real numbers.*complex"),
        ((Q, K, np.zeros(5)), {}, ValueError, r"value must have at least 2 dimensions.*\(5,\)"),
        ((Q, K[0], V), {}, ValueError, "same number of dimensions"),
        ((Q, K[..., :7], V), {}, ValueError, "same head width D.*D=8.*D=7"),
        ((Q, K, V[..., :4, :]), {}, ValueError, "same length S.*S=5.*S=4"),
        ((Q, K, V[:, :1]), {}, ValueError, "same number of heads Hkv.*key.*2.*value.*1"),
        ((Q[:, :3], K, V), {}, ValueError, "H=3 must be a multiple of key/value heads Hkv=2"),
        ((Q[:1], K, V), {}, ValueError, "same leading \\(batch\\) dimensions"),
        ((Q, K, V * np.nan), {}, ValueError, "value contains NaN or inf"),
        ((Q, K, V), {"mask": [[True]]}, TypeError, "mask must be a numpy.ndarray or None"),
        ((Q, K, V), {"mask": np.ones((3, 5), int)}, TypeError, "boolean .* or floating"),
        ((Q, K, V), {"mask": np.ones((1, 2, 4, 3, 5), bool)}, ValueError, "5 dimensions, more"),
        ((Q, K, V), {"mask": np.ones((3, 4), bool)}, ValueError, r"\(3, 4\) does not broadcast"),
        ((Q, K, V), {"mask": np.full((3, 5), np.nan)}, ValueError, "mask contains NaN or \\+inf"),
        ((Q, K, V), {"mask": np.full((3, 5), np.inf)}, ValueError, "mask contains NaN or \\+inf"),
        ((Q, K, V), {"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
        ((Q, K, V), {"scale": float("inf")}, ValueError, "scale must be a finite number"),
        ((Q, K, V), {"scale": "0.5"}, ValueError, "scale must be a finite number"),
        ((Q[0, 0], K[0, 0], V[0, 0]), {"mask": np.ones((1, 3, 5), bool)}, ValueError, "more"),
    ],
)
def test_attention_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        attention(*args, **kw)
    g = np.zeros((2, 4, 3, 6))
    with pytest.raises(exc, match=match):
        attention_backward(*args, g, **kw)


def test_mask_that_would_enlarge_the_scores():
    with pytest.raises(ValueError, match=r"mask of shape \(3, 1, 1, 5\) would enlarge"):
        attention(Q[:1], K[:1], V[:1], np.ones((3, 1, 1, 5), bool))


@pytest.mark.parametrize("shape", [(2, 4, 3, 5), (2, 4, 6)])
def test_backward_grad_out_shape(shape):
    expected = r"grad_out must have the shape of the output .*\(2, 4, 3, 6\), got "
    with pytest.raises(ValueError, match=expected + re.escape(str(shape))):
        attention_backward(Q, K, V, np.zeros(shape))


def test_backward_grad_out_shape_2d():
    with pytest.raises(ValueError, match=r"\(\.\.\., H, T, Dv\) = \(3, 6\), got \(3, 5\)"):
        attention_backward(Q[0, 0], K[0, 0], V[0, 0], np.zeros((3, 5)))
