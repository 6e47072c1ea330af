"""prefetch and prefetch_in_process: the same items in the same order, errors surface at their
item, the thread or the worker process stops on close."""

import functools
import os
import threading
import time

import pytest
import torch

from eaglepipe.prefetch import prefetch, prefetch_in_process


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


def numbered(n: int, fail_at: int | None = None, error: BaseException | None = None):
    """Items i with a tensor each; ``error`` raised at item ``fail_at`` (module level: a spawned
    worker must unpickle it)."""
    for i in range(n):
        if i == fail_at:
            raise error
        yield i, torch.full((3,), float(i)), os.getpid()


class Unpicklable(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_a_worker_process_yields_the_same_items_in_order():
    items = list(prefetch_in_process(functools.partial(numbered, 20), depth=3))
    assert [i for i, _, _ in items] == list(range(20))
    assert all(torch.equal(t, torch.full((3,), float(i))) for i, t, _ in items)
    assert {pid for _, _, pid in items} != {os.getpid()}  # made in another process


@pytest.mark.parametrize("error, raised, message", [
    (SystemExit("shard 7: cannot be read; rerun extraction"), SystemExit, "shard 7: cannot be read"),
    (ValueError("shard 7 is broken"), ValueError, "shard 7 is broken"),
    (Unpicklable(1, 2), RuntimeError, "Unpicklable: 1 and 2"),  # its type and message cross
])
def test_an_error_in_the_worker_is_raised_at_its_item(error, raised, message):
    it = prefetch_in_process(functools.partial(numbered, 10, 2, error))
    assert [next(it)[0] for _ in range(2)] == [0, 1]
    with pytest.raises(raised, match=message):
        next(it)


def test_closing_stops_the_worker_process():
    import multiprocessing

    it = prefetch_in_process(functools.partial(numbered, 10**9), depth=2)
    _, _, worker = next(it)
    assert worker in [p.pid for p in multiprocessing.active_children()]
    it.close()
    assert worker not in [p.pid for p in multiprocessing.active_children()]
