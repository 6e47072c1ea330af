"""Inject faults into whole `snakemake` runs of a tiny CPU config and print what each rerun gave.

  python benchmarks/fault_table.py [--work DIR] [--only NAME ...]

Each fault starts from a copy of one finished run, changes the config where the fault says so,
injects the fault (a real kill -9, damaged files, ...), then runs a plain `snakemake`. The result
is compared with an uninterrupted run of the current config: "same" (draft tensors, metrics rows,
offline evaluation and the manifest's shards all equal), "error: <the sentence>" (the run stopped
and said why), or "LOST: <what differs>". Takes ~15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts")]

import tiny  # noqa: E402
from workflow import (copy_workflow, differences, kill_stage, snakemake, start_snakemake, tiny_config,  # noqa: E402
                      wait_for_line, write_config)

RUN = "results/tiny"


def base_config(target: Path, chats: Path) -> dict:
    cfg = tiny_config(target, chats)
    # two samples a shard and checkpoints every 4 of 24 steps: room to be killed in between
    cfg["extract"]["batch_size"] = 2
    cfg["train"].update(max_steps=24, eval_every=4, checkpoint_every=4)
    return cfg


def with_change(cfg: dict, section: str, **values) -> dict:
    return {**cfg, section: {**cfg[section], **values}}


def clone(ws: Path, dest: Path) -> Path:
    shutil.copytree(ws, dest, symlinks=True)
    return dest


def kill_during(ws: Path, stage: str, log_name: str, marker: str, *args: str) -> None:
    """Start snakemake, kill -9 the ``stage`` job once its log shows ``marker``, wait for snakemake."""
    log = ws / RUN / "logs" / log_name
    log.unlink(missing_ok=True)
    proc = start_snakemake(ws, *args)
    wait_for_line(log, marker, proc)
    kill_stage(proc, stage)
    proc.wait()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def newest_checkpoint(ws: Path) -> Path:
    return sorted((ws / RUN / "train/checkpoints").glob("step-*"))[-1]


# name -> (what the fault is, config section and values to change first or None, injection)
def faults(target: Path) -> dict:
    train_log, extract_log = "train_draft.log", "extract_hidden_states.replica-0-of-1.log"

    def kill_training(ws):
        kill_during(ws, "train_draft", train_log, "train_draft: checkpoint ")

    def kill_retraining(ws):
        shutil.rmtree(ws / RUN / "train")  # a retraining from scratch on purpose (README)
        kill_training(ws)

    def kill_extraction(ws):
        kill_during(ws, "extract_hidden_states", extract_log, "backend loaded")

    def damaged_checkpoint(damage):
        def inject(ws):
            kill_retraining(ws)
            weights = newest_checkpoint(ws) / "model.safetensors"
            damage(weights)
        return inject

    def planted_pickle(ws):
        import torch

        kill_retraining(ws)
        state = newest_checkpoint(ws) / "trainer_state.pt"
        torch.save({"evil": Payload(ws / "payload-ran")}, state)

    def flip_reused_shard(ws):
        shard = sorted((ws / RUN / "hidden_states/shards").glob("train-*.safetensors"))[0]
        flip_byte(shard, shard.stat().st_size - 3)
        # a kill of extraction after the flip: the rerun reuses shards
        kill_during(ws, "extract_hidden_states", extract_log, "backend loaded", "--forcerun", "extract_hidden_states")

    def delete_shard(ws):
        sorted((ws / RUN / "hidden_states/shards").glob("train-*.safetensors"))[0].unlink()
        snakemake(ws, "--forcerun", "train_draft", check=False)

    def kill_fresh_extraction(ws):
        shutil.rmtree(ws / RUN / "hidden_states/shards")
        kill_during(ws, "extract_hidden_states", extract_log, "backend loaded", "--forcerun", "extract_hidden_states")

    def no_config_json(ws):
        model = ws / "target-copy"
        shutil.copytree(target, model)
        (model / "config.json").unlink()
        cfg = json.loads(json.dumps(read_config(ws)))
        cfg["target"]["model"] = str(model)
        write_config(ws, cfg)

    def kill_snakemake(ws):
        """kill -9 of Snakemake itself: its training job runs on; `--unlock` and rerun beside it."""
        log = ws / RUN / "logs" / train_log
        log.unlink(missing_ok=True)
        shutil.rmtree(ws / RUN / "train")
        proc = start_snakemake(ws)
        wait_for_line(log, "train_draft: checkpoint ", proc)
        proc.kill()
        proc.wait()
        snakemake(ws, "--unlock")

    def forcerun_training(ws):
        snakemake(ws, "--forcerun", "train_draft", check=False)

    return {
        "kill training": ("train/ deleted, kill -9 of the training job after its first checkpoint", None,
                          kill_retraining),
        "lr change + kill training": ("train.lr changed, training killed", ("train", {"lr": 0.002}), kill_training),
        "storage fp8 + kill extraction": ("extract.storage_dtype fp8, extraction killed after loading",
                                          ("extract", {"storage_dtype": "fp8"}), kill_extraction),
        "layer change + kill extraction": ("extract.layer_ids changed, extraction killed",
                                           ("extract", {"layer_ids": [1, 2, 4, 6]}), kill_extraction),
        "kill extraction": ("shards deleted, --forcerun extract_hidden_states killed after loading", None,
                            kill_fresh_extraction),
        "bit flip in reused shard": ("a bit of a shard flipped, extraction rerun and killed", None,
                                     flip_reused_shard),
        "deleted shard": ("a shard deleted, then --forcerun train_draft", None, delete_shard),
        "truncated checkpoint": ("train/ deleted, training killed, newest checkpoint's weights truncated", None,
                                 damaged_checkpoint(lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]))),
        "zeroed checkpoint": ("train/ deleted, training killed, newest checkpoint's last weight bytes zeroed", None,
                              damaged_checkpoint(lambda p: p.write_bytes(p.read_bytes()[:-64] + bytes(64)))),
        "planted pickle": ("train/ deleted, training killed, a pickle that runs a command planted as trainer state",
                           None,
                           planted_pickle),
        "kill snakemake": ("train/ deleted, kill -9 of Snakemake during training, --unlock, rerun while its job "
                           "runs on", None,
                           kill_snakemake),
        "forcerun training": ("--forcerun train_draft on a finished run", None, forcerun_training),
        "model dir without config.json": ("target.model pointed at a copy without config.json", None,
                                          no_config_json),
    }


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def read_config(ws: Path) -> dict:
    import yaml

    return yaml.safe_load((ws / "config/config.yaml").read_text())


def rerun_as_a_user(ws: Path):
    """A plain `snakemake`; when the export stops because the delivered draft is in the way (it is
    never overwritten: README), delete the draft as its sentence asks and run once more.
    Returns (the last run, whether the draft was deleted)."""
    rerun = snakemake(ws, "--rerun-incomplete", check=False)
    export_log = ws / RUN / "logs/export_draft.log"
    asked = rerun.returncode != 0 and export_log.is_file() and "never overwritten" in export_log.read_text()
    if asked:
        shutil.rmtree(ws / RUN / "draft")
        rerun = snakemake(ws, "--rerun-incomplete", check=False)
    return rerun, asked


def last_error(ws: Path, output: str) -> str:
    """The sentence the failed job ended with: the last line of its log, else Snakemake's last line."""
    m = re.search(r"Error in rule \w+:.*?log: (\S+)", output, re.S)
    text = (ws / m.group(1)).read_text(errors="replace") if m and (ws / m.group(1)).is_file() else output
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return (lines or ["?"])[-1][:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--only", nargs="*", help="fault names to run (default: all)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="faults-"))
    (work / "base").mkdir(parents=True)
    base = copy_workflow(work / "base")
    target = tiny.make_llama(base / "target")
    chats = tiny.make_chats(base / "chats.jsonl", n=24)
    cfg = base_config(target, chats)
    write_config(base, cfg)
    t0 = time.perf_counter()
    snakemake(base)
    print(f"base run: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    references: dict[str, Path] = {"": base}
    rows = []
    for name, (what, change, inject) in faults(target).items():
        if args.only and name not in args.only:
            continue
        current = with_change(cfg, change[0], **change[1]) if change else cfg
        key = json.dumps(change) if change else ""
        if change and key not in references:
            references[key] = clone(base, work / f"reference-{len(references)}")
            write_config(references[key], current)
            shutil.rmtree(references[key] / RUN / "draft")  # a new draft is exported into an empty place
            snakemake(references[key])
        ws = clone(base, work / name.replace(" ", "_"))
        write_config(ws, current)
        inject(ws)
        rerun, asked = rerun_as_a_user(ws)
        out = rerun.stdout + rerun.stderr
        if (ws / "payload-ran").exists():
            outcome = "LOST: the planted pickle ran"
        elif rerun.returncode != 0:
            outcome = "error: " + last_error(ws, out)
        else:
            diff = differences(ws / RUN, references[key] / RUN)
            outcome = "same" if not diff else "LOST: " + "; ".join(diff)[:160]
        if asked:
            outcome += " (after deleting the delivered draft, as the export asked)"
        if "Nothing to be done" in out and change:
            outcome += " (Nothing to be done)"
        rows.append((name, what, outcome))
        print(f"{name}: {outcome}", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"| {'fault':{width}} | injected | rerun gives |\n|{'-' * (width + 2)}|---|---|")
    for name, what, outcome in rows:
        print(f"| {name:{width}} | {what} | {outcome} |")
    same = sum(r[2].startswith("same") for r in rows)
    errors = sum(r[2].startswith("error") for r in rows)
    print(f"\n{len(rows)} faults: {same} ended with nothing lost, {errors} with a clear error, "
          f"{len(rows) - same - errors} lost something")


if __name__ == "__main__":
    main()
