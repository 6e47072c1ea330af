#!/usr/bin/env python3
"""Extraction throughput on one GPU: our CLI (vLLM backend, shards on disk) against plain vLLM
prefill and against our hf backend, same model and same tokens.

  python3 benchmarks/bench_extraction.py [--arch llama1b --n 1024 --len 1024 --json FILE]

Run on the H200 from the repository root after vLLM was staged (PYTHONPATH=/tmp/site). Rows:
  ours vllm   python -m eaglepipe.extract_hidden_states --backend vllm: tokens / seconds from
              the first generate() to the last shard written (fsynced, checksummed); no model load
  plain vllm  LLM.generate(max_tokens=1) without capture, the first call after start (cold, as
              ours) and a second one (warm)
  ours hf     the same CLI with --backend hf --device cuda
plus the disk's write+fsync speed, which bounds any extraction that keeps its shards. Targets:
ours vllm >= 0.8x plain and >= 3x ours hf. ~3-4 minutes for the defaults (two vLLM starts).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# before any vllm import (see shared/device/README.md pitfalls); nothing here touches CUDA
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

REPO = Path(__file__).resolve().parents[1]


def prompts(data: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for f in ("train.jsonl", "eval.jsonl")
            for line in open(data / f) if line.strip()]


def plain(args) -> None:
    """In a child process: plain vLLM prefill, printed as one JSON line."""
    from vllm import LLM, SamplingParams

    ps = [{"prompt_token_ids": p} for p in prompts(Path(args.work) / "data")]
    ntok = sum(len(p["prompt_token_ids"]) for p in ps)
    t0 = time.perf_counter()
    llm = LLM(model=str(Path(args.work) / "model"), skip_tokenizer_init=True, dtype="bfloat16",
              enable_prefix_caching=False, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_util, enforce_eager=not args.compiled, seed=0)
    start = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    print("PLAIN " + json.dumps({"tokens": ntok, "start_s": round(start, 1), "cold_s": round(times[0], 3),
                                 "warm_s": round(times[1], 3), "cold_tok_per_s": round(ntok / times[0]),
                                 "warm_tok_per_s": round(ntok / times[1])}), flush=True)


def disk_speed(d: Path, size: int = 1 << 30) -> float:
    """Bytes/s of writing and fsyncing one file in d (what an atomic shard write costs)."""
    block = os.urandom(64 << 20)
    p = d / "disk_speed.bin"
    t = time.perf_counter()
    with open(p, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    p.unlink()
    return size / dt


def run(cmd: list[str], log: Path, timeout: int) -> tuple[float, str]:
    t = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'scripts'}:{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "a") as f:
        f.write("### " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=timeout)
        f.write(p.stdout)
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t, p.stdout


def ours(args, backend: str, log: Path) -> dict:
    work = Path(args.work)
    out = work / backend / "part.json"
    shutil.rmtree(work / backend, ignore_errors=True)
    wall, _ = run([sys.executable, "-m", "eaglepipe.extract_hidden_states",
                   "--train", str(work / "data" / "train.jsonl"), "--eval", str(work / "data" / "eval.jsonl"),
                   "--model", str(work / "model"), "--backend", backend, "--device", "cuda",
                   "--tensor-parallel-size", "1", "--layer-ids", args.layer_ids,
                   "--batch-size", str(args.batch_size), "--storage-dtype", "model", "--dtype", "bfloat16",
                   "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_util),
                   *([] if args.compiled else ["--enforce-eager"]), "--shard-dir", str(work / backend / "shards"),
                   "--replica", "0", "--replicas", "1", "--out", str(out)], log, 540)
    m = json.loads(out.read_text())
    res = dict(m["throughput"], wall_s=round(wall, 1), bytes=sum(s["bytes"] for s in m["splits"].values()),
               shards=sum(len(s["shards"]) for s in m["splits"].values()))
    shutil.rmtree(work / backend, ignore_errors=True)  # tens of GB; the next row needs the disk
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama1b", choices=["llama", "llama1b", "dsv3"])
    ap.add_argument("--n", type=int, default=1024, help="train samples (plus 8 eval)")
    ap.add_argument("--len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--layer-ids", default="2,8,13,16", help="llama1b: N=16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-util", type=float, default=0.8)
    ap.add_argument("--compiled", action="store_true", help="vLLM with torch.compile + CUDA graphs")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--work", default="/tmp/bench_extraction")
    ap.add_argument("--log", default=None, help="log of every command (default WORK/bench.log)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.plain:
        return plain(args)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = Path(args.log or work / "bench.log")
    if not (work / "model" / "config.json").exists():
        run([sys.executable, str(REPO / "benchmarks" / "make_random_target.py"), "--arch", args.arch,
             "--out", str(work / "model")], log, 300)
    shutil.rmtree(work / "data", ignore_errors=True)
    run([sys.executable, str(REPO / "benchmarks" / "make_random_target.py"), "--data-out", str(work / "data"),
         "--n", str(args.n), "--len", str(args.len)], log, 120)
    res = {"arch": args.arch, "n": args.n, "len": args.len, "batch_size": args.batch_size,
           "layer_ids": args.layer_ids, "compiled": args.compiled}
    res["disk_write_fsync_bytes_per_s"] = round(disk_speed(work))
    print(f"disk write+fsync: {res['disk_write_fsync_bytes_per_s'] / 2**30:.2f} GiB/s", flush=True)
    res["ours_vllm"] = ours(args, "vllm", log)
    print("ours vllm", res["ours_vllm"], flush=True)
    _, out = run([sys.executable, __file__, "--plain", "--work", str(work), "--max-model-len",
                  str(args.max_model_len), "--gpu-util", str(args.gpu_util),
                  *(["--compiled"] if args.compiled else [])], log, 300)
    res["plain_vllm"] = json.loads([x for x in out.splitlines() if x.startswith("PLAIN ")][-1][6:])
    print("plain vllm", res["plain_vllm"], flush=True)
    if not args.skip_hf:
        res["ours_hf"] = ours(args, "hf", log)
        print("ours hf", res["ours_hf"], flush=True)

    v = res["ours_vllm"]["tokens_per_s"]
    bpt = res["ours_vllm"]["bytes"] / max(res["ours_vllm"]["tokens"], 1)
    res["disk_bound_tok_per_s"] = round(res["disk_write_fsync_bytes_per_s"] / bpt)
    res["ratio_vs_plain_cold"] = round(v / res["plain_vllm"]["cold_tok_per_s"], 3)
    res["ratio_vs_plain_warm"] = round(v / res["plain_vllm"]["warm_tok_per_s"], 3)
    rows = [("ours vllm (shards on disk)", v, ""),
            ("plain vllm prefill, cold", res["plain_vllm"]["cold_tok_per_s"], f"ours/plain {res['ratio_vs_plain_cold']:.2f}"),
            ("plain vllm prefill, warm", res["plain_vllm"]["warm_tok_per_s"], f"ours/plain {res['ratio_vs_plain_warm']:.2f}"),
            ("disk write+fsync bound", res["disk_bound_tok_per_s"], f"{bpt:.0f} B/token")]
    if "ours_hf" in res:
        res["ratio_vs_hf"] = round(v / res["ours_hf"]["tokens_per_s"], 3)
        rows.append(("ours hf (cuda)", res["ours_hf"]["tokens_per_s"], f"ours vllm/hf {res['ratio_vs_hf']:.2f}"))
    print(f"\n{'':<28} {'tok/s':>10}  note")
    for name, tps, note in rows:
        print(f"{name:<28} {tps:>10,.0f}  {note}")
    print("BENCH " + json.dumps(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
