"""Date writing: every format parses back to its date with an independent strptime check."""

from __future__ import annotations

import random
import re
from datetime import date, datetime, timedelta

import pytest

from qkv.data.dates import (
    CASES,
    DATE_FORMATS,
    FIRST_DATE,
    LAST_DATE,
    date_pair,
    expand_two_digit_year,
    format_date,
    ordinal,
)

# Written here from the examples in the issue, not from qkv's tables: format -> strptime pattern
# (after ordinal suffixes are removed). %y is fixed up below: strptime's pivot is 69, ours 50.
STRPTIME = {
    "iso": "%Y-%m-%d",
    "compact": "%Y%m%d",
    "dotted": "%Y.%m.%d",
    "year_slash": "%Y/%m/%d",
    "us_slash": "%m/%d/%Y",
    "us_slash_short": "%m/%d/%y",
    "day_mon_year": "%d-%b-%Y",
    "day_month_year": "%d %B %Y",
    "mon_day_year": "%b %d, %Y",
    "mon_day_short": "%b %d '%y",
    "month_ordinal_year": "%B %d, %Y",
    "the_ordinal_of_month": "the %d of %B, %Y",
    "weekday_ordinal_of_month": "%A %d of %B %Y",
    "weekday_month_day_year": "%A, %B %d, %Y",
    "rfc2822": "%a, %d %b %Y",
}
EXAMPLES = {  # the issue's own examples for 2015-03-03 (letter case aside)
    "weekday_ordinal_of_month": "tuesday 3rd of march 2015",
    "us_slash_short": "3/3/15",
    "mon_day_year": "MAR 3, 2015",
    "dotted": "2015.03.03",
    "day_mon_year": "03-Mar-2015",
    "month_ordinal_year": "March 3rd, 2015",
    "day_month_year": "3 march 2015",
    "rfc2822": "Tue, 3 Mar 2015",
    "compact": "20150303",
    "year_slash": "2015/3/3",
}
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
ORDINAL = re.compile(r"\b(\d{1,2})(st|nd|rd|th)\b", re.IGNORECASE)
# Edge days: range ends, leap days, month and year ends, the two-digit-year pivot.
EDGES = [
    FIRST_DATE, LAST_DATE, date(2000, 2, 29), date(1952, 2, 29), date(2048, 2, 29),
    date(1999, 12, 31), date(2000, 1, 1), date(2049, 1, 1), date(1950, 12, 31),
    date(2011, 11, 11), date(2012, 12, 12), date(2013, 1, 13), date(2021, 8, 22),
]  # fmt: skip


def parse_independently(text: str, fmt: str) -> date:
    """Parse ``text`` with strptime, checking ordinals and weekday names on the way."""
    for m in ORDINAL.finditer(text):
        n = int(m.group(1))
        want = "th" if 11 <= n <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        assert m.group(2).lower() == want, f"ordinal {m.group(0)!r} in {text!r}"
    plain = ORDINAL.sub(r"\1", text)
    parsed = datetime.strptime(plain, STRPTIME[fmt]).date()  # %A/%B/%b match any case
    if "%y" in STRPTIME[fmt] and parsed.year >= 2050:
        parsed = parsed.replace(year=parsed.year - 100)
    # strptime ignores a weekday that contradicts the date; check the name ourselves.
    names = [w for w in re.findall(r"[a-z]+", text.lower()) if w[:3] in {d[:3] for d in WEEKDAYS}]
    for name in names:
        wanted = WEEKDAYS[parsed.weekday()]
        assert name in (wanted, wanted[:3]), f"weekday {name!r} in {text!r}, date {parsed}"
    return parsed


def test_at_least_ten_formats_and_the_issue_examples():
    assert len(DATE_FORMATS) >= 10
    assert set(STRPTIME) == set(DATE_FORMATS)
    for fmt, example in EXAMPLES.items():
        got = {format_date(date(2015, 3, 3), fmt, case=c) for c in CASES}
        assert example in got, f"{fmt}: {example!r} not among {got}"


@pytest.mark.parametrize("fmt", DATE_FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_every_format_parses_back(fmt, case):
    rng = random.Random(f"{fmt}{case}")
    days = EDGES + [FIRST_DATE + timedelta(days=rng.randrange(36525)) for _ in range(300)]
    for d in days:
        text = format_date(d, fmt, case=case)
        assert parse_independently(text, fmt) == d, f"{fmt}/{case}: {text!r} is not {d}"
        if case == "lower":
            assert text == text.lower()
        if case == "upper":
            assert text == text.upper()


def test_weekday_formats_name_the_right_day():
    # 2015-03-03 was a Tuesday, 2000-01-01 a Saturday, 1969-07-20 a Sunday.
    assert format_date(date(2015, 3, 3), "rfc2822") == "Tue, 3 Mar 2015"
    assert format_date(date(2000, 1, 1), "weekday_month_day_year") == "Saturday, January 1, 2000"
    assert format_date(date(1969, 7, 20), "weekday_ordinal_of_month", case="lower") == (
        "sunday 20th of july 1969"
    )


def test_two_digit_years_cover_the_range_once():
    assert [expand_two_digit_year(y) for y in (50, 99, 0, 49)] == [1950, 1999, 2000, 2049]
    assert sorted(expand_two_digit_year(y) for y in range(100)) == list(range(1950, 2050))
    assert format_date(date(1950, 1, 1), "us_slash_short") == "1/1/50"
    assert format_date(date(2049, 12, 31), "us_slash_short") == "12/31/49"
    with pytest.raises(ValueError, match=r"yy must lie in \[0, 99\], got 100"):
        expand_two_digit_year(100)


def test_ordinals():
    got = [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31, 111, 112)]
    assert got == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "31st",
        "111th", "112th",
    ]  # fmt: skip


def test_date_pair_targets_are_iso_and_in_range():
    rng = random.Random(0)
    for _ in range(500):
        source, target = date_pair(rng)
        d = date.fromisoformat(target)
        assert FIRST_DATE <= d <= LAST_DATE
        assert any(format_date(d, f, case=c) == source for f in DATE_FORMATS for c in CASES)


def test_format_date_errors():
    with pytest.raises(ValueError, match=r"d must lie in \[1950-01-01, 2049-12-31\], got 1949"):
        format_date(date(1949, 12, 31), "iso")
    with pytest.raises(ValueError, match=r"fmt must be one of .*got 'nope'"):
        format_date(date(2015, 3, 3), "nope")
    with pytest.raises(ValueError, match=r"case must be one of .*got 'title'"):
        format_date(date(2015, 3, 3), "iso", case="title")
    with pytest.raises(TypeError, match=r"d must be a datetime.date, got str"):
        format_date("2015-03-03", "iso")
