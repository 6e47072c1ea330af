"""Crash-safe file writes: a file is either absent or complete, never half-written.

Write to a temporary name in the same directory, fsync, rename over the target, fsync the
directory. A kill -9 at any moment leaves at worst a ``.tmp-*`` file that readers never open.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; keep results readable like any file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike) -> int:
    """Delete ``.tmp-*`` leftovers of writes a crash interrupted; return how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    stale = list(directory.glob(".tmp-*"))
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)
