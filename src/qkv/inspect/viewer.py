"""The interactive attention viewer: one self-contained HTML file, no network at all.

    v = qkv.inspect.view(model, ids, "attention.html", labels=tokens)   # or view(cap, tokens)
    v                                                                    # inline in Jupyter

Three views, as in BertViz (Vig, 2019), on a page that loads nothing from anywhere (the
script and styles are inlined from this package; a Content-Security-Policy forbids any fetch):

* **head view**: query tokens on the left, keys on the right, a line from each query to the
  keys it attends to most, one colour per head, opacity = weight. Hover a token to focus its
  lines; choose the layer and the heads.
* **model view**: a thumbnail of every layer × head; click one to open it larger.
* **cross-attention view** (encoder-decoder models): the head view from target to source.

Only the visible rows are drawn, so 4,096 tokens stay responsive; the data are compressed by
:mod:`qkv.inspect.viewer_data`. Several viewers on one page do not interfere: each has its own
element id, and its script is a closure over that element.
"""

from __future__ import annotations

import html
import json
import os
import re
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qkv.inspect.adapters import key_side, query_side, run_model
from qkv.inspect.capture import Captured
from qkv.inspect.files import atomic_write
from qkv.inspect.hookpoints import attention_layers, match_names
from qkv.inspect.viewer_data import LayerSummary, choose_top_k
from qkv.inspect.weights import check_heads, weight_blocks

__all__ = ["View", "script_json", "view"]

# No request of any kind may leave the page: inline scripts and styles, data: images only.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "img-src data:")  # fmt: skip


def script_json(data: Any) -> str:
    """``data`` as JSON that can sit verbatim inside ``<script type="application/json">``.

    The page reads the element's ``textContent`` and gives it to ``JSON.parse`` without any
    un-escaping, so the text must be valid JSON *and* must not change the HTML tokenizer's
    state. Every way out of the script-data state starts with ``<`` (``</script``, or ``<!--``
    then ``<script`` entering the double-escaped state), so ``<`` (and ``>``, ``&`` with it)
    is written as a JSON escape ``\\u003c``; JSON puts those characters only inside strings,
    where the escape decodes to the same character. ``ensure_ascii`` writes every other
    non-ASCII character as an escape, U+2028 and U+2029 (line terminators in older JavaScript)
    and lone surrogates included, so the payload is plain ASCII.

    Raises:
        ValueError: ``data`` holds NaN or infinity (not JSON; ``JSON.parse`` would refuse it).
    """
    try:
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except ValueError:
        raise ValueError("the viewer's data hold NaN or infinity (did the model produce NaN "
                         "attention weights?); JSON cannot carry them") from None
    for char, escaped in _SCRIPT_ESCAPES:
        payload = payload.replace(char, escaped)
    return payload


# The characters script_json writes as JSON escapes (each only ever inside a JSON string).
_SCRIPT_ESCAPES = (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"))


def _static(name: str) -> str:
    return (resources.files("qkv.inspect") / "static" / name).read_text(encoding="utf-8")


class View:
    """A rendered viewer: :meth:`save` writes the HTML file, Jupyter shows it inline.

    Attributes:
        data: the page's JSON data (token labels and compressed layers).
        path: where :meth:`save` last wrote it, or None.
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.path: Path | None = None

    def fragment(self) -> str:
        """An HTML fragment (one ``div``) holding the viewer, with a fresh element id."""
        vid = f"qkv-view-{uuid.uuid4().hex[:12]}"
        payload = script_json(self.data)
        return (
            f'<div class="qkv-viewer" id="{vid}">'
            f"<style>{_static('viewer.css')}</style>"
            f'<script type="application/json" class="qkv-data">{payload}</script>'
            f"<script>(function(){{{_static('viewer.js')}\n"
            f'qkvViewer(document.getElementById("{vid}"));}})();</script></div>'
        )

    def html(self) -> str:
        """A complete HTML document (UTF-8) that opens from disk."""
        title = html.escape(self.data.get("title") or "qkv attention viewer")
        # A lone surrogate (possible in a Python str) has no UTF-8 form: write U+FFFD.
        title = re.sub("[\ud800-\udfff]", "\ufffd", title)
        return (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            f"<title>{title}</title></head><body>{self.fragment()}</body></html>\n"
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`html` to ``path`` atomically (folders created); returns the path."""
        self.path = atomic_write(path, self.html())
        return self.path

    def _repr_html_(self) -> str:
        return self.fragment()

    def __repr__(self) -> str:
        groups = ", ".join(f"{g['title']} ({len(g['layers'])} layers)" for g in self.data["groups"])
        return f"View({groups})"


def _labels(tokens: Any, name: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, Tensor):
        tokens = tokens.reshape(-1).tolist()
    if isinstance(tokens, str) or not hasattr(tokens, "__iter__"):
        raise TypeError(f"{name} must be a sequence of token labels, got {type(tokens).__name__}")
    return [str(t) for t in tokens]


def _group_title(pattern: str, kind: str) -> str:
    stack = pattern.split(".")[0]
    side = "" if stack == "blocks" else stack.replace("_blocks", "") + " "
    return f"{side}{kind}-attention"


def _summaries_from_captured(cap: Captured, layers: Any, batch: int, top_k: int,
                             block_rows: int) -> list[LayerSummary]:  # fmt: skip
    names = match_names(cap.layers, layers, "layers", allow_int=True)
    weights = cap.weights
    pairs = sum(weights[n].shape[1] * weights[n].shape[2] for n in names)
    out = []
    for name in names:
        w = weights[name][batch]  # (H', T, S)
        T, S = w.shape[1:]
        s = LayerSummary(name, cap.kinds[name], cap.heads[name], T, S,
                         k=choose_top_k(top_k, S, pairs))  # fmt: skip
        for i0 in range(0, T, block_rows):
            s.add(i0, w[:, i0 : i0 + block_rows])
        out.append(s)
    return out


@torch.no_grad()
def _summaries_from_model(model: nn.Module, ids: Any, target: Any, kwargs: Any, layers: Any,
                          heads: Any, batch: int, top_k: int,
                          block_rows: int) -> list[LayerSummary]:  # fmt: skip
    found = attention_layers(model)
    names = match_names(list(found), layers, "layers", allow_int=True)
    summaries: dict[str, LayerSummary] = {}
    head_lists = {n: check_heads(heads, found[n].num_heads, n) for n in names}

    def on_call(name: str, inputs) -> None:
        if name in summaries:
            raise ValueError(f"{name} ran twice in one forward pass; capture() it instead")
        T, S = inputs.query.shape[2], inputs.key.shape[2]
        kind = "cross" if inputs.cross else "causal self" if inputs.is_causal else "self"
        pairs = T * len(head_lists[name]) * len(names)  # the page's query × head pairs
        s = LayerSummary(name, kind, head_lists[name], T, S, k=choose_top_k(top_k, S, pairs))
        for i0, block in weight_blocks(inputs, head_lists[name], block_rows=block_rows):
            s.add(i0, block[batch])  # (H', n, S)
        summaries[name] = s

    handles = [found[n].hook_inputs.add_hook(lambda x, _p, n=n: on_call(n, x)) for n in names]
    try:
        run_model(model, ids, target, kwargs)
    finally:
        for h in handles:
            h.remove()
    return [summaries[n] for n in names if n in summaries]


def view(
    source: nn.Module | Captured,
    tokens: Any = None,
    path: str | os.PathLike | None = None,
    *,
    target_tokens: Any = None,
    input_ids: Tensor | None = None,
    target: Tensor | None = None,
    layers: Any = None,
    heads: Any = None,
    batch: int = 0,
    top_k: int = 12,
    title: str | None = None,
    block_rows: int = 256,
    model_kwargs: dict[str, Any] | None = None,
) -> View:
    """Build the viewer for a model run or for weights already captured, and save it.

    Args:
        source: a :class:`Captured` (from :func:`qkv.inspect.capture`), or a qkv model,
            which is run once on ``input_ids`` (and ``target`` for an encoder-decoder) while
            each layer's weights are rebuilt and compressed a block of rows at a time.
        tokens: labels of the input positions (a list of strings), or, for a model without
            ``input_ids``, the ``(B, T)`` ids themselves (labelled by their values).
        path: write the HTML file here (None: only return the :class:`View`).
        target_tokens: labels of an encoder-decoder's target positions.
        input_ids, target: the model's inputs (models only).
        layers: which attention layers (names, glob patterns or indices; None: all).
        heads: which heads (models only; a :class:`Captured` shows what it holds).
        batch: the batch row shown.
        top_k: lines per query and head (lowered on huge inputs to keep the page small).
        title: the page title.
        block_rows: query rows processed at once (bounds memory on long inputs).
        model_kwargs: more arguments of the model's forward (e.g. ``attention_mask``).

    Returns:
        a :class:`View`.

    Raises:
        TypeError: a source that is neither a module nor a :class:`Captured`; labels that
            are not a sequence.
        ValueError: no inputs for a model, fewer labels than positions, bad ``layers``,
            ``heads`` or ``batch``, no attention layer captured.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be an int >= 0, got {batch!r}")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")
    if isinstance(source, Captured):
        summaries = _summaries_from_captured(source, layers, batch, top_k, block_rows)
    elif isinstance(source, nn.Module):
        if input_ids is None and isinstance(tokens, Tensor):
            input_ids, tokens = tokens, tokens[batch] if tokens.dim() == 2 else tokens
        if input_ids is None:
            raise ValueError(
                "view(model, ...) needs the model's input: input_ids= (or ids as tokens)"
            )
        if target is not None and target_tokens is None:
            target_tokens = target[batch]
        summaries = _summaries_from_model(source, input_ids, target, model_kwargs, layers,
                                          heads, batch, top_k, block_rows)  # fmt: skip
    else:
        raise TypeError(f"source must be a model or a Captured, got {type(source).__name__}")
    if not summaries:
        raise ValueError("no attention layer was captured, so there is nothing to view")
    v = View(_page_data(summaries, _labels(tokens, "tokens"),
                        _labels(target_tokens, "target_tokens"), title))  # fmt: skip
    if path is not None:
        v.save(path)
    return v


def _page_data(summaries: list[LayerSummary], source: list[str] | None,
               target: list[str] | None, title: str | None) -> dict[str, Any]:  # fmt: skip
    """Group the layers (one group per stack and sublayer) and attach the token labels."""
    groups: dict[str, dict[str, Any]] = {}
    need = {"source": 0, "target": 0}
    for s in summaries:
        pattern = re.sub(r"\.\d+\.", ".*.", s.name)
        q, k = query_side(s.name), key_side(s.name, s.kind)
        need[q], need[k] = max(need[q], s.T), max(need[k], s.S)
        g = groups.setdefault(pattern, {"title": _group_title(pattern, s.kind), "kind": s.kind,
                                        "q": q, "k": k, "layers": []})  # fmt: skip
        if s.kind == "causal self":
            g["kind"], g["title"] = s.kind, _group_title(pattern, s.kind)
        g["layers"].append(s.to_json())
    labels: dict[str, list[str]] = {}
    for side, given in (("source", source), ("target", target)):
        if given is not None and len(given) < need[side]:
            raise ValueError(
                f"{'tokens' if side == 'source' else 'target_tokens'} has {len(given)} labels "
                f"but the attention covers {need[side]} positions"
            )
        labels[side] = given[: need[side]] if given else [str(i) for i in range(need[side])]
    return {"title": title or "qkv attention viewer", "tokens": labels,
            "groups": list(groups.values())}  # fmt: skip
