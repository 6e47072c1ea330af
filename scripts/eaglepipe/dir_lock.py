"""One writer per stage directory: an exclusive lock that dies with its process.

Snakemake's own lock guards a workflow directory only while Snakemake runs: after Snakemake is
killed its job runs on, and after the `--unlock` a rerun needs, a second job would write the same
shards or checkpoints beside it. The stage takes this lock first; a second one stops with a
sentence naming the directory and the process holding it.

The lock is ``flock`` on ``<dir>/<name>`` (the kernel releases it when the holder dies, however
it dies), and the file records who holds it, for the message and for the log line when the lock
of a dead process is taken over. Child processes (shard writers) inherit the lock with the file
descriptor.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        return {}


@contextmanager
def dir_lock(directory: str | os.PathLike, name: str = ".lock"):
    """Hold ``<directory>/<name>`` for the block; SystemExit if another live process holds it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = _holder(path)
            raise SystemExit(f"{directory} is being written by another job (process {h.get('pid', '?')} on "
                             f"{h.get('host', '?')}, since {h.get('since', '?')}, lock {path}); wait for it to "
                             "end or end it, then rerun") from None
        previous = _holder(path)
        if previous.get("pid"):
            # the file outlived its holder: that process died without releasing it
            log.warning("%s: taking over the lock of process %s on %s (since %s), which has ended",
                        directory, previous["pid"], previous.get("host"), previous.get("since"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released cleanly: nothing to take over
    finally:
        os.close(fd)
