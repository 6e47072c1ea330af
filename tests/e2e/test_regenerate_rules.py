"""The regeneration rules in a tiny run: the fixed eval prompts and the training data they make, and
which of them reruns after which change (the stage itself: tests/test_regenerate.py)."""

from __future__ import annotations

import json

import pytest

import tiny
from workflow import copy_workflow, dry_run, snakemake, write_config

pytestmark = pytest.mark.e2e


def test_rules_rerun_on_their_own_sampling_changes_only(tmp_path, tiny_llama):
    ws = copy_workflow(tmp_path)
    chats = tiny.make_chats(ws / "chats.jsonl", n=12)
    prompts = tiny.make_chats(ws / "prompts.jsonl", n=3)
    regenerate = {"enabled": True, "max_new_tokens": 8, "on_loop": "keep", "turns": "first"}
    write_config(ws, {
        "run_name": "tiny",
        "target": {"model": str(tiny_llama), "build": None, "deploy_name": "tiny/llama"},
        "data": {"path": str(chats), "max_length": 256, "eval_fraction": 0.5},
        "draft": {"vocab_size": 64},
        "extract": {"backend": "hf", "device": "cpu", "batch_size": 4},
        "regenerate": regenerate,
        "evaluate": {"prompts": str(prompts)},
        "benchmark_serving": {"max_tokens": 6},
    })
    jobs, reasons, _ = dry_run(ws)
    made = reasons["output files have to be generated"]
    assert jobs["regenerate_responses"] == jobs["regenerate_eval_prompts"] == 1
    assert "regenerate_responses" in made and "regenerate_eval_prompts" in made
    snakemake(ws, "results/tiny/data/train.jsonl")

    # the fixed prompts are the eval split, token for token; every training conversation trains
    data = ws / "results" / "tiny" / "data"
    fixed = [json.loads(line) for line in (ws / "results/tiny/regenerated/eval_prompts.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in evals] == [
        (r["id"], r["input_ids"], r["loss_mask"]) for r in fixed]
    assert len(fixed) == 3 and all(sum(r["loss_mask"]) <= 6 for r in fixed)  # greedy, benchmark_serving.max_tokens
    # both files name their conversations c0, c1, ...: the fixed set keeps its ids, the data's
    # conversations reusing them are the counted duplicates, every other one trains
    train_ids = {json.loads(line)["id"].split("#")[0] for line in (data / "train.jsonl").read_text().splitlines()}
    assert train_ids == {f"c{i}" for i in range(3, 12)}
    stats = json.loads((data / "stats.json").read_text())
    assert stats["splits"]["eval"]["samples"] == 3 and stats["eval_data"].endswith("eval_prompts.jsonl")
    assert stats["read"] == 15 and stats["skipped_by_reason"] == {"duplicate_id": 3}

    jobs, _, _ = dry_run(ws)
    assert not {"regenerate_responses", "regenerate_eval_prompts", "prepare_data"} & set(jobs)
    jobs, reasons, out = dry_run(ws, "--config", "regenerate=" + json.dumps({**regenerate, "temperature": 0.9}))
    assert {"regenerate_responses", "prepare_data"} <= set(jobs) and "regenerate_eval_prompts" not in jobs, out
    assert any("regenerate_responses" in rules for reason, rules in reasons.items() if "params" in reason.lower()), out
    jobs, _, out = dry_run(ws, "--config", 'benchmark_serving={"max_tokens": 7}')
    assert {"regenerate_eval_prompts", "prepare_data"} <= set(jobs) and "regenerate_responses" not in jobs, out
    jobs, _, out = dry_run(ws, "--config", 'train={"lr": 0.002}')
    assert not {"regenerate_responses", "regenerate_eval_prompts", "prepare_data"} & set(jobs), out
    # how the engine uses the machine changes no answer (the parts' keys leave it out): no rerun
    engine = {"regenerate": {**regenerate, "hf_batch_size": 3}, "extract": {"gpu_memory_utilization": 0.5}}
    jobs, _, out = dry_run(ws, "--config", *(f"{k}={json.dumps(v)}" for k, v in engine.items()))
    assert not {"regenerate_responses", "regenerate_eval_prompts", "prepare_data"} & set(jobs), out
