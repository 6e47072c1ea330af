#!/usr/bin/env python3
"""Where the next training rows should be packed while a step runs: a thread or a worker process.

  python3 benchmarks/bench_row_loader.py [--layers 4 --hidden 576 --batch-tokens 8192 --shards 6
      --steps 40 --calls 2000 --dir DIR]

On a GPU our training step is host-bound: the host issuing small torch calls (kernel launches) is
the step. This stands in for it on any machine: a step is --calls small torch calls on a 16-element
tensor plus taking the next packed row (SmolLM2-135M's shape by default: 4 layers x 576, rows of
8,192 tokens, bf16, random states in --shards shards of 64 samples of 50-1,023 tokens, written
with the extraction's own shard writer into DIR, default a temporary directory). Rows, in one run:
  rows made before     every row packed before timing: the step alone
  thread               packed_data.PackedRows.prefetched("thread"): a thread packs the next rows
  process              .prefetched("process"): a DataLoader worker process packs them
Prints ms per step and each row's ratio to the first; packing one row in the caller is timed too.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eaglepipe.packed_data import PackedRows  # noqa: E402
from eaglepipe.shards import write_manifest, write_shard  # noqa: E402


def make_shards(out: Path, shards: int, layers: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rows, first = [], 0
    for s in range(shards):
        lengths = torch.randint(50, 1024, (64,), generator=g)
        tokens = int(lengths.sum())
        rows.append(write_shard(
            out / "shards" / f"train-{s:06d}.safetensors", torch.randn(tokens, layers, hidden, generator=g).bfloat16(),
            torch.randint(0, 49152, (tokens,), generator=g), torch.ones(tokens, dtype=torch.long),
            torch.arange(first, first + 64), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            {"layer_ids": list(range(layers))}))
        first += 64
    manifest = {"layer_ids": list(range(layers)), "shard_dir": "shards", "storage_dtype": "bf16",
                "target": {"model": "random", "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": 49152},
                "splits": {"train": {"shards": rows}, "eval": {"shards": rows[:1]}}}
    write_manifest(out / "manifest.json", manifest)
    manifest["_path"] = str(out / "manifest.json")
    manifest["shard_dir"] = str(out / "shards")
    return manifest


def step(calls: int) -> None:
    x = torch.zeros(16)
    for _ in range(calls):
        x = x.add(1).mul_(0.5)


def timed_steps(rows, steps: int, calls: int) -> float:
    next(rows)  # the loader started, its first rows made
    t0 = time.perf_counter()
    for _ in range(steps):
        next(rows)
        step(calls)
    return (time.perf_counter() - t0) * 1000 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--shards", type=int, default=6)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--calls", type=int, default=2000, help="small torch calls per step")
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        manifest = make_shards(Path(tmp), args.shards, args.layers, args.hidden)
        packed = PackedRows(manifest, "train", args.batch_tokens, dtype=torch.bfloat16, pad_to=args.batch_tokens,
                            shuffle_window=args.shards)
        made = [row for _, row in zip(range(args.steps + 1), packed.stream())]
        t0 = time.perf_counter()
        for _, _row in zip(range(10), packed.stream()):
            pass
        pack_ms = (time.perf_counter() - t0) * 100
        step(args.calls)  # warm
        results = {"rows made before": timed_steps(iter(made), args.steps, args.calls)}
        for loader in ("thread", "process"):
            stream = packed.prefetched(loader)
            results[loader] = timed_steps(stream, args.steps, args.calls)
            stream.close()
    base = results["rows made before"]
    print(f"packing one row in the caller: {pack_ms:.1f} ms; a step: {args.calls} small torch calls + the next row")
    print("| rows packed by | ms/step | vs rows made before |\n| --- | --- | --- |")
    for name, ms in results.items():
        print(f"| {name} | {ms:.2f} | {ms / base:.3f}x |")


if __name__ == "__main__":
    main()
