"""Crash-safe file writes: a file is either absent or complete, never half-written.

Write to a temporary name in the same directory, fsync, rename over the target, fsync the
directory. A kill -9 at any moment leaves at worst a ``.tmp-*`` file that readers never open.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path


_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_prefix(name: str) -> str:
    """How a write of ``name`` in progress is named (and its leftover found after a kill)."""
    return f".tmp-{name}."


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` whole (publish_dir)."""
    with staged_dir(path) as tmp:
        yield tmp
        publish_dir(tmp, path)


@contextmanager
def staged_dir(path: str | os.PathLike):
    """Yield a temporary directory beside ``path`` for publish_dir; whatever is not published is
    removed on the way out."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A kill -9 skips the cleanup in `finally`: the next write of the same path removes what the
    # killed one left (one writer per path: Snakemake's lock and ours per stage directory).
    for leftover in [*path.parent.glob(f"{_tmp_prefix(path.name)}*"), *path.parent.glob(f".tmp-old-{path.name}.*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(path.name), dir=path.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def publish_dir(tmp: Path, path: str | os.PathLike) -> None:
    """Replace ``path`` whole by the staged directory ``tmp``.

    Files get the umask's modes (mkdtemp and some writers create owner-only ones) and are fsynced
    before the rename publishes them. A previous ``path`` is moved aside first (a directory
    cannot be renamed over a non-empty one) and removed afterwards.
    """
    path = Path(path)
    for p in sorted(tmp.rglob("*"), reverse=True) + [tmp]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~_UMASK)
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        else:
            fsync_dir(p)
    old = None
    try:
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{path.name}.", dir=path.parent))
            path.rename(old / path.name)
        try:
            tmp.rename(path)
        except OSError:
            if old is not None:  # the previous one goes back: nothing is lost before its replacement is in place
                (old / path.name).rename(path)
            raise
        fsync_dir(path.parent)
    finally:
        if old is not None and old.exists():
            shutil.rmtree(old)


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; keep results readable like any file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")


def read_json_object(path: str | os.PathLike, what: str, error: type[Exception] = ValueError) -> dict:
    """The JSON object in ``path``; anything else raises ``error`` naming what and where."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{what} {path}: cannot be read as JSON ({e})") from e
    if not isinstance(obj, dict):
        raise error(f"{what} {path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def json_object_argument(text: str) -> dict:
    """An argparse ``type``: a JSON object given on the command line (e.g. keyword arguments)."""
    import argparse

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def remove_stale_temporaries(directory: str | os.PathLike, names: Iterable[str] | None = None) -> int:
    """Delete ``.tmp-*`` leftovers of writes a crash interrupted; return how many. ``names``: only
    the leftovers of these target file names, for a directory that concurrent jobs write into
    (one job must not delete another's write in progress)."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    patterns = [".tmp-*"] if names is None else [f"{_tmp_prefix(name)}*" for name in names]
    stale = [p for pattern in patterns for p in directory.glob(pattern)]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)
