"""The parent's record of a worker's unanswered items (`process.Unsent`): a range while its
items are answered in order, a dict after, and always what a dict of the same items would say,
since the scheduler and the death handler use it as one."""

from __future__ import annotations

import random

import pytest

from hardy.workers.process import Unsent


def test_unsent_is_the_dict_it_replaces():
    """Random operations, as the scheduler and the death handler make them, on `Unsent` and on a
    dict of the same items give the same answers and the same items, in the same order."""
    rng = random.Random(7)
    for _ in range(300):
        start, n = rng.randrange(0, 50), rng.randrange(0, 30)
        items = range(start, start + n) if rng.random() < 0.8 else rng.sample(range(100), n)
        mine, theirs = Unsent(items), dict.fromkeys(items)
        for _ in range(rng.randrange(0, 40)):
            i = rng.choice([*theirs, -1, 7, 1000]) if theirs and rng.random() < 0.7 else rng.randrange(-2, 90)
            op = rng.choice(["pop", "del", "in", "answered", "len", "first"])
            if op == "pop":
                assert mine.pop(i, None) == theirs.pop(i, None)
            elif op == "del":
                if i in theirs:
                    del mine[i], theirs[i]
                else:
                    with pytest.raises(KeyError):
                        del mine[i]
            elif op == "in":
                assert (i in mine) == (i in theirs)
            elif op == "answered":
                k = rng.randrange(0, 10)
                mine.answered(i, k)
                for j in range(i, i + k):
                    theirs.pop(j, None)
            elif op == "len":
                assert len(mine) == len(theirs) and bool(mine) == bool(theirs)
            else:
                assert next(iter(mine), None) == next(iter(theirs), None)
            assert list(mine) == list(theirs)
        mine.clear()
        assert not mine and list(mine) == []


def test_consecutive_items_answered_in_order_stay_a_range():
    unsent = Unsent(range(100, 5100))
    unsent.answered(100, 2000)
    unsent.pop(2100)
    del unsent[2101]
    assert unsent.rest is None and (unsent.start, unsent.stop) == (2102, 5100)
    unsent.pop(4000)  # out of order: a dict from here on
    assert unsent.rest is not None and len(unsent) == 2997 and 4000 not in unsent and 4001 in unsent


def test_a_key_equal_to_an_int_is_that_item_as_in_a_dict():
    np = pytest.importorskip("numpy")
    for key in (True, 2.0, np.int64(2)):
        mine, theirs = Unsent(range(0, 5)), dict.fromkeys(range(0, 5))
        assert (key in mine) == (key in theirs)
        mine.pop(key, None)
        theirs.pop(key, None)
        assert list(mine) == list(theirs)
