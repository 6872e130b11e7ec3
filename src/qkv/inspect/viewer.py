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
* **neuron view**: for one query/key pair of one head, the ``D`` terms ``q_i ⊙ k_j · scale``
  whose sum is the pre-softmax score (:mod:`qkv.inspect.neuron`), and that query's scores
  over every key.
* **generation timeline** (with ``timeline=``, a :func:`qkv.inspect.record_generation`
  record): the text grows one token per step; a slider scrubs the steps and each token is
  shaded by the new token's attention to it, per layer and head.

Keys need not be tokens: ``key_axis="time"`` with ``frame_seconds`` labels the source side
(the keys of cross-attention, e.g. Whisper's 1,500 encoder frames) ``"0.00 s"``, ``"0.02 s"``,
..., and the page draws it as a time axis.

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

from qkv.checks import is_number
from qkv.inspect.adapters import key_side, query_side, run_model
from qkv.inspect.capture import Captured
from qkv.inspect.files import atomic_write
from qkv.inspect.hookpoints import attention_layers, match_names
from qkv.inspect.labels import readable_tokens
from qkv.inspect.neuron import NeuronPages
from qkv.inspect.timeline import Generation
from qkv.inspect.viewer_data import LayerSummary, choose_top_k, time_bins, time_labels
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


# The page's script: the viewer and its views, inlined in this order inside one closure.
SCRIPTS = ("viewer.js", "timeline.js", "neuron.js")


class View:
    """A rendered viewer: :meth:`save` writes the HTML file, Jupyter shows it inline
    (:meth:`notebook_html`), :meth:`fragment` embeds it in a page of your own.

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
            f"<script>(function(){{{''.join(_static(n) + chr(10) for n in SCRIPTS)}"
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

    def notebook_html(self, height: int = 640) -> str:
        """The viewer as notebooks show it: an ``iframe`` whose ``srcdoc`` is the whole page
        (:meth:`html`), scripts allowed inside its sandbox and nothing else. Jupyter
        Notebook, JupyterLab, VS Code and an nbconvert export all isolate or sanitise output
        HTML differently; a sandboxed ``srcdoc`` frame runs the viewer's script the same way
        in each (the form plotly's and folium's notebook renderers use), and two views in one
        notebook cannot touch each other."""
        return (
            f'<iframe class="qkv-frame" sandbox="allow-scripts" srcdoc="{html.escape(self.html())}"'
            f' style="width: 100%; height: {int(height)}px; border: 0;"'
            ' title="qkv attention viewer"></iframe>'
        )

    def _repr_html_(self) -> str:
        return self.notebook_html()

    def __repr__(self) -> str:
        parts = [f"{g['title']} ({len(g['layers'])} layers)" for g in self.data["groups"]]
        if self.data.get("timeline"):
            parts.append(f"timeline ({self.data['timeline']['steps']} steps)")
        return f"View({', '.join(parts)})"


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


def _bins(axis: dict[str, Any] | None, name: str, kind: str) -> tuple[int, int]:
    """Frames grouped per row of a layer's query and key sides (1: one row per position)."""
    b = 1 if axis is None else axis.get("frames", 1)
    return (b if query_side(name) == "source" else 1,
            b if key_side(name, kind) == "source" else 1)


def _summaries_from_captured(cap: Captured, layers: Any, batch: int, top_k: int, block_rows: int,
                             pages: NeuronPages | None,
                             axis: dict[str, Any] | None = None) -> list[LayerSummary]:  # fmt: skip
    """Summaries of the captured layers; their first call's inputs go to the neuron view
    when the capture kept them (``keep_inputs=True``)."""
    names = match_names(cap.layers, layers, "layers", allow_int=True)
    weights = cap.weights
    pairs = sum(weights[n].shape[1] * weights[n].shape[2] for n in names)
    out = []
    for name in names:
        w = time_bins(weights[name][batch], *_bins(axis, name, cap.kinds[name]))  # (H', T, S)
        T, S = w.shape[1:]
        s = LayerSummary(name, cap.kinds[name], cap.heads[name], T, S,
                         k=choose_top_k(top_k, S, pairs))  # fmt: skip
        for i0 in range(0, T, block_rows):
            s.add(i0, w[:, i0 : i0 + block_rows])
        out.append(s)
    # Only a single-call layer's queries line up with its weights' rows.
    for name in names:
        if pages is not None and len(cap.inputs.get(name, ())) == 1:
            pages.add(name, cap.inputs[name][0], cap.heads[name], batch)
    return out


@torch.no_grad()
def _summaries_from_model(model: nn.Module, ids: Any, target: Any, kwargs: Any, layers: Any,
                          heads: Any, batch: int, top_k: int, block_rows: int,
                          pages: NeuronPages | None,
                          axis: dict[str, Any] | None = None) -> list[LayerSummary]:  # fmt: skip
    found = attention_layers(model)
    names = match_names(list(found), layers, "layers", allow_int=True)
    summaries: dict[str, LayerSummary] = {}
    head_lists = {n: check_heads(heads, found[n].num_heads, n) for n in names}

    def on_call(name: str, inputs) -> None:
        if name in summaries:
            raise ValueError(f"{name} ran twice in one forward pass; capture() it instead")
        kind = "cross" if inputs.cross else "causal self" if inputs.is_causal else "self"
        bq, bk = _bins(axis, name, kind)
        T, S = -(-inputs.query.shape[2] // bq), -(-inputs.key.shape[2] // bk)  # rows shown
        pairs = T * len(head_lists[name]) * len(names)  # the page's query × head pairs
        s = LayerSummary(name, kind, head_lists[name], T, S, k=choose_top_k(top_k, S, pairs))
        rows = -(-block_rows // bq) * bq  # whole groups of frames in each block
        for i0, block in weight_blocks(inputs, head_lists[name], block_rows=rows):
            s.add(i0 // bq, time_bins(block[batch], bq, bk))  # (H', n, S)
        summaries[name] = s
        if pages is not None:
            pages.add(name, inputs, head_lists[name], batch)

    handles = [found[n].hook_inputs.add_hook(lambda x, _p, n=n: on_call(n, x)) for n in names]
    try:
        run_model(model, ids, target, kwargs)
    finally:
        for h in handles:
            h.remove()
    return [summaries[n] for n in names if n in summaries]


def view(
    source: nn.Module | Captured | Generation,
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
    timeline: Generation | None = None,
    neuron: bool = True,
    key_axis: str = "tokens",
    frame_seconds: float | None = None,
    time_bin: float | None = None,
    readable: bool = True,
) -> View:
    """Build the viewer for a model run or for weights already captured, and save it.

    Args:
        source: a :class:`Captured` (from :func:`qkv.inspect.capture`), or a qkv model,
            which is run once on ``input_ids`` (and ``target`` for an encoder-decoder) while
            each layer's weights are rebuilt and compressed a block of rows at a time, or a
            :class:`~qkv.inspect.timeline.Generation` alone (a page with only its timeline).
        tokens: labels of the input positions (a list of strings: tokenizer pieces such as
            ``Ġprinting`` are shown readable, :func:`qkv.inspect.labels.readable_tokens`), or,
            for a model without ``input_ids``, the ``(B, T)`` ids themselves (labelled by
            their values).
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
        timeline: a :func:`~qkv.inspect.record_generation` record to show as the generation
            timeline; its ``P + N`` labels are ``tokens`` when they are that many, else ids.
        neuron: include the neuron view's ``q``/``k`` vectors (a model, or a capture made
            with ``keep_inputs=True``; layers in order within
            :data:`~qkv.inspect.neuron.NEURON_BUDGET` floats).
        key_axis: ``"tokens"``, or ``"time"``: the source side (the keys of
            cross-attention; both sides of an encoder's self-attention) is a time axis,
            position ``i`` labelled ``i · frame_seconds`` (``"0.02 s"``); ``tokens`` must
            then be None.
        time_bin: with ``key_axis="time"``, seconds per row of the time side: frames are
            grouped (a key's weights summed, a query's averaged) so long audio fits one
            screen (``qkv inspect`` on Whisper: 0.5 s, 60 rows for a 30 s window instead of
            1,500). None: one row per frame.
        frame_seconds: seconds per source position (with ``key_axis="time"``; Whisper's
            encoder: 0.02).
        readable: show token labels through :func:`qkv.inspect.labels.readable_tokens`
            (False: exactly as given).

    Returns:
        a :class:`View`.

    Raises:
        TypeError: a source that is neither a module, a :class:`Captured` nor a
            :class:`Generation`; labels that are not a sequence.
        ValueError: no inputs for a model, fewer labels than positions, bad ``layers``,
            ``heads``, ``batch``, ``key_axis`` or ``frame_seconds``, no attention layer
            captured, a timeline over the page's budget.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch must be an int >= 0, got {batch!r}")
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")
    axis = _axis(key_axis, frame_seconds, tokens, time_bin)
    pages = NeuronPages() if neuron else None
    if isinstance(source, Generation):
        if timeline is not None:
            raise ValueError("give the Generation either as source or as timeline=, not both")
        summaries, timeline = [], source
    elif isinstance(source, Captured):
        summaries = _summaries_from_captured(source, layers, batch, top_k, block_rows, pages,
                                             axis)
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
                                          heads, batch, top_k, block_rows, pages,
                                          axis)  # fmt: skip
    else:
        raise TypeError("source must be a model, a Captured or a Generation, got "
                        f"{type(source).__name__}")  # fmt: skip
    if timeline is not None and not isinstance(timeline, Generation):
        raise TypeError(f"timeline must be a Generation (record_generation), got "
                        f"{type(timeline).__name__}")  # fmt: skip
    if not summaries and timeline is None:
        raise ValueError("no attention layer was captured, so there is nothing to view")
    labels = _labels(tokens, "tokens")
    data = _page_data(summaries, labels, _labels(target_tokens, "target_tokens"), title, axis,
                      readable=readable)  # fmt: skip
    if timeline is not None:
        n = int(timeline.ids.numel())
        ids_labels = [str(i) for i in timeline.ids.tolist()]
        data["timeline"] = timeline.page_data(labels if labels and len(labels) >= n else ids_labels)
    if pages is not None and (pages.layers or pages.left_out):
        data["neuron"], data["neuronLeftOut"] = pages.layers, pages.left_out
    v = View(data)
    if path is not None:
        v.save(path)
    return v


def _axis(key_axis: Any, frame_seconds: Any, tokens: Any,
          time_bin: Any = None) -> dict[str, Any] | None:  # fmt: skip
    """The source side's axis for the page: None (tokens) or ``{"kind": "time", "seconds"
    per row, "unit", and "frames" per row when grouped}``."""
    if key_axis == "tokens":
        if frame_seconds is not None or time_bin is not None:
            raise ValueError("frame_seconds and time_bin are only for key_axis='time'")
        return None
    if key_axis != "time":
        raise ValueError(f"key_axis must be 'tokens' or 'time', got {key_axis!r}")
    if not is_number(frame_seconds) or frame_seconds <= 0:
        raise ValueError(f"key_axis='time' needs frame_seconds, a number > 0 (seconds per "
                         f"source position), got {frame_seconds!r}")  # fmt: skip
    if tokens is not None:
        raise ValueError("key_axis='time' labels the source side by time: give tokens=None")
    if time_bin is None:
        return {"kind": "time", "seconds": float(frame_seconds), "unit": "s"}
    if not is_number(time_bin) or not time_bin >= frame_seconds or time_bin > 3600:
        raise ValueError(f"time_bin must be a number of seconds from frame_seconds="
                         f"{frame_seconds} to 3600, got {time_bin!r}")
    frames = round(time_bin / frame_seconds)
    return {"kind": "time", "seconds": frames * float(frame_seconds), "unit": "s",
            "frames": frames}


def _page_data(summaries: list[LayerSummary], source: list[str] | None,
               target: list[str] | None, title: str | None,
               axis: dict[str, Any] | None = None, *,
               readable: bool = True) -> dict[str, Any]:  # fmt: skip
    """Group the layers (one group per stack and sublayer) and attach the position labels."""
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
    if axis is not None:
        source = time_labels(need["source"], axis["seconds"])
    labels: dict[str, list[str]] = {}
    for side, given in (("source", source), ("target", target)):
        if given is not None and len(given) < need[side]:
            raise ValueError(
                f"{'tokens' if side == 'source' else 'target_tokens'} has {len(given)} labels "
                f"but the attention covers {need[side]} positions"
            )
        if readable and given and not (side == "source" and axis is not None):
            given = readable_tokens(given)
        labels[side] = given[: need[side]] if given else [str(i) for i in range(need[side])]
    axes = {"source": axis or {"kind": "tokens"}, "target": {"kind": "tokens"}}
    for g in groups.values():  # the page opens on the most focused head of each group
        scores = [(f, li, h) for li, lay in enumerate(g["layers"])
                  for h, f in zip(lay["heads"], lay["focus"], strict=True)]  # fmt: skip
        best = max(scores, default=None)
        if best is not None:
            g["open"] = {"layer": best[1], "head": best[2], "focus": best[0]}
    return {"title": title or "qkv attention viewer", "tokens": labels, "axes": axes,
            "groups": list(groups.values())}  # fmt: skip
