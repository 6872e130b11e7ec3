"""The viewer in a real browser: Debian's chromium, headless, driven by selenium.

``make browser`` installs what this needs (``apt-get install -y chromium chromium-driver`` and
``pip install selenium``); the tests skip, saying so, only where that cannot be installed.
The browser runs offline (network emulation), with a fresh profile.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from inspect_refs import build

import qkv.inspect as qi
from qkv.models import DecoderLM, DecoderLMConfig

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium (make browser)"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason=f"selenium missing: {INSTALL}")
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip(f"Debian's chromium/chromedriver not installed: {INSTALL}")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1200,900",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):  # fmt: skip
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    # No network at all: any request the page made would fail and be logged.
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0})  # fmt: skip
    yield driver
    driver.quit()


def _errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _canvas(driver, root_id: str, panel: str) -> str:
    return driver.execute_script(
        "return document.querySelector(arguments[0]).toDataURL()",
        f"#{root_id} .{panel} canvas.qkv-lines",
    )


def _attr(driver, root_id: str, panel: str, name: str) -> str:
    return driver.find_element("css selector", f"#{root_id} .{panel}").get_attribute(name)


@pytest.fixture(scope="module")
def two_viewers(tmp_path_factory):
    """One page holding two viewers: an encoder-decoder's and a decoder-only model's."""
    model, run = build("seq2seq")
    with qi.capture(model) as cap, torch.no_grad():
        run()
    a = qi.view(cap, [f"s{i}" for i in range(9)], target_tokens=[f"t{i}" for i in range(7)])
    lm, lm_run = build("gpt2")
    with qi.capture(lm) as cap2, torch.no_grad():
        lm_run()
    b = qi.view(cap2, [f"w{i}" for i in range(11)])
    page = a.html().replace("</body>", b.fragment() + "</body>")
    path = tmp_path_factory.mktemp("viewer") / "two.html"
    path.write_text(page, encoding="utf-8")
    return path


def test_opens_offline_without_errors_and_reacts(browser, two_viewers):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    browser.get(two_viewers.as_uri())
    roots = browser.execute_script(
        "return [...document.querySelectorAll('.qkv-viewer')].map(r => [r.id, r.dataset.ready])")
    assert len(roots) == 2 and all(ready == "1" for _, ready in roots), roots
    (a, _), (b, _) = roots
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert _errors(browser) == []

    # An encoder-decoder's page opens on the cross-attention; the head view opens on one head.
    assert browser.find_element("css selector", f"#{a} .qkv-cross").get_attribute(
        "class").split()[-1] == "qkv-on"  # fmt: skip
    browser.find_elements("css selector", f"#{a} .qkv-tabs button")[0].click()
    chips = browser.find_elements("css selector", f"#{a} .qkv-head .qkv-chip")
    assert sum("qkv-off" not in c.get_attribute("class") for c in chips) == 1
    browser.find_element("css selector", f"#{a} .qkv-head .qkv-controls button").click()  # all
    chips = browser.find_elements("css selector", f"#{a} .qkv-head .qkv-chip")
    assert all("qkv-off" not in c.get_attribute("class") for c in chips)

    # Hovering a query token focuses it: other lines go, the drawing changes.
    before = (_canvas(browser, a, "qkv-head"), _attr(browser, a, "qkv-head", "data-lines"))
    b_draws = _attr(browser, b, "qkv-head", "data-draws")
    token = browser.find_elements("css selector", f"#{a} .qkv-head .qkv-left .qkv-tok")[2]
    ActionChains(browser).move_to_element(token).perform()
    assert _attr(browser, a, "qkv-head", "data-focus") == "q2"
    after = (_canvas(browser, a, "qkv-head"), _attr(browser, a, "qkv-head", "data-lines"))
    assert after[0] != before[0] and int(after[1]) < int(before[1]), (before[1], after[1])
    assert "qkv-focus" in token.get_attribute("class")
    assert _attr(browser, b, "qkv-head", "data-draws") == b_draws, "the other viewer redrew"

    # Hovering a key token shows the lines into it.
    key = browser.find_elements("css selector", f"#{a} .qkv-head .qkv-right .qkv-tok")[4]
    ActionChains(browser).move_to_element(key).perform()
    assert _attr(browser, a, "qkv-head", "data-focus") == "k4"

    # Switching the layer changes the drawing (focus cleared first by leaving the stage).
    ActionChains(browser).move_to_element(
        browser.find_element("css selector", f"#{a} .qkv-title")).perform()
    layer0 = _canvas(browser, a, "qkv-head")
    other = 1 - int(_attr(browser, a, "qkv-head", "data-layer"))  # it opened on either layer
    Select(browser.find_element("css selector", f"#{a} .qkv-head select.qkv-layer")
           ).select_by_index(other)  # fmt: skip
    assert _attr(browser, a, "qkv-head", "data-layer") == str(other)
    assert _canvas(browser, a, "qkv-head") != layer0

    # Turning a head off removes its lines.
    lines = int(_attr(browser, a, "qkv-head", "data-lines"))
    browser.find_element("css selector", f"#{a} .qkv-head .qkv-chip[data-head='0']").click()
    assert int(_attr(browser, a, "qkv-head", "data-lines")) < lines

    # Model view: a thumbnail per layer × head; clicking one opens it.
    browser.find_elements("css selector", f"#{a} .qkv-tabs button")[1].click()
    thumbs = browser.find_elements("css selector", f"#{a} .qkv-model-view .qkv-grid canvas")
    assert len(thumbs) == 2 * 3  # the encoder's 2 layers × 3 heads
    thumbs[4].click()
    assert _attr(browser, a, "qkv-model-view", "data-open") == "1,1"

    # Cross-attention view: target queries, source keys.
    browser.find_elements("css selector", f"#{a} .qkv-tabs button")[2].click()
    assert int(_attr(browser, a, "qkv-cross", "data-lines")) > 0
    labels = [e.text for e in browser.find_elements(
        "css selector", f"#{a} .qkv-cross .qkv-right .qkv-tok") if e.text]  # fmt: skip
    assert labels[:2] == ["s0", "s1"]
    assert len(browser.find_elements("css selector", f"#{b} .qkv-tabs button")) == 2
    assert _errors(browser) == []


def test_stays_responsive_at_4096_tokens(browser, tmp_path):
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(50, d_model=16, num_layers=2, num_heads=2,
                                      max_len=4096)).eval()  # fmt: skip
    ids = torch.randint(0, 50, (1, 4096), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    v = qi.view(model, ids, tmp_path / "long.html")
    build_s = time.perf_counter() - start
    size_mb = v.path.stat().st_size / 1e6
    start = time.perf_counter()
    browser.get(v.path.as_uri())
    load_s = time.perf_counter() - start
    root = browser.execute_script("return document.querySelector('.qkv-viewer').id")
    timings = browser.execute_script(
        """
        const root = document.getElementById(arguments[0]);
        const panel = root.querySelector('.qkv-head');
        const t = {render: +root.dataset.renderMs};
        let s = performance.now();
        const tok = panel.querySelectorAll('.qkv-left .qkv-tok')[5];
        tok.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
        t.hover = performance.now() - s;
        t.focus = panel.dataset.focus;
        panel.querySelector('.qkv-stage').dispatchEvent(new MouseEvent('mouseleave'));
        const sel = panel.querySelector('select.qkv-layer');
        s = performance.now();
        sel.value = '1'; sel.dispatchEvent(new Event('change'));
        t.layer = performance.now() - s;
        t.layerShown = panel.dataset.layer;
        const keyTok = panel.querySelectorAll('.qkv-right .qkv-tok')[3];
        s = performance.now();
        keyTok.dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));
        t.keyHover = performance.now() - s;
        return t;
        """,
        root,
    )
    # Scrolling to the middle draws the rows there.
    browser.execute_script(
        "document.querySelector('#' + arguments[0] + ' .qkv-head .qkv-scroll').scrollTop = 2048 * 18",
        root)  # fmt: skip
    time.sleep(0.2)
    shown = [int(e.get_attribute("data-index")) for e in browser.find_elements(
        "css selector", f"#{root} .qkv-head .qkv-left .qkv-tok") if e.is_displayed()]  # fmt: skip
    print(f"\n4096 tokens, 2 layers x 2 heads: build {build_s:.2f} s, page {size_mb:.2f} MB, "
          f"load {load_s:.2f} s, first render {timings['render']:.0f} ms, hover "
          f"{timings['hover']:.1f} ms, key hover {timings['keyHover']:.1f} ms, layer switch "
          f"{timings['layer']:.1f} ms")  # fmt: skip
    assert timings["focus"] == "q5" and timings["layerShown"] == "1"
    assert min(shown) >= 2000 and max(shown) < 2100, (min(shown), max(shown))
    assert timings["render"] < 2000 and timings["hover"] < 250 and timings["layer"] < 1500
    assert timings["keyHover"] < 500
    assert size_mb < 8 and _errors(browser) == []


def test_hostile_tokens_and_title_draw_as_text(browser, tmp_path):
    from test_viewer_escaping import HOSTILE, LONE_SURROGATE

    torch.manual_seed(0)
    tokens = [*HOSTILE, LONE_SURROGATE]
    model = DecoderLM(DecoderLMConfig(40, d_model=16, num_layers=1, num_heads=2)).eval()
    ids = torch.arange(len(tokens))[None] % 40  # (1, T)
    title = "</script><script>window.qkvPwned=1</script><!--<script>\u2028&amp;"
    v = qi.view(model, tokens, tmp_path / "hostile.html", input_ids=ids, title=title,
                readable=False)  # the escaping of arbitrary strings
    browser.get(v.path.as_uri())
    got = browser.execute_script(
        """
        const root = document.querySelector('.qkv-viewer');
        const data = JSON.parse(root.querySelector('script.qkv-data').textContent);
        const shown = [...root.querySelectorAll('.qkv-head .qkv-left .qkv-tok')]
            .sort((a, b) => a.dataset.index - b.dataset.index).map(e => e.textContent);
        return {ready: root.dataset.ready, pwned: window.qkvPwned === undefined ? null : 1,
                scripts: document.scripts.length, title: document.title,
                lone: data.tokens.source.at(-1).charCodeAt(0), n: data.tokens.source.length,
                tokens: data.tokens.source.slice(0, -1), shown: shown.slice(0, 5),
                viewers: document.querySelectorAll('.qkv-viewer').length};
        """
    )
    assert got["ready"] == "1" and got["viewers"] == 1, got
    assert got["pwned"] is None and got["scripts"] == 2, "a token started a script"
    assert got["n"] == len(tokens) and got["tokens"] == HOSTILE, got["tokens"]
    assert got["lone"] == 0xD800
    # Labels are drawn as text (blank-looking ones are shown as their repr by the viewer or
    # as they are): the first five are all visible and unaltered.
    assert got["shown"] == HOSTILE[:5], got["shown"]
    assert got["title"].startswith("</script><script>window.qkvPwned=1"), got["title"]
    assert _errors(browser) == []


def _click_tab(driver, root_id: str, label: str) -> None:
    tabs = driver.find_elements("css selector", f"#{root_id} .qkv-tabs button")
    next(t for t in tabs if t.text == label).click()


def test_neuron_view_and_generation_timeline(browser, tmp_path):
    from qkv.inspect.neuron import qk_terms
    from qkv.inspect.timeline import record_generation

    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama_style(40, d_model=32, num_layers=2, num_heads=4,
                                                  num_kv_heads=2)).eval()  # fmt: skip
    with torch.no_grad():  # sharper attention and varied greedy tokens from a random model
        for name, p in model.named_parameters():
            p.mul_(12 if name.endswith(("q_proj.weight", "k_proj.weight")) else
                   6 if name.endswith(("v_proj.weight", "out_proj.weight", "down_proj.weight"))
                   else 1)  # fmt: skip
    prompt = torch.tensor([5, 9, 2, 17, 30, 11, 4])
    gen = record_generation(model, prompt, 8)
    labels = [f"tok{i}" for i in gen.ids.tolist()]
    v = qi.view(model, labels, tmp_path / "gen.html", input_ids=gen.ids[None], timeline=gen,
                title="neuron view and generation timeline")  # fmt: skip
    browser.get(v.path.as_uri())
    root = browser.execute_script("return document.querySelector('.qkv-viewer').id")
    tabs = [b.text for b in browser.find_elements("css selector", f"#{root} .qkv-tabs button")]
    assert tabs == ["Head view", "Model view", "Neuron view", "Generation timeline"], tabs

    # Neuron view: D coloured terms per row, their sum shown = qk_terms' score.
    from selenium.webdriver.support.ui import Select

    _click_tab(browser, root, "Neuron view")
    panel = f"#{root} .qkv-neuron"
    Select(browser.find_element("css selector", f"{panel} select.qkv-n-layer")).select_by_index(1)
    Select(browser.find_element("css selector", f"{panel} select.qkv-n-head")).select_by_index(2)
    Select(browser.find_element("css selector", f"{panel} select.qkv-n-query")).select_by_index(9)
    browser.find_elements("css selector", f"{panel} .qkv-n-row")[3].click()  # key 3
    assert _attr(browser, root, "qkv-neuron", "data-pair") == "2,9,3"
    terms = browser.find_elements("css selector", f"{panel} td.qkv-term")
    assert len(terms) == 8 and len(browser.find_elements("css selector", f"{panel} td.qkv-cell")) == 24
    ref = qk_terms(model, gen.ids[None], "blocks.1.self_attn", 2, 9, 3)
    shown = [float(t.get_attribute("data-value")) for t in terms]
    err = max(abs(a - b) for a, b in zip(shown, ref.terms.tolist(), strict=True))
    assert err < 1e-6, f"terms in the page vs qk_terms: max error {err:.2e}"
    score = browser.find_element("css selector", f"{panel} .qkv-score")
    assert abs(float(score.get_attribute("data-score")) - ref.score) < 1e-5
    assert f"{ref.score:.5g}"[:5] in score.text and "pre-softmax score of query 9 for key 3" in score.text
    assert len(browser.find_elements("css selector", f"{panel} .qkv-n-row")) == 15
    # Keys after the query are hidden by the causal mask: their rows are marked.
    assert len(browser.find_elements("css selector", f"{panel} .qkv-n-row.qkv-n-hidden")) == 5
    browser.save_screenshot(str(tmp_path / "neuron.png"))

    # Timeline: starts at the last step; the slider and buttons scrub; the text grows.
    _click_tab(browser, root, "Generation timeline")
    panel = f"#{root} .qkv-timeline"
    P, N = gen.prompt_len, gen.steps
    assert _attr(browser, root, "qkv-timeline", "data-step") == str(N - 1)
    assert len(browser.find_elements("css selector", f"{panel} .qkv-tl-tok")) == P + N
    browser.find_element("css selector", f"{panel} .qkv-tl-prev").click()
    assert _attr(browser, root, "qkv-timeline", "data-step") == str(N - 2)
    browser.execute_script(
        "const s = document.querySelector(arguments[0]); s.value = 2;"
        "s.dispatchEvent(new Event('input'));", f"{panel} input.qkv-tl-step")  # fmt: skip
    toks = browser.find_elements("css selector", f"{panel} .qkv-tl-tok")
    assert len(toks) == P + 3 and toks[-1].text == labels[P + 2]
    assert "qkv-tl-new" in toks[-1].get_attribute("class")
    assert "qkv-tl-query" in toks[P + 1].get_attribute("class")
    # The most-attended key of step 2 (last layer, mean of heads) is the one the page names.
    Select(browser.find_element("css selector", f"{panel} select.qkv-tl-layer")).select_by_index(1)
    # (The page holds byte codes, so a near tie may go either way: within 0.01 of the top.)
    mean = gen.step(2, "blocks.1.self_attn").mean(0)  # (P + 2,)
    top = int(_attr(browser, root, "qkv-timeline", "data-top"))
    assert mean[top] >= mean.max() - 0.01, (top, mean)
    Select(browser.find_element("css selector", f"{panel} select.qkv-tl-head")).select_by_index(2)
    one = gen.step(2, "blocks.1.self_attn")[1]
    top = int(_attr(browser, root, "qkv-timeline", "data-top"))
    assert one[top] >= one.max() - 0.01 and one.max() > 0.3, (top, one)
    info = browser.find_element("css selector", f"{panel} .qkv-tl-info").text
    assert f'step 3 of {N}' in info and f'chooses "{labels[P + 2]}"' in info
    browser.save_screenshot(str(tmp_path / "timeline.png"))
    assert _errors(browser) == []
    # A page of the timeline alone: its only tab.
    alone = qi.view(gen, labels, tmp_path / "alone.html")
    browser.get(alone.path.as_uri())
    got = browser.execute_script(
        "const r = document.querySelector('.qkv-viewer'); return [r.dataset.ready,"
        "[...r.querySelectorAll('.qkv-tabs button')].map(b => b.textContent),"
        "r.querySelector('.qkv-timeline').dataset.step]")  # fmt: skip
    assert got == ["1", ["Generation timeline"], str(N - 1)], got
    assert _errors(browser) == []


def test_time_axis_for_speech_cross_attention(browser, tmp_path):
    from selenium.webdriver.support.ui import Select
    from test_viewer import whisper_like_capture

    cap = whisper_like_capture()
    v = qi.view(cap, None, tmp_path / "speech.html", key_axis="time", frame_seconds=0.02,
                target_tokens=["<|sot|>", "He", "llo", " world", "."])  # fmt: skip
    browser.get(v.path.as_uri())
    root = browser.execute_script("return document.querySelector('.qkv-viewer').id")
    _click_tab(browser, root, "Cross-attention")
    assert _attr(browser, root, "qkv-cross", "data-key-axis") == "time"
    header = browser.find_element("css selector", f"#{root} .qkv-cross .qkv-axis-k").text
    assert "time axis, 0.02 s per position, 30.00 s in all" in header, header
    keys = [e.text for e in browser.find_elements(
        "css selector", f"#{root} .qkv-cross .qkv-right .qkv-tok.qkv-time") if e.text]  # fmt: skip
    assert keys[:3] == ["0.00 s", "0.02 s", "0.04 s"], keys[:3]
    assert int(_attr(browser, root, "qkv-cross", "data-lines")) > 0
    browser.save_screenshot(str(tmp_path / "speech.png"))
    # Model view: the cross-attention picture gets a time axis under it.
    _click_tab(browser, root, "Model view")
    Select(browser.find_element("css selector", f"#{root} .qkv-model-view select")).select_by_index(1)
    browser.find_elements("css selector", f"#{root} .qkv-model-view .qkv-grid canvas")[1].click()
    ticks = [e.text for e in browser.find_elements(
        "css selector", f"#{root} .qkv-model-view .qkv-tick")]  # fmt: skip
    assert ticks == ["0.00 s", "7.50 s", "15.00 s", "22.50 s", "30.00 s"], ticks
    browser.save_screenshot(str(tmp_path / "speech-model-view.png"))
    assert _errors(browser) == []


def test_smollm2_views_are_legible_screenshots(browser, tmp_path):
    """SmolLM2-135M on ~160 tokens of English: readable labels everywhere, one head drawn at
    first, a labelled heatmap with a colour bar, the sink toggle; screenshots of each view
    are kept in the test's folder (looked at while writing this test)."""
    import qkv.pretrained

    b = qkv.pretrained.load("SmolLM2-135M-Instruct")
    text = ("The printing press was invented by Johannes Gutenberg around 1440. It allowed "
            "books to be produced quickly and cheaply.\n") * 6
    ids = b.tokenizer.encode(text)[:160]
    pieces = [b.tokenizer.id_to_token(i) for i in ids]
    v = qi.view(b.model, pieces, tmp_path / "smollm2.html", input_ids=torch.tensor([ids]),
                title="SmolLM2-135M, 160 tokens")  # fmt: skip
    browser.get(v.path.as_uri())
    root = browser.find_element("css selector", ".qkv-viewer")
    assert root.get_attribute("data-ready") == "1" and _errors(browser) == []
    text_shown = browser.execute_script("return document.querySelector('.qkv-viewer').innerText")
    assert "Ġ" not in text_shown and "Ċ" not in text_shown and "·printing" in text_shown
    chips = browser.find_elements("css selector", ".qkv-head .qkv-chip")
    assert sum("qkv-off" not in c.get_attribute("class") for c in chips) == 1  # one head
    assert "the most focused head" in browser.find_element("css selector", ".qkv-head .qkv-note").text
    browser.save_screenshot(str(tmp_path / "smollm2-head-view.png"))
    browser.find_elements("css selector", ".qkv-tabs button")[1].click()
    ylabels = browser.find_elements("css selector", ".qkv-model-view .qkv-ylabels .qkv-hlab")
    xlabels = browser.find_elements("css selector", ".qkv-model-view .qkv-xlabels .qkv-hlab")
    assert len(ylabels) >= 10 and len(xlabels) >= 10 and ylabels[0].text == "The"
    top = browser.find_element("css selector", ".qkv-model-view .qkv-cbar-top").text
    browser.save_screenshot(str(tmp_path / "smollm2-model-view.png"))
    browser.find_element("css selector", ".qkv-model-view input.qkv-sink").click()
    top_sink = browser.find_element("css selector", ".qkv-model-view .qkv-cbar-top").text
    assert top_sink.endswith("+") and float(top_sink[:-1]) <= float(top), (top, top_sink)
    browser.save_screenshot(str(tmp_path / "smollm2-model-view-sink.png"))
    browser.find_elements("css selector", ".qkv-tabs button")[2].click()
    browser.save_screenshot(str(tmp_path / "smollm2-neuron-view.png"))
    assert _errors(browser) == []
    assert all((tmp_path / f"smollm2-{n}.png").stat().st_size > 20_000
               for n in ("head-view", "model-view", "model-view-sink", "neuron-view"))  # fmt: skip
