#!/usr/bin/env python3
"""The shard writer alone, no model: what extraction does per batch after the backend returns.

  python3 benchmarks/bench_shard_writer.py [--tokens 65536 --layers 4 --hidden 2048 --dir DIR]

Rows, same batch (per-sample pieces of 1,024 tokens, bf16) in one run, each written atomically
with fsync into DIR (default: a temporary directory on the current disk):
  save_file      torch.isfinite check, torch.cat, safetensors.save_file, sha256 re-read (before)
  write_shard    eaglepipe.shard_pipeline.all_finite + shards.write_shard (pieces streamed,
                 hashed while written)
  write_shard fp8  the same with fp8 aux storage
Prints GiB/s and the ratio to the first row.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eaglepipe import shards  # noqa: E402
from eaglepipe.atomic import atomic_path, sha256_file  # noqa: E402
from eaglepipe.shard_pipeline import all_finite  # noqa: E402


def before(path: Path, pieces, small) -> None:
    assert all(bool(torch.isfinite(p).all()) for p in pieces)
    with atomic_path(path) as tmp:
        save_file({"hidden_states": torch.cat(pieces), **small}, str(tmp))
    sha256_file(path)


def after(path: Path, pieces, small, storage="model") -> None:
    assert all(all_finite(p) for p in pieces)
    shards.write_shard(path, pieces, small["input_ids"], small["loss_mask"], small["sample_index"],
                       small["offsets"], metadata={}, storage_dtype=storage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--sample-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = args.tokens // args.sample_len
    pieces = [torch.randn(args.sample_len, args.layers, args.hidden).to(torch.bfloat16) for _ in range(n)]
    small = {"input_ids": torch.zeros(args.tokens, dtype=torch.int64),
             "loss_mask": torch.ones(args.tokens, dtype=torch.uint8),
             "sample_index": torch.arange(n), "offsets": torch.arange(n + 1) * args.sample_len}
    gib = args.tokens * args.layers * args.hidden * 2 / 2**30
    rows = [("save_file (before)", before), ("write_shard", after),
            ("write_shard fp8", lambda p, x, s: after(p, x, s, "fp8"))]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        best = {}
        for name, fn in rows:
            times = []
            for i in range(args.repeat):
                t = time.perf_counter()
                fn(Path(d) / f"{i}.safetensors", pieces, small)
                times.append(time.perf_counter() - t)
                (Path(d) / f"{i}.safetensors").unlink()
            best[name] = min(times)
    base = best[rows[0][0]]
    print(f"{args.tokens} tokens x {args.layers} layers x {args.hidden} bf16 = {gib:.2f} GiB per shard, "
          f"{torch.get_num_threads()} threads, best of {args.repeat}")
    print(f"{'':<22} {'s':>7} {'GiB/s':>7} {'speedup':>8}")
    for name, _ in rows:
        print(f"{name:<22} {best[name]:7.3f} {gib / best[name]:7.2f} {base / best[name]:7.2f}x")


if __name__ == "__main__":
    main()
