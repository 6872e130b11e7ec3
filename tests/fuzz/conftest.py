"""Hypothesis profiles for the file-reader fuzzers, and the count of examples they ran clean.

``make test`` runs the quick profile: a few hundred examples in all, derandomised so the suite
is repeatable. ``make fuzz`` sets ``QKV_FUZZ=1``, which selects the long profile: thousands of
random examples (a new seed each run). The tests use the profile ``"qkv-readers"``, which is
whichever of the two the environment selects; the global hypothesis profile (that other tests
may load) is left alone.

At the end of the session the terminal summary says how many examples ran clean: loaded, or
refused with a BadFileError naming the changed file (summed over xdist workers).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

from fuzz.tiny_files import OUTCOMES

LONG = os.environ.get("QKV_FUZZ", "") not in ("", "0")
_COMMON = dict(
    deadline=None,  # a hang is caught by hard_deadline; shared CPUs make timings noise
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("qkv-fuzz-quick", max_examples=25, derandomize=True, database=None,
                          **_COMMON)  # fmt: skip
settings.register_profile("qkv-fuzz-long", max_examples=500, **_COMMON)
settings.register_profile(
    "qkv-readers", parent=settings.get_profile("qkv-fuzz-long" if LONG else "qkv-fuzz-quick")
)

_TOTALS: Counter[str] = Counter()


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the counts to the controller
        workeroutput["qkv_fuzz_outcomes"] = dict(OUTCOMES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _TOTALS.update(getattr(node, "workeroutput", {}).get("qkv_fuzz_outcomes", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    totals = _TOTALS + OUTCOMES
    if not totals:
        return
    profile = "long (QKV_FUZZ=1)" if LONG else "quick"
    terminalreporter.write_line(
        f"qkv fuzz ({profile} profile): {totals['loaded'] + totals['refused']} examples ran "
        f"clean: {totals['loaded']} loaded, {totals['refused']} refused with a BadFileError "
        "naming the changed file"
    )
