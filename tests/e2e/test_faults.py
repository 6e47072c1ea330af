"""Faults injected into whole `snakemake` runs of a tiny config: every rerun ends with what an
uninterrupted run with the current config produces, or with one sentence saying what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tiny
from workflow import (copy_workflow, differences, dry_run, kill_stage, kill_stage_once_started, snakemake,
                      start_snakemake, tiny_config, wait_for_line, write_config)

pytestmark = pytest.mark.e2e


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


def test_killed_training_after_a_setting_change_reruns_to_the_uninterrupted_result(finished, tmp_path):
    ws, target, chats = finished
    changed = config(target, chats, lr=0.002)
    reference = clone(ws, tmp_path / "reference")
    write_config(reference, changed)
    shutil.rmtree(reference / "results/tiny/draft")  # a new draft goes to an empty place (README)
    snakemake(reference)

    faulted = clone(ws, tmp_path / "faulted")
    write_config(faulted, changed)
    log = faulted / "results/tiny/logs/train_draft.log"
    log.unlink()
    proc = start_snakemake(faulted)
    wait_for_line(log, "train_draft: checkpoint ", proc)  # after the first checkpoint of the new settings
    kill_stage(proc, "train_draft")
    assert proc.wait() != 0
    # the rerun resumes training, then the export stops at the old draft with its sentence
    rerun = snakemake(faulted, check=False)
    assert "Nothing to be done" not in rerun.stdout + rerun.stderr
    assert "resuming from results/tiny/train/checkpoints/step-0000004" in log.read_text()
    export_log = (faulted / "results/tiny/logs/export_draft.log").read_text()
    assert rerun.returncode != 0 and "a delivered draft is never overwritten, delete it on purpose" in export_log
    shutil.rmtree(faulted / "results/tiny/draft")
    snakemake(faulted)
    assert not (found := differences(faulted / "results/tiny", reference / "results/tiny")), "\n".join(found)


OFFLINE = "results/tiny/eval/offline.json"


def test_a_request_for_one_file_after_a_failed_export_reruns_the_export(finished, tmp_path):
    """Retrained, then the export failed (it never overwrites a delivered draft) and Snakemake removed
    its outputs: a request for the offline evaluation alone must not call the old one up to date."""
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    write_config(faulted, config(target, chats, lr=0.002))
    failed = snakemake(faulted, "--", OFFLINE, check=False)
    assert failed.returncode != 0
    assert not (faulted / "results/tiny/draft/model.safetensors").exists()
    jobs, reasons, out = dry_run(faulted, "--", OFFLINE)
    assert set(jobs) == {"export_draft", "evaluate_offline"}, out
    assert "evaluate_offline" in reasons["updated input files"], out


def test_a_request_for_one_file_after_a_killed_extraction_reruns_from_the_extraction(finished, tmp_path):
    """New data, then the extraction was killed: the shards, and all made from them, are the old data's."""
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    changed = config(target, chats)
    changed["data"]["max_length"] = 80
    write_config(faulted, changed)
    proc = start_snakemake(faulted, "--", OFFLINE)
    kill_stage_once_started(proc, "extract_hidden_states")
    assert proc.wait() != 0
    jobs, _, out = dry_run(faulted, "--", OFFLINE)
    after_extraction = {"extract_hidden_states", "gather_hidden_states", "train_draft", "export_draft",
                        "evaluate_offline"}
    assert after_extraction <= set(jobs) <= after_extraction | {"vocab_mapping"}, out
