"""Make the next items of an iterator in a background thread while the caller uses the current one.

Training packs each row on the CPU (read the shard, convert, shift, concatenate, pad): on a GPU
that time was spent with the GPU idle, once per step. speculators' Trainer overlaps it with
DataLoader worker processes; one thread is enough here (the heavy parts are torch copies, which
release the GIL) and keeps the rows' order and the data position exact for resume.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

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
