"""Checkpoint layout, atomicity markers, links, pruning and resume selection."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from eaglepipe import checkpoints
from eaglepipe.checksum import CHECKSUM, file_checksum


@pytest.fixture(scope="module")
def draft(tiny_llama, tmp_path_factory):
    from eaglepipe.draft_model import build_draft

    vm = tmp_path_factory.mktemp("vm") / "vocab_mapping.safetensors"
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[::4] = True
    save_file({"d2t": torch.arange(0, 400, 4) - torch.arange(100), "t2d": t2d}, str(vm))
    return build_draft(tiny_llama, [1, 3, 5], vm, ttt_steps=2)


def state(digest="d1", step=0):
    return {"digest": digest, "step": step, "position": [0, step], "optimizer": {}, "evals": {}, "best": None}


def test_layout_links_and_pruning(draft, tmp_path):
    for step in (10, 20, 30, 40):
        checkpoints.save(tmp_path, step, draft, state(step=step), [{"step": step}], best=step == 20)
    root = tmp_path / "checkpoints"
    ck = root / "step-0000040"
    assert {"config.json", "model.safetensors", "trainer_state.pt", "metrics.jsonl", "COMPLETE"} <= {p.name for p in ck.iterdir()}
    assert os.readlink(root / "latest") == "step-0000040" and os.readlink(root / "best") == "step-0000020"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-0000020", "step-0000030", "step-0000040"]
    assert not list(root.glob(".tmp-*"))


def test_resume_picks_newest_complete_with_matching_digest(draft, tmp_path, caplog):
    checkpoints.save(tmp_path, 1, draft, state(step=1), [{"step": 0}, {"step": 1}])
    checkpoints.save(tmp_path, 2, draft, state(step=2), [])
    (tmp_path / "checkpoints" / "step-0000002" / "COMPLETE").unlink()
    (tmp_path / "checkpoints" / ".tmp-step-0000003").mkdir()  # a save killed half-way
    ckpt, st, rows = checkpoints.find_resume(tmp_path, "d1")
    assert ckpt.name == "step-0000001" and st["step"] == 1 and rows == [{"step": 0}, {"step": 1}]
    with caplog.at_level(logging.WARNING):
        assert checkpoints.find_resume(tmp_path, "other") is None
    assert "other settings" in caplog.text and "starting fresh" in caplog.text
    # nothing is removed before the new settings' first checkpoint is on disk
    assert checkpoints.find_resume(tmp_path, "d1")[0].name == "step-0000001"
    checkpoints.save(tmp_path, 1, draft, state("other", step=1), [], best=True)
    assert checkpoints.find_resume(tmp_path, "d1") is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best", "latest", "step-0000001"]


def test_a_superseded_training_is_removed_only_by_the_next_checkpoint(draft, tmp_path):
    for step in (2, 4):
        checkpoints.save(tmp_path, step, draft, state(step=step), [], best=step == 2)
    assert checkpoints.supersede(tmp_path) == 2
    root = tmp_path / "checkpoints"
    assert checkpoints.find_resume(tmp_path, "d1") is None  # a retraining starts fresh
    assert sorted(p.name for p in root.glob("superseded-*")) == ["superseded-step-0000002", "superseded-step-0000004"]
    checkpoints.save(tmp_path, 2, draft, state(step=2), [], best=True)
    assert sorted(p.name for p in root.iterdir()) == ["best", "latest", "step-0000002"]


def test_load_weights_round_trip_and_mismatch(draft, tmp_path):
    ck = checkpoints.save(tmp_path, 5, draft, state(step=5), [])
    with torch.no_grad():
        saved = draft.fc.weight.clone()
        draft.fc.weight.zero_()
    checkpoints.load_weights(draft, ck)
    assert torch.equal(draft.fc.weight, saved)
    save_file({"fc.weight": saved, "bogus": saved.clone()}, str(ck / "model.safetensors"))
    with pytest.raises(SystemExit, match="weights do not fit the draft"):
        checkpoints.load_weights(draft, ck)


def test_settings_digest_is_order_independent():
    assert checkpoints.settings_digest({"a": 1, "b": 2}) == checkpoints.settings_digest({"b": 2, "a": 1})
    assert checkpoints.settings_digest({"a": 1}) != checkpoints.settings_digest({"a": 2})


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero(path):
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # the end of the last tensor: the file still loads, with other weights
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, zero], ids=["truncated", "zeroed"])
@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt", "COMPLETE"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(draft, tmp_path, caplog, damage, name):
    checkpoints.save(tmp_path, 1, draft, state(step=1), [{"step": 1}])
    newest = checkpoints.save(tmp_path, 2, draft, state(step=2), [{"step": 2}])
    damage(newest / name)
    with caplog.at_level(logging.WARNING):
        ckpt, st, rows = checkpoints.find_resume(tmp_path, "d1")
    assert ckpt.name == "step-0000001" and st["step"] == 1 and rows == [{"step": 1}]
    assert f"checkpoint {newest} is damaged" in caplog.text and "falling back" in caplog.text


def test_every_damaged_checkpoint_means_a_fresh_start(draft, tmp_path, caplog):
    only = checkpoints.save(tmp_path, 1, draft, state(step=1), [])
    truncate(only / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert checkpoints.find_resume(tmp_path, "d1") is None
    assert "starting fresh" in caplog.text and only.is_dir()  # removed by the next save, not before
    checkpoints.save(tmp_path, 1, draft, state(step=1), [])
    assert checkpoints.find_resume(tmp_path, "d1")[0] == only


class Payload:
    """Unpickling this runs a command (the attack a trainer state loaded with pickle allows)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_pickle_never_runs(draft, tmp_path, caplog):
    checkpoints.save(tmp_path, 1, draft, state(step=1), [])
    planted = checkpoints.save(tmp_path, 2, draft, state(step=2), [])
    marker = tmp_path / "payload-ran"
    torch.save(dict(state(step=2), evil=Payload(marker)), planted / "trainer_state.pt")
    # the attacker also rewrites the recorded checksums, so only the loader stands in the way
    complete = json.loads((planted / "COMPLETE").read_text())
    complete["files"]["trainer_state.pt"] = {"bytes": (planted / "trainer_state.pt").stat().st_size,
                                             CHECKSUM: file_checksum(planted / "trainer_state.pt")}
    (planted / "COMPLETE").write_text(json.dumps(complete))
    with caplog.at_level(logging.WARNING):
        ckpt, _, _ = checkpoints.find_resume(tmp_path, "d1")
    assert not marker.exists(), "the planted pickle ran"
    assert ckpt.name == "step-0000001" and "cannot be loaded as plain data" in caplog.text
    # our words: no terminal escapes, no advice on how to load it anyway
    assert "\x1b" not in caplog.text and "weights_only" not in caplog.text and "trust" not in caplog.text


FULL_DISK = {
    "OSError": (torch, "save", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "trainer_state.pt"),
    # what torch.save raises on a full disk (torch 2.13.0), and safetensors under save_pretrained
    "torch": (torch, "save", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
              "trainer_state.pt"),
    "safetensors": (None, "save_pretrained",
                    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                    "config.json and model.safetensors"),
}


@pytest.mark.parametrize("case", FULL_DISK)
def test_a_full_disk_while_checkpointing_is_one_sentence(draft, tmp_path, monkeypatch, case):
    where, name, error, file = FULL_DISK[case]

    def no_space(*_, **__):
        raise error

    # a checkpoint of these settings to resume from (torch), of other settings (OSError), none (safetensors)
    previous = None if case == "safetensors" else checkpoints.save(
        tmp_path, 2, draft, state("d1" if case == "torch" else "other", step=2), [])
    monkeypatch.setattr(where or draft, name, no_space)
    root = tmp_path / "checkpoints"
    with pytest.raises(SystemExit) as e:
        checkpoints.save(tmp_path, 3, draft, state(step=3), [])
    resumes = "step-0000002" if case == "torch" else "the start"
    assert re.fullmatch(f"cannot write checkpoint {root}/step-0000003: writing {file} failed \\(the disk is full; "
                        f"[0-9.]+ [KMGT]?i?B free there\\); free space in {root} and rerun, training resumes "
                        f"from {resumes}", str(e.value)), str(e.value)
    assert not list(root.glob(".tmp-*"))  # the half-written checkpoint is gone
    assert [p.name for p in root.glob("step-*")] == (["step-0000002"] if previous else [])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_checkpoint_on_a_full_tmpfs_is_one_sentence(draft, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode:
        pytest.skip("this container may not mount a tmpfs")
    try:
        with pytest.raises(SystemExit, match=r"cannot write checkpoint .*: writing .* failed \(the disk is full; "
                                              r".*free space in .* and rerun, training resumes from the start$"):
            checkpoints.save(small, 1, draft, state(step=1), [])
        assert not list((small / "checkpoints").iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)
