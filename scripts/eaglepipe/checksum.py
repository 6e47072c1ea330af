"""Shard checksums: XXH3-128 of the file's bytes, recorded in the manifest under ``CHECKSUM``.

Not sha256: extraction checksums every byte it writes (~16 KB per token) and a resume re-reads
every reused shard. Measured on one core of this kind of machine: sha256 1.47 GiB/s, blake3
3.2 GiB/s, XXH3-128 18 GiB/s; with sha256 the hash was half of a writer's time. The checksum
guards against truncated or corrupted files, not against tampering, so a non-cryptographic
128-bit hash is enough. ``xxhsum -H2 FILE`` prints the same value.
"""

from __future__ import annotations

import hashlib
import os

import xxhash

CHECKSUM = "xxh3_128"


def hasher():
    return xxhash.xxh3_128()


def file_checksum(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, hasher).hexdigest()
