#!/usr/bin/env python3
"""Side by side on one GPU: our trainer (eaglepipe.train_draft) vs speculators' own trainer
(``speculators train``), same hidden states, same steps, same tokens per step, same draft.

  python benchmarks/compare_trainers.py --manifest M --vocab V --model T --work DIR \\
      --steps S --batch-tokens B --lr LR[,LR...] --warmup-steps W [--ttt-steps 3] [--k 3] --json OUT

Stages (each skipped when its result file in --work exists, so a killed run resumes):
 1. ours: ``python -m eaglepipe.train_draft`` for S steps, rows of <= B tokens;
 2. convert: our train + eval shards -> speculators' offline format (a ``datasets`` dir with
    input_ids / loss_mask / seq_len, train rows first, then eval rows, and
    ``hidden_states/hs_<row>.safetensors`` = {token_ids [T], hidden_states [T, L, H]}), and our
    vocab mapping -> d2t/t2d .npy;
 3. speculators: its Trainer (``speculators.train.cli.main``, what ``speculators train`` runs) with
    the same draft (1 llama layer, full attention, aux ids from the manifest, d2t/t2d, norm flags,
    kl_div, TTT), AdamW, cosine schedule with the same warm-up, total_seq_len = B, S steps;
 4. both final drafts through OUR offline estimator (``python -m eaglepipe.evaluate``) on the
    manifest's eval split.
With several learning rates (--lr 0.001,0.0015) both trainers run once per rate, interleaved
(ours, speculators, ours, ...) so a drift of the machine's speed hits both, and the table adds each
trainer at its best rate of the grid: its best offline AL and its median ms/step over all its runs
(the learning rate does not change the work of a step, so every run is one more timing sample).
Prints a table and writes --json. What differs between the trainers, by design of each:
 - packing: both pack shuffled samples greedily into rows of <= B real tokens (the same mean fill:
   7,736 of 8,192 on the issue-5 data), each in its own order; speculators pads every row to B and
   computes on the padding, ours does not (tokens/step below are real tokens, each trainer's count);
 - precision: both run bf16 autocast over fp32 weights on the GPU, on bf16 states (ours:
   draft_model.training_row_options, page-locked; speculators: --spec-hidden-states-dtype, bf16
   by default, its recommended setting);
 - data loading: ours reads shards in the training process; speculators uses DataLoader workers
   (--spec-workers) with prefetch;
 - epochs: both cycle through the train split when S rows exceed it, each in its own order.
ms/step is the median after --warmup-report steps: ours from its metrics.jsonl windows (wall time
between logged steps, every step synchronised by its .item() calls), speculators' from its per-step
profile (``step_ms``, every step synchronised at log_freq 1).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from eaglepipe.atomic import read_json_object, write_json  # noqa: E402
from eaglepipe.draft_model import LOSS_IMPLEMENTATION  # noqa: E402
from eaglepipe.packed_data import GLOBAL, ROW_LOADERS, shuffle_buffer  # noqa: E402
from eaglepipe.shard_manifest import load_manifest, shard_paths  # noqa: E402
from eaglepipe.shards import read_shard  # noqa: E402
from eaglepipe.training import FROZEN, LM_HEADS, OPTIMIZERS, TRAINED  # noqa: E402

SPEC_CHILD = "--speculators-child"  # internal: run speculators' trainer in this (child) process


# ----------------------------------------------------------------------------- conversion
def convert_to_speculators(manifest: dict, out: Path, vocab: Path | None = None) -> dict:
    """Write the manifest's train then eval samples in speculators' offline format under ``out``.

    Row i of the dataset is hidden_states/hs_<i>.safetensors (token_ids int64 [T], hidden_states
    [T, L, H] as stored: the aux layers then the final layer). speculators takes the first
    int(rows * train_data_ratio) rows for training and the rest for validation, so the returned
    ratio puts the split exactly at our train/eval boundary.
    """
    from datasets import Dataset
    from safetensors.torch import save_file
    from tqdm import tqdm

    if out.exists():  # another manifest's rows, or a killed conversion: none of them may be read
        shutil.rmtree(out)
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    counts = {}
    for split in ("train", "eval"):
        paths = shard_paths(manifest, split)
        n = 0
        for path, _row in tqdm(paths, desc=f"convert {split}", unit="shard"):
            shard = read_shard(path)
            for b in range(shard.num_samples):
                s = shard.sample(b)
                ids = s["input_ids"].long()
                save_file({"token_ids": ids, "hidden_states": s["hidden_states"].contiguous()},
                          str(hs_dir / f"hs_{len(rows['seq_len'])}.safetensors"))
                rows["input_ids"].append(ids.tolist())
                rows["loss_mask"].append(s["loss_mask"].long().tolist())
                rows["seq_len"].append(int(ids.numel()))
                n += 1
        counts[split] = n
    if not counts["train"] or not counts["eval"]:
        raise SystemExit(f"manifest {manifest.get('_path')}: need train and eval samples, got {counts}")
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")  # as speculators' preprocessing leaves it
    ds.save_to_disk(str(out))
    total = counts["train"] + counts["eval"]
    info = {"train_rows": counts["train"], "eval_rows": counts["eval"],
            # midway between two boundaries, so float rounding cannot move the split
            "train_data_ratio": (counts["train"] + 0.5) / total,
            "train_lengths": rows["seq_len"][: counts["train"]]}
    if vocab is not None:
        import numpy as np

        from eaglepipe.draft_model import load_vocab_mapping

        d2t, t2d = load_vocab_mapping(vocab)
        np.save(out / "d2t.npy", d2t.numpy())
        np.save(out / "t2d.npy", t2d.numpy())
        info["draft_vocab_size"] = int(d2t.numel())
    return info


def speculators_epochs(train_lengths: list[int], batch_tokens: int, steps: int, seed: int) -> tuple[int, list[int]]:
    """Epochs that give speculators exactly ``steps`` steps: its loop runs whole epochs and stops
    at max_steps inside one, but a further epoch would still take one step before stopping."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=batch_tokens, lengths=train_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    per_epoch, done = [], 0
    while done < steps:
        sampler.set_epoch(len(per_epoch))
        per_epoch.append(len(sampler))  # >= 1: the sampler truncates samples longer than a row
        done += per_epoch[-1]
    return len(per_epoch), per_epoch


SPEC_DEFAULTS = "speculators-defaults"


def speculators_argv(args, manifest: dict, data: Path, conv: dict, epochs: int, lr: float | None,
                     name: str = "speculators") -> list[str]:
    """``speculators train`` flags for the draft our trainer builds (draft_model.NORM_FLAGS included).
    ``lr`` None: speculators' own optimizer, learning rate, weight decay and schedule (what a user of
    ``speculators train`` gets without those flags), not ours."""
    from eaglepipe.settings import leaf
    from eaglepipe.draft_model import NORM_FLAGS
    from eaglepipe.layers import aux_layer_ids

    aux = [str(int(i)) for i in aux_layer_ids(manifest["layer_ids"])]
    # what ours trains here, no --draft-layers being given: the schema's draft.layers
    layers = leaf("draft", "layers")["default"]
    work = Path(args.work) / name
    argv = [
        "--verifier-name-or-path", str(args.model), "--speculator-type", "eagle3",
        "--data-path", str(data), "--hidden-states-backend", "file", "--on-missing", "raise",
        "--num-layers", str(layers), "--draft-arch", "llama",
        "--full-attention-indices", *[str(i) for i in range(layers)],
        "--target-layer-ids", *aux,
        "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
        "--draft-vocab-size", str(conv["draft_vocab_size"]),
        "--total-seq-len", str(args.batch_tokens), "--train-data-ratio", repr(conv["train_data_ratio"]),
        "--hidden-states-dtype", args.spec_hidden_states_dtype,
        "--num-workers", str(args.spec_workers), "--prefetch-factor", "4",
        "--loss-fn", "kl_div", "--loss-implementation", "eager", "--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", "1.0",
        *([] if lr is None else ["--optimizer", "adamw", "--lr", repr(lr), "--weight-decay", "0.0",
                                 "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(args.warmup_steps)]),
        "--epochs", str(epochs), "--max-steps", str(args.steps), "--checkpoint-freq", "1", "--log-freq", "1",
        "--save-path", str(work / "checkpoints"), "--log-dir", str(work / "logs"), "--logger", "",
        "--seed", str(args.seed), "--no-resume-from-checkpoint",
    ]
    for flag, value in NORM_FLAGS.items():
        name = flag.replace("_", "-")
        if value:
            argv.append(f"--{name}")
        elif name != "fc-norm":  # --fc-norm has no negative form: off unless given
            argv.append(f"--no-{name}")
    return argv


def speculators_child(argv: list[str]) -> None:
    """Run speculators' trainer here; its per-step metric dicts also go to $SPEC_METRICS (JSONL).

    A root handler, because speculators' dictConfig replaces the handlers of its own loggers.
    """
    path = os.environ["SPEC_METRICS"]

    class Jsonl(logging.Handler):
        def emit(self, record):  # reopened per record: speculators' dictConfig closes handlers
            if isinstance(record.msg, dict) and "global_step" in record.msg:
                with open(path, "a") as f:
                    f.write(json.dumps(record.msg, default=float) + "\n")

    console = logging.StreamHandler(sys.stderr)
    console.addFilter(lambda r: not isinstance(r.msg, dict))
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(Jsonl())
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(argv))


# ----------------------------------------------------------------------------- timing
def median_after(values: list[tuple[int, float]], warmup: int) -> float | None:
    kept = [v for step, v in values if step > warmup]
    return round(statistics.median(kept), 3) if kept else None


def ours_timing(metrics: Path, warmup: int) -> dict:
    """Per-window ms/step from our metrics.jsonl: each train row holds the tokens/s of the window
    since the previous row and the cumulative train tokens."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    ms, prev_step, prev_tokens = [], 0, 0
    for r in train:
        steps, tokens = r["step"] - prev_step, r["train_tokens"] - prev_tokens
        if steps > 0 and r["tokens_per_s"] > 0:
            ms.append((prev_step + 1, 1000.0 * tokens / r["tokens_per_s"] / steps))
        prev_step, prev_tokens = r["step"], r["train_tokens"]
    steps = train[-1]["step"] if train else 0
    return {"steps": steps, "tokens_per_step": round(prev_tokens / steps, 1) if steps else None,
            "ms_per_step": median_after(ms, warmup), "final_train_loss": train[-1]["loss"] if train else None}


def speculators_timing(metrics: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train" in r and r.get("profile")]
    ms = [(r["global_step"] + 1, r["profile"]["step_ms"]) for r in train]
    tokens = [r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000.0 for r in train]
    return {"steps": len(train), "tokens_per_step": round(sum(tokens) / len(tokens), 1) if tokens else None,
            "ms_per_step": median_after(ms, warmup),
            "final_train_loss": train[-1]["train"].get("loss") if train else None}


# ----------------------------------------------------------------------------- stages
def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run ``cmd`` with output to ``log``; returns wall seconds; exits with the log's tail on failure."""
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed (exit {rc}) after {wall:.0f} s; "
                         f"last lines of {log}:\n{tail}")
    return wall


def stage(path: Path, fn, made_from: dict) -> dict:
    """The stage's saved result, or run it and save it. ``made_from``: the settings the result
    depends on, saved with it; a result made from other settings is made again, never reused."""
    if path.is_file():
        result = read_json_object(path, "stage result", SystemExit)
        if result.get("made_from") == made_from:
            print(f"reusing {path}", flush=True)
            return result
        print(f"{path}: made from other settings ({result.get('made_from')}), making it again", flush=True)
    result = {**fn(), "made_from": made_from}
    write_json(path, result)
    return result


def made_from(args, **run) -> dict:
    """The settings a training run's result depends on (the run's own learning rate etc. in ``run``)."""
    return {"manifest": str(args.manifest), "vocab": str(args.vocab), "model": str(args.model), "steps": args.steps,
            "batch_tokens": args.batch_tokens, "warmup_steps": args.warmup_steps, "ttt_steps": args.ttt_steps,
            "seed": args.seed, **run}


def ours_name(buffer_gib: float | str, row_loader: str = "thread", loss: str = "kl_div", ttt_steps: int | None = None,
              loss_decay: float = 1.0, optimizer: str = "adamw", lm_head: str = FROZEN) -> str:
    """ours[-bufN|-global][-process][-<loss>][-tttN][-decayD][-muon][-lmhead]; ttt_steps None: the
    comparison's --ttt-steps."""
    return (("ours" if buffer_gib == 0 else f"ours-{GLOBAL}" if buffer_gib == GLOBAL else f"ours-buf{buffer_gib:g}")
            + ("" if row_loader == "thread" else f"-{row_loader}") + ("" if loss == "kl_div" else f"-{loss}")
            + ("" if ttt_steps is None else f"-ttt{ttt_steps}") + ("" if loss_decay == 1.0 else f"-decay{loss_decay:g}")
            + ("" if optimizer == "adamw" else f"-{optimizer}") + ("" if lm_head == FROZEN else "-lmhead"))


def run_name(trainer: str, lr: float, lrs: list[float]) -> str:
    """The trainer's name, with its learning rate when the grid has several (ours-buf4@lr0.0015)."""
    return trainer if len(lrs) == 1 else f"{trainer}@lr{lr:g}"


def train_ours(args, work: Path, variant: dict, lr: float, name: str) -> dict:
    """One run of our trainer; ``variant``: its shuffle_buffer_gib, row_loader, loss, ttt_steps,
    ttt_step_loss_decay, optimizer and lm_head (frozen or trained)."""
    out = work / name
    if out.exists():  # a killed run: start over, or the timing would mix two processes
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "eaglepipe.train_draft", "--manifest", str(args.manifest), "--vocab", str(args.vocab),
           "--model", str(args.model), "--out-dir", str(out), "--ttt-steps", str(variant["ttt_steps"]),
           "--ttt-step-loss-decay", repr(variant["ttt_step_loss_decay"]), "--optimizer", variant["optimizer"],
           "--lr", repr(lr), "--weight-decay", "0.0",
           "--warmup-steps", str(args.warmup_steps), "--max-steps", str(args.steps),
           "--batch-tokens", str(args.batch_tokens), "--shuffle-buffer-gib", str(variant["shuffle_buffer_gib"]),
           "--row-loader", variant["row_loader"], "--eval-every", str(args.steps),
           "--checkpoint-every", str(args.steps), "--loss", variant["loss"], "--seed", str(args.seed),
           "--lm-head", variant["lm_head"]]
    wall = run_logged(cmd, work / f"{name}_train.log", {"PYTHONPATH": pythonpath()})
    summary = read_json_object(out / "summary.json", "training summary", SystemExit)
    return {"wall_s": round(wall, 1), "lr": lr, "draft": str(out / summary["last"]),
            **ours_timing(out / "metrics.jsonl", args.warmup_report)}


def train_speculators(args, work: Path, manifest: dict, lr: float | None, name: str) -> dict:
    data = work / "speculators_data"
    conv = stage(work / "convert.json", lambda: timed(lambda: convert_to_speculators(manifest, data, args.vocab)),
                 {"manifest": str(args.manifest), "vocab": str(args.vocab)})
    epochs, per_epoch = speculators_epochs(conv["train_lengths"], args.batch_tokens, args.steps, args.seed)
    out = work / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    argv = speculators_argv(args, manifest, data, conv, epochs, lr, name)
    (out / "argv.json").write_text(json.dumps(argv))
    wall = run_logged([sys.executable, str(Path(__file__).resolve()), SPEC_CHILD, *argv], work / f"{name}_train.log",
                      {"PYTHONPATH": pythonpath(), "SPEC_METRICS": str(metrics)})
    ckpts = sorted((p for p in (out / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not ckpts:
        raise SystemExit(f"speculators wrote no checkpoint under {out / 'checkpoints'}")
    return {"wall_s": round(wall, 1), "lr": lr, "draft": str(ckpts[-1]), "epochs": epochs, "batches_per_epoch": per_epoch,
            "convert_s": conv["seconds"], **speculators_timing(metrics, args.warmup_report)}


def timed(fn) -> dict:
    t0 = time.perf_counter()
    result = fn()
    return {**result, "seconds": round(time.perf_counter() - t0, 1)}


def evaluate(args, work: Path, name: str, draft: str) -> dict:
    out = work / f"eval_{name}.json"
    run_logged([sys.executable, "-m", "eaglepipe.evaluate", "--draft", draft, "--manifest", str(args.manifest),
                "--split", "eval", "--model", str(args.model), "--k", str(args.k), "--out", str(out)],
               work / f"eval_{name}.log", {"PYTHONPATH": pythonpath()})
    return read_json_object(out, "offline evaluation", SystemExit)


def pythonpath() -> str:
    return os.pathsep.join([str(REPO / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])


# ----------------------------------------------------------------------------- report
def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def ratios(a: dict, b: dict) -> dict:
    return {k: ratio(a[k], b[k]) for k in ("ms_per_step", "tokens_per_s", "acceptance_length")}


def grid(runs: dict) -> dict:
    """Each trainer at its best learning rate: its best offline AL (and that rate) and its median
    ms/step over all its runs; then each of our trainers over speculators on those two figures."""
    by_trainer: dict[str, list[dict]] = {}
    for name, r in runs.items():
        by_trainer.setdefault(name.split("@")[0], []).append(r)
    best = {}
    for trainer, rs in by_trainer.items():
        top = max(rs, key=lambda r: r["acceptance_length"] or 0)
        ms = [r["ms_per_step"] for r in rs if r["ms_per_step"]]
        best[trainer] = {"lr": top["lr"], "acceptance_length": top["acceptance_length"], "runs": len(rs),
                         "ms_per_step_median": round(statistics.median(ms), 3) if ms else None,
                         "ms_per_step_range": [min(ms), max(ms)] if ms else None}
    def over(base: str) -> dict:  # none before the base has run (a comparison cut short)
        return {} if base not in best else {t: {"acceptance_length": ratio(b["acceptance_length"], best[base]["acceptance_length"]),
                    "ms_per_step": ratio(b["ms_per_step_median"], best[base]["ms_per_step_median"])}
                for t, b in best.items() if t.startswith("ours")}

    return {"best": best, "over_speculators": over("speculators"),
            **({"over_speculators_defaults": over(SPEC_DEFAULTS)} if SPEC_DEFAULTS in best else {})}


def report(results: dict) -> str:
    runs = results["runs"]
    width = max(12, *map(len, runs))
    head = f"{'trainer':<{width}} {'steps':>6} {'tok/step':>9} {'ms/step':>8} {'tok/s':>9} {'AL':>7}  per-position acceptance"
    lines = [head, "-" * len(head)]
    for name, r in runs.items():
        pos = ", ".join(f"{p:.3f}" if p is not None else "-" for p in r["per_position_acceptance"])
        lines.append(f"{name:<{width}} {r['steps']:>6} {r['tokens_per_step'] or 0:>9.0f} {r['ms_per_step'] or 0:>8.1f} "
                     f"{r['tokens_per_s'] or 0:>9.0f} {r['acceptance_length'] or 0:>7.3f}  [{pos}]")
    for pair, q in results["ratios"].items():
        lines.append(f"{pair}: ms/step {q['ms_per_step']}, tokens/s {q['tokens_per_s']}, offline AL {q['acceptance_length']}")
    if len(results["settings"]["lr"]) > 1:
        lines.append("each trainer at its best learning rate of the grid (ms/step: median over all its runs):")
        for trainer, b in results["grid"]["best"].items():
            lo, hi = b["ms_per_step_range"] or (0, 0)
            rate = "its defaults" if b["lr"] is None else f"lr {b['lr']:g}"
            lines.append(f"  {trainer:<{width}} {rate}: AL {b['acceptance_length']:.3f}, "
                         f"ms/step {b['ms_per_step_median']} ({lo}-{hi}, {b['runs']} runs)")
        for trainer, q in results["grid"]["over_speculators"].items():
            lines.append(f"  {trainer} / speculators, each at its best: offline AL {q['acceptance_length']}, "
                         f"ms/step {q['ms_per_step']}")
        for trainer, q in results["grid"].get("over_speculators_defaults", {}).items():
            lines.append(f"  {trainer} at its best / {SPEC_DEFAULTS}: offline AL {q['acceptance_length']}, "
                         f"ms/step {q['ms_per_step']}")
    return "\n".join(lines)


def parse_positive(p: argparse.ArgumentParser, flag: str, text: str, kind=float) -> list:
    """Comma-separated numbers > 0 of ``kind``, sorted, duplicates dropped."""
    try:
        values = sorted({kind(v) for v in text.split(",")})
    except ValueError:
        p.error(f"{flag} {text}: comma-separated {kind.__name__}s, e.g. {'3,5' if kind is int else '0.001,0.0015'}")
    if not values[0] > 0:
        p.error(f"{flag} {text}: each must be > 0")
    return values


def parse_buffers(p: argparse.ArgumentParser, text: str) -> list[float | str]:
    """--ours-shuffle-buffers: train_draft --shuffle-buffer-gib values, numbers sorted, then global."""
    try:
        values = {shuffle_buffer(v) for v in text.split(",")}
    except argparse.ArgumentTypeError as e:
        p.error(f"--ours-shuffle-buffers {text}: {e}")
    return sorted(v for v in values if v != GLOBAL) + [GLOBAL] * (GLOBAL in values)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", required=True, type=Path, help="hidden-state manifest.json (train + eval splits)")
    p.add_argument("--vocab", required=True, type=Path, help="vocab_mapping.safetensors (d2t, t2d)")
    p.add_argument("--model", required=True, type=Path, help="target model directory")
    p.add_argument("--work", required=True, type=Path, help="working directory (both runs, converted data)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--lr", default="0.001",
                   help="learning rate, or a comma-separated grid: both trainers run once per rate")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--k", type=int, default=3, help="draft tokens per chain in the offline estimate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec-workers", type=int, default=8, help="speculators' DataLoader workers")
    p.add_argument("--spec-hidden-states-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup-report", type=int, default=20, help="steps left out of the median ms/step")
    p.add_argument("--ours-shuffle-buffers", default=GLOBAL,
                   help=f"our trainer once per train.shuffle_buffer_gib, e.g. 0,4,{GLOBAL} (rows ours: each shard "
                        f"alone; ours-buf4; ours-{GLOBAL}, one permutation of the split as speculators' sampler)")
    p.add_argument("--ours-row-loaders", default="thread",
                   help="our trainer once per train_draft --row-loader, e.g. thread,process (rows ours-buf4, "
                        "ours-buf4-process)")
    p.add_argument("--ours-losses", default="kl_div",
                   help="our trainer once per train.loss (speculators' losses), e.g. kl_div,lk_hybrid (rows "
                        "ours-buf4, ours-buf4-lk_hybrid); speculators trains with kl_div, its EAGLE-3 default")
    p.add_argument("--ours-ttt-steps", default=None,
                   help="our trainer once per TTT depth, e.g. 3,5 (rows ours-global, ours-global-ttt5); default "
                        "--ttt-steps, what speculators trains with; the offline estimate stays at --k")
    p.add_argument("--ours-loss-decays", default="1.0",
                   help="our trainer once per --ttt-step-loss-decay, e.g. 1,0.8 (rows ours-global, "
                        "ours-global-decay0.8: position i weighted decay**i); speculators keeps 1.0, its default")
    p.add_argument("--ours-optimizers", default="adamw",
                   help="our trainer once per train.optimizer, e.g. adamw,muon (rows ours-global, ours-global-muon: "
                        "Muon on the 2-D weights at the same rate, speculators' split and defaults); speculators "
                        "keeps adamw at --lr (its defaults, Muon, under --spec-defaults)")
    p.add_argument("--ours-lm-heads", default=FROZEN,
                   help=f"our trainer once per state of the draft's lm_head, e.g. {FROZEN},{TRAINED} (rows ours-global, "
                        f"ours-global-lmhead: train_draft --lm-head {TRAINED}, as EAGLE-3's and SpecForge's trainers); "
                        f"speculators keeps it {FROZEN}")
    p.add_argument("--spec-defaults", action="store_true",
                   help=f"also speculators with its own optimizer, learning rate, weight decay and schedule "
                        f"(row {SPEC_DEFAULTS}; speculators 0.9: Muon, lr 1e-3, linear decay)")
    p.add_argument("--json", required=True, type=Path)
    args = p.parse_args(argv)
    for name in ("steps", "batch_tokens", "ttt_steps", "k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    args.lr = parse_positive(p, "--lr", args.lr)
    args.ours_ttt_steps = parse_positive(p, "--ours-ttt-steps", args.ours_ttt_steps or str(args.ttt_steps), int)
    args.ours_loss_decays = parse_positive(p, "--ours-loss-decays", args.ours_loss_decays)
    args.ours_shuffle_buffers = parse_buffers(p, args.ours_shuffle_buffers)
    args.ours_row_loaders = list(dict.fromkeys(args.ours_row_loaders.split(",")))
    if unknown := [r for r in args.ours_row_loaders if r not in ROW_LOADERS]:
        p.error(f"--ours-row-loaders {','.join(unknown)}: each one of {', '.join(ROW_LOADERS)}")
    args.ours_optimizers = list(dict.fromkeys(args.ours_optimizers.split(",")))
    if unknown := [o for o in args.ours_optimizers if o not in OPTIMIZERS]:
        p.error(f"--ours-optimizers {','.join(unknown)}: each one of {', '.join(OPTIMIZERS)}")
    args.ours_lm_heads = list(dict.fromkeys(args.ours_lm_heads.split(",")))
    if unknown := [h for h in args.ours_lm_heads if h not in LM_HEADS]:
        p.error(f"--ours-lm-heads {','.join(unknown)}: each one of {', '.join(LM_HEADS)}")
    args.ours_losses = list(dict.fromkeys(args.ours_losses.split(",")))
    from speculators.losses import resolve_loss_config

    for loss in args.ours_losses:
        try:
            resolve_loss_config(loss, LOSS_IMPLEMENTATION)
        except ValueError as e:
            p.error(f"--ours-losses {loss}: {e}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compare_trainers: no CUDA device. speculators' Trainer moves the model to the "
                         "accelerator and cannot run on CPU; run this on a GPU machine "
                         "(benchmarks/gpu_compare_trainers.sh).")
    try:
        manifest = load_manifest(args.manifest)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    runs, pairs = {}, []
    spec_settings = {"spec_workers": args.spec_workers, "spec_hidden_states_dtype": args.spec_hidden_states_dtype}

    def measure(name: str, train, settings: dict) -> None:
        """Train (or reuse) one run and score it at once, then write every run measured so far: a
        comparison cut by a deadline keeps what it finished."""
        r = runs[name] = stage(work / f"{name}.json", train, settings)
        ev = stage(work / f"eval_{name}_summary.json", lambda: evaluate(args, work, name, r["draft"]),
                   {"draft": r["draft"], "made_from": r["made_from"], "k": args.k})
        r.update(acceptance_length=ev["acceptance_length"], per_position_acceptance=ev["per_position_acceptance"],
                 eval_anchors=ev["anchors"], eval_tokens=ev["tokens_evaluated"],
                 tokens_per_s=round(1000.0 * r["tokens_per_step"] / r["ms_per_step"], 1)
                 if r["tokens_per_step"] and r["ms_per_step"] else None)
        if r["steps"] != args.steps:
            print(f"warning: {name} ran {r['steps']} steps, asked {args.steps}", file=sys.stderr)
        write_json(args.json, so_far())

    def so_far() -> dict:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        settings.update(layer_ids=manifest["layer_ids"], gpu=torch.cuda.get_device_name(0), torch=torch.__version__)
        return {"runs": runs, "ratios": {f"{a} / {b}": ratios(runs[a], runs[b]) for a, b in pairs
                                         if a in runs and b in runs},
                "grid": grid(runs), "settings": settings}

    for lr in args.lr:  # interleaved, so a drift of the machine's speed hits both trainers
        spec = run_name("speculators", lr, args.lr)
        for g, loader, loss, ttt, decay, opt, head in itertools.product(
                args.ours_shuffle_buffers, args.ours_row_loaders, args.ours_losses, args.ours_ttt_steps,
                args.ours_loss_decays, args.ours_optimizers, args.ours_lm_heads):
            variant = {"shuffle_buffer_gib": g, "row_loader": loader, "loss": loss, "ttt_steps": ttt,
                       "ttt_step_loss_decay": decay, "optimizer": opt, "lm_head": head}
            name = run_name(ours_name(g, loader, loss, None if ttt == args.ttt_steps else ttt, decay, opt, head),
                            lr, args.lr)
            measure(name, lambda variant=variant, lr=lr, name=name: train_ours(args, work, variant, lr, name),
                    made_from(args, lr=lr, **variant))
            pairs.append((name, spec))
        measure(spec, lambda lr=lr, spec=spec: train_speculators(args, work, manifest, lr, spec),
                made_from(args, lr=lr, **spec_settings))
    if args.spec_defaults:  # once: its learning rate is its own
        pairs += [(name, SPEC_DEFAULTS) for name in runs if name.startswith("ours")]
        measure(SPEC_DEFAULTS, lambda: train_speculators(args, work, manifest, None, SPEC_DEFAULTS),
                made_from(args, lr=None, **spec_settings))
    results = so_far()  # as last written
    print(report(results))
    for name, r in runs.items():
        print(f"FINAL_OFFLINE_AL {name} {r['acceptance_length']} (k={args.k})")


if __name__ == "__main__":
    if sys.argv[1:2] == [SPEC_CHILD]:
        speculators_child(sys.argv[2:])
    else:
        main()
