"""The disk budget's pieces without a whole run (tests/e2e/test_disk_budget.py runs them together):
when extraction defers the train shards, the schedule of what must be on disk at once, and the
producer making a pass's shards within the budget."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

import tiny
from eaglepipe import extract_hidden_states as ehs
from eaglepipe import shard_budget
from eaglepipe.gather_manifest import gather


def test_no_budget_or_one_that_fits_changes_nothing():
    sizes = {"train": [100, 100], "eval": [50]}
    assert shard_budget.plan(None, sizes, 10) is None
    assert shard_budget.plan(250 / 2**30, sizes, 10) is None
    record = shard_budget.plan(200 / 2**30, sizes, 10)
    assert record["train_bytes"] == 150 and record["eval_bytes"] == 50 and record["projected_bytes"] == 250
    with pytest.raises(SystemExit, match="extract.disk_budget_gib .*the held-out eval shards alone need") as e:
        shard_budget.plan(120 / 2**30, sizes, 10)
    assert "at least 150 B" in str(e.value) and "every shard fits in 250 B" in str(e.value)
    assert shard_budget.plan(1 / 2**30, {"train": [], "eval": [50]}, 10) is None  # a parity set


def test_the_schedule_counts_what_the_rows_in_flight_need():
    # pass 0: rows use shards (0), (0, 1), (1), (2); pass 1 the reverse
    plans = {0: [[(0, 0, 5)], [(0, 1, 5), (1, 0, 5)], [(1, 1, 5)], [(2, 0, 5)]],
             1: [[(2, 0, 5)], [(1, 0, 5)], [(1, 1, 5), (0, 0, 5)], [(0, 1, 5)]]}
    sched = shard_budget.Schedule(lambda e: plans[e % 2], (0, 1), steps=5, world=1, sizes=[10, 20, 40])
    assert [(e, i) for e, i, _ in sched.rows] == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert sched.order == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1)]
    assert sched.last[(0, 0)] == 0 and sched.last[(0, 1)] == 1 and sched.last[(1, 1)] == 4
    assert sched.peak_bytes(0) == 40  # one row's shards at a time
    assert sched.peak_bytes(1) == 40 + 40  # with a row read ahead: both passes' copies of shard 2
    assert sched.peak_bytes(10) == 10 + 20 + 40 + 40 + 20


def test_the_shuffle_window_fits_every_pass_of_the_run():
    # a row reads one shard; but with a window of 2 shards, pass 2 packs two shards a row:
    # three rows in flight then need 50 bytes, more than the budget of 30
    def make_plan(window):
        one_shard_a_row = [[(si, 0, 5)] for si in range(4)]
        two_shards_a_row = [[(0, 0, 5), (1, 0, 5)], [(2, 0, 5), (3, 0, 5)]]
        return lambda epoch: two_shards_a_row if (window, epoch) == (2, 2) else one_shard_a_row

    def window(steps):
        return shard_budget.choose_window(make_plan, 2, 4, 30, [10] * 4, steps, world=1, depth=0)

    assert window(steps=8) == 2  # passes 0 and 1
    assert window(steps=10) == 1  # and pass 2, which the training would refuse to start (Budget.start)


def test_extraction_over_the_budget_writes_only_the_eval_shards_and_the_producer_the_rest(tmp_path, tiny_llama):
    train, evl = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    tiny.make_tokenized(train, 8, 400, seed=1, prefix="t")
    tiny.make_tokenized(evl, 2, 400, seed=2, prefix="e")
    shard_dir = tmp_path / "hs" / "shards"
    common = ["--train", str(train), "--eval", str(evl), "--model", str(tiny_llama), "--device", "cpu",
              "--batch-size", "2", "--shard-dir", str(shard_dir)]
    part = tmp_path / "hs" / "parts" / "replica-0-of-1.json"
    ehs.main([*common, "--out", str(part), "--disk-budget-gib", str(100_000 / 2**30)])
    m = json.loads(part.read_text())
    assert m["disk_budget"]["bytes"] == 100_000
    assert all(r["deferred"] for r in m["splits"]["train"]["shards"]) and len(m["splits"]["train"]["shards"]) == 4
    assert sorted(p.name for p in shard_dir.glob("*.safetensors")) == ["eval-000000.safetensors"]
    merged = gather([part], tmp_path / "hs" / "manifest.json")
    assert merged["disk_budget"] == m["disk_budget"]
    # the training refuses, before any step, a budget that cannot hold the shards its rows in flight need
    from argparse import Namespace

    from eaglepipe.shard_manifest import load_manifest
    from eaglepipe.train_draft import budget_plan

    train_args = Namespace(shuffle_buffer_gib="global", batch_tokens=64, seed=0, max_steps=20)
    with pytest.raises(SystemExit, match="the train share of the budget .* cannot hold .* raise the budget by"):
        budget_plan(train_args, load_manifest(tmp_path / "hs" / "manifest.json"), 1, tmp_path / "train", {})
    # the same settings without the budget: the part's settings (and so the shards' digest) are the same
    plain = tmp_path / "plain.json"
    ehs.main([*common, "--out", str(plain), "--shard-dir", str(tmp_path / "plain")])
    assert json.loads(plain.read_text())["settings"] == m["settings"] and "disk_budget" not in json.loads(plain.read_text())

    # the producer: two passes of batch 0 and 1, at most one shard's room beside what is on disk
    biggest = max(r["bytes"] for r in m["splits"]["train"]["shards"])
    schedule = tmp_path / "schedule.json"
    progress = tmp_path / "trained.json"
    progress.write_text(json.dumps({"rows": 0}))
    # where the training's Budget keeps the producer's records (train_dir/budget/extracted.jsonl)
    train_dir = tmp_path / "train"
    stats = train_dir / "budget" / shard_budget.EXTRACTED
    stats.parent.mkdir(parents=True)
    schedule.write_text(json.dumps({"occurrences": [[0, 1, 0], [0, 0, 1], [1, 0, 2]], "budget_bytes": 2 * biggest,
                                    "eval_bytes": 0, "stats": str(stats),
                                    "progress": str(progress)}))
    done = threading.Event()

    def consume():  # what the training does: delete a shard after its use, say so first
        waiter = shard_budget.ShardWaiter(shard_dir, None)
        for k, (e, b) in enumerate([(0, 1), (0, 0), (1, 0)]):
            path = waiter(e, b)
            assert shard_budget.occurrence_bytes(shard_dir) <= 2 * biggest
            progress.write_text(json.dumps({"rows": k + 1}))
            path.unlink()
            Path(f"{path}.checksum").unlink()
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    ehs.main([*common, "--schedule", str(schedule)])
    t.join(timeout=60)
    assert done.is_set()
    load, *rows = [json.loads(x) for x in stats.read_text().splitlines()]
    assert list(load) == ["model_load_s"] and load["model_load_s"] > 0  # the target, loaded once for both passes
    assert [(r["epoch"], r["batch"]) for r in rows] == [(0, 1), (0, 0), (1, 0)]
    assert not shard_budget.occurrence_files(shard_dir)
    assert os.path.exists(shard_dir / "eval-000000.safetensors")

    # the training's summary: the shards made and the producer's loads apart; a producer killed
    # right after its load (a line cut by the kill beside it) loaded the target all the same
    with stats.open("a") as f:
        f.write(json.dumps({"model_load_s": 3.25}) + '\n{"epoch": 1, "bat')
    budget = shard_budget.Budget(load_manifest(tmp_path / "hs" / "manifest.json"), train_dir, None, seed=0)
    summary = budget.summary(rows_per_epoch=2, train_tokens=0, window=1, configured_window=1)
    assert summary["model_loads_s"] == [load["model_load_s"], 3.25]
    assert summary["shards_extracted"] == 3
    assert summary["reextraction_s"] == round(sum(r["seconds"] for r in rows), 3)
    assert summary["peak_shard_bytes"] == max(r["peak_bytes"] for r in rows)


def test_the_refusal_for_lack_of_disk_names_the_budget(tmp_path, tiny_llama, monkeypatch):
    from collections import namedtuple

    from eaglepipe import disk_budget

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 100 << 20))
    with pytest.raises(SystemExit, match="set extract.disk_budget_gib to train through a bounded set of shards"):
        disk_budget.check_room(tmp_path, 1 << 30, None, 0)
