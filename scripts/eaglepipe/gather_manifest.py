"""Stage gather_hidden_states: the extraction replicas' part manifests merged into the one
manifest training reads.

  python -m eaglepipe.gather_manifest --out hidden_states/manifest.json parts/replica-*.json

Checks that the parts were made with the same settings, come from distinct replicas of one
plan, cover every batch of every split exactly once, and that every shard file exists with its
recorded size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .shard_manifest import BUDGET_KEY, load_manifest, shard_paths, split_summary, write_manifest

SAME = ("target", "layer_ids", "layer_convention", "storage_dtype", "settings")


def gather(parts: list[str | os.PathLike], out: str | os.PathLike) -> dict:
    """The merged manifest (also written to ``out``); ValueError with a clear message on any mismatch."""
    if not parts:
        raise ValueError("no part manifests given")
    ms = [load_manifest(p) for p in parts]
    first = ms[0]
    for m in ms[1:]:
        for key in (*SAME, BUDGET_KEY):
            if m.get(key) != first.get(key):
                raise ValueError(f"{m['_path']}: {key} {m.get(key)!r} differs from {first['_path']}: "
                                 f"{first.get(key)!r}; all replicas must run with the same settings")
    count = first["replica"]["count"]
    seen: dict[int, str] = {}
    for m in ms:
        r = m["replica"]
        if r["count"] != count or r["batches"] != first["replica"]["batches"]:
            raise ValueError(f"{m['_path']}: replica plan {r} differs from {first['_path']}: {first['replica']}")
        if r["index"] in seen:
            raise ValueError(f"{m['_path']}: replica {r['index']} is also {seen[r['index']]}")
        seen[r["index"]] = m["_path"]
    if len(ms) != count:
        missing = sorted(set(range(count)) - set(seen))
        raise ValueError(f"{len(ms)} part manifests for {count} replicas; missing replicas {missing}")

    out = Path(out)
    shard_dirs = {(Path(m["_path"]).parent / m["shard_dir"]).resolve() for m in ms}
    if len(shard_dirs) != 1:
        raise ValueError(f"the parts write to different shard directories: {sorted(map(str, shard_dirs))}")
    splits = {}
    for split, total in first["replica"]["batches"].items():
        owner: dict[int, str] = {}
        rows, empty = [], []
        for m in ms:
            for path, row in shard_paths(m, split):
                if row.get("deferred"):  # extracted while training runs, under a disk budget
                    continue
                if not path.is_file():
                    raise ValueError(f"{m['_path']}: shard {path} of {split} batch {row['batch']} does not exist")
                if path.stat().st_size != row["bytes"]:
                    raise ValueError(f"{m['_path']}: shard {path} has {path.stat().st_size} bytes, "
                                     f"the manifest records {row['bytes']}")
            s = m["splits"][split]
            batches = [r["batch"] for r in s["shards"]] + list(s.get("empty_batches", []))
            for b in batches:
                if b in owner:
                    raise ValueError(f"{m['_path']}: {split} batch {b} is also in {owner[b]}")
                owner[b] = m["_path"]
            rows += s["shards"]
            empty += s.get("empty_batches", [])
        missing = sorted(set(range(total)) - set(owner))
        if missing:
            raise ValueError(f"{split}: batches {missing[:10]}{' ...' if len(missing) > 10 else ''} of "
                             f"{total} are in no part manifest")
        extra = sorted(set(owner) - set(range(total)))
        if extra:
            raise ValueError(f"{split}: batches {extra} are outside the plan of {total} batches")
        splits[split] = split_summary(rows, empty)

    per_replica = [dict(m["throughput"], replica=m["replica"]["index"]) for m in ms]
    backends = sorted({m["backend"] for m in ms})
    merged = {key: first[key] for key in SAME}
    merged.update(
        backend=",".join(backends),
        shard_dir=os.path.relpath(shard_dirs.pop(), out.parent.resolve()),
        splits=splits,
        skipped=[s for m in ms for s in m.get("skipped", [])],
        replica={"index": None, "count": count, "batches": first["replica"]["batches"]},
        # replicas run side by side: their rates add up, the wall time is the slowest one's
        throughput={"tokens": sum(t["tokens"] for t in per_replica),
                    "seconds": max(t["seconds"] for t in per_replica),
                    "tokens_per_s": round(sum(t["tokens_per_s"] for t in per_replica), 1),
                    "model_load_s": max(t["model_load_s"] for t in per_replica),
                    "replicas": sorted(per_replica, key=lambda t: t["replica"])},
        tokenizer_digest=first.get("tokenizer_digest"),
        bytes_per_token=first.get("bytes_per_token"),
    )
    if first.get(BUDGET_KEY) is not None:
        merged[BUDGET_KEY] = first[BUDGET_KEY]
    write_manifest(out, merged)
    return merged


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the merged manifest.json")
    ap.add_argument("parts", nargs="+", help="part manifests of the extraction replicas")
    args = ap.parse_args(argv)
    try:
        m = gather(args.parts, args.out)
    except ValueError as e:
        raise SystemExit(f"gather_manifest: {e}") from e
    for split, s in m["splits"].items():
        print(f"{split}: {len(s['shards'])} shards, {s['samples']} samples, {s['tokens']} tokens, "
              f"{s['bytes']} bytes", file=sys.stderr)
    if m["skipped"]:
        print(f"skipped samples (non-finite hidden states): {len(m['skipped'])}", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
