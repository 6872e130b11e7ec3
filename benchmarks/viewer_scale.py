"""The attention viewer at real sizes: page size, build memory and time, render time.

Usage::

    .venv/bin/python benchmarks/viewer_scale.py                   # 200, 1200, 4096 tokens
    .venv/bin/python benchmarks/viewer_scale.py --tokens 200      # one size

For each length, a fresh subprocess loads SmolLM2-135M-Instruct (30 layers x 9 heads, real
weights, offline), builds ``qkv.inspect.view(model, tokens, input_ids=...)`` on that many
tokens of English text (every layer, every head, the neuron view) and reports the page's size,
the build's wall time and the process's peak resident memory (``ru_maxrss``: the model and
the forward included); then headless Chromium (when installed) opens the page and reports the
viewer's own render time (``data-render-ms``: parsing the data and drawing the first view)
and the page load time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch
import qkv.pretrained, qkv.inspect as qi
n, path = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(2)
b = qkv.pretrained.load("SmolLM2-135M-Instruct")
text = ("The printing press was invented by Johannes Gutenberg around 1440. It allowed books "
        "to be produced quickly and cheaply, which helped spread literacy across Europe. ")
ids = []
while len(ids) < n:
    ids += b.tokenizer.encode(text)
ids = ids[:n]
pieces = [b.tokenizer.id_to_token(i) for i in ids]
start = time.perf_counter()
qi.view(b.model, pieces, path, input_ids=torch.tensor([ids]), title=f"SmolLM2, {n} tokens")
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"tokens": n, "build_s": seconds, "peak_bytes": peak}))
"""


def render(path: Path) -> dict | None:
    """Open the page in headless Chromium: ``{"render_ms", "load_s"}``, or None."""
    chromium, driver = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if not (chromium.exists() and driver.exists()):
        return None
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(chromium)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1300,1000"):
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service(str(driver)), options=opts)
    try:
        start = time.perf_counter()
        d.get(path.as_uri())
        ms = d.execute_script("return document.querySelector('.qkv-viewer').dataset.renderMs")
        return {"render_ms": float(ms), "load_s": time.perf_counter() - start}
    finally:
        d.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[200, 1200, 4096])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            page = Path(tmp) / f"view-{n}.html"
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(page)], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            shown = render(page)
            extra = ("" if shown is None else
                     f", render {shown['render_ms']:.0f} ms (page load {shown['load_s']:.1f} s)")
            print(f"{n:>5} tokens: page {page.stat().st_size / 1e6:.1f} MB, build "
                  f"{r['build_s']:.1f} s, peak memory {r['peak_bytes'] / 2**30:.2f} GiB{extra}")


if __name__ == "__main__":
    main()
