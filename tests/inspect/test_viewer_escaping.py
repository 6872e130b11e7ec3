"""The viewer's data block survives hostile tokens: it parses back, as the page reads it.

The page reads ``<script type="application/json" class="qkv-data">``'s ``textContent`` and
hands it to ``JSON.parse`` with no un-escaping. These tests read it back the same way: the
text between the tags (as an HTML parser delimits it) through ``json.loads``, nothing
replaced. The same hostile tokens go through a real browser in test_browser.py.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from importlib import resources

import pytest
import torch

import qkv.inspect as qi
from qkv.inspect.viewer import script_json
from qkv.models import DecoderLM, DecoderLMConfig

# Each of these, written raw into a <script> element, breaks the page: the data block ends
# early (</script>), the tokenizer enters the escaped states (<!--, <!--<script>), or JSON.parse
# / older JavaScript sees a line terminator (U+2028, U+2029), a control or a lone surrogate.
HOSTILE = [
    "<!--", "-->", "</script>", "</SCRIPT >", "<script>", "<!--<script>", "<!--<script>-->",
    "</script><script>window.qkvPwned=1</script>", "<\\/", "]]>", "&lt;", "&amp;", "<!", "</",
    "\u2028", "\u2029", "a\u2028b\u2029c", "\x00", "\r\n", "\t", '"', "\\", "\\u003c", "'",
    "`${x}`", "</style>", "<![CDATA[", "\u00e9\u4e2d\U0001f600", "\u202e", "\ufeff",
]
# A lone surrogate is a legal Python str, but has no UTF-8 form.
LONE_SURROGATE = "\ud800"


class _ScriptText(HTMLParser):
    """The text of every ``<script>`` element, as an HTML parser delimits it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.scripts: list[tuple[dict, str]] = []
        self._open: dict | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open = dict(attrs)
            self.scripts.append((self._open, ""))

    def handle_data(self, data):
        if self._open is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag):
        if tag == "script":
            self._open = None


def _data_blocks(page: str) -> list[str]:
    parser = _ScriptText()
    parser.feed(page)
    parser.close()
    return [text for attrs, text in parser.scripts if attrs.get("class") == "qkv-data"]


@pytest.fixture(scope="module")
def hostile_view():
    torch.manual_seed(0)
    tokens = [*HOSTILE, LONE_SURROGATE]
    model = DecoderLM(DecoderLMConfig(40, d_model=16, num_layers=1, num_heads=2)).eval()
    ids = torch.arange(len(tokens))[None] % 40  # (1, T)
    title = "<!--</script>" + "\u2028" + "&amp;"
    # readable=False: the labels as given, to test the escaping of arbitrary strings
    return qi.view(model, tokens, input_ids=ids, title=title, readable=False), tokens


@pytest.mark.parametrize("token", [*HOSTILE, LONE_SURROGATE], ids=ascii)
def test_script_json_round_trips_each_hostile_string(token):
    data = {"tokens": [token, "x" + token + "y"], "title": token}
    payload = script_json(data)
    # Nothing in it can move the HTML tokenizer out of script data: every way out starts
    # with "<"; and it is plain ASCII (no raw U+2028/U+2029, controls or surrogates).
    assert "<" not in payload and ">" not in payload and "&" not in payload, payload
    assert payload.isascii() and payload.isprintable(), ascii(payload)
    assert json.loads(payload) == data, ascii(payload)


def test_data_block_parses_back_as_the_page_reads_it(hostile_view):
    v, tokens = hostile_view
    page = v.html()
    blocks = _data_blocks(page)
    assert len(blocks) == 1, f"{len(blocks)} data blocks: a token ended one early"
    data = json.loads(blocks[0])  # no un-escaping: the page does none
    assert data == v.data
    assert data["tokens"]["source"] == tokens
    # Only the page's own two scripts: a token's "<script>" started none.
    parser = _ScriptText()
    parser.feed(page)
    assert len(parser.scripts) == 2, [a for a, _ in parser.scripts]


def test_page_encodes_as_utf8_with_a_lone_surrogate_in_title_and_tokens(hostile_view, tmp_path):
    v, _ = hostile_view
    v2 = qi.View({**v.data, "title": "t" + LONE_SURROGATE})
    path = v2.save(tmp_path / "page.html")
    text = path.read_bytes().decode("utf-8")  # strict: valid UTF-8 throughout
    assert "<title>t\ufffd</title>" in text
    assert json.loads(_data_blocks(text)[0])["title"] == "t" + LONE_SURROGATE


def test_inlined_script_and_style_cannot_end_their_elements():
    for name, end in (("viewer.js", "</script"), ("viewer.css", "</style")):
        text = (resources.files("qkv.inspect") / "static" / name).read_text(encoding="utf-8")
        low = text.lower()
        assert end not in low and "<!--" not in low, f"{name} holds {end} or <!--"


def test_nan_in_the_data_is_a_clear_error():
    with pytest.raises(ValueError, match="NaN or infinity"):
        script_json({"max": [float("nan")]})
