"""Dates written the ways people write them, for the date-normalisation task.

Every date from :data:`FIRST_DATE` (1950-01-01) to :data:`LAST_DATE` (2049-12-31) can be
written in any of the :data:`DATE_FORMATS` below, in any of the letter :data:`CASES`; the
target is always ISO 8601, ``"2015-03-03"``.

Conventions, chosen so that every source string has exactly one reading:

* Slash formats with the year last are **month/day/year** (US order): ``"3/14/15"``.
* Formats with the year first are year/month/day: ``"2015/3/14"``, ``"2015.03.14"``.
* Two-digit years: ``50``-``99`` mean 1950-1999, ``00``-``49`` mean 2000-2049
  (:func:`expand_two_digit_year`), which covers the whole range exactly once.
* Month and weekday names are English and generated from the tables here, never from the
  machine's locale.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import date, timedelta

__all__ = [
    "CASES",
    "DATE_FORMATS",
    "FIRST_DATE",
    "LAST_DATE",
    "MONTHS",
    "WEEKDAYS",
    "date_pair",
    "expand_two_digit_year",
    "format_date",
    "ordinal",
    "random_date",
]

FIRST_DATE = date(1950, 1, 1)
LAST_DATE = date(2049, 12, 31)
NUM_DAYS = (LAST_DATE - FIRST_DATE).days + 1  # 36525

MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
CASES = ("natural", "lower", "upper")  # "natural" = as written in the table below


def ordinal(n: int) -> str:
    """``n`` with its English ordinal suffix: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st."""
    if 11 <= n % 100 <= 13:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def expand_two_digit_year(yy: int) -> int:
    """The year a two-digit year stands for: 50-99 -> 1950-1999, 00-49 -> 2000-2049.

    Raises:
        ValueError: ``yy`` outside ``[0, 99]``.
    """
    if not 0 <= yy <= 99:
        raise ValueError(f"yy must lie in [0, 99], got {yy!r}")
    return 1900 + yy if yy >= 50 else 2000 + yy


def _month(d: date) -> str:
    return MONTHS[d.month - 1]


def _mon(d: date) -> str:
    return MONTHS[d.month - 1][:3]


def _weekday(d: date) -> str:
    return WEEKDAYS[d.weekday()]


def _yy(d: date) -> str:
    return f"{d.year % 100:02d}"


# name -> writer; the example in each comment is 2015-03-03, a Tuesday.
_WRITERS: dict[str, Callable[[date], str]] = {
    "iso": lambda d: d.isoformat(),  # 2015-03-03
    "compact": lambda d: f"{d.year}{d.month:02d}{d.day:02d}",  # 20150303
    "dotted": lambda d: f"{d.year}.{d.month:02d}.{d.day:02d}",  # 2015.03.03
    "year_slash": lambda d: f"{d.year}/{d.month}/{d.day}",  # 2015/3/3
    "us_slash": lambda d: f"{d.month}/{d.day}/{d.year}",  # 3/3/2015
    "us_slash_short": lambda d: f"{d.month}/{d.day}/{_yy(d)}",  # 3/3/15
    "day_mon_year": lambda d: f"{d.day:02d}-{_mon(d)}-{d.year}",  # 03-Mar-2015
    "day_month_year": lambda d: f"{d.day} {_month(d)} {d.year}",  # 3 March 2015
    "mon_day_year": lambda d: f"{_mon(d)} {d.day}, {d.year}",  # Mar 3, 2015
    "mon_day_short": lambda d: f"{_mon(d)} {d.day} '{_yy(d)}",  # Mar 3 '15
    "month_ordinal_year": lambda d: f"{_month(d)} {ordinal(d.day)}, {d.year}",  # March 3rd, 2015
    "the_ordinal_of_month": lambda d: f"the {ordinal(d.day)} of {_month(d)}, {d.year}",
    "weekday_ordinal_of_month": (  # Tuesday 3rd of March 2015
        lambda d: f"{_weekday(d)} {ordinal(d.day)} of {_month(d)} {d.year}"
    ),
    "weekday_month_day_year": (  # Tuesday, March 3, 2015
        lambda d: f"{_weekday(d)}, {_month(d)} {d.day}, {d.year}"
    ),
    "rfc2822": lambda d: f"{_weekday(d)[:3]}, {d.day} {_mon(d)} {d.year}",  # Tue, 3 Mar 2015
}
DATE_FORMATS = tuple(_WRITERS)


def format_date(d: date, fmt: str, *, case: str = "natural") -> str:
    """Write ``d`` in the format named ``fmt`` and the letter case ``case``.

    Args:
        d: a date in ``[FIRST_DATE, LAST_DATE]``.
        fmt: one of :data:`DATE_FORMATS`.
        case: one of :data:`CASES` (``"natural"`` capitalises names as in ``"Mar 3, 2015"``).

    Returns:
        the written date, e.g. ``format_date(date(2015, 3, 3), "rfc2822", case="upper")`` is
        ``"TUE, 3 MAR 2015"``.

    Raises:
        TypeError: ``d`` not a ``datetime.date``.
        ValueError: ``d`` out of range, or an unknown ``fmt`` or ``case``.
    """
    if not isinstance(d, date):
        raise TypeError(f"d must be a datetime.date, got {type(d).__name__}")
    if not FIRST_DATE <= d <= LAST_DATE:
        raise ValueError(f"d must lie in [{FIRST_DATE}, {LAST_DATE}], got {d}")
    if fmt not in _WRITERS:
        raise ValueError(f"fmt must be one of {DATE_FORMATS}, got {fmt!r}")
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    text = _WRITERS[fmt](d)
    return {"natural": text, "lower": text.lower(), "upper": text.upper()}[case]


def random_date(rng: random.Random) -> date:
    """A date drawn uniformly from ``[FIRST_DATE, LAST_DATE]``."""
    return FIRST_DATE + timedelta(days=rng.randrange(NUM_DAYS))


def date_pair(rng: random.Random) -> tuple[str, str]:
    """One ``(written date, ISO date)`` example: uniform date, format and case."""
    d = random_date(rng)
    return format_date(d, rng.choice(DATE_FORMATS), case=rng.choice(CASES)), d.isoformat()
