"""Stages extract_hidden_states, extract_parity_hidden_states: the target's hidden states for every
tokenized sample, in per-batch shards.

  python -m eaglepipe.extract_hidden_states --train T.jsonl --eval E.jsonl --model M \
      --backend hf|vllm --layer-ids auto|2,15,27,30 --batch-size 64 --shard-dir DIR \
      --replica i --replicas R --out parts/replica-i-of-R.json   (all flags: --help)

Each split is cut into consecutive batches of --batch-size samples, one shard per batch
(``{split}-{batch:06d}.safetensors``); replica i of R does the batches with batch % R == i. The
model is loaded once. A rerun reuses every shard that is complete and was made from the same
settings and the same samples, so a crash costs one model load, not the work done. The output is
a part manifest that ``eaglepipe.gather_manifest`` merges.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from . import shards
from .atomic import read_json_object, remove_stale_temporaries
from .checksum import CHECKSUM
from .dir_lock import dir_lock
from .model_dir import check_model_dir
from .layers import CONVENTION, resolve_layer_ids
from .progress import TokenProgress
from .units import human_bytes
from .writer_pool import POOLS, make_pool

SPLITS = ("train", "eval")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "special_tokens_map.json", "chat_template.jinja")
DISK_MARGIN = 1.05
DISK_RESERVE = 1 << 30
MAX_WRITERS = 8
WRITER_MEMORY = 32 << 30
RAM_DISK = Path("/dev/shm")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Sample:
    index: int  # position in its split's file, stored as the shard's sample_index
    id: str
    input_ids: list[int]
    loss_mask: list[int]


def read_samples(path: str) -> list[Sample]:
    """Tokenized JSONL from prepare_data; any malformed record is an error naming file and line."""
    out: list[Sample] = []
    seen: dict[str, int] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{where}: not valid JSON ({e})") from e
            if not isinstance(rec, dict):
                raise SystemExit(f"{where}: expected an object with id, input_ids, loss_mask")
            for key in ("id", "input_ids", "loss_mask"):
                if key not in rec:
                    raise SystemExit(f"{where}: missing field {key!r} (need id, input_ids, loss_mask)")
            ids, mask = rec["input_ids"], rec["loss_mask"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                raise SystemExit(f"{where}: field 'input_ids' must be a non-empty list of token ids >= 0")
            if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
                raise SystemExit(f"{where}: field 'loss_mask' must be a list of 0/1 as long as input_ids "
                                 f"({len(ids)}), got {len(mask) if isinstance(mask, list) else type(mask).__name__}")
            sid = str(rec["id"])
            if sid in seen:
                raise SystemExit(f"{where}: id {sid!r} repeats line {seen[sid]}; ids must be unique")
            seen[sid] = lineno
            out.append(Sample(len(out), sid, ids, mask))
    return out


def parse_layer_ids(text: str, num_hidden_layers: int) -> list[int]:
    try:
        configured = None if text == "auto" else [int(x) for x in text.split(",")]
        return resolve_layer_ids(configured, num_hidden_layers)
    except ValueError as e:
        raise SystemExit(f"--layer-ids {text}: {e}") from e


def bytes_per_token(num_layers: int, hidden: int, dtype_bytes: int, storage: str) -> int:
    """Shard bytes per token: states (fp8: aux 1 B + a 4 B scale per layer) + input_ids + loss_mask."""
    if storage == "fp8":
        states = (num_layers - 1) * (hidden + 4) + hidden * dtype_bytes
    else:
        states = num_layers * hidden * dtype_bytes
    return states + 8 + 1


def tokenizer_digest(model: str, revision: str | None) -> str | None:
    """Digest of the tokenizer files next to the model (local dir or hub cache), if there are any."""
    d = Path(model)
    if not d.is_dir():
        try:
            from huggingface_hub import snapshot_download

            d = Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:  # not cached locally: the digest is "if available"
            return None
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        if (d / name).is_file():
            h.update(name.encode() + b"\0" + (d / name).read_bytes())
            found = True
    return h.hexdigest()[:16] if found else None


# Flags that do not change what a shard holds; every other flag does (a new flag counts until it
# is listed here), so a shard made with any other value is never reused. The backend, device and
# vLLM engine flags count: other kernels give other bits.
RESULT_NEUTRAL = {
    "train": "each shard's samples are compared one by one",
    "eval": "each shard's samples are compared one by one",
    "batch_size": "each shard's samples are compared one by one",
    "trust_remote_code": "whether the target's own code may load",
    "staging_dir": "where vLLM's files wait",
    "connector_threads": "how vLLM's files are written",
    "writer_pool": "how shards are written",
    "shard_dir": "where shards go",
    "replica": "which shards this job makes",
    "replicas": "which shards this job makes",
    "out": "where the part manifest goes",
}


def settings_of(args, layer_ids: list[int], tokenizer: str | None) -> dict:
    """What decides a shard's content: every flag not RESULT_NEUTRAL (layer ids resolved), the
    tokenizer's digest (shards of another tokenizer are never reused) and the format version."""
    s = {k: v for k, v in vars(args).items() if k not in RESULT_NEUTRAL}
    s.update(layer_ids=layer_ids, tokenizer_digest=tokenizer, format_version=shards.FORMAT_VERSION)
    s["digest"] = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]
    return s


def shard_name(split: str, batch: int) -> str:
    return f"{split}-{batch:06d}.safetensors"


def reusable_row(path: Path, batch: list[Sample], digest: str, num_layers: int, hidden: int):
    """The manifest row of an existing intact shard that holds exactly this batch with these
    settings, else None (a damaged one is logged)."""
    if not path.is_file():
        return None
    problem = shards.recorded_damage(path)
    if problem:
        log(f"shard {path} {problem}: rebuilding it")
        return None
    if not shards.shard_is_valid(path):
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["eaglepipe"])
            if meta.get("settings_digest") != digest:
                return None
            skipped = {s["id"] for s in meta.get("skipped", [])}
            kept = [s for s in batch if s.id not in skipped]
            if meta.get("sample_ids") != [s.id for s in kept] or len(skipped) + len(kept) != len(batch):
                return None
            if f.get_tensor("sample_index").tolist() != [s.index for s in kept]:
                return None
            if f.get_tensor("input_ids").tolist() != [t for s in kept for t in s.input_ids]:
                return None
            if f.get_tensor("loss_mask").tolist() != [m for s in kept for m in s.loss_mask]:
                return None
            T = sum(len(s.input_ids) for s in kept)
            if "hidden_states" in f.keys():
                ok = f.get_slice("hidden_states").get_shape() == [T, num_layers, hidden]
            else:
                ok = (f.get_slice("aux_fp8").get_shape() == [T, num_layers - 1, hidden]
                      and f.get_slice("final").get_shape() == [T, hidden])
            if not ok:
                return None
    except Exception:  # unreadable in any way: rewrite it
        return None
    checksum = read_json_object(shards.checksum_path(path), "shard checksum")[CHECKSUM]  # just verified
    return {"file": path.name, "samples": len(kept), "tokens": T, "bytes": path.stat().st_size,
            CHECKSUM: checksum}, meta.get("skipped", [])


def all_finite(x: torch.Tensor) -> bool:
    """Exact, and ~45x faster than ``isfinite(x).all()`` on 256 MiB of bf16 (2 cores, 9 vs 433 ms):
    a NaN or inf makes the sum non-finite, so a finite sum proves every element finite; only a
    non-finite sum (the rare case, or an overflow of huge finite values) pays for the
    element-wise check."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def pack_and_write(path: Path, split: str, b: int, batch: list[Sample], loaded, meta: dict,
                   storage: str, num_layers: int, hidden: int):
    """Check the backend's states against the batch, pack them into one shard; return (row, skipped)."""
    if len(loaded) != len(batch):
        raise RuntimeError(f"{split} batch {b}: the backend returned {len(loaded)} results for {len(batch)} samples")
    kept, states, skipped = [], [], []
    for s, (hs, token_ids) in zip(batch, loaded):
        where = f"sample {s.id!r} ({split} record {s.index})"
        if token_ids is not None and token_ids != s.input_ids:
            raise SystemExit(f"{where}: the backend saw other token ids than the input "
                             f"({len(token_ids)} vs {len(s.input_ids)} tokens)")
        if tuple(hs.shape) != (len(s.input_ids), num_layers, hidden):
            raise SystemExit(f"{where}: hidden states of shape {tuple(hs.shape)}, expected "
                             f"({len(s.input_ids)} tokens, {num_layers} layers, {hidden})")
        if not all_finite(hs):
            skipped.append({"split": split, "batch": b, "index": s.index, "id": s.id,
                            "reason": "non-finite hidden states"})
            continue
        kept.append(s)
        states.append(hs)
    if not kept:
        path.unlink(missing_ok=True)
        shards.checksum_path(path).unlink(missing_ok=True)
        return None, skipped
    offsets = [0]
    for s in kept:
        offsets.append(offsets[-1] + len(s.input_ids))
    row = shards.write_shard(
        path,
        hidden_states=states,
        input_ids=torch.tensor([t for s in kept for t in s.input_ids]),
        loss_mask=torch.tensor([m for s in kept for m in s.loss_mask]),
        sample_index=torch.tensor([s.index for s in kept]),
        offsets=torch.tensor(offsets),
        metadata=dict(meta, split=split, batch=b, sample_ids=[s.id for s in kept], skipped=skipped),
        storage_dtype=storage,
    )
    return row, skipped


def write_batch(path: Path, split: str, b: int, batch: list[Sample], loader, meta: dict, storage: str,
                num_layers: int, hidden: int):
    """One writer's job (a thread's or a process's): take the backend's output, write the shard;
    return ((row, skipped), seconds taking the output, seconds checking and writing)."""
    t0 = time.perf_counter()
    loaded = loader()
    t1 = time.perf_counter()
    result = pack_and_write(path, split, b, batch, loaded, meta, storage, num_layers, hidden)
    return result, t1 - t0, time.perf_counter() - t1


def extract(backend, pool, writers: int, jobs: list[tuple[str, int, list[Sample]]], shard_dir: Path,
            meta: dict, storage: str, num_layers: int, hidden: int):
    """Stream the jobs' batches through the backend into the writers, at most 2 x writers batches
    ahead of them; return ([(split, batch, row or None, skipped)], throughput with the time split)."""
    by_key = {(split, b): batch for split, b, batch in jobs}
    done = []
    # where the time goes: in the backend (the GPU's share) or blocked on the writers; the tail
    # after the last batch is the writers' alone. The writers' own time, summed over them, splits
    # into taking the backend's output (for vLLM: waiting for the connector to finish its files)
    # and checking + writing shards (checksums, disk)
    busy = {"backend_s": 0.0, "writers_wait_s": 0.0, "writers_load_s": 0.0, "writers_write_s": 0.0}
    with TokenProgress(sum(len(s.input_ids) for *_, batch in jobs for s in batch), "extract") as bar:

        def finish(key, future):
            (row, skip), load_s, write_s = future.result()
            busy["writers_load_s"] += load_s
            busy["writers_write_s"] += write_s
            done.append((*key, row, skip))
            bar.update(sum(len(s.input_ids) for s in by_key[key]), shards=len(done))

        def timed(key: str, fn, *a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                busy[key] += time.perf_counter() - t

        pending: deque = deque()
        items = backend.batches((key, [s.input_ids for s in batch]) for key, batch in by_key.items())
        try:
            while (item := timed("backend_s", next, items, None)) is not None:
                (split, b), loader = item
                pending.append(((split, b), pool.submit(write_batch, shard_dir / shard_name(split, b), split, b,
                                                        by_key[split, b], loader, meta, storage, num_layers,
                                                        hidden)))
                while pending and (len(pending) > 2 * writers or pending[0][1].done()):
                    timed("writers_wait_s", finish, *pending.popleft())
            t_tail = time.perf_counter()
            while pending:
                finish(*pending.popleft())
            busy["tail_s"] = time.perf_counter() - t_tail
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
        return done, dict(bar.summary(), writers=writers, **{k: round(v, 3) for k, v in busy.items()})


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="tokenized train JSONL {id, input_ids, loss_mask}")
    ap.add_argument("--eval", required=True, help="tokenized eval JSONL")
    ap.add_argument("--model", required=True, help="target: local directory or hub id")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="hf backend only")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm backend only")
    ap.add_argument("--layer-ids", default="auto", help="auto or ascending ids ending with num_hidden_layers")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per shard")
    ap.add_argument("--storage-dtype", choices=list(shards.STORAGE_DTYPES), default="model")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=8192, help="vllm backend only")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm backend only")
    ap.add_argument("--enforce-eager", action="store_true", help="vllm backend only")
    ap.add_argument("--staging-dir", default="auto",
                    help="vllm backend: where vLLM's per-request files wait to be packed: auto (the RAM "
                         f"disk {RAM_DISK} when it has room, else the shard directory), shards, or a directory")
    ap.add_argument("--connector-threads", type=int, default=None,
                    help="vllm backend: threads of vLLM's connector writing its per-request files "
                         "(default: vLLM's, 8 in 0.26.0)")
    ap.add_argument("--writer-pool", choices=["auto", *POOLS], default="auto",
                    help="shard writers as threads or processes: auto = processes for vllm (its output is "
                         "files; each writer gets its own interpreter), threads for hf (tensors in memory)")
    ap.add_argument("--shard-dir", required=True)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--out", required=True, help="part manifest JSON")
    args = ap.parse_args(argv)
    if args.replicas < 1 or not 0 <= args.replica < args.replicas:
        ap.error(f"--replica {args.replica} --replicas {args.replicas}: need 0 <= replica < replicas")
    if args.staging_dir not in ("auto", "shards") and not Path(args.staging_dir).is_dir():
        ap.error(f"--staging-dir {args.staging_dir}: no such directory")
    if args.batch_size < 1:
        ap.error(f"--batch-size {args.batch_size}: must be >= 1")
    if args.connector_threads is not None and args.connector_threads < 1:
        ap.error(f"--connector-threads {args.connector_threads}: must be >= 1")
    return args


def same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def has_room(where: Path, need: int) -> bool:
    """Room for ``need`` bytes in ``where`` with a 5 % and 1 GiB margin."""
    return need * DISK_MARGIN + DISK_RESERVE <= shutil.disk_usage(where).free


def staging_dir(args, shard_dir: Path, staged_bytes: int) -> Path:
    """This replica's own subdirectory for vLLM's per-request files (emptied at start, removed at the end).

    On the shard disk these transient files compete with the shards for its bandwidth: on the
    H200 the default 'auto' (RAM disk) took extraction from 48k to 80k tok/s, the disk's bound.
    """
    if args.staging_dir == "auto":
        root = RAM_DISK if RAM_DISK.is_dir() and has_room(RAM_DISK, staged_bytes) else shard_dir
    elif args.staging_dir == "shards":
        root = shard_dir
    else:
        root = Path(args.staging_dir)
    if root == shard_dir:
        return shard_dir / f".staging-replica{args.replica}"
    tag = hashlib.sha256(str(shard_dir.resolve()).encode()).hexdigest()[:8]
    return root / f"eaglepipe-staging-{tag}-replica{args.replica}"


def load_backend(args, layer_ids, num_hidden_layers, staging: Path | None):
    if args.backend == "vllm":
        from .extract_vllm import VLLMExtractor

        return VLLMExtractor(
            args.model, layer_ids, args.dtype, staging,
            tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
            revision=args.revision, trust_remote_code=args.trust_remote_code,
            connector_threads=args.connector_threads)
    from .extract_hf import HFExtractor

    return HFExtractor(args.model, layer_ids, num_hidden_layers, DTYPES[args.dtype], device=args.device,
                       revision=args.revision, trust_remote_code=args.trust_remote_code)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_model_dir(args.model)
    # replicas share the shard directory (disjoint batches): one lock per replica
    with dir_lock(args.shard_dir, f".lock-replica{args.replica}"):
        run(args)


def run(args) -> None:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(args.model, revision=args.revision,
                                         trust_remote_code=args.trust_remote_code).get_text_config()
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model {args.model}: cannot read its config ({e})") from e
    N, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    layer_ids = parse_layer_ids(args.layer_ids, N)
    L = len(layer_ids)
    tokenizer = tokenizer_digest(args.model, args.revision)
    settings = settings_of(args, layer_ids, tokenizer)
    shard_dir = Path(args.shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    stale = remove_stale_temporaries(shard_dir)
    if stale:
        log(f"removed {stale} stale temporary files from {shard_dir}")

    # ---- plan: every split's batches, this replica's share, what can be reused
    data = {"train": read_samples(args.train), "eval": read_samples(args.eval)}
    for split, samples in data.items():
        for s in samples:
            if max(s.input_ids) >= V:
                raise SystemExit(f"{getattr(args, split)}: sample {s.id!r} has token id {max(s.input_ids)}, "
                                 f"the target's vocabulary has {V}")
            if args.backend == "vllm" and len(s.input_ids) > args.max_model_len:
                raise SystemExit(f"{getattr(args, split)}: sample {s.id!r} has {len(s.input_ids)} tokens, "
                                 f"more than --max-model-len {args.max_model_len}")
    batches = {split: [data[split][i:i + args.batch_size] for i in range(0, len(data[split]), args.batch_size)]
               for split in SPLITS}
    mine = [(split, b) for split in SPLITS for b in range(len(batches[split])) if b % args.replicas == args.replica]
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    empty: dict[str, list[int]] = {split: [] for split in SPLITS}
    skipped: list[dict] = []
    todo = []
    for split, b in mine:
        found = reusable_row(shard_dir / shard_name(split, b), batches[split][b], settings["digest"], L, H)
        if found:
            rows[split].append(dict(found[0], batch=b))
            skipped += found[1]
        else:
            todo.append((split, b))
    n_reused = len(mine) - len(todo)

    dtype_bytes = DTYPES[args.dtype].itemsize
    bpt = bytes_per_token(L, H, dtype_bytes, args.storage_dtype)
    tokens_mine = sum(len(s.input_ids) for split, b in mine for s in batches[split][b])
    tokens_todo = sum(len(s.input_ids) for split, b in todo for s in batches[split][b])
    n_all = {split: len(data[split]) for split in SPLITS}
    log(f"target {args.model}: {N} layers, hidden {H}, vocab {V}; layer ids {layer_ids} ({CONVENTION})")
    log(f"data: train {n_all['train']} samples in {len(batches['train'])} batches, eval {n_all['eval']} "
        f"samples in {len(batches['eval'])} batches of up to {args.batch_size}")
    log(f"replica {args.replica} of {args.replicas}: {len(mine)} shards, "
        f"{sum(len(batches[s][b]) for s, b in mine)} samples, {tokens_mine} tokens")
    log(f"bytes/token: {L} layers x {H} x {dtype_bytes} B = {L * H * dtype_bytes} B of states"
        + (f", fp8 aux storage -> {bpt - 9} B" if args.storage_dtype == "fp8" else "")
        + f", {bpt} B with input_ids and loss_mask")
    log(f"projected size: {human_bytes(tokens_mine * bpt)} for this replica; {n_reused} shards reusable, "
        f"{len(todo)} to write ({tokens_todo} tokens, {human_bytes(tokens_todo * bpt)})")
    # GPU: several writers check and write while the GPU runs on, as many as WRITER_MEMORY allows
    # (each holds its batch as loaded, plus fp8 copies); CPU: one, cores are scarce
    batch_tokens = max((sum(len(s.input_ids) for s in batches[sp][b]) for sp, b in todo), default=0)
    writers = 1 if args.backend == "hf" and args.device == "cpu" else \
        max(1, min(MAX_WRITERS, WRITER_MEMORY // max(1, 2 * batch_tokens * L * H * dtype_bytes)))
    needs = {shard_dir: (tokens_todo * bpt, "the shards still to write")}
    staging = None
    if args.backend == "vllm":
        from .extract_vllm import LOOKAHEAD_TOKENS

        # vLLM's files wait from generation until a writer takes them: the queue of 2 x writers
        # batches, the batch being handed over, and what is queued in the engine (the lookahead,
        # overshot by up to one batch)
        staged = min(tokens_todo, (2 * writers + 2) * batch_tokens + LOOKAHEAD_TOKENS) * L * H * dtype_bytes
        staging = staging_dir(args, shard_dir, staged)
        if same_filesystem(staging.parent, shard_dir):
            needs[shard_dir] = (needs[shard_dir][0] + staged, "the shards still to write and vLLM's staging")
        else:
            needs[staging.parent] = (staged, "vLLM's staged files")
        log(f"vLLM staging: {staging} (up to {human_bytes(staged)})")
    for where, (need, what) in needs.items():
        if todo and not has_room(where, need):
            raise SystemExit(f"not enough disk space in {where}: {what} need {human_bytes(need)} (plus 5% and "
                             f"1 GiB margin), {human_bytes(shutil.disk_usage(where).free)} is free; free space, move "
                             f"the shard or staging directory or use extract.storage_dtype fp8")

    # ---- extract what is missing
    meta = {"layer_ids": layer_ids, "layer_convention": CONVENTION,
            "target": {"model": args.model, "revision": args.revision}, "dtype": args.dtype,
            "tokenizer_digest": tokenizer,
            "settings_digest": settings["digest"], "backend": args.backend}
    load_s = 0.0
    progress = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    if todo:
        imports = ()  # what writer processes import at start (a thread pool has none to do)
        if args.backend == "vllm":
            from .extract_vllm import WRITER_IMPORTS as imports
        pool_kind = args.writer_pool if args.writer_pool != "auto" else \
            "processes" if args.backend == "vllm" else "threads"
        with make_pool(pool_kind, writers, imports) as pool:
            t0 = time.perf_counter()  # writer processes start while the model loads
            backend = load_backend(args, layer_ids, N, staging)
            load_s = time.perf_counter() - t0
            log(f"{args.backend} backend loaded in {load_s:.1f}s")
            jobs = [(split, b, batches[split][b]) for split, b in todo]
            done, progress = extract(backend, pool, writers, jobs, shard_dir, meta, args.storage_dtype, L, H)
        backend.close()
        for split, b, row, skip in done:
            skipped.extend(skip)
            if row is None:
                empty[split].append(b)
            else:
                rows[split].append(dict(row, batch=b))
        log(f"time: {progress['seconds']:.1f}s = backend {progress['backend_s']:.1f}s + waiting for the writers "
            f"({writers} {pool_kind}) {progress['writers_wait_s']:.1f}s + their tail {progress['tail_s']:.1f}s "
            f"(+ overheads); the writers, summed: {progress['writers_load_s']:.1f}s taking the backend's output"
            + (" (waiting for vLLM's files)" if args.backend == "vllm" else "")
            + f", {progress['writers_write_s']:.1f}s checking and writing shards")
        progress["writer_pool"] = pool_kind
    log(f"reused {n_reused} shards, wrote {len(todo) - sum(map(len, empty.values()))}")
    if skipped:
        log(f"skipped {len(skipped)} samples with non-finite hidden states: "
            + ", ".join(f"{s['split']}/{s['id']}" for s in skipped))

    # ---- part manifest
    out = Path(args.out)
    splits = {}
    for split in SPLITS:
        rs = sorted(rows[split], key=lambda r: r["batch"])
        splits[split] = {"shards": rs, "empty_batches": sorted(empty[split]),
                         "samples": sum(r["samples"] for r in rs), "tokens": sum(r["tokens"] for r in rs),
                         "bytes": sum(r["bytes"] for r in rs)}
    manifest = {
        "target": {"model": args.model, "revision": args.revision, "num_hidden_layers": N,
                   "hidden_size": H, "vocab_size": V, "dtype": args.dtype},
        "layer_ids": layer_ids,
        "layer_convention": CONVENTION,
        "storage_dtype": args.storage_dtype,
        "backend": args.backend,
        "shard_dir": os.path.relpath(shard_dir.resolve(), out.parent.resolve()),
        "splits": splits,
        "skipped": sorted(skipped, key=lambda s: (s["split"], s["index"])),
        "replica": {"index": args.replica, "count": args.replicas,
                    "batches": {split: len(batches[split]) for split in SPLITS}},
        "throughput": dict(progress, model_load_s=round(load_s, 2)),
        "settings": dict(settings, batch_size=args.batch_size),
        "tokenizer_digest": meta["tokenizer_digest"],
        "bytes_per_token": bpt,
    }
    shards.write_manifest(out, manifest)
    log(f"wrote {out}: {sum(s['tokens'] for s in splits.values())} tokens in "
        f"{sum(len(s['shards']) for s in splits.values())} shards, "
        f"{human_bytes(sum(s['bytes'] for s in splits.values()))}")


if __name__ == "__main__":
    main()
