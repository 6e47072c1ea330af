#!/usr/bin/env python3
"""Extraction throughput on one GPU: our CLI (vLLM backend, shards written) against plain vLLM
prefill and against our hf backend, same model and same tokens, in one run.

  python3 benchmarks/bench_extraction.py [--arch llama1b --n 1024 --len 1024 --batch-size 16 --json FILE]
                                         [--rows plain,vllm-disk,hf-disk,fp8-disk,vllm-ram,hf-ram,...]
                                         [--data results/RUN/data]   a run's own samples, not random ones

Run on the H200 from the repository root after vLLM was staged (PYTHONPATH=/tmp/site). Rows:
  plain vllm   LLM.generate(max_tokens=1) without capture, the first call after start (cold, as
               ours) and a second one (warm)
  ours vllm    python -m eaglepipe.extract_hidden_states --backend vllm: tokens / seconds from the
               first generate() to the last shard written (fsynced, checksummed); no model load.
               Shards on the disk (staging 'auto', the default: RAM disk), also with fp8 storage,
               and shards on the RAM disk (the pipeline's own bound, disk removed)
               On the RAM disk also with the writers as threads instead of processes
               (vllm-ram-threads) and with 16 instead of 8 connector threads (vllm-ram-conn16)
  ours hf      the same CLI with --backend hf --device cuda, shards on disk and on the RAM disk
plus the disk's write+fsync speed, which bounds any extraction that keeps its shards on it, and
each run's time split (backend / waiting for writers / writers' tail, from its manifest).
Batches of 16 samples: the writers work one shard each, so the tail after the last generate() is
one shard's write, not the 1 GB of a 64-sample shard (a long run hides that tail; a benchmark of
a million tokens does not).
Targets: ours vllm >= 0.8x plain and >= 3x ours hf. The RAM disk (default /dev/shm) is used only
where it has room; JSON is rewritten after every row. ~6 minutes for the defaults; --rows picks
a subset (a run that must fit a time limit), the ratios use the rows that ran.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from eaglepipe.vllm_env import set_vllm_env_defaults  # noqa: E402

set_vllm_env_defaults()  # before any vllm import; nothing here touches CUDA


def data_dir(args) -> Path:
    return Path(args.data) if args.data else Path(args.work) / "data"


def prompts(data: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for f in ("train.jsonl", "eval.jsonl")
            for line in open(data / f) if line.strip()]


def plain(args) -> None:
    """In a child process: plain vLLM prefill, printed as one JSON line."""
    from vllm import LLM, SamplingParams

    ps = [{"prompt_token_ids": p} for p in prompts(data_dir(args))]
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


def ours(args, backend: str, log: Path, shard_root: Path, staging: Path | None = None,
         storage: str = "model", extra: tuple[str, ...] = ()) -> dict:
    work = Path(args.work)
    out = shard_root / "part.json"
    shutil.rmtree(shard_root, ignore_errors=True)
    wall, _ = run([sys.executable, "-m", "eaglepipe.extract_hidden_states",
                   "--train", str(data_dir(args) / "train.jsonl"), "--eval", str(data_dir(args) / "eval.jsonl"),
                   "--model", str(work / "model"), "--backend", backend, "--device", "cuda",
                   "--tensor-parallel-size", "1", "--layer-ids", args.layer_ids,
                   "--batch-size", str(args.batch_size), "--storage-dtype", storage, "--dtype", "bfloat16",
                   "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_util),
                   *([] if args.compiled else ["--enforce-eager"]),
                   *(["--staging-dir", str(staging)] if staging else []), "--shard-dir", str(shard_root / "shards"),
                   "--replica", "0", "--replicas", "1", "--out", str(out), *extra], log, 540)
    m = json.loads(out.read_text())
    return dict(m["throughput"], wall_s=round(wall, 1), bytes=sum(s["bytes"] for s in m["splits"].values()),
                shards=sum(len(s["shards"]) for s in m["splits"].values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama1b", choices=["llama", "llama1b", "dsv3"])
    ap.add_argument("--n", type=int, default=1024, help="train samples (plus 8 eval)")
    ap.add_argument("--len", type=int, default=1024, help="tokens per sample")
    ap.add_argument("--data", default=None, help="samples to use instead of --n x --len random tokens: a directory "
                    "with train.jsonl and eval.jsonl of input_ids, e.g. a pipeline run's results/RUN/data (the "
                    "same tokens its extraction read)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--layer-ids", default="2,8,13,16", help="llama1b: N=16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-util", type=float, default=0.8)
    ap.add_argument("--compiled", action="store_true", help="vLLM with torch.compile + CUDA graphs")
    ap.add_argument("--work", default="/tmp/bench_extraction", help="on the disk under test")
    ap.add_argument("--ram", default="/dev/shm", help="RAM disk for the rows without the disk")
    ap.add_argument("--log", default=None, help="log of every command (default WORK/bench.log)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=lambda t: t.split(","), default=["plain", "vllm-disk", "hf-disk", "fp8-disk",
                                                                     "vllm-ram", "hf-ram"])
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
    if not args.data:
        shutil.rmtree(work / "data", ignore_errors=True)
        run([sys.executable, str(REPO / "benchmarks" / "make_random_target.py"), "--data-out", str(work / "data"),
             "--n", str(args.n), "--len", str(args.len)], log, 120)
    samples = prompts(data_dir(args))
    res = {"arch": args.arch, "data": args.data or f"random, {args.n} x {args.len}", "samples": len(samples),
           "tokens": sum(map(len, samples)), "batch_size": args.batch_size, "layer_ids": args.layer_ids,
           "max_model_len": args.max_model_len, "gpu_util": args.gpu_util, "compiled": args.compiled, "rows": {}}
    res["disk_write_fsync_bytes_per_s"] = round(disk_speed(work))
    print(f"disk write+fsync: {res['disk_write_fsync_bytes_per_s'] / 2**30:.2f} GiB/s", flush=True)

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    def row(name, fn):
        res["rows"][name] = fn()
        print(name, res["rows"][name], flush=True)
        save()

    disk = work / "out"
    ram = Path(args.ram) / "eaglepipe-bench"
    runs = {
        "plain": ("plain vllm", lambda: json.loads([x for x in run(
            [sys.executable, __file__, "--plain", "--work", str(work), *(["--data", args.data] if args.data else []),
             "--max-model-len", str(args.max_model_len),
             "--gpu-util", str(args.gpu_util), *(["--compiled"] if args.compiled else [])], log, 300)[1].splitlines()
            if x.startswith("PLAIN ")][-1][6:])),
        "vllm-disk": ("ours vllm, disk", lambda: ours(args, "vllm", log, disk)),
        "hf-disk": ("ours hf, disk", lambda: ours(args, "hf", log, disk)),
        "fp8-disk": ("ours vllm, disk, fp8", lambda: ours(args, "vllm", log, disk, storage="fp8")),
        "vllm-ram": ("ours vllm, RAM", lambda: ours(args, "vllm", log, ram / "vllm")),
        "vllm-ram-threads": ("ours vllm, RAM, writer threads",
                             lambda: ours(args, "vllm", log, ram / "vllm", extra=("--writer-pool", "threads"))),
        "vllm-ram-conn16": ("ours vllm, RAM, 16 connector threads",
                            lambda: ours(args, "vllm", log, ram / "vllm", extra=("--connector-threads", "16"))),
        "hf-ram": ("ours hf, RAM", lambda: ours(args, "hf", log, ram / "hf")),
    }
    unknown = set(args.rows) - set(runs)
    if unknown:
        ap.error(f"--rows: unknown {sorted(unknown)}; known {list(runs)}")
    from eaglepipe.shards import bytes_per_token

    hidden = json.loads((work / "model" / "config.json").read_text())["hidden_size"]
    # the bf16 shards of all tokens, +20 % for vLLM's staged files
    need = 1.2 * res["tokens"] * bytes_per_token(len(args.layer_ids.split(",")), hidden, 2, "model")
    ram_free = shutil.disk_usage(args.ram).free if Path(args.ram).is_dir() else 0
    for key in args.rows:
        name, fn = runs[key]
        if key.endswith("-ram") and ram_free < need:
            res["ram_note"] = f"{args.ram} has {ram_free / 2**30:.1f} GiB free, the RAM rows need {need / 2**30:.1f}"
            print(res["ram_note"] + f": {name} skipped", flush=True)
            continue
        row(name, fn)
        shutil.rmtree(disk if key.endswith("-disk") else ram, ignore_errors=True)  # tens of GB

    rows = res["rows"]
    plain_warm = rows.get("plain vllm", {}).get("warm_tok_per_s")
    ours_rows = [r for n, r in rows.items() if n.startswith("ours")]
    bpt = ours_rows[0]["bytes"] / max(ours_rows[0]["tokens"], 1) if ours_rows else 0
    table = []
    if plain_warm:
        table += [("plain vllm prefill, cold", rows["plain vllm"]["cold_tok_per_s"], ""),
                  ("plain vllm prefill, warm", plain_warm, "= 1")]
    if bpt:
        res["bytes_per_token"] = round(bpt)
        res["disk_bound_tok_per_s"] = round(res["disk_write_fsync_bytes_per_s"] / bpt)
        table.append(("disk write+fsync bound", res["disk_bound_tok_per_s"], f"{bpt:.0f} B/token"))
    for name, r in rows.items():
        if not name.startswith("ours"):
            continue
        notes = []
        if plain_warm:
            r["ratio_vs_plain_warm"] = round(r["tokens_per_s"] / plain_warm, 3)
            notes.append(f"{r['ratio_vs_plain_warm']:.2f}x plain")
            if r.get("tail_s") and "RAM" in name:
                # the writers' tail after the last batch is a fixed cost that a run of hours amortises
                r["steady_tok_per_s"] = round(r["tokens"] / (r["seconds"] - r["tail_s"]))
                notes.append(f"{r['steady_tok_per_s'] / plain_warm:.2f}x without the final tail")
        hf = rows.get("ours hf, RAM" if "RAM" in name else "ours hf, disk")
        if name.startswith("ours vllm") and hf:
            r["ratio_vs_hf"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 2)
            notes.append(f"{r['ratio_vs_hf']:.2f}x hf")
        if "disk" in name:
            notes.append(f"{r['tokens_per_s'] * r['bytes'] / r['tokens'] / res['disk_write_fsync_bytes_per_s']:.2f} "
                         "of disk bound")
        table.append((name, r["tokens_per_s"], ", ".join(notes)))
    save()
    print(f"\n{'':<38} {'tok/s':>10}  note")
    for name, tps, note in table:
        print(f"{name:<38} {tps:>10,.0f}  {note}")
    print(f"\n{'time split (s)':<38} {'run':>6} {'backend':>8} {'wait':>6} {'tail':>6}  writers: "
          "n pool, summed time taking the backend's output, checking + writing")
    for name, r in rows.items():
        if "backend_s" in r:
            print(f"{name:<38} {r['seconds']:>6.1f} {r['backend_s']:>8.1f} {r['writers_wait_s']:>6.1f} "
                  f"{r['tail_s']:>6.1f}  {r['writers']} {r['writer_pool']}, {r['writers_load_s']:.1f}, "
                  f"{r['writers_write_s']:.1f}")
    print("BENCH " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
