"""The pool of shard writers: threads of this process, or processes of their own.

Threads are right when the backend hands over tensors in this process (hf). Processes are right
when it hands over file paths (vLLM's connector files): each writer then has its own interpreter
and its own torch thread pool, so the writers neither share the GIL with each other and with the
engine loop, nor run 16-thread OpenMP reductions from 8 threads at once.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

from .process_lifetime import die_with_parent

POOLS = ("threads", "processes")


def make_pool(kind: str, writers: int, imports: tuple[str, ...] = ()) -> Executor:
    """``writers`` workers; processes import ``imports`` when they start (not during the first job)
    and are started here, so they get ready while the caller loads its model."""
    if kind == "threads":
        return ThreadPoolExecutor(writers)
    if kind != "processes":
        raise ValueError(f"writer pool {kind!r}: expected one of {POOLS}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // writers)
    # spawn: a fork of a process whose OpenMP pool or CUDA context is running can deadlock
    pool = ProcessPoolExecutor(writers, multiprocessing.get_context("spawn"), initializer=_start_writer,
                               initargs=(os.getpid(), threads, imports))
    for _ in range(writers):  # each submit to a pool without an idle worker starts one
        pool.submit(int)
    return pool


def _start_writer(parent: int, threads: int, imports: tuple[str, ...]) -> None:
    die_with_parent(parent)  # a writer outliving a killed parent would wait for jobs forever
    import torch

    torch.set_num_threads(threads)
    for name in imports:
        importlib.import_module(name)
