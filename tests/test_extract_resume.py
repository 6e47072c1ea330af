"""Resume after a real kill -9, rewrite of damaged or stale shards, byte-identical results."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiny
from eaglepipe import extract_hidden_states as ehs

REPO = Path(__file__).resolve().parents[1]
BATCHES = 40


def run_cli(work: Path, model: Path, name: str, *extra, wait=True):
    args = [sys.executable, "-m", "eaglepipe.extract_hidden_states", "--train", str(work / "train.jsonl"),
            "--eval", str(work / "eval.jsonl"), "--model", str(model), "--backend", "hf", "--device", "cpu",
            "--batch-size", "4", "--shard-dir", str(work / name / "shards"),
            "--out", str(work / name / "part.json"), *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    log = open(work / f"{name}.log", "a")
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    if wait:
        assert p.wait(timeout=300) == 0, (work / f"{name}.log").read_text()[-3000:]
    return p


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


def last_line_of(text: str, prefix: str) -> str:
    return [x for x in text.splitlines() if x.startswith(prefix)][-1]


def last_line(log: Path, prefix: str) -> str:
    return last_line_of(log.read_text(), prefix)


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_resume_after_kill_is_byte_identical(tmp_path, tiny_llama, pool):
    tiny.make_tokenized(tmp_path / "train.jsonl", 4 * (BATCHES - 4), 400, lengths=(30, 60), seed=3, prefix="t")
    tiny.make_tokenized(tmp_path / "eval.jsonl", 16, 400, lengths=(30, 60), seed=4, prefix="e")
    run_cli(tmp_path, tiny_llama, "full")
    full = shard_bytes(tmp_path / "full" / "shards")
    assert len(full) == BATCHES

    shard_dir = tmp_path / "killed" / "shards"
    p = run_cli(tmp_path, tiny_llama, "killed", "--writer-pool", pool, wait=False)
    deadline = time.time() + 120
    while not list(shard_dir.glob("*.checksum")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    before = len(list(shard_dir.glob("*.checksum")))  # a shard written without its record is redone
    assert 1 <= before < BATCHES, f"kill landed after {before} of {BATCHES} shards"
    assert not (tmp_path / "killed" / "part.json").exists()

    run_cli(tmp_path, tiny_llama, "killed", "--writer-pool", pool)
    log = tmp_path / "killed.log"
    assert last_line(log, "reused") == f"reused {before} shards, wrote {BATCHES - before}"
    assert shard_bytes(shard_dir) == full
    assert not list(shard_dir.glob(".tmp-*"))

    # a truncated shard, one with a broken header and a stray temporary are all dealt with
    names = sorted(full)
    (shard_dir / names[0]).write_bytes(full[names[0]][: len(full[names[0]]) // 2])
    (shard_dir / names[5]).write_bytes(b"\xff" * 16 + full[names[5]][16:])
    flipped = bytearray(full[names[7]])
    flipped[-3] ^= 0x10  # one bit of the last hidden state: the file still opens and looks complete
    (shard_dir / names[7]).write_bytes(bytes(flipped))
    (shard_dir / ".tmp-train-000009.safetensors.abc").write_bytes(b"partial")
    run_cli(tmp_path, tiny_llama, "killed")
    assert last_line(log, "reused") == f"reused {BATCHES - 3} shards, wrote 3"
    for name in (names[0], names[5], names[7]):
        assert f"shard {shard_dir / name} " in log.read_text() and "rebuilding it" in log.read_text()
    assert "removed 1 stale temporary files" in log.read_text()
    assert shard_bytes(shard_dir) == full and not list(shard_dir.glob(".tmp-*"))


def test_changed_settings_or_samples_rewrite_shards(tmp_path, tiny_llama, capsys):
    tiny.make_tokenized(tmp_path / "train.jsonl", 8, 400, seed=3, prefix="t")
    tiny.make_tokenized(tmp_path / "eval.jsonl", 4, 400, seed=4, prefix="e")

    def run(*extra):
        ehs.main(["--train", str(tmp_path / "train.jsonl"), "--eval", str(tmp_path / "eval.jsonl"),
                  "--model", str(tiny_llama), "--device", "cpu", "--batch-size", "4", "--shard-dir", str(tmp_path / "shards"),
                  "--out", str(tmp_path / "part.json"), *extra])
        return last_line_of(capsys.readouterr().err, "reused")

    assert run() == "reused 0 shards, wrote 3"
    assert run("--storage-dtype", "fp8") == "reused 0 shards, wrote 3"  # other settings digest
    assert run("--storage-dtype", "fp8", "--device", "cpu") == "reused 3 shards, wrote 0"
    assert run("--storage-dtype", "fp8", "--batch-size", "2") == "reused 0 shards, wrote 6"
    # one sample's tokens change: only its batch is redone
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    lines[5] = lines[5].replace('"input_ids": [', '"input_ids": [7, ').replace('"loss_mask": [', '"loss_mask": [0, ')
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    assert run("--storage-dtype", "fp8", "--batch-size", "2") == "reused 5 shards, wrote 1"


def test_categories_go_to_the_manifest_and_a_changed_one_rewrites_no_shard(tmp_path, tiny_llama, capsys):
    tiny.make_tokenized(tmp_path / "train.jsonl", 4, 400, seed=3, prefix="t")
    tiny.make_tokenized(tmp_path / "eval.jsonl", 6, 400, seed=4, prefix="e")

    def run(categories):
        lines = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
        (tmp_path / "eval.jsonl").write_text("".join(
            json.dumps({k: v for k, v in {**r, "category": c}.items() if v is not None}) + "\n"
            for r, c in zip(lines, categories)))
        ehs.main(["--train", str(tmp_path / "train.jsonl"), "--eval", str(tmp_path / "eval.jsonl"),
                  "--model", str(tiny_llama), "--device", "cpu", "--batch-size", "4", "--shard-dir", str(tmp_path / "shards"),
                  "--out", str(tmp_path / "part.json")])
        m = json.loads((tmp_path / "part.json").read_text())
        return last_line_of(capsys.readouterr().err, "reused"), m["splits"]

    reused, splits = run(["math", None, "math", "code", None, None])
    assert reused == "reused 0 shards, wrote 3"
    # in sample order per shard row; a row whose samples have none has no such field
    assert [r.get("categories") for r in splits["eval"]["shards"]] == [["math", None, "math", "code"], None]
    assert all("categories" not in r for r in splits["train"]["shards"])
    reused, splits = run(["math", None, "math", "code", None, "code"])
    assert reused == "reused 3 shards, wrote 0"  # only the manifest tells categories
    assert [r.get("categories") for r in splits["eval"]["shards"]] == [["math", None, "math", "code"], [None, "code"]]


def test_every_flag_changes_shard_settings_unless_listed_as_neutral(tmp_path):
    """A new flag counts as changing shards until RESULT_NEUTRAL lists it; every listed one is a flag."""
    args = ehs.parse_args(["--train", "t", "--eval", "e", "--model", "m", "--shard-dir", "s", "--out", "o"])
    flags = set(vars(args))
    assert set(ehs.RESULT_NEUTRAL) <= flags, set(ehs.RESULT_NEUTRAL) - flags
    settings = ehs.settings_of(args, [2, 4], "tok-a")
    assert flags - set(ehs.RESULT_NEUTRAL) <= set(settings)
    assert ehs.settings_of(args, [2, 4], "tok-b")["digest"] != settings["digest"]  # another tokenizer
    args.enforce_eager = True
    assert ehs.settings_of(args, [2, 4], "tok-a")["digest"] != settings["digest"]
    args.enforce_eager, args.shard_dir, args.writer_pool = False, "elsewhere", "processes"
    assert ehs.settings_of(args, [2, 4], "tok-a")["digest"] == settings["digest"]


def test_a_full_disk_names_the_shard_directory(tmp_path, monkeypatch):
    from eaglepipe import shards

    def no_space(*_, **__):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards, "save_pieces", no_space)
    with pytest.raises(SystemExit, match=f"cannot write shard {tmp_path}/x.safetensors: No space left on device; "
                                         f"free space in {tmp_path}"):
        shards.write_shard(tmp_path / "x.safetensors", torch.zeros(2, 2, 4), torch.zeros(2), torch.zeros(2),
                           torch.zeros(1), torch.tensor([0, 2]), {})


def test_a_replica_removes_only_its_own_leftovers(tmp_path, tiny_llama, capsys):
    """Replicas share the shard directory and run at once: one must never delete another's write in
    progress (a SLURM run lost a shard that way)."""
    tiny.make_tokenized(tmp_path / "train.jsonl", 8, 400, seed=3, prefix="t")
    tiny.make_tokenized(tmp_path / "eval.jsonl", 4, 400, seed=4, prefix="e")
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    others = shard_dir / ".tmp-train-000001.safetensors.inflight"  # batch 1: replica 1's
    own = shard_dir / ".tmp-train-000000.safetensors.killed"  # batch 0: replica 0's
    others.write_bytes(b"being written")
    own.write_bytes(b"left by a kill -9")
    ehs.main(["--train", str(tmp_path / "train.jsonl"), "--eval", str(tmp_path / "eval.jsonl"),
              "--model", str(tiny_llama), "--device", "cpu", "--batch-size", "4", "--shard-dir", str(shard_dir),
              "--replica", "0", "--replicas", "2", "--out", str(tmp_path / "part.json")])
    assert "removed 1 stale temporary files" in capsys.readouterr().err
    assert others.read_bytes() == b"being written" and not own.exists()
    assert sorted(p.name for p in shard_dir.glob("*.safetensors")) == \
        ["eval-000000.safetensors", "train-000000.safetensors"]
