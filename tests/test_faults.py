"""Faults injected into whole `snakemake` runs of a tiny config: every rerun ends with what an
uninterrupted run with the current config produces, or with one sentence saying what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny
from test_workflow import tiny_config
from workflow import copy_workflow, kill_stage, snakemake, start_snakemake, wait_for_line, write_config

TIMING = ("tokens_per_s",)  # the only metrics that differ between two runs of the same settings


def config(target: Path, chats: Path, **train) -> dict:
    cfg = tiny_config(target, chats)
    # long enough to be killed between checkpoints
    cfg["train"].update(max_steps=24, eval_every=4, checkpoint_every=4, **train)
    return cfg


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run with train.lr 0.001."""
    ws = copy_workflow(tmp_path_factory.mktemp("faults"))
    target = tiny.make_llama(ws / "target")
    chats = tiny.make_chats(ws / "chats.jsonl", n=24)
    write_config(ws, config(target, chats))
    snakemake(ws)
    return ws, target, chats


def clone(ws: Path, dest: Path) -> Path:
    shutil.copytree(ws, dest, symlinks=True)
    return dest


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def assert_same_results(run: Path, reference: Path) -> None:
    got, want = load_file(run / "draft" / "model.safetensors"), load_file(reference / "draft" / "model.safetensors")
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"draft tensors differ from the uninterrupted run: {different}"
    assert metrics(run) == metrics(reference)
    for name in ("eval/offline.json",):
        assert json.loads((run / name).read_text()) == json.loads((reference / name).read_text()), name


def test_killed_training_after_a_setting_change_reruns_to_the_uninterrupted_result(finished, tmp_path):
    ws, target, chats = finished
    changed = config(target, chats, lr=0.002)
    reference = clone(ws, tmp_path / "reference")
    write_config(reference, changed)
    snakemake(reference)

    faulted = clone(ws, tmp_path / "faulted")
    write_config(faulted, changed)
    log = faulted / "results/tiny/logs/train_draft.log"
    log.unlink()
    proc = start_snakemake(faulted)
    wait_for_line(log, "train_draft: checkpoint ", proc)  # after the first checkpoint of the new settings
    kill_stage(proc, "train_draft")
    assert proc.wait() != 0
    rerun = snakemake(faulted)
    assert "Nothing to be done" not in rerun.stdout + rerun.stderr
    assert_same_results(faulted / "results/tiny", reference / "results/tiny")
