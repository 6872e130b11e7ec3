"""Words on long work (issue 27): ``qkv inspect`` on 1,000 tokens printed nothing for two
minutes. Stages print on stderr: through a pipe a slow stage is a line when it has run
``SLOW_SECONDS`` and a line when it ends; quick ones print nothing."""

from __future__ import annotations

import io
import time

from rich.console import Console

from qkv.cli import progress
from qkv.cli.progress import Stages


def _piped() -> tuple[Stages, io.StringIO]:
    buf = io.StringIO()
    return Stages("inspect", Console(file=buf, force_terminal=False, width=200)), buf


def test_a_slow_stage_says_it_started_and_when_it_ended(monkeypatch):
    monkeypatch.setattr(progress, "SLOW_SECONDS", 0.05)
    stages, buf = _piped()
    with stages.stage("running the model on 1000 tokens"):
        time.sleep(0.3)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "qkv inspect: running the model on 1000 tokens ..."
    assert lines[1].startswith("qkv inspect: running the model on 1000 tokens: done in 0.")


def test_a_quick_stage_prints_nothing_through_a_pipe():
    stages, buf = _piped()
    with stages.stage("loading"):
        pass
    assert buf.getvalue() == ""


def test_counted_work_reports_about_every_tenth():
    stages, buf = _piped()
    assert list(stages.track(iter(range(25)), 25, "windows")) == list(range(25))
    lines = buf.getvalue().splitlines()
    assert lines[0] == "qkv inspect: windows: 0/25" and lines[-1] == "qkv inspect: windows: 25/25"
    assert len(lines) == 14  # 0, every 2nd, and the end


def test_on_a_terminal_a_stage_ends_with_a_check_mark():
    buf = io.StringIO()
    stages = Stages("embed", Console(file=buf, force_terminal=True, width=100))
    with stages.stage("embedding 3 texts"):
        pass
    out = buf.getvalue()
    assert "✓" in out and "embedding 3 texts (0.0 s)" in out, out
