"""Make the next items of an iterator ahead, while the caller uses the current one: in a thread
(``prefetch``) or in a worker process (``prefetch_in_process``).

Training packs each row on the CPU (read the shard, convert, shift, concatenate, pad): on a GPU
that time was spent with the GPU idle, once per step. A thread hides it and is the default. On a
GPU the step is host-bound (the host issuing kernels is the step) and a packing thread competes for
the GIL with the issuing one, which a worker process (as speculators' DataLoader workers) avoids at
the price of a copy through shared memory; which wins is measured on the GPU host
(benchmarks/compare_trainers.py --ours-row-loaders thread,process). Both keep the rows' order
and the data position exact for resume: the position travels with each row.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

T = TypeVar("T")
_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch(items: Iterator[T], depth: int = 2) -> Iterator[T]:
    """Yield the items of ``items``, up to ``depth`` of them made ahead by a thread.

    An exception in the thread is raised in the caller at the item where it happened. Closing the
    returned generator stops the thread and waits for it (its current item at most): a daemon
    thread still inside torch when the interpreter exits aborts the process.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, raised there
            put(_Failed(e))

    thread = threading.Thread(target=produce, name="eaglepipe-prefetch", daemon=True)
    thread.start()
    try:
        while (x := q.get()) is not _END:
            if isinstance(x, _Failed):
                raise x.error
            yield x
    finally:
        stop.set()
        thread.join()


class _Items(IterableDataset):
    """The iterable a DataLoader worker runs: ``make()``'s items, then the error that ended them,
    as an item (a worker's SystemExit would otherwise end the worker without its message)."""

    def __init__(self, make: Callable[[], Iterator]):
        self.make = make

    def __iter__(self):
        try:
            yield from self.make()
        except (Exception, SystemExit) as e:  # raised in the caller at this item (not GeneratorExit: a close)
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:  # it must cross the process boundary (both ways): its type and message do
                e = RuntimeError(f"{type(e).__name__}: {e}")
            yield _Failed(e)


def _as_is(item):
    """The worker's items as they are (DataLoader's default turns tuples into lists)."""
    return item


def prefetch_in_process(make: Callable[[], Iterator[T]], depth: int = 2, pin_memory: bool = False) -> Iterator[T]:
    """Yield the items of ``make()``, up to ``depth`` of them made ahead by one worker process.

    torch's DataLoader runs the worker (tensors come back through shared memory; with
    ``pin_memory`` its thread here copies them to page-locked memory). ``make`` is called in the
    worker and must pickle where processes are spawned (a bound method of a picklable object does).
    An error in the worker is raised here at the item where it happened; closing the returned
    generator stops the worker.
    """
    # its own generator: the worker's seed is drawn from it, not from the caller's global RNG
    loader = DataLoader(_Items(make), batch_size=None, num_workers=1, prefetch_factor=depth, pin_memory=pin_memory,
                        collate_fn=_as_is, generator=torch.Generator())
    items = iter(loader)
    try:
        for x in items:
            if isinstance(x, _Failed):
                raise x.error
            yield x
    finally:
        del items  # its finalizer stops and joins the worker now, not at the next collection
