"""qkv.inspect.files.atomic_write: content, permissions, no temporary files left."""

from __future__ import annotations

import os

from qkv.inspect.files import atomic_write


def test_atomic_write_gives_the_mode_open_would(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    out = atomic_write(tmp_path / "sub" / "page.html", "<p>é</p>")
    assert out.read_text(encoding="utf-8") == "<p>é</p>"
    mode, expected = out.stat().st_mode & 0o777, plain.stat().st_mode & 0o777
    assert mode == expected, f"atomic_write made mode {oct(mode)}, open() makes {oct(expected)}"
    atomic_write(out, b"\x00\x01")
    assert out.read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(out.parent)) == ["page.html"]
