"""Synthetic tasks: correct targets, disjoint splits, determinism from the seed."""

from __future__ import annotations

import random
from datetime import date

import pytest

from qkv.data import SPLITS, TASKS, Task, make_task

SIZES = dict(n_train=400, n_valid=60, n_test=60)


@pytest.fixture(scope="module", params=TASKS)
def task(request) -> Task:
    return make_task(request.param, seed=7, **SIZES)


def test_sizes(task):
    assert [len(task.pairs(s)) for s in SPLITS] == [400, 60, 60]
    assert all(isinstance(s, str) and isinstance(t, str) and s for s, t in task.pairs("train"))


def test_splits_are_disjoint_by_source(task):
    sources = {split: [s for s, _ in task.pairs(split)] for split in SPLITS}
    for split, items in sources.items():
        assert len(set(items)) == len(items), f"{task.name}: repeated source inside {split}"
    for a, b in [("train", "valid"), ("train", "test"), ("valid", "test")]:
        both = set(sources[a]) & set(sources[b])
        assert not both, f"{task.name}: {len(both)} sources in {a} and {b}, e.g. {sorted(both)[:3]}"


def test_same_seed_same_pairs_different_seed_different(task):
    again = make_task(task.name, seed=7, **SIZES)
    assert again == task
    other = make_task(task.name, seed=8, **SIZES)
    overlap = set(other.pairs("train")) & set(task.pairs("train"))
    assert len(overlap) < 100, f"{task.name}: seeds 7 and 8 share {len(overlap)}/400 pairs"


def test_targets_are_right(task):
    for source, target in task.pairs("train") + task.pairs("test"):
        if task.name == "copy":
            assert target == source and source.isdigit()
        elif task.name == "reverse":
            assert target == "".join(reversed(source)) and source.isdigit()
        elif task.name == "sort":
            assert list(target) == sorted(source) and source.isdigit()
        elif task.name == "addition":
            a, b = source.split("+")
            assert int(target) == int(a) + int(b)
            assert str(int(a)) == a and str(int(b)) == b, f"leading zero in {source!r}"
        elif task.name == "dates":
            assert date(1950, 1, 1) <= date.fromisoformat(target) <= date(2049, 12, 31)
        else:
            raise AssertionError(f"untested task {task.name}")


def test_digit_lengths_follow_the_options():
    t = make_task("reverse", seed=0, n_train=300, n_valid=0, n_test=0, min_len=3, max_len=5)
    lengths = {len(s) for s, _ in t.pairs("train")}
    assert lengths == {3, 4, 5}
    t = make_task("addition", seed=0, n_train=300, n_valid=0, n_test=0, min_digits=2, max_digits=2)
    assert all(len(a) == 2 and len(b) == 2 for a, b in (s.split("+") for s, _ in t.train))


def test_small_spaces_are_filled_without_repeats():
    # 1 + 2 digit strings: 110 sources in all; asking for 100 takes the dense path.
    t = make_task("copy", seed=3, n_train=80, n_valid=10, n_test=10, min_len=1, max_len=2)
    sources = [s for split in SPLITS for s, _ in t.pairs(split)]
    assert len(set(sources)) == 100
    assert make_task("copy", seed=3, n_train=80, n_valid=10, n_test=10, max_len=2) == t
    t = make_task("addition", seed=0, n_train=100, n_valid=0, n_test=0, max_digits=1)
    assert len(set(t.train)) == 100  # every a+b with one-digit operands


def test_date_sources_are_varied():
    t = make_task("dates", seed=0, n_train=2000, n_valid=0, n_test=0)
    sources = [s for s, _ in t.train]
    assert any(c.islower() for s in sources for c in s)
    assert any(s.isupper() for s in sources)
    assert any("/" in s for s in sources) and any("," in s for s in sources)
    years = [int(tg[:4]) for _, tg in t.train]
    assert min(years) < 1960 and max(years) > 2040


def test_texts_lists_every_string():
    t = make_task("sort", seed=0, n_train=5, n_valid=2, n_test=2)
    assert len(t.texts()) == 18
    assert set(t.texts()) >= {s for s, _ in t.train}


def test_task_seed_is_independent_of_global_random_state():
    random.seed(1)
    a = make_task("copy", seed=0, n_train=20, n_valid=0, n_test=0)
    random.seed(2)
    assert make_task("copy", seed=0, n_train=20, n_valid=0, n_test=0) == a


def test_errors():
    with pytest.raises(ValueError, match=r"name must be one of \('copy'.*got 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match=r"n_valid must be a non-negative int, got -1"):
        make_task("copy", n_valid=-1)
    with pytest.raises(TypeError, match=r"seed must be an int, got str"):
        make_task("copy", seed="0")
    with pytest.raises(ValueError, match=r"only 10 distinct sources.*= 11"):
        make_task("copy", n_train=11, n_valid=0, n_test=0, max_len=1)
    with pytest.raises(ValueError, match=r"min_len must be <= max_len, got min_len=5 > max_len=2"):
        make_task("copy", min_len=5, max_len=2)
    with pytest.raises(ValueError, match=r"max_digits must be an int in \[1, 100\], got 0"):
        make_task("addition", max_digits=0)
    with pytest.raises(TypeError, match=r"task 'dates': .*unexpected keyword argument 'max_len'"):
        make_task("dates", max_len=3)
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'valid', 'test'\)"):
        make_task("copy", n_train=1, n_valid=1, n_test=1).pairs("validation")
