"""A tiny run trained through a disk budget of a few shards (extract.disk_budget_gib,
docs/disk-budget.md): the shards on disk stay within the budget plus the one being written, every
sample is trained as often as without the budget, the same order gives the same draft, and kill -9
of the training (and with it its extractor), then of its extractor alone, resume to the result of
the uninterrupted run without the budget."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from workflow import differences, dry_run, finished_config, kill_stage, snakemake, start_snakemake, wait_for_line, \
    write_config

pytestmark = pytest.mark.e2e

RUN = "results/tiny"


def config(target: Path, chats: Path, budget_gib: float | None = None) -> dict:
    """The session's finished run's settings (a dozen shards, each shuffled alone: workflow.finished_config)
    through a budget."""
    cfg = finished_config(target, chats)
    cfg["extract"]["disk_budget_gib"] = budget_gib
    return cfg


def manifest(ws: Path) -> dict:
    return json.loads((ws / RUN / "hidden_states/manifest.json").read_text())


@pytest.fixture(scope="module")
def runs(finished_tiny, tmp_path_factory):
    """(the run without a budget: the session's finished run (conftest.py), read only; the same run
    through a budget of a few shards, the budget, the biggest train shard, (target, chats)). The
    budgeted run is killed twice on the way: its training (its extractor dies with it), then, in
    the rerun, its extractor alone."""
    root = tmp_path_factory.mktemp("budget")
    plain, target, chats = finished_tiny.ws, finished_tiny.target, finished_tiny.chats
    splits = manifest(plain)["splits"]
    biggest = max(r["bytes"] for r in splits["train"]["shards"])
    # the eval shards and 5 train shards of the ~12: as few as the rows in flight allow
    budget = splits["eval"]["bytes"] + 5 * biggest
    budgeted = root / "budgeted"
    shutil.copytree(plain, budgeted, symlinks=True)
    shutil.rmtree(budgeted / RUN / "draft")  # a new draft goes to an empty place
    write_config(budgeted, config(target, chats, budget / 2**30))
    jobs, _, _ = dry_run(budgeted)
    # the budget changes which shards stay on disk: extraction (eval shards reused) and what follows
    assert {"extract_hidden_states", "gather_hidden_states", "train_draft"} <= set(jobs)
    assert not {"prepare_data", "vocab_mapping"} & set(jobs)
    log = budgeted / RUN / "logs/train_draft.log"
    log.unlink()
    proc = start_snakemake(budgeted)
    wait_for_line(log, "train_draft: checkpoint results/tiny/train/checkpoints/step-0000010", proc)
    kill_stage(proc, "train_draft")  # the extractor it started dies with it
    assert proc.wait() != 0
    log.unlink()
    proc = start_snakemake(budgeted)
    wait_for_line(log, "producer: hf backend loaded", proc)
    kill_stage(proc, "extract_hidden_states")  # the extractor alone: the training stops, naming the shard
    assert proc.wait() != 0
    (budgeted / "first-rerun.log").write_text(log.read_text())
    snakemake(budgeted)
    return plain, budgeted, budget, biggest, (target, chats)


def reference_counts(ws: Path, cfg: dict) -> Counter:
    """How often each train sample is trained by the unbudgeted run: its rows replayed."""
    from eaglepipe.packed_data import PackedRows
    from eaglepipe.shard_manifest import load_manifest

    m = load_manifest(ws / RUN / "hidden_states/manifest.json")
    rows = PackedRows(m, "train", cfg["train"]["batch_tokens"], seed=cfg["train"].get("seed", 0), shuffle=True,
                      shuffle_window=1)
    counts, epoch, need = Counter(), 0, cfg["train"]["max_steps"]
    while need:
        for row in rows.plan(epoch):
            for si, b, _ in row:
                counts[_index(rows, si, b)] += 1
            need -= 1
            if not need:
                break
        epoch += 1
    return counts


def _index(rows, si: int, b: int) -> int:
    from safetensors import safe_open

    with safe_open(str(rows.shards[si][0]), "pt") as f:
        return int(f.get_tensor("sample_index")[b])


def test_the_budget_bounds_the_shards_and_trains_the_same_draft(runs):
    plain, budgeted, budget, biggest, (target, chats) = runs
    summary = json.loads((budgeted / RUN / "train/summary.json").read_text())
    b = summary["disk_budget"]
    assert b["budget_bytes"] == int(budget / 2**30 * 2**30)
    # measured by the extractor after each shard it wrote: the budget plus the shard in flight
    assert 0 < b["peak_shard_bytes"] <= budget + biggest, b
    assert b["passes"] > 1 and b["shards_extracted"] > len(manifest(plain)["splits"]["train"]["shards"]), b
    assert b["order"] == "as without the budget"
    assert "disk_budget" not in json.loads((plain / RUN / "train/summary.json").read_text())
    # every sample trained as often as without the budget, counted by the training
    state = torch.load(budgeted / RUN / "train/checkpoints/latest/trainer_state.pt", weights_only=True)
    counted = Counter({i: int(c) for i, c in enumerate(state["budget"]["counts"].tolist()) if c})
    assert counted == reference_counts(plain, config(target, chats))
    assert b["samples_trained"] == sum(counted.values())
    # the same order: the same curve and draft; the eval shards are kept, no train shard is left
    found = [d for d in differences(budgeted / RUN, plain / RUN) if d != "hidden_states/manifest.json"]
    assert not found, "\n".join(found)
    shards = {p.name for p in (budgeted / RUN / "hidden_states/shards").glob("*.safetensors")}
    assert shards == {r["file"] for r in manifest(budgeted)["splits"]["eval"]["shards"]}
    assert all(r.get("deferred") for r in manifest(budgeted)["splits"]["train"]["shards"])
    card = (budgeted / RUN / "draft/README.md").read_text()
    assert "disk budget" in card
    # the extractor loaded the target in each of the three training jobs (two of them killed); the
    # extraction reused its eval shards (no load): those are all of the run's target loads
    assert len(b["model_loads_s"]) == 3 and all(s > 0 for s in b["model_loads_s"]), b
    stages = [f"train_draft (disk budget extraction, load {i} of 3)" for i in (1, 2, 3)]
    loads = json.loads((budgeted / RUN / "summary.json").read_text())["target_loads"]["loads"]
    assert loads == [{"stage": st, "seconds": s} for st, s in zip(stages, b["model_loads_s"])], loads
    assert all(f"| {st} |" in card for st in stages), card


def test_kills_of_the_training_and_of_its_extractor_resume(runs):
    _, budgeted, _, _, _ = runs
    first = (budgeted / "first-rerun.log").read_text()
    assert "resuming from results/tiny/train/checkpoints/step-0000010" in first, first[-3000:]
    assert "the extractor feeding training" in first and "ended before writing it" in first, first[-3000:]
    last = (budgeted / RUN / "logs/train_draft.log").read_text()
    assert "resuming from results/tiny/train/checkpoints/step-00000" in last, last[-3000:]
