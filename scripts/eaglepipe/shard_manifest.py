"""The manifest that lists a run's hidden-state shards (``shards.py``: the shard format).

A shard's row: file, samples, tokens, bytes and its checksum (``checksum.py``), and ``categories``
(each sample's category, null for none; ``row_categories``) when a sample of the shard has one
(chat_data's ``category``, which the evaluations report acceptance by), and likewise
``prompt_sets`` (each eval sample's fixed evaluation set; ``row_prompt_sets``).
Training reads the manifest, never scans the shard directory. Apart from ``shards.py`` because
this needs no torch: the stages that read only the manifest (gather_hidden_states, the plots)
start without importing it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import read_json_object, write_json
from .checksum import CHECKSUM

FORMAT_VERSION = 1  # of the shards and of the manifest
BUDGET_KEY = "disk_budget"  # the manifest's record of a budgeted extraction (shard_budget.py)


def manifest_row(path: str | os.PathLike, samples: int, tokens: int, size: int, checksum: str) -> dict:
    return {"file": Path(path).name, "samples": samples, "tokens": tokens, "bytes": size, CHECKSUM: checksum}


def write_manifest(path: str | os.PathLike, manifest: dict) -> None:
    manifest = dict(manifest, format_version=FORMAT_VERSION)
    write_json(path, manifest)


def split_summary(rows: list[dict], empty_batches: list[int]) -> dict:
    """A split's manifest entry: its shards' rows in batch order, the batches that kept no sample
    (every sample skipped), and the totals."""
    rows = sorted(rows, key=lambda r: r["batch"])
    return {"shards": rows, "empty_batches": sorted(empty_batches),
            "samples": sum(r["samples"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
            "bytes": sum(r["bytes"] for r in rows)}


def load_manifest(path: str | os.PathLike) -> dict:
    path = Path(path)
    m = read_json_object(path, "manifest")
    for key in ("layer_ids", "splits", "shard_dir", "target"):
        if key not in m:
            raise ValueError(f"manifest {path}: missing key {key!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"manifest {path}: format version {m.get('format_version')}, expected {FORMAT_VERSION}")
    m["_path"] = str(path)
    return m


def row_categories(row: dict) -> list[str | None]:
    """The category of each sample of a shard's manifest row (None: it has none)."""
    return row.get("categories") or [None] * row["samples"]


def row_prompt_sets(row: dict) -> list[str | None]:
    """The fixed evaluation set (evaluate.prompts) of each sample of a shard's manifest row (None: none)."""
    return row.get("prompt_sets") or [None] * row["samples"]


def shard_paths(manifest: dict, split: str) -> list[tuple[Path, dict]]:
    """(absolute path, manifest row) of every shard of a split, in manifest order."""
    if split not in manifest["splits"]:
        raise ValueError(f"manifest {manifest.get('_path')}: no split {split!r} "
                         f"(has {sorted(manifest['splits'])})")
    base = Path(manifest["_path"]).parent / manifest["shard_dir"]
    return [(base / row["file"], row) for row in manifest["splits"][split]["shards"]]
