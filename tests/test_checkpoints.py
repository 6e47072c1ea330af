"""Checkpoint layout, atomicity markers, links, pruning and resume selection."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest
import torch
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
    assert not (tmp_path / "checkpoints").exists()
    assert checkpoints.find_resume(tmp_path, "d1") is None


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
    assert "starting fresh" in caplog.text and not (tmp_path / "checkpoints").exists()


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


def test_a_full_disk_while_checkpointing_names_the_directory(draft, tmp_path, monkeypatch):
    def no_space(*_, **__):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", no_space)
    root = tmp_path / "checkpoints"
    with pytest.raises(SystemExit, match=f"cannot write checkpoint {root}/step-0000003: No space left on device; "
                                         f"free space in {root}"):
        checkpoints.save(tmp_path, 3, draft, state(step=3), [])
    assert not list(root.glob(".tmp-*"))  # the half-written checkpoint is gone
