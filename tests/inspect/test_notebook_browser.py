"""The viewer inside a notebook, in a real browser (issue 27): a notebook that shows two
views is executed by a Jupyter kernel (nbclient), exported to HTML by nbconvert, and opened
offline in headless chromium; each view's frame must draw, with no console errors. Skips,
saying why, where the notebook tools or the browser are missing (``make test`` installs them).
"""

from __future__ import annotations

import pytest
from test_browser import _errors, browser  # noqa: F401 (the chromium fixture)

CELLS = [
    "import torch\nimport qkv.inspect as qi\nfrom qkv.models import DecoderLM, DecoderLMConfig\n"
    "torch.manual_seed(0)\n"
    "model = DecoderLM(DecoderLMConfig(40, d_model=32, num_layers=2, num_heads=4, max_len=32))"
    ".eval()\nids = torch.randint(0, 40, (1, 9))\nwith qi.capture(model) as cap, "
    "torch.no_grad():\n    model(ids)",
    "qi.view(cap, [f'w{i}' for i in range(9)])",  # shown by the notebook: the last expression
    "qi.view(model, ids, heads=[1])",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat", reason="pip install nbformat (make test)")
    nbclient = pytest.importorskip("nbclient", reason="pip install nbclient (make test)")
    nbconvert = pytest.importorskip("nbconvert", reason="pip install nbconvert (make test)")
    pytest.importorskip("ipykernel", reason="pip install ipykernel (make test)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    shown = [o for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    assert len(shown) == 2, [c.get("outputs") for c in nb.cells]
    body, _ = nbconvert.HTMLExporter(template_name="basic").from_notebook_node(nb)
    path = tmp_path_factory.mktemp("notebook") / "views.html"
    path.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"></head><body>{body}'
                    "</body></html>", encoding="utf-8")
    return path


def test_views_in_an_exported_notebook_draw_offline_without_errors(browser, exported):  # noqa: F811
    browser.get(exported.as_uri())
    frames = browser.find_elements("css selector", "iframe.qkv-frame")
    assert len(frames) == 2
    for frame in frames:
        browser.switch_to.frame(frame)
        try:
            state = browser.execute_script(
                "const v = document.querySelector('.qkv-viewer');"
                "return v && [v.dataset.ready, document.querySelectorAll('canvas').length];")
        finally:
            browser.switch_to.default_content()
        assert state is not None and state[0] == "1" and state[1] > 0, state
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert _errors(browser) == []
