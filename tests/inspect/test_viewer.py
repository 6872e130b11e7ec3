"""The viewer's HTML and data (the browser tests are in test_browser.py)."""

from __future__ import annotations

import base64
import json
import re
from importlib import resources

import numpy as np
import pytest
import torch
from inspect_refs import build

import qkv.inspect as qi
from qkv.inspect.capture import Captured
from qkv.inspect.viewer import SCRIPTS
from qkv.inspect.viewer_data import TOPK_BUDGET, choose_top_k


def page_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" class="qkv-data">(.*?)</script>', html, re.S)
    assert m, "no data block"
    return json.loads(m.group(1))  # as the page: textContent to JSON.parse, nothing replaced


def arrays(layer: dict) -> tuple[np.ndarray, np.ndarray]:
    H, T, k = len(layer["heads"]), layer["T"], layer["k"]
    dtype = "<u2" if layer["idxBytes"] == 2 else "<u4"
    idx = np.frombuffer(base64.b64decode(layer["idx"]), dtype=dtype).reshape(H, T, k)
    w = np.frombuffer(base64.b64decode(layer["w"]), dtype=np.uint8).reshape(H, T, k)
    return idx, w


@pytest.fixture(scope="module")
def seq2seq_view():
    model, run = build("seq2seq")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    v = qi.view(cap, [f"s{i}" for i in range(9)], target_tokens=[f"t{i}" for i in range(7)],
                batch=1, top_k=4)  # fmt: skip
    return cap, v, model, run


def test_page_is_offline_and_self_contained(tmp_path, seq2seq_view):
    _, v, _, _ = seq2seq_view
    path = v.save(tmp_path / "deep" / "view.html")
    html = path.read_text(encoding="utf-8")
    assert path == v.path and html.startswith("<!DOCTYPE html>")
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert not re.search(r"https?://|<link|<script[^>]*\bsrc=|@import|url\(", html), (
        "the page refers to something outside itself"
    )


def test_groups_labels_and_topk_equal_the_captured_weights(seq2seq_view):
    cap, v, _, _ = seq2seq_view
    data = page_data(v.html())
    assert [g["title"] for g in data["groups"]] == [
        "encoder self-attention", "decoder causal self-attention", "decoder cross-attention"]
    assert data["tokens"]["source"][:2] == ["s0", "s1"] and len(data["tokens"]["target"]) == 7
    assert [(g["q"], g["k"]) for g in data["groups"]] == [
        ("source", "source"), ("target", "target"), ("target", "source")]
    for g in data["groups"]:
        for layer in g["layers"]:
            w_true = cap.weights[layer["name"]][1].double().numpy()  # (H, T, S)
            idx, w = arrays(layer)
            assert layer["k"] == 4
            decoded = (w / 255.0) ** 2  # the square-root code of viewer_data.py
            got = np.take_along_axis(w_true, idx.astype(np.int64), axis=-1)  # (H, T, k)
            kept = w > 0
            bound = (2 * np.sqrt(got) + 0.5 / 255) * (0.5 / 255) + 1e-9
            assert (np.abs(got - decoded)[kept] <= bound[kept]).all(), layer["name"]
            top = -np.sort(-w_true, axis=-1)[..., :4]
            assert (np.abs(top - decoded) <= (2 * np.sqrt(top) + 0.5 / 255) * (0.5 / 255) + 1e-9).all()


def test_detail_picture_is_the_matrix_scaled_to_its_maximum(seq2seq_view):
    cap, v, _, _ = seq2seq_view
    layer = page_data(v.html())["groups"][0]["layers"][0]
    d = layer["detail"]
    assert (d["r"], d["c"]) == (9, 9)  # small enough to be shown whole
    pic = np.frombuffer(base64.b64decode(d["data"]), dtype=np.uint8).reshape(3, 9, 9)
    w = cap.weights[layer["name"]][1].double()
    expected = torch.round(w / w.flatten(1).amax(1)[:, None, None] * 255).numpy()
    assert np.abs(pic - expected).max() <= 1
    assert d["max"] == pytest.approx(w.flatten(1).amax(1).tolist(), rel=1e-6)


def test_view_of_a_model_equals_view_of_its_capture(seq2seq_view):
    _, v, model, run = seq2seq_view
    src, tgt = run.args
    direct = qi.view(model, [f"s{i}" for i in range(9)], input_ids=src, target=tgt,
                     target_tokens=[f"t{i}" for i in range(7)], batch=1, top_k=4,
                     block_rows=4)  # fmt: skip
    a, b = page_data(v.html()), page_data(direct.html())
    for ga, gb in zip(a["groups"], b["groups"], strict=True):
        for la, lb in zip(ga["layers"], gb["layers"], strict=True):
            (ia, wa), (ib, wb) = arrays(la), arrays(lb)
            assert np.array_equal(wa, wb), la["name"]
            assert np.array_equal(ia[wa > 1], ib[wb > 1]), la["name"]
            assert la["detail"]["max"] == pytest.approx(lb["detail"]["max"], rel=1e-6)
    ids_view = qi.view(model, src, target=tgt, heads=[0])  # ids as labels, one head
    data = page_data(ids_view.html())
    assert data["tokens"]["source"] == [str(int(i)) for i in src[0]]
    assert all(layer["heads"] == [0] for g in data["groups"] for layer in g["layers"])


def test_fragments_are_independent_and_show_in_jupyter(seq2seq_view):
    import html as html_mod

    _, v, _, _ = seq2seq_view
    a, b = v.fragment(), v.fragment()
    ids = [re.search(r'id="(qkv-view-[0-9a-f]+)"', f).group(1) for f in (a, b)]
    assert ids[0] != ids[1] and all(i in f for i, f in zip(ids, (a, b), strict=True))
    assert a.startswith('<div class="qkv-viewer"') and "<html" not in a
    # Jupyter: a sandboxed frame holding the whole page (scripts run inside, nothing else)
    frame = v._repr_html_()
    doc = re.fullmatch(r'<iframe class="qkv-frame" sandbox="allow-scripts" srcdoc="([^"]*)".*'
                       r"</iframe>", frame, flags=re.S)
    assert doc is not None, frame[:200]
    page = html_mod.unescape(doc.group(1))
    assert page.startswith("<!DOCTYPE html>") and page_data(page) == page_data(v.html())
    assert "View(encoder self-attention (2 layers)" in repr(v)


def test_labels_are_escaped_inside_the_page():
    model, run = build("gpt2")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    evil = ["</script><script>alert(1)</script>"] + [f"w{i}" for i in range(10)]
    html = qi.view(cap, evil).html()
    assert "</script><script>alert(1)" not in html
    assert page_data(html)["tokens"]["source"][0] == evil[0]


def test_top_k_shrinks_to_fit_the_page_budget():
    assert choose_top_k(12, 5, 10) == 5  # never more than the keys
    assert choose_top_k(12, 4096, 2 * 4 * 4096) == 12
    assert choose_top_k(12, 4096, 30 * 9 * 4096) == TOPK_BUDGET // (30 * 9 * 4096)
    assert choose_top_k(12, 10**6, 10**9) == 1


def test_view_errors():
    model, run = build("gpt2")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    with pytest.raises(ValueError, match="tokens has 3 labels but the attention covers 11"):
        qi.view(cap, ["a", "b", "c"])
    with pytest.raises(TypeError, match="source must be a model, a Captured or a Generation, got str"):
        qi.view("model", ["a"])
    with pytest.raises(ValueError, match=r"needs the model's input: input_ids="):
        qi.view(model, ["a", "b"])
    with pytest.raises(ValueError, match="batch must be an int >= 0, got -1"):
        qi.view(cap, None, batch=-1)
    with pytest.raises(TypeError, match="tokens must be a sequence of token labels, got str"):
        qi.view(cap, "abc")
    with pytest.raises(ValueError, match="layers 'x' matches no name"):
        qi.view(cap, None, layers="x")
    with pytest.raises(ValueError, match=r"heads holds 7, but blocks\.0\.self_attn has H=3"):
        qi.view(model, run.args[0], heads=7)


def whisper_like_capture(frames: int = 1500, T: int = 5, H: int = 2) -> Captured:
    """Synthetic weights shaped like Whisper's decoder: causal self-attention over the tokens
    and cross-attention over ``frames`` encoder frames (rows of a softmax)."""
    g = torch.Generator().manual_seed(0)
    cap = Captured()
    causal = torch.full((T, T), float("-inf")).triu(1)  # (T, T)
    for name, kind, S, bias in (("decoder_blocks.0.self_attn", "causal self", T, causal),
                                ("decoder_blocks.0.cross_attn", "cross", frames, 0.0)):  # fmt: skip
        scores = torch.randn(1, H, T, S, generator=g) * 3 + bias  # (1, H, T, S)
        cap.calls[name], cap.kinds[name] = [torch.softmax(scores, -1)], kind
        cap.heads[name], cap.num_heads[name] = list(range(H)), H
    return cap


def test_time_axis_labels_the_keys_in_seconds():
    cap = whisper_like_capture()
    tokens = ["<|sot|>", "He", "llo", " world", "."]
    v = qi.view(cap, None, target_tokens=tokens, key_axis="time", frame_seconds=0.02)
    data = page_data(v.html())
    src = data["tokens"]["source"]
    assert len(src) == 1500 and src[:3] == ["0.00 s", "0.02 s", "0.04 s"] and src[-1] == "29.98 s"
    assert data["tokens"]["target"] == ["⟨sot⟩", "He", "llo", "·world", "."]  # readable
    assert data["axes"] == {"source": {"kind": "time", "seconds": 0.02, "unit": "s"},
                            "target": {"kind": "tokens"}}  # fmt: skip
    cross = data["groups"][1]
    assert (cross["kind"], cross["q"], cross["k"]) == ("cross", "target", "source")
    idx, _ = arrays(cross["layers"][0])
    top = cap.weights["decoder_blocks.0.cross_attn"][0].argmax(-1)  # (H, T)
    assert np.array_equal(idx[..., 0], top.numpy()), "the strongest frame is not line 0"
    for seconds, first in ((0.0005, ["0.0000 s", "0.0005 s"]), (0.025, ["0.000 s", "0.025 s"])):
        fine = qi.view(cap, None, key_axis="time", frame_seconds=seconds).data["tokens"]["source"]
        assert fine[:2] == first, fine[:2]
    plain = page_data(qi.view(cap, None).html())
    assert plain["tokens"]["source"][:2] == ["0", "1"] and plain["axes"]["source"]["kind"] == "tokens"


def test_a_time_bin_groups_frames_so_the_audio_fits_one_screen():
    """Issue 27: the Whisper viewer listed 1,500 frames one per row. time_bin=0.5 groups 25
    frames a row: 60 rows for 30 s, each key row the sum of its frames' weights (rows still
    sum to 1), and the model path gives what the captured path gives."""
    cap = whisper_like_capture()
    v = qi.view(cap, None, key_axis="time", frame_seconds=0.02, time_bin=0.5)
    data = page_data(v.html())
    src = data["tokens"]["source"]
    assert len(src) == 60 and src[:2] == ["0.00 s", "0.50 s"] and src[-1] == "29.50 s"
    assert data["axes"]["source"] == {"kind": "time", "seconds": 0.5, "unit": "s", "frames": 25}
    cross = data["groups"][1]["layers"][0]
    assert (cross["T"], cross["S"]) == (5, 60)
    w = cap.weights["decoder_blocks.0.cross_attn"][0]  # (H, T, 1500)
    idx, _ = arrays(cross)
    assert np.array_equal(idx[..., 0], w.unflatten(-1, (60, 25)).sum(-1).argmax(-1).numpy())
    model, run = build("seq2seq")  # the encoder's side as a "time" axis, both paths
    with qi.capture(model) as cap2, torch.no_grad():
        run()
    kw = dict(key_axis="time", frame_seconds=0.02, time_bin=0.06, neuron=False)  # 3 frames
    a = qi.view(cap2, None, **kw).data
    b = qi.view(model, None, input_ids=run.args[0], target=run.args[1], block_rows=4, **kw).data
    S = run.args[0].shape[1]
    assert a["tokens"]["source"] == b["tokens"]["source"]
    assert len(a["tokens"]["source"]) == -(-S // 3)  # 3 frames a row
    for ga, gb in zip(a["groups"], b["groups"], strict=True):
        for la, lb in zip(ga["layers"], gb["layers"], strict=True):
            assert (la["T"], la["S"], la["idx"]) == (lb["T"], lb["S"], lb["idx"]), la["name"]


def test_time_axis_errors():
    cap = whisper_like_capture(frames=20)
    with pytest.raises(ValueError, match="key_axis must be 'tokens' or 'time', got 'frames'"):
        qi.view(cap, None, key_axis="frames")
    with pytest.raises(ValueError, match="key_axis='time' needs frame_seconds, a number > 0"):
        qi.view(cap, None, key_axis="time")
    with pytest.raises(ValueError, match=r"needs frame_seconds.*got -1"):
        qi.view(cap, None, key_axis="time", frame_seconds=-1)
    with pytest.raises(ValueError, match="frame_seconds and time_bin are only for key_axis"):
        qi.view(cap, None, frame_seconds=0.02)
    with pytest.raises(ValueError, match=r"time_bin must be a number of seconds from"):
        qi.view(cap, None, key_axis="time", frame_seconds=0.02, time_bin=0.001)
    with pytest.raises(ValueError, match="give tokens=None"):
        qi.view(cap, ["a"] * 20, key_axis="time", frame_seconds=0.02)


def test_every_inlined_script_is_in_the_page_and_cannot_end_its_element(seq2seq_view):
    page = seq2seq_view[1].html()
    for name in (*SCRIPTS, "viewer.css"):
        text = (resources.files("qkv.inspect") / "static" / name).read_text(encoding="utf-8")
        low = text.lower()
        assert "</script" not in low and "</style" not in low and "<!--" not in low, name
        assert text in page, f"{name} is not inlined"
        assert not re.search(r"https?://|fetch\(|XMLHttpRequest|import\(", text), name
