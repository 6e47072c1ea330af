#!/usr/bin/env python3
"""Do our shard writers scale with their number? Threads against processes, no model, no vLLM.

  python3 benchmarks/bench_writers_parallel.py [--writers 1,2,4,8 --dir /dev/shm --repeat 2]

Each writer does what one of extraction's writers does for the vLLM backend: read a batch of
vLLM-connector-like files (one safetensors file per sample, ``hidden_states [T, L, H]`` bf16 and
``token_ids``, written beforehand with safetensors' ``save_file`` as the connector does), check
and pack them into one shard (``shard_pipeline.pack_and_write``: finite check, pieces
streamed and hashed into the file, fsync, rename) and delete the inputs. N writers work N batches
at once, as N threads of one process or as N processes (extraction's two writer pools:
processes for vLLM's files, threads for the hf backend's tensors). Prints the
aggregate GiB/s of hidden states per row and the ratio processes / threads.

Why: on the H200 host (16 cores) 8 writer threads packed only ~2.5 GB/s together while one
writer alone writes ~1.5 GiB/s, and the writers became extraction's bottleneck once vLLM was
fed continuously. This shows whether more threads help or the process's threads contend.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eaglepipe.shard_pipeline import pack_and_write  # noqa: E402
from eaglepipe.tokenized_samples import PreparedSample  # noqa: E402
from eaglepipe.writer_pool import POOLS, make_pool  # noqa: E402


def make_batch(d: Path, tag: str, samples: int, sample_len: int, states: torch.Tensor) -> list[str]:
    paths = []
    for i in range(samples):
        p = d / f"{tag}-{i}.safetensors"
        save_file({"hidden_states": states, "token_ids": torch.arange(sample_len)}, str(p))
        paths.append(str(p))
    return paths


def job(paths: list[str], out: str, layers: int, hidden: int) -> int:
    loaded = []
    for p in paths:
        d = load_file(p)
        loaded.append((d["hidden_states"], d["token_ids"].tolist()))
        os.unlink(p)
    T = loaded[0][0].shape[0]
    batch = [PreparedSample(i, f"s{i}", list(range(T)), [1] * T) for i in range(len(paths))]
    row, _ = pack_and_write(Path(out), "train", 0, batch, loaded, {}, "model", layers, hidden)
    os.unlink(out)
    return row["bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--samples", type=int, default=16, help="samples per batch (shard)")
    ap.add_argument("--sample-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    root = Path(args.dir) / "eaglepipe-bench-writers"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    states = torch.randn(args.sample_len, args.layers, args.hidden).to(torch.bfloat16)
    gib = args.samples * states.numel() * 2 / 2**30
    cores = os.cpu_count() or 1
    print(f"{args.samples} x {args.sample_len} tokens x {args.layers} x {args.hidden} bf16 = {gib:.2f} GiB "
          f"per batch, {cores} cores, {args.dir}, best of {args.repeat}", flush=True)
    best: dict[tuple[str, int], float] = {}
    try:
        for n in args.writers:
            for mode in POOLS:
                with make_pool(mode, n) as pool:  # extraction's own pools
                    list(pool.map(int, range(n)))  # workers started before the clock
                    for r in range(args.repeat):
                        batches = [make_batch(root, f"{mode}{n}-{r}-{w}", args.samples, args.sample_len, states)
                                   for w in range(n)]
                        t = time.perf_counter()
                        list(pool.map(job, batches, [str(root / f"shard{w}") for w in range(n)],
                                      [args.layers] * n, [args.hidden] * n))
                        rate = n * gib / (time.perf_counter() - t)
                        best[mode, n] = max(best.get((mode, n), 0.0), rate)
                print(f"{n} writers, {mode}: {best[mode, n]:.2f} GiB/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'writers':>7} {'threads GiB/s':>14} {'processes GiB/s':>16} {'processes/threads':>18}")
    for n in args.writers:
        th, pr = best["threads", n], best["processes", n]
        print(f"{n:>7} {th:>14.2f} {pr:>16.2f} {pr / th:>17.2f}x")


if __name__ == "__main__":
    main()
