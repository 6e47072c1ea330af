"""Stage train_draft: the EAGLE-3 draft trained on hidden-state shards.

Our own small loop around speculators' model and losses: speculators' Trainer refuses to run
without an accelerator and its resume path fails on CPU, and the pipeline must train on a laptop.
The same loop runs on one GPU, and under torchrun (WORLD_SIZE > 1) with DDP.

Writes ``<out>/metrics.jsonl`` (a row per logged train step and per evaluation, the untrained
draft's at step 0 included), checkpoints under ``<out>/checkpoints/`` (see checkpoints.py) and at
the end ``<out>/summary.json``, which the exporter reads.

Under a disk budget (a manifest whose train shards are deferred: shard_budget) the training starts
the extractor given by ``--producer`` as its child, reads each train shard as it is made and
deletes it after the step that used it last; the summary's ``disk_budget`` says what it cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import time
from contextlib import closing, nullcontext
from pathlib import Path

import torch

from . import checkpoints, shard_budget
from .acceptance import DRAFT_VOCAB_KEY, EXPLANATIONS
from .atomic import atomic_path, sha256_file, write_json
from .code_digest import code_digest
from .dir_lock import dir_lock
from .draft_model import LOSS_IMPLEMENTATION
from .model_dir import check_model_dir
from .layers import aux_layer_ids, validate_layer_ids
from .packed_data import PackedRows, add_row_loader_argument, shuffle_buffer, shuffle_window
from .process_lifetime import die_with_parent
from .progress import TokenProgress
from .runtime import all_reduce, leave_distributed, rng_state, set_rng_state, set_threads, setup_distributed
from .settings import add_stage_arguments
from .shard_manifest import BUDGET_KEY, load_manifest
from .training import Optimization, check_training_args, new_draft

log = logging.getLogger("eaglepipe.train_draft")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglepipe.train_draft", description=__doc__.split("\n")[0])
    p.add_argument("--manifest", required=True, help="hidden-state manifest.json")
    p.add_argument("--vocab", required=True, help="vocab_mapping.safetensors (d2t, t2d)")
    p.add_argument("--model", required=True, help="target model directory (embeddings, final norm, lm_head)")
    p.add_argument("--out-dir", required=True)
    add_stage_arguments(p, "train_draft", types={"shuffle_buffer_gib": shuffle_buffer})
    add_row_loader_argument(p)
    p.add_argument("--producer", default=None,
                   help="under a disk budget: the shell command of the extractor that makes the train shards while "
                        "training runs (python -m eaglepipe.extract_hidden_states ... without --schedule; the rule "
                        "gives it)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_training_args(p, args)
    return args


# Flags that do not change what training produces; every other flag does (a new flag counts
# until it is listed here), so a checkpoint made with any other value is never resumed.
RESULT_NEUTRAL = {
    "out_dir": "where the results go",
    "trust_remote_code": "whether the target's own code may load",
    "manifest": "its shards are digested instead (settings 'data')",
    "vocab": "its content is digested instead (settings 'vocab')",
    "row_loader": "the same rows whichever packs them",
    "producer": "the extractor under a disk budget: what it makes is checked against the manifest's settings",
}


def run_settings(args, manifest: dict) -> dict:
    """Everything that changes what training produces (the world size does not: packed_data); under
    a disk budget, add the shuffle window it leaves (window_settings)."""
    data = hashlib.sha256(json.dumps([manifest["layer_ids"], manifest["splits"]], sort_keys=True).encode())
    settings = {k: v for k, v in vars(args).items() if k not in RESULT_NEUTRAL}
    return dict(settings, model=str(args.model), data=data.hexdigest()[:16], vocab=sha256_file(args.vocab)[:16])


def window_settings(settings: dict, window: int) -> dict:
    """run_settings under a disk budget: with the shuffle window it leaves (not the budget: another
    one of the same window trains the same draft)."""
    return dict(settings, budget_window=window)


PREFETCH_DEPTH = 2  # rows packed ahead of the step (PackedRows.prefetched's default)


def budget_plan(args, manifest: dict, world: int, out: Path, settings: dict):
    """Under a disk budget: (the shuffle window it leaves, the window without it, plan(window) ->
    the rows of a pass); else None. The window is the widest the budget holds with the rows of
    ``world`` processes in flight, or the resumed training's (resumed_window)."""
    if not shard_budget.is_budgeted(manifest):
        return None
    configured = shuffle_window(manifest, "train", args.shuffle_buffer_gib)
    plans: dict[int, PackedRows] = {}

    def rows_of(window: int):
        if window not in plans:
            plans[window] = PackedRows(manifest, "train", args.batch_tokens, seed=args.seed, shuffle=True,
                                       shuffle_window=window, wait_shard=lambda e, b: None)
        return plans[window].plan

    rows = shard_budget.train_rows(manifest)
    widest = shard_budget.choose_window(rows_of, configured, len(rows), manifest[BUDGET_KEY]["train_bytes"],
                                        [r["bytes"] for r in rows], args.max_steps, world, PREFETCH_DEPTH)
    window = resumed_window(out, settings, widest) or widest
    if window != widest:
        log.info("disk budget: the resumed training keeps its shuffle window of %d shard(s) (the budget holds %d "
                 "with %d process(es))", window, widest, world)
    return window, configured, rows_of(window)


def resumed_window(out: Path, settings: dict, widest: int) -> int | None:
    """The shuffle window of the newest checkpoint of these settings whose window the budget holds
    (at most ``widest`` shards), or None. The widest window depends on the world size (the rows in
    flight): a training resumed with fewer processes keeps its own, and so its order."""
    windows = {checkpoints.settings_digest(window_settings(settings, w)): w for w in range(1, widest + 1)}
    for ckpt in reversed(checkpoints.complete_checkpoints(out)):
        if window := windows.get(checkpoints.marker_digest(ckpt)):
            return window
    return None


class MetricsLog:
    """The metrics rows: kept in memory and in every checkpoint (Snakemake deletes the declared
    metrics.jsonl of a failed job, so a resumed run takes the rows before its step from the
    checkpoint); appended to metrics.jsonl as they come for watching, rewritten whole at the end."""

    def __init__(self, path: Path, rows: list[dict], enabled: bool):
        self.path, self.rows, self.enabled = path, list(rows), enabled
        if enabled:
            self.save()

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def save(self) -> None:
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(json.dumps(row) + "\n" for row in self.rows))


# ----------------------------------------------------------------------------- training
def train(args, stop_after: int | None = None) -> dict | None:
    """Run (or resume) training; returns the summary, or None when stopped early by ``stop_after``
    (the test's stand-in for a killed job)."""
    from speculators.losses import resolve_loss_config

    from .acceptance import check_select_by
    from .draft_model import training_row_options
    from .evaluation import Evaluation

    threads = set_threads()
    rank, world, device = setup_distributed()
    main_rank = rank == 0
    out = Path(args.out_dir)
    try:
        manifest = load_manifest(args.manifest)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    layer_ids = [int(i) for i in manifest["layer_ids"]]
    try:
        validate_layer_ids(layer_ids, int(manifest["target"].get("num_hidden_layers", layer_ids[-1])))
    except ValueError as e:
        raise SystemExit(f"manifest {args.manifest}: {e}") from e
    aux_ids = aux_layer_ids(layer_ids)
    settings = run_settings(args, manifest)
    budgeted = budget_plan(args, manifest, world, out, settings)
    if budgeted:
        settings = window_settings(settings, budgeted[0])
    digest = checkpoints.settings_digest(settings)
    log.info("target %s, layer ids %s (aux %s), %d thread(s), device %s, world size %d, settings digest %s",
             args.model, layer_ids, aux_ids, threads, device, world, digest)
    if not main_rank:  # past its device, another rank's info lines and bar repeat rank 0's
        logging.getLogger().setLevel(logging.WARNING)

    code = code_digest(Path(__file__).parent, "train_draft")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank has its budget window from the checkpoints before rank 0 moves any aside
    # rank 0 decides (and moves a finished training of other code aside) before the others look
    resume = reusable_or_superseded(out, digest, code, args.max_steps) if main_rank else None
    if world > 1:
        dist.barrier()
        if not main_rank:
            resume = checkpoints.find_resume(out, digest)
    budget = shard_budget.Budget(manifest, out, args.producer, args.seed) if budgeted else None
    if resume and resume[1]["step"] >= args.max_steps:
        return reuse(args, out, *resume, layer_ids, aux_ids, main_rank, budget, budgeted, world)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model = new_draft(args, aux_ids, device)
    draft_vocab = int(model.draft_vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    log.info("draft: %s trainable parameters, draft vocab %d, target vocab %d",
             f"{sum(p.numel() for p in params):,}", draft_vocab, model.verifier_vocab_size)
    optimization = Optimization(args, model)
    loss_config = resolve_loss_config(args.loss, LOSS_IMPLEMENTATION)
    evaluation = Evaluation(manifest, "eval", args.model, args.context_buckets, args.trust_remote_code, device)
    check_select_by(args.select_by, evaluation.strata)

    step, position, train_tokens, evals, best, rows = 0, (0, 0), 0, {}, None, []
    if resume:
        ckpt, state, rows = resume
        checkpoints.load_weights(model, ckpt)
        optimization.load_state_dict(state["optimization"])
        set_rng_state(state["rng"])
        step, position, train_tokens = state["step"], tuple(state["position"]), state["train_tokens"]
        evals, best = state["evals"], state["best"]
        if budget:
            budget.load_state(state["budget"])
        log.info("resuming from %s at step %d (data position epoch %d, row %d); saved with world size %d, "
                 "now %d%s", ckpt, step, *position, state["world_size"], world,
                 "" if state["world_size"] == world else " (rows per step change with it)")
    else:
        log.info("starting fresh")
        if budget and main_rank:
            budget.fresh()
    metrics = MetricsLog(out / "metrics.jsonl", rows, main_rank)
    ddp_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def run_eval(at_step: int) -> dict:
        ev = evaluation(model, args.ttt_steps, loss_config, args.batch_tokens, args.ttt_step_loss_decay, rank, world)
        row = {"step": at_step, "split": "eval", **{k: v for k, v in ev.items() if k not in EXPLANATIONS}}
        metrics.write(row)
        log.info("eval at step %d: acceptance length %s, per-position acceptance %s, loss %s, draft vocab "
                 "coverage %s", at_step, ev["acceptance_length"], ev["per_position_acceptance"], ev["loss"],
                 ev[DRAFT_VOCAB_KEY])
        evals[at_step] = ev
        return ev

    if not resume:
        run_eval(0)

    window = shuffle_window(manifest, "train", args.shuffle_buffer_gib)
    wait_shard = None
    if budget:
        window = budgeted[0]
        log.info("disk budget: rows shuffle the samples of %d shard(s) at a time, %s", window,
                 "as without the budget" if window == budgeted[1] else
                 f"fewer than without it ({'all' if budgeted[1] is None else budgeted[1]}): another order, another draft")
        if main_rank:
            wait_shard = budget.start(budgeted[2], position, args.max_steps - step, world, PREFETCH_DEPTH)
        else:
            wait_shard = shard_budget.ShardWaiter(budget.shard_dir, None)
    log.info("rows shuffle the samples of %s at a time (--shuffle-buffer-gib %s)",
             "every shard" if window is None else f"{window} shard(s)", args.shuffle_buffer_gib)
    # the next rows are packed while this step runs (on a GPU that was idle time)
    rows = PackedRows(manifest, "train", args.batch_tokens, seed=args.seed, shuffle=True, rank=rank, world_size=world,
                      shuffle_window=window, wait_shard=wait_shard, **training_row_options(device, args.batch_tokens))
    log.info("rows are packed ahead by a %s (--row-loader)", "worker process" if args.row_loader == "process" else "thread")
    try:
        return train_steps(args, out, rows, position, step, world, device, main_rank, model, ddp_model, optimization,
                           params, loss_config, metrics, run_eval, evals, best, train_tokens, digest, code, settings,
                           layer_ids, aux_ids, draft_vocab, budget, budgeted, stop_after)
    finally:
        if budget and main_rank:
            budget.stop()


def train_steps(args, out, rows, position, step, world, device, main_rank, model, ddp_model, optimization, params,
                loss_config, metrics, run_eval, evals, best, train_tokens, digest, code, settings, layer_ids, aux_ids,
                draft_vocab, budget, budgeted, stop_after):
    """The training loop from ``step`` at data ``position`` to --max-steps."""
    from .acceptance import select_value

    stream = rows.prefetched(args.row_loader, *position, depth=PREFETCH_DEPTH, steps=args.max_steps - step)
    log_every = max(1, args.max_steps // 200)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    window_tokens, window_start = 0, time.perf_counter()
    model.train()
    with TokenProgress(args.max_steps - step, "train", unit="step", disable=not main_rank) as bar, closing(stream):
        while step < args.max_steps:
            position, batch = next(stream)
            b = {k: batch[k].to(device, non_blocking=True) for k in keys}  # from page-locked rows on GPUs
            # GPUs: bf16 autocast over fp32 master weights, as speculators' Trainer does; CPU stays
            # fp32 (bf16 matmuls are slower there, and resume is tested bit for bit)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                _, loss, m = ddp_model(**b, ttt_steps=args.ttt_steps,
                                       ttt_step_loss_decay=args.ttt_step_loss_decay, loss_config=loss_config)
            optimization.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimization.step()
            step += 1
            if budget and main_rank:  # every rank has trained its row: their last use deletes shards
                budget.step_done(world)
            tokens = batch["lengths"].sum().reshape(1).to(device)  # real tokens, not the pads
            stats = torch.stack([loss.detach().float()] + [m[f"full_acc_{s}_sum"].float() for s in range(args.ttt_steps)]
                                + [m[f"full_acc_{s}_total"].float() for s in range(args.ttt_steps)])
            all_reduce({"t": tokens, "s": stats}, world)
            train_tokens += int(tokens)
            window_tokens += int(tokens)
            loss_value = float(stats[0]) / world
            bar.update(1, loss=f"{loss_value:.3f}", tok_s=f"{window_tokens / (time.perf_counter() - window_start):.0f}")
            if step % log_every == 0 or step == args.max_steps:
                elapsed = time.perf_counter() - window_start
                acc = {f"acc_{s}": round(float(stats[1 + s]) / max(1.0, float(stats[1 + args.ttt_steps + s])), 6)
                       for s in range(args.ttt_steps)}
                metrics.write({"step": step, "split": "train", "loss": round(loss_value, 6), **acc,
                               "lr": optimization.last_lr(), "tokens_per_s": round(window_tokens / elapsed, 1),
                               "train_tokens": train_tokens, "epoch": position[0]})
                window_tokens, window_start = 0, time.perf_counter()
            is_ckpt = step % args.checkpoint_every == 0 or step == args.max_steps
            if is_ckpt or step % args.eval_every == 0:
                ev = run_eval(step)
                window_start = time.perf_counter()  # evaluation time is not training throughput
                model.train()
            if is_ckpt:
                al = select_value(ev, args.select_by)
                is_best = best is None or al > best["acceptance_length"]
                if is_best:
                    best = {"step": step, "acceptance_length": al}  # the AL it was chosen by
                if main_rank:
                    state = {"optimization": optimization.state_dict(),
                             "position": list(position), "rng": rng_state(), "step": step, "world_size": world,
                             "digest": digest, "code": code, "settings": settings, "train_tokens": train_tokens,
                             "evals": evals, "best": best, "resources": training_resources(optimization, device)}
                    if budget:
                        state["budget"] = budget.state()
                    path = checkpoints.save(out, step, model, state, metrics.rows, best=is_best)
                    log.info("checkpoint %s%s", path, " (best so far)" if is_best else "")
                if world > 1:
                    torch.distributed.barrier()
            if stop_after is not None and step >= stop_after:
                return None

    summary = training_summary(args, step, best, evals, train_tokens, layer_ids, aux_ids, draft_vocab,
                               training_resources(optimization, device))
    if budget and main_rank:  # rank 0 started the extractor and counted the samples
        budget.stop()
        summary["disk_budget"] = budget_summary(budget, budgeted, world, train_tokens)
        log.info("disk budget: %s", summary["disk_budget"])
    if main_rank:
        metrics.save()
        write_json(out / "summary.json", summary)
        log.info("done: best %s (acceptance length %s), last %s (acceptance length %s)", summary["best"],
                 summary["best_eval"]["acceptance_length"], summary["last"], summary["last_eval"]["acceptance_length"])
    return summary


def reusable_or_superseded(out: Path, digest: str, code: str, max_steps: int):
    """find_resume's checkpoint, unless it ends a finished training that cannot be reused: made by
    other code, or whose best checkpoint is damaged. That one is retrained from scratch, its
    checkpoints moved aside (checkpoints.supersede) and removed only once the new training's first
    checkpoint is on disk."""
    resume = checkpoints.find_resume(out, digest)
    if not resume or resume[1]["step"] < max_steps:
        return resume
    ckpt, state, _ = resume
    why = None
    if state.get("code") != code:
        why = f"it was made by other code (code digest {state.get('code')}, now {code})"
    else:
        best = ckpt.with_name(checkpoints.step_name(state["best"]["step"]))
        problem = checkpoints.intact(best) if best.is_dir() else "it is missing"
        if problem:
            why = f"its best checkpoint {best} is damaged ({problem})"
    if why is None:
        return resume
    log.info("retraining from scratch: %s ends a finished training, but %s; its %d checkpoint(s) are kept as "
             "%s* until the new training's first checkpoint is written", ckpt, why, checkpoints.supersede(out),
             checkpoints.SUPERSEDED)
    return None


def budget_summary(budget, budgeted, world: int, train_tokens: int) -> dict:
    window, configured, rows_of_epoch = budgeted
    rows_per_pass = len(list(rows_of_epoch(0))) // world * world
    return budget.summary(rows_per_pass, train_tokens, window, configured)


def reuse(args, out: Path, ckpt: Path, state: dict, rows: list[dict], layer_ids, aux_ids, main_rank: bool,
          budget=None, budgeted=None, world: int = 1) -> dict:
    """The outputs of a finished training with these settings, data and code, from its checkpoints:
    whatever made the job run again (a regenerated identical manifest, --forcerun), no step is redone."""
    config = json.loads((ckpt / "config.json").read_text())
    summary = training_summary(args, state["step"], state["best"], state["evals"], state["train_tokens"], layer_ids,
                               aux_ids, int(config["draft_vocab_size"]), state["resources"])
    if budget:
        budget.load_state(state["budget"])
        summary["disk_budget"] = budget_summary(budget, budgeted, world, state["train_tokens"])
    if main_rank:
        MetricsLog(out / "metrics.jsonl", rows, enabled=True)
        write_json(out / "summary.json", summary)
    log.info("reusing the finished training %s (same settings, data and code): no step to run; to retrain from "
             "scratch, delete %s and run again", ckpt, out)
    return summary


def training_resources(optimization: Optimization, device) -> dict:
    """What the training kept in memory: each optimizer state's dtype and the peak GPU memory (None on CPU);
    kept in every checkpoint so that a reused training's summary is the one its run wrote."""
    return {"optimizer_state_dtypes": optimization.state_dtypes(),
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            if device.type == "cuda" else None}


def training_summary(args, step: int, best: dict, evals: dict, train_tokens: int, layer_ids, aux_ids,
                     draft_vocab: int, resources: dict) -> dict:
    """summary.json, which the exporter reads."""
    return {
        "best": f"checkpoints/{checkpoints.step_name(best['step'])}",
        "last": f"checkpoints/{checkpoints.step_name(step)}",
        "steps": step,
        "best_eval": evals[best["step"]],
        "best_selected_by": args.select_by,
        "last_eval": evals[step],
        "layer_ids": layer_ids,
        "aux_layer_ids": aux_ids,
        "target_model": str(args.model),
        "draft_vocab_size": draft_vocab,
        "ttt_steps": args.ttt_steps,
        "train_tokens": train_tokens,
        "metrics": "metrics.jsonl",
        **resources,
    }


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    check_model_dir(args.model)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts each rank in a session of its own: after kill -9 of torchrun (the job's
        # process under Snakemake) its ranks would train on, holding the lock a rerun needs
        die_with_parent(os.getppid())
    # one job per checkpoint directory; under torchrun rank 0 holds it for all ranks
    with dir_lock(args.out_dir) if int(os.environ.get("RANK", "0")) == 0 else nullcontext():
        train(args)
    leave_distributed()


if __name__ == "__main__":
    main()
