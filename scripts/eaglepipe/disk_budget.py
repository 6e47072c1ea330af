"""Disk room for extraction: where vLLM's per-request files wait to be packed, and whether the
shards still to write (and those files) fit before the model is loaded."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .units import human_bytes

DISK_MARGIN = 1.05
DISK_RESERVE = 1 << 30
RAM_DISK = Path("/dev/shm")


def same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def has_room(where: Path, need: int) -> bool:
    """Room for ``need`` bytes in ``where`` with a 5 % and 1 GiB margin."""
    return need * DISK_MARGIN + DISK_RESERVE <= shutil.disk_usage(where).free


def staged_bytes(tokens_todo: int, batch_tokens: int, writers: int, lookahead_tokens: int,
                 state_bytes_per_token: int) -> int:
    """The most bytes vLLM's files take while they wait from generation until a writer takes them:
    the queue of 2 x writers batches, the batch being handed over, and what is queued in the
    engine (the lookahead, overshot by up to one batch)."""
    return min(tokens_todo, (2 * writers + 2) * batch_tokens + lookahead_tokens) * state_bytes_per_token


def staging_dir(choice: str, replica: int, shard_dir: Path, staged: int) -> Path:
    """This replica's own subdirectory for vLLM's per-request files (emptied at start, removed at the
    end). ``choice`` is --staging-dir: auto (the RAM disk when it has room for ``staged`` bytes,
    else the shard directory), shards, or a directory.

    On the shard disk these transient files compete with the shards for its bandwidth: on the
    H200 the default 'auto' (RAM disk) took extraction from 48k to 80k tok/s, the disk's bound.
    """
    if choice == "auto":
        root = RAM_DISK if RAM_DISK.is_dir() and has_room(RAM_DISK, staged) else shard_dir
    elif choice == "shards":
        root = shard_dir
    else:
        root = Path(choice)
    if root == shard_dir:
        return shard_dir / f".staging-replica{replica}"
    tag = hashlib.sha256(str(shard_dir.resolve()).encode()).hexdigest()[:8]
    return root / f"eaglepipe-staging-{tag}-replica{replica}"


def check_room(shard_dir: Path, shard_bytes: int, staging: Path | None, staged: int) -> None:
    """SystemExit unless each filesystem has room for what goes on it: the shards still to write
    and, with vLLM, its staged files (on the shard disk or on their own)."""
    needs = {shard_dir: (shard_bytes, "the shards still to write")}
    if staging is not None:
        if same_filesystem(staging.parent, shard_dir):
            needs[shard_dir] = (shard_bytes + staged, "the shards still to write and vLLM's staging")
        else:
            needs[staging.parent] = (staged, "vLLM's staged files")
    for where, (need, what) in needs.items():
        if not has_room(where, need):
            raise SystemExit(f"not enough disk space in {where}: {what} need {human_bytes(need)} (plus 5% and "
                             f"1 GiB margin), {human_bytes(shutil.disk_usage(where).free)} is free; free space, move "
                             f"the shard or staging directory, use extract.storage_dtype fp8, or set "
                             f"extract.disk_budget_gib to train through a bounded set of shards "
                             f"(docs/disk-budget.md)")
