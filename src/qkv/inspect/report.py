"""Everything :mod:`qkv.inspect` draws, for one input, written into one folder.

Used by ``qkv inspect`` and ``qkv demo``: one capture of every layer, then the pictures
(a layers × heads grid per attention kind, the first and last layer's head 0, the rollout,
an encoder-decoder's alignment, the masks, the sinusoidal positions when the model uses them),
the token's-journey trace of the last position (text and JSON) and the viewer.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.inspect.adapters import key_side, query_side, run_model
from qkv.inspect.capture import capture
from qkv.inspect.figures import plot_masks, plot_positions
from qkv.inspect.files import atomic_write
from qkv.inspect.hookpoints import attention_layers
from qkv.inspect.plots import plot_alignment, plot_grid, plot_head, plot_rollout
from qkv.inspect.trace import trace
from qkv.inspect.viewer import view
from qkv.nn.positions import SinusoidalPositionalEncoding

__all__ = ["PICTURE_BUDGET", "weights_bytes", "write_report"]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@torch.no_grad()
def write_report(
    model: nn.Module,
    input_ids: Tensor,
    out: str | os.PathLike,
    *,
    tokens: list[str] | None = None,
    target: Tensor | None = None,
    target_tokens: list[str] | None = None,
    title: str | None = None,
) -> dict[str, Path]:
    """Capture ``model`` on one input and write the PNGs, the trace and the viewer to ``out``.

    Args:
        model: a qkv model (in evaluation mode for reproducible pictures).
        input_ids: ``(1, T)`` ids (the first row is drawn).
        out: the folder (created).
        tokens, target_tokens: position labels of the input and of an encoder-decoder's
            target (default: indices).
        target: an encoder-decoder's decoder input ``(1, T_tgt)``.
        title: the viewer's title.

    Inputs whose weights would not fit in :data:`PICTURE_BUDGET` (2 GiB: e.g. SmolLM2's 270
    heads past ~1,400 tokens) get the viewer and the trace (both streamed) and a ``note.txt``
    saying why the PNGs were skipped, instead of running out of memory.

    Returns:
        ``{what: path}`` of every file written, in the order written.

    Raises:
        ValueError, TypeError: the errors of :func:`capture`, the plots and the viewer.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    need = weights_bytes(model, input_ids, target)
    if need > PICTURE_BUDGET:
        # The PNGs come from every layer's full weights; the viewer and the trace stream.
        files["note"] = atomic_write(folder / "note.txt", (
            f"The PNG pictures were skipped: they need every layer's full attention weights "
            f"at once, about {need / 2**30:.1f} GiB here (budget {PICTURE_BUDGET / 2**30:.0f} "
            "GiB). The viewer (built a block of rows at a time) and the trace are written; "
            "use fewer tokens for the pictures.\n"))  # fmt: skip
        _common_files(model, input_ids, folder, files, tokens, target, target_tokens)
        files["viewer"] = view(model, tokens, folder / "viewer.html", input_ids=input_ids,
                               target=target, target_tokens=target_tokens,
                               title=title).path  # fmt: skip
        return files
    with capture(model) as cap:
        run_model(model, input_ids, target)
    sides: dict[str, Any] = {"source": tokens, "target": target_tokens}
    kinds: dict[str, list[str]] = {}
    for name in cap.layers:
        kinds.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    for pattern, names in kinds.items():
        slug = _slug(pattern.replace("*", ""))
        files[f"grid {pattern}"] = plot_grid(cap, folder / f"grid-{slug}.png", layers=names)
        q = sides[query_side(names[0])]
        k = sides[key_side(names[0], cap.kinds[names[0]])]
        for name in dict.fromkeys((names[0], names[-1])):
            files[f"head {name}"] = plot_head(
                cap, folder / f"head-{_slug(name)}-h0.png", layer=name, head=cap.heads[name][0],
                q_tokens=q, k_tokens=k, title=f"{name}, head {cap.heads[name][0]}",
            )
    # No rollout without a square self-attention stack (e.g. only a decoder's cached steps).
    with contextlib.suppress(ValueError):
        files["rollout"] = plot_rollout(cap, folder / "rollout.png", tokens=tokens)
    if any(kind == "cross" for kind in cap.kinds.values()):
        files["alignment"] = plot_alignment(
            cap, folder / "alignment.png", src_tokens=tokens, tgt_tokens=target_tokens
        )
    _common_files(model, input_ids, folder, files, tokens, target, target_tokens)
    files["viewer"] = view(cap, tokens, folder / "viewer.html", target_tokens=target_tokens,
                           title=title).path  # fmt: skip
    return files


# The full-weight pictures are drawn only when every layer's weights fit in this many bytes.
PICTURE_BUDGET = 2 * 2**30


def weights_bytes(model: nn.Module, input_ids: Tensor, target: Tensor | None = None) -> int:
    """Bytes every attention layer's float32 weights ``(H, T, S)`` take for this input (the
    longest of the input and the target for both sides: an upper bound)."""
    n = max(int(input_ids.shape[-1]), 0 if target is None else int(target.shape[-1]))
    heads = sum(layer.num_heads for layer in attention_layers(model).values())
    return heads * n * n * 4 * int(input_ids.shape[0])


def _common_files(model: nn.Module, input_ids: Tensor, folder: Path, files: dict[str, Path],
                  tokens: Any, target: Tensor | None, target_tokens: Any) -> None:  # fmt: skip
    """The masks, the positions (sinusoidal models) and the trace: no weights needed."""
    T = int(input_ids.shape[-1])
    files["masks"] = plot_masks(folder / "masks.png", length=T, lengths=(T, max(1, T * 2 // 3)))
    d_model = getattr(getattr(model, "config", None), "d_model", 64)
    if any(isinstance(m, SinusoidalPositionalEncoding) for m in model.modules()):
        files["positions"] = plot_positions(folder / "positions.png", max_len=max(T, 64),
                                            d_model=d_model)  # fmt: skip
    journey = trace(model, input_ids, -1, target=target, tokens=tokens,
                    target_tokens=target_tokens)  # fmt: skip
    atomic_write(folder / "trace.txt", journey.table() + "\n")
    atomic_write(folder / "trace.json", journey.to_json() + "\n")
    files["trace"], files["trace json"] = folder / "trace.txt", folder / "trace.json"
