"""Stages extract_hidden_states, extract_parity_hidden_states: the target's hidden states for every
tokenized sample, in per-batch shards.

  python -m eaglepipe.extract_hidden_states --train T.jsonl --eval E.jsonl --model M \
      --backend hf|vllm [--layer-ids 2,15,27,30] --batch-size 64 --shard-dir DIR \
      --replica i --replicas R --out parts/replica-i-of-R.json   (all flags: --help)

Each split is cut into consecutive batches of --batch-size samples, one shard per batch
(``{split}-{batch:06d}.safetensors``); replica i of R does the batches with batch % R == i. The
model is loaded once. A rerun reuses every shard that is complete and was made from the same
settings and the same samples, so a crash costs one model load, not the work done. The output is
a part manifest that ``eaglepipe.gather_manifest`` merges.

This module holds the flags, the plan and the order of work; the samples are read by
``tokenized_samples``, batches become shards in ``shard_pipeline``, the disk room is checked in
``disk_budget``, and ``shards`` owns the shard format.

With ``--disk-budget-gib`` and shards that would not fit it, only the eval shards are written and
the train batches are listed as deferred: training starts this module again with ``--schedule``
as its producer, which makes the train shards while training runs (``shard_budget``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import disk_budget, shard_budget, shard_manifest, shards
from .atomic import read_json_object, remove_stale_temporaries
from .dir_lock import dir_lock
from .model_dir import check_model_dir
from .layers import CONVENTION, resolve_layer_ids
from .shard_pipeline import extract, reusable_row, writer_count
from .tokenized_samples import read_prepared
from .units import human_bytes
from .settings import add_stage_arguments
from .vllm_env import gib_above_zero
from .writer_pool import POOLS, make_pool

SPLITS = ("train", "eval")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                   "special_tokens_map.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_layer_ids(configured: list[int] | None, num_hidden_layers: int) -> list[int]:
    """--layer-ids, or the default ids of a target of ``num_hidden_layers`` when it is not given."""
    try:
        return resolve_layer_ids(configured, num_hidden_layers)
    except ValueError as e:
        raise SystemExit(f"--layer-ids {','.join(map(str, configured or []))}: {e}") from e


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
# vLLM engine flags count: other kernels give other bits (the memory flags, --kv-cache-gib too:
# the KV cache bounds the batches the engine runs, and another batch shape is other kernels).
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
    "disk_budget_gib": "which shards stay on disk, not what a shard holds",
    "schedule": "which shards this job makes",
}


def settings_of(args, layer_ids: list[int], tokenizer: str | None) -> dict:
    """What decides a shard's content: every flag not RESULT_NEUTRAL (layer ids resolved), the
    tokenizer's digest (shards of another tokenizer are never reused) and the format version."""
    s = {k: v for k, v in vars(args).items() if k not in RESULT_NEUTRAL}
    s.update(layer_ids=layer_ids, tokenizer_digest=tokenizer, format_version=shard_manifest.FORMAT_VERSION)
    s["digest"] = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]
    return s


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="tokenized train JSONL {id, input_ids, loss_mask}")
    ap.add_argument("--eval", required=True, help="tokenized eval JSONL")
    ap.add_argument("--model", required=True, help="target: local directory or hub id")
    add_stage_arguments(ap, "extract_hidden_states", types={"kv_cache_gib": gib_above_zero})
    ap.add_argument("--connector-threads", type=int, default=None,
                    help="vllm backend: threads of vLLM's connector writing its per-request files "
                         "(default: vLLM's, 8 in 0.26.0)")
    ap.add_argument("--writer-pool", choices=["auto", *POOLS], default="auto",
                    help="shard writers as threads or processes: auto = processes for vllm (its output is "
                         "files; each writer gets its own interpreter), threads for hf (tensors in memory)")
    ap.add_argument("--shard-dir", required=True)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--out", help="part manifest JSON (required but with --schedule)")
    ap.add_argument("--schedule", default=None,
                    help="run as the producer of a training under a disk budget: make the train shards this "
                         "schedule (written by train_draft) lists, each when the budget has room (shard_budget)")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replicas < 1 or not 0 <= args.replica < args.replicas:
        ap.error(f"--replica {args.replica} --replicas {args.replicas}: need 0 <= replica < replicas")
    if args.staging_dir not in ("auto", "shards") and not Path(args.staging_dir).is_dir():
        ap.error(f"--staging-dir {args.staging_dir}: no such directory")
    if args.out is None and args.schedule is None:
        ap.error("--out is required (the part manifest)")
    if args.connector_threads is not None and args.connector_threads < 1:
        ap.error(f"--connector-threads {args.connector_threads}: must be >= 1")
    return args


def load_backend(args, layer_ids, num_hidden_layers, staging: Path | None):
    if args.backend == "vllm":
        from .extract_vllm import VLLMExtractor

        return VLLMExtractor(
            args.model, layer_ids, args.dtype, staging,
            tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
            revision=args.revision, trust_remote_code=args.trust_remote_code,
            connector_threads=args.connector_threads, kv_cache_gib=args.kv_cache_gib)
    from .extract_hf import HFExtractor

    return HFExtractor(args.model, layer_ids, num_hidden_layers, DTYPES[args.dtype], device=args.device,
                       revision=args.revision, trust_remote_code=args.trust_remote_code)


def main(argv=None) -> None:
    args = parse_args(argv)
    check_model_dir(args.model)
    # replicas share the shard directory (disjoint batches): one lock per replica; a disk budget's
    # producer (started by the training) has its own
    with dir_lock(args.shard_dir, ".lock-producer" if args.schedule else f".lock-replica{args.replica}"):
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

    # ---- plan: every split's batches, this replica's share, what can be reused
    data = {"train": read_prepared(args.train), "eval": read_prepared(args.eval)}
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
    dtype_bytes = DTYPES[args.dtype].itemsize
    bpt = shards.bytes_per_token(L, H, dtype_bytes, args.storage_dtype)
    meta = {"layer_ids": layer_ids, "layer_convention": CONVENTION,
            "target": {"model": args.model, "revision": args.revision}, "dtype": args.dtype,
            "tokenizer_digest": tokenizer,
            "settings_digest": settings["digest"], "backend": args.backend}
    if args.schedule:
        return produce(args, batches["train"], meta, N, L, H, shard_dir)
    # the whole run's shards (every replica's), against the disk budget
    budget = shard_budget.plan(args.disk_budget_gib, {
        split: [shard_budget.shard_bytes(sum(len(s.input_ids) for s in batch), len(batch), bpt)
                for batch in batches[split]] for split in SPLITS}, bpt)
    deferred = []
    if budget:
        deferred = [(split, b) for split, b in mine if split == "train"]
        mine = [(split, b) for split, b in mine if split != "train"]
        whole = [shard_dir / shards.shard_name(split, b) for split, b in deferred]
        whole = [p for p in whole if p.is_file()]
        for p in whole:  # shards of an extraction without the budget: the budget bounds them too
            p.unlink()
            shards.checksum_path(p).unlink(missing_ok=True)
        log(f"disk budget {human_bytes(budget['bytes'])} (extract.disk_budget_gib {args.disk_budget_gib}): the run's "
            f"shards would take {human_bytes(budget['projected_bytes'])}; writing the eval shards now "
            f"({human_bytes(budget['eval_bytes'])}), the {len(deferred)} train shard(s) of this replica while "
            f"training runs, within {human_bytes(budget['train_bytes'])}"
            + (f"; removed {len(whole)} train shard(s) written without the budget" if whole else ""))
    elif args.disk_budget_gib is not None:
        log(f"disk budget {args.disk_budget_gib} GiB: the run's shards fit it, every shard is written now")
    # only this replica's leftovers: the other replicas write into the same directory at the same time
    stale = remove_stale_temporaries(shard_dir, [shards.shard_name(split, b) for split, b in mine])
    if stale:
        log(f"removed {stale} stale temporary files from {shard_dir}")
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for split, b in deferred:
        rows[split].append(shard_budget.deferred_row(shards.shard_name(split, b), b, batches[split][b], bpt))
    empty: dict[str, list[int]] = {split: [] for split in SPLITS}
    skipped: list[dict] = []
    todo = []
    for split, b in mine:
        found = reusable_row(shard_dir / shards.shard_name(split, b), batches[split][b], settings["digest"], L, H)
        if found:
            rows[split].append(dict(found[0], batch=b))
            skipped += found[1]
        else:
            todo.append((split, b))
    n_reused = len(mine) - len(todo)

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
    batch_tokens = max((sum(len(s.input_ids) for s in batches[sp][b]) for sp, b in todo), default=0)
    writers = writer_count(args.backend == "hf" and args.device == "cpu", batch_tokens, L * H * dtype_bytes)
    staging, staged = None, 0
    if args.backend == "vllm":
        from .extract_vllm import LOOKAHEAD_TOKENS

        staged = disk_budget.staged_bytes(tokens_todo, batch_tokens, writers, LOOKAHEAD_TOKENS, L * H * dtype_bytes)
        staging = disk_budget.staging_dir(args.staging_dir, args.replica, shard_dir, staged)
        log(f"vLLM staging: {staging} (up to {human_bytes(staged)})")
    if todo:
        disk_budget.check_room(shard_dir, tokens_todo * bpt + (budget["train_bytes"] if budget else 0), staging,
                               staged)

    # ---- extract what is missing
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
    splits = {split: shard_manifest.split_summary(rows[split], empty[split]) for split in SPLITS}
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
    if budget:
        manifest[shard_manifest.BUDGET_KEY] = budget
    shard_manifest.write_manifest(out, manifest)
    log(f"wrote {out}: {sum(s['tokens'] for s in splits.values())} tokens in "
        f"{sum(len(s['shards']) for s in splits.values())} shards, "
        f"{human_bytes(sum(s['bytes'] for s in splits.values()))}")


def produce(args, batches, meta: dict, N: int, L: int, H: int, shard_dir: Path) -> None:
    """The producer of a training under a disk budget: the occurrences its schedule lists (train
    batches of a pass), in order, each when the occurrences on disk leave room for it within the
    budget's train share; intact ones (a rerun after a kill) are reused, damaged ones rebuilt. Each
    one made is recorded (seconds, shard bytes on disk after it) in the schedule's stats file, and
    so is the load of the target (model_load_s), made before the first shard that needs it."""
    schedule = read_json_object(Path(args.schedule), "schedule", SystemExit)
    ppid = os.getppid()
    budget = int(schedule["budget_bytes"])
    occurrences = [tuple(o) for o in schedule["occurrences"]]  # (pass, batch, the schedule row using it last)
    progress = Path(schedule["progress"])
    for _, b, _ in occurrences:
        if b >= len(batches):
            raise SystemExit(f"{args.schedule}: train batch {b} is outside the {len(batches)} batches of {args.train}")
    names = {shard_budget.occurrence_name(e, b) for e, b, _ in occurrences}
    stale = remove_stale_temporaries(shard_dir, sorted(names))
    if stale:
        log(f"removed {stale} stale temporary files from {shard_dir}")
    dtype_bytes = DTYPES[args.dtype].itemsize
    bpt = shards.bytes_per_token(L, H, dtype_bytes, args.storage_dtype)
    backend = pool = None
    made = reused = 0
    stats = open(schedule["stats"], "a")

    def record(entry: dict) -> None:  # flushed: a kill of this producer must not lose what it did
        stats.write(json.dumps(entry) + "\n")
        stats.flush()

    log(f"producer: {len(occurrences)} train shard(s) to provide within {human_bytes(budget)}")
    try:
        for e, b, last in occurrences:
            batch = batches[b]
            path = shard_dir / shard_budget.occurrence_name(e, b)
            def needed(last=last):
                return shard_budget.trained_rows(progress) <= last

            if not needed():  # trained from a copy a killed run left
                continue
            if reusable_row(path, batch, meta["settings_digest"], L, H):
                reused += 1
                continue
            need = shard_budget.shard_bytes(sum(len(s.input_ids) for s in batch), len(batch), bpt)
            waited = shard_budget.wait_for_room(shard_dir, need, budget, ppid, f"producer of {path}", needed)
            if waited is None or not needed():
                continue
            t0 = time.perf_counter()
            if backend is None:
                batch_tokens = max(sum(len(s.input_ids) for s in bt) for bt in batches)
                writers = writer_count(args.backend == "hf" and args.device == "cpu", batch_tokens, L * H * dtype_bytes)
                pool = make_pool("threads", writers, ()).__enter__()
                staging = None
                if args.backend == "vllm":
                    from .extract_vllm import LOOKAHEAD_TOKENS

                    staged = disk_budget.staged_bytes(batch_tokens, batch_tokens, writers, LOOKAHEAD_TOKENS,
                                                      L * H * dtype_bytes)
                    staging = disk_budget.staging_dir(args.staging_dir, args.replica, shard_dir, staged)
                backend = load_backend(args, meta["layer_ids"], N, staging)
                load_s = time.perf_counter() - t0
                # recorded at once: a producer killed before its first shard has loaded the target all the same
                record({"model_load_s": round(load_s, 2)})
                log(f"producer: {args.backend} backend loaded in {load_s:.1f}s")
                t0 = time.perf_counter()
            extract(backend, pool, writers, [("train", b, batch)], shard_dir, meta, args.storage_dtype, L, H,
                    name=lambda split, batch, e=e: shard_budget.occurrence_name(e, batch))
            seconds = time.perf_counter() - t0
            eval_bytes = sum(p.stat().st_size for p in shard_dir.glob("eval-*.safetensors"))
            peak = eval_bytes + shard_budget.occurrence_bytes(shard_dir)
            record({"epoch": e, "batch": b, "seconds": round(seconds, 3), "waited_s": round(waited, 3),
                    "peak_bytes": peak})
            made += 1
    finally:
        stats.close()
        if backend is not None:
            backend.close()
            pool.__exit__(None, None, None)
    log(f"producer: made {made} train shard(s), reused {reused}")


if __name__ == "__main__":
    main()
