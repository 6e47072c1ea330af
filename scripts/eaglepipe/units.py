"""Sizes as people read them, for logs and figures."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """A byte count in binary units: "512 B", "1.5 KiB", ... up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
