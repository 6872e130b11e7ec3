"""Every figure qkv draws says what it shows: a colour bar with a label (or a legend), axis
names, tick labels that fit without overlapping on 200 tokens, and a rollout scale that is not
one bright column. The Figure objects are inspected (Agg canvas), not the pixels."""

from __future__ import annotations

import itertools

import pytest
import torch

from qkv.inspect import alignment, analysis_plots, figures, plots
from qkv.inspect.capture import Captured
from qkv.inspect.lens import LogitLens

T = 200
PIECES = [("Ġ" if i % 3 else "") + ["the", "quick", "brown", "fox", "jumps", "over"][i % 6]
          for i in range(T)]  # GPT-2 style pieces  # fmt: skip


@pytest.fixture
def drawn(monkeypatch):
    """Record every Figure the plot modules save (they still write their PNG)."""
    figs, paths = [], []
    real = plots.save

    def spy(fig, path):
        figs.append(fig)
        paths.append(real(fig, path))
        return paths[-1]

    for module in (plots, figures, analysis_plots, alignment):
        monkeypatch.setattr(module, "save", spy)
    yield figs
    for fig, path in zip(figs, paths, strict=True):  # what was written holds every text
        assert_texts_saved(fig, path)


def assert_texts_saved(fig, path):
    """Every visible text of ``fig`` (titles, axis and colour-bar labels, ticks) lies within
    the PNG written (issue 27: a colour-bar label ran off a one-row grid, an axis label off
    the logit lens): the file covers the figure and the box of all its texts."""
    renderer = fig.canvas.get_renderer()
    w, h = fig.get_size_inches()
    tight = fig.get_tightbbox(renderer)  # inches, texts included
    need_w = max(w, tight.x1) - min(0.0, tight.x0)
    need_h = max(h, tight.y1) - min(0.0, tight.y0)
    head = path.read_bytes()[16:24]  # the PNG's IHDR width and height
    got = (int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big"))
    want = (need_w * fig.dpi, need_h * fig.dpi)
    assert all(g >= x - 2 for g, x in zip(got, want, strict=True)), (path.name, got, want)


def sink_weights(B: int, H: int, Tq: int, S: int, seed: int, causal: bool) -> torch.Tensor:
    """Softmax weights ``(B, H, Tq, S)`` where the first key takes most of every row."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, H, Tq, S, generator=g)
    scores[..., 0] += 8.0  # an attention sink
    if causal:
        scores = scores.masked_fill(~torch.ones(Tq, S, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1)  # (B, H, Tq, S)


@pytest.fixture(scope="module")
def cap() -> Captured:
    c = Captured()
    for layer in range(4):
        name = f"blocks.{layer}.self_attn"
        c.calls[name] = [sink_weights(1, 2, T, T, layer, causal=True)]
        c.kinds[name], c.heads[name], c.num_heads[name] = "causal self", [0, 1], 2
    c.calls["decoder.0.cross_attn"] = [sink_weights(1, 2, 30, T, 9, causal=False)]
    c.kinds["decoder.0.cross_attn"] = "cross"
    c.heads["decoder.0.cross_attn"], c.num_heads["decoder.0.cross_attn"] = [0, 1], 2
    return c


def colorbars(fig):
    return [ax._colorbar for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


def legends(fig):
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]


def main_axes(fig):
    return [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is None]


def assert_no_overlap(fig, texts, what):
    """Consecutive tick labels' boxes do not intersect (in display pixels)."""
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_text()]
    for a, b in itertools.pairwise(boxes):
        wide, tall = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
        overlap = wide > 0.5 and tall > 0.5
        assert not overlap, f"{what}: tick labels overlap at {a} and {b}"


def assert_labelled(fig, name, *, ticks=True):
    bars = colorbars(fig)
    assert bars or legends(fig), f"{name}: no colour bar and no legend"
    for bar in bars:
        assert bar.ax.get_ylabel().strip(), f"{name}: a colour bar without a label"
    for ax in main_axes(fig):
        if not ticks:
            continue
        assert ax.get_xlabel().strip() and ax.get_ylabel().strip(), f"{name}: unnamed axis"
        for axis, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            texts = [t.get_text() for t in labels]
            assert texts and all(texts), f"{name}: empty {axis} tick labels {texts[:5]}"
            assert_no_overlap(fig, labels, f"{name} {axis}")


def test_head_alignment_rollout_on_200_tokens(tmp_path, drawn, cap):
    plots.plot_head(cap, tmp_path / "h.png", layer=1, head=1, q_tokens=PIECES)
    plots.plot_alignment(cap, tmp_path / "a.png", src_tokens=PIECES,
                         tgt_tokens=PIECES[:30])  # fmt: skip
    plots.plot_rollout(cap, tmp_path / "r.png", tokens=PIECES)
    for fig, name in zip(drawn, ("head", "alignment", "rollout"), strict=True):
        assert_labelled(fig, name)
        (ax,) = main_axes(fig)
        assert len(ax.get_xticklabels()) < T, f"{name}: 200 key labels were not thinned"
        assert "labelled" in ax.get_xlabel(), f"{name}: thinning not said: {ax.get_xlabel()!r}"
        assert all(t.get_rotation() == 90 for t in ax.get_xticklabels())
        shown = [t.get_text() for t in (*ax.get_xticklabels(), *ax.get_yticklabels())]
        assert not any("Ġ" in t for t in shown), f"{name}: raw GPT-2 pieces {shown[:6]}"
        assert "·quick" in shown or "·brown" in shown, f"{name}: spaces not marked {shown[:6]}"
    assert "cross-attention weight" in colorbars(drawn[1])[0].ax.get_ylabel()


def test_rollout_scale_shows_more_than_the_sink_column(tmp_path, drawn, cap):
    r = plots.rollout(cap)
    assert float(r[:, 0].mean()) > 0.9  # the sink takes nearly all of every row
    plots.plot_rollout(cap, tmp_path / "r.png", tokens=PIECES)
    (fig,) = drawn
    (ax,) = main_axes(fig)
    image = ax.images[0]
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    lower[:, 0] = False  # below the diagonal, outside the first column
    shown = torch.as_tensor(image.norm(r.numpy()).filled(0.0))[lower]  # colour positions
    linear = (r / r.max())[lower]
    assert float(linear.median()) < 0.01, "the case is not the one that looked blank"
    assert float(shown.median()) > 0.1, f"rollout still mostly dark: median {shown.median():.3f}"
    assert float(shown.std()) > 0.05, "rollout colours show no structure"
    label = colorbars(fig)[0].ax.get_ylabel()
    assert "log scale without key 0" in label and "key 0:" in label, label


def test_grid_has_a_colour_bar_saying_each_head_is_scaled(tmp_path, drawn, cap):
    plots.plot_grid(cap, tmp_path / "g.png")
    (fig,) = drawn
    (bar,) = colorbars(fig)
    assert "head's max" in bar.ax.get_ylabel()
    titles = [ax.get_title() for ax in main_axes(fig) if ax.get_title()]
    rows = [ax.get_ylabel() for ax in main_axes(fig) if ax.get_ylabel()]
    assert titles == ["head 0", "head 1"] and len(rows) == 5, (titles, rows)


def test_positions_and_masks(tmp_path, drawn):
    figures.plot_positions(tmp_path / "p.png", max_len=T, d_model=64)
    figures.plot_masks(tmp_path / "m.png", length=12, lengths=(12, 7))
    assert_labelled(drawn[0], "positions", ticks=False)
    (legend,) = legends(drawn[1])
    assert [t.get_text() for t in legend.get_texts()] == ["may attend (True)", "masked (False)"]
    for ax in drawn[1].axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_xticklabels()


def test_analysis_plots(tmp_path, drawn):
    g = torch.Generator().manual_seed(0)
    analysis_plots.plot_patching(torch.randn(4, T, generator=g), tmp_path / "p.png",
                                 tokens=PIECES, metric_label="logit difference")  # fmt: skip
    analysis_plots.plot_patching(torch.randn(4, 6, generator=g), tmp_path / "h.png",
                                 kind="head", center=0.0)  # fmt: skip
    analysis_plots.plot_head_attribution(torch.rand(4, 6, generator=g), tmp_path / "s.png",
                                         center=None, title="prefix matching")  # fmt: skip
    analysis_plots.plot_heatmap(torch.rand(5, 7, generator=g), tmp_path / "x.png",
                                col_label="column")  # fmt: skip
    lens = LogitLens(logits=torch.randn(3, 1, 12, 20, generator=g))
    analysis_plots.plot_logit_lens(lens, tmp_path / "l.png", tokens=PIECES[:12],
                                   token_names=lambda i: PIECES[i % T])  # fmt: skip
    names = ("patching", "patch heads", "attribution", "heatmap", "logit lens")
    lens_axes = main_axes(drawn[4])[0]
    cells = [t.get_text() for t in lens_axes.texts]
    assert cells and not any("Ġ" in t for t in cells), cells[:6]
    rows = [t.get_text() for t in lens_axes.get_yticklabels()]
    assert rows[0] == "block 0 in" and rows[-1] == "output", rows  # not tokens: unchanged
    columns = [t.get_text() for t in lens_axes.get_xticklabels()]
    assert columns[:3] == ["the", "·quick", "·brown"], columns[:3]
    for fig, name in zip(drawn, names, strict=True):
        assert_labelled(fig, name)
    assert colorbars(drawn[0])[0].ax.get_ylabel() == "logit difference"
    assert colorbars(drawn[2])[0].ax.get_ylabel() == "score"
    assert colorbars(drawn[4])[0].ax.get_ylabel() == "p(top token)"


def test_time_alignment(tmp_path, drawn):
    w = sink_weights(1, 1, 60, 1500, 3, causal=False)[0, 0]  # (T, frames)
    alignment.plot_time_alignment(w, tmp_path / "t.png", tokens=PIECES[:60],
                                  seconds_per_frame=0.02, duration=10.0)  # fmt: skip
    (fig,) = drawn
    bars = colorbars(fig)
    assert bars and bars[0].ax.get_ylabel() == "cross-attention weight"
    (ax,) = main_axes(fig)
    assert ax.get_xlabel() == "audio time (s)" and ax.get_ylabel().startswith("token")
    assert_no_overlap(fig, ax.get_yticklabels(), "time alignment y")
