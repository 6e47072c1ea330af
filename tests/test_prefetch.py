"""prefetch: the same items in the same order, errors surface at their item, the thread stops on close."""

import threading
import time

import pytest

from eaglepipe.prefetch import prefetch


def test_same_items_in_order():
    assert list(prefetch(iter(range(50)), depth=3)) == list(range(50))
    assert list(prefetch(iter([]))) == []


def test_works_ahead_of_the_consumer():
    made = []

    def items():
        for i in range(10):
            made.append(i)
            yield i

    it = prefetch(items(), depth=2)
    assert next(it) == 0
    deadline = time.time() + 5
    while len(made) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert len(made) == 3  # the one consumed plus `depth` made ahead, and no more
    it.close()


def test_error_in_the_thread_is_raised_at_its_item():
    def items():
        yield 1
        yield 2
        raise ValueError("shard 7 is broken")

    it = prefetch(items())
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(ValueError, match="shard 7 is broken"):
        next(it)


def test_closing_stops_an_endless_producer():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    it = prefetch(endless(), depth=2)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == before
