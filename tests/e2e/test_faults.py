"""Faults injected into whole `snakemake` runs of a tiny config: every rerun ends with what an
uninterrupted run with the current config produces, or with one sentence saying what is wrong."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from workflow import (differences, dry_run, finished_config, kill_stage, kill_stage_once_started, snakemake,
                      start_snakemake, wait_for_line, write_config)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def finished(finished_tiny):
    """The session's finished run (conftest.py), train.lr 0.001: the tests copy it before changing it."""
    return finished_tiny.ws, finished_tiny.target, finished_tiny.chats


def clone(ws: Path, dest: Path) -> Path:
    shutil.copytree(ws, dest, symlinks=True)
    return dest


def test_killed_training_after_a_setting_change_reruns_to_the_uninterrupted_result(finished, tmp_path):
    ws, target, chats = finished
    changed = finished_config(target, chats, lr=0.002)
    reference = clone(ws, tmp_path / "reference")
    write_config(reference, changed)
    shutil.rmtree(reference / "results/tiny/draft")  # a new draft goes to an empty place (README)
    snakemake(reference, "--", OFFLINE)  # all that differences() compares

    faulted = clone(ws, tmp_path / "faulted")
    write_config(faulted, changed)
    old_draft = draft_files(faulted)
    log = faulted / "results/tiny/logs/train_draft.log"
    log.unlink()
    proc = start_snakemake(faulted)
    wait_for_line(log, "train_draft: checkpoint ", proc)  # after the first checkpoint of the new settings
    kill_stage(proc, "train_draft")
    assert proc.wait() != 0
    # the rerun resumes training, then the export stops at the old draft with its sentence, as root
    # too (CI runs as root), leaving it whole: the directory and the sentence agree
    rerun = snakemake(faulted, check=False)
    assert "Nothing to be done" not in rerun.stdout + rerun.stderr
    assert "resuming from results/tiny/train/checkpoints/step-0000005" in log.read_text()
    export_log = (faulted / "results/tiny/logs/export_draft.log").read_text()
    assert rerun.returncode != 0 and "a delivered draft is never overwritten, delete it on purpose" in export_log
    assert "holds ['README.md', 'config.json', 'model.safetensors'], a delivered draft whose" in export_log
    assert draft_files(faulted) == old_draft
    shutil.rmtree(faulted / "results/tiny/draft")
    snakemake(faulted, "--", OFFLINE)
    assert not (found := differences(faulted / "results/tiny", reference / "results/tiny")), "\n".join(found)


OFFLINE = "results/tiny/eval/offline.json"


def draft_files(ws: Path) -> dict[str, tuple[bytes, int]]:
    """The delivered draft's files (all but the export record): content and modification time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (ws / "results/tiny/draft").iterdir()
            if p.name != "export.json"}


def checkpoint_files(ws: Path) -> dict[str, bytes]:
    root = ws / "results/tiny/train/checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_finished_training_is_taken_from_its_checkpoints_when_its_manifest_is_rebuilt(finished, tmp_path):
    """The manifest rebuilt byte-identical makes Snakemake rerun train_draft ("Input files updated by
    another job"): the finished training's result is taken without a step, the draft kept as it is."""
    ws, _, _ = finished
    faulted = clone(ws, tmp_path / "faulted")
    manifest = faulted / "results/tiny/hidden_states/manifest.json"
    built, old_draft, old_checkpoints = manifest.read_bytes(), draft_files(faulted), checkpoint_files(faulted)
    summary = (faulted / "results/tiny/train/summary.json").read_bytes()
    manifest.unlink()
    snakemake(faulted)
    assert manifest.read_bytes() == built
    log = (faulted / "results/tiny/logs/train_draft.log").read_text()
    assert "reusing the finished training results/tiny/train/checkpoints/step-0000030" in log, log
    assert "starting fresh" not in log and "train_draft: checkpoint " not in log
    assert (faulted / "results/tiny/train/summary.json").read_bytes() == summary
    assert checkpoint_files(faulted) == old_checkpoints
    export_log = (faulted / "results/tiny/logs/export_draft.log").read_text()
    assert "kept results/tiny/draft: the delivered draft there is this export of " in export_log
    del old_draft["README.md"]  # the card is written again with the evaluation
    assert {k: v for k, v in draft_files(faulted).items() if k != "README.md"} == old_draft


def test_a_setting_change_killed_before_its_first_checkpoint_keeps_the_finished_training(finished, tmp_path):
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    old_checkpoints, old_draft = checkpoint_files(faulted), draft_files(faulted)
    write_config(faulted, finished_config(target, chats, lr=0.002))
    log = faulted / "results/tiny/logs/train_draft.log"
    log.unlink()
    proc = start_snakemake(faulted)
    wait_for_line(log, "train_draft: starting fresh", proc)
    kill_stage(proc, "train_draft")
    assert proc.wait() != 0
    assert "other settings" in log.read_text() and "train_draft: checkpoint " not in log.read_text()
    assert checkpoint_files(faulted) == old_checkpoints
    # back to the finished settings: nothing was lost, nothing is trained again
    write_config(faulted, finished_config(target, chats))
    snakemake(faulted, "--rerun-incomplete")
    assert "reusing the finished training" in log.read_text() and "train_draft: checkpoint " not in log.read_text()
    assert draft_files(faulted)["model.safetensors"] == old_draft["model.safetensors"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_full_disk_while_checkpointing_is_one_sentence(finished, tmp_path):
    """torch.save reports a full disk as RuntimeError ("unexpected pos"), not OSError: the job
    still ends with one sentence."""
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    root = faulted / "results/tiny/train/checkpoints"
    old_checkpoints = checkpoint_files(faulted)
    newest = sorted(root.glob("step-*"))[-1]
    # room for the draft's weights and config and half its trainer state: torch.save is what fails
    room = sum((newest / name).stat().st_size for name in ("model.safetensors", "config.json")) + \
        (newest / "trainer_state.pt").stat().st_size // 2
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(root)]).returncode:
        pytest.skip("this container may not mount a tmpfs")
    try:  # the new settings' checkpoints go to the small filesystem mounted over the old ones
        write_config(faulted, finished_config(target, chats, lr=0.002))
        failed = snakemake(faulted, "--", "results/tiny/train/summary.json", check=False)
        assert failed.returncode != 0
        lines = (faulted / "results/tiny/logs/train_draft.log").read_text().splitlines()
        assert not any("Traceback" in line for line in lines), lines[-20:]
        where = root.relative_to(faulted)
        assert re.fullmatch(f"cannot write checkpoint {where}/step-0000005: writing trainer_state.pt failed "
                            r"\(the disk is full; [0-9.]+ [KMG]?i?B free there\); free space in "
                            f"{where} and rerun, training resumes from the start", lines[-1]), lines[-1]
        assert not list(root.glob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(root)], check=True)
    assert checkpoint_files(faulted) == old_checkpoints


def test_a_request_for_one_file_after_a_failed_export_reruns_the_export(finished, tmp_path):
    """Retrained, then the export failed (it never overwrites a delivered draft) and Snakemake removed
    its outputs: a request for the offline evaluation alone must not call the old one up to date."""
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    write_config(faulted, finished_config(target, chats, lr=0.002))
    old_draft = draft_files(faulted)
    failed = snakemake(faulted, "--", OFFLINE, check=False)
    assert failed.returncode != 0
    assert draft_files(faulted) == old_draft  # left whole, and its record is gone: the export is pending
    assert not (faulted / "results/tiny/draft/export.json").exists()
    jobs, reasons, out = dry_run(faulted, "--", OFFLINE)
    assert set(jobs) == {"export_draft", "evaluate_offline"}, out
    assert "evaluate_offline" in reasons["updated input files"], out


def test_a_request_for_one_file_after_a_killed_extraction_reruns_from_the_extraction(finished, tmp_path):
    """New data, then the extraction was killed: the shards, and all made from them, are the old data's."""
    ws, target, chats = finished
    faulted = clone(ws, tmp_path / "faulted")
    changed = finished_config(target, chats)
    changed["data"]["max_length"] = 80
    write_config(faulted, changed)
    proc = start_snakemake(faulted, "--", OFFLINE)
    kill_stage_once_started(proc, "extract_hidden_states")
    assert proc.wait() != 0
    jobs, _, out = dry_run(faulted, "--", OFFLINE)
    after_extraction = {"extract_hidden_states", "gather_hidden_states", "train_draft", "export_draft",
                        "evaluate_offline"}
    assert after_extraction <= set(jobs) <= after_extraction | {"vocab_mapping"}, out
