"""The regeneration rules in a tiny run: the fixed eval prompts and the training data they make, one
job (one target load) answering both, and what reruns after which change (the stage itself:
tests/test_regenerate.py)."""

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
    # a second fixed set (as MT-Bench and HumanEval): its conversations renamed k0, k1
    code = ws / "code.jsonl"
    code.write_text("".join(json.dumps({**json.loads(line), "id": f"k{i}"}) + "\n" for i, line in
                            enumerate(tiny.make_chats(ws / "code-source.jsonl", n=2, seed=5).read_text().splitlines())))
    regenerate = {"enabled": True, "max_new_tokens": 8, "on_loop": "keep", "turns": "first"}
    write_config(ws, {
        "run_name": "tiny",
        "target": {"model": str(tiny_llama), "build": None, "deploy_name": "tiny/llama"},
        "data": {"path": str(chats), "max_length": 256, "eval_fraction": 0.5},
        "draft": {"vocab_size": 64},
        "extract": {"backend": "hf", "device": "cpu", "batch_size": 4},
        "regenerate": regenerate,
        "train": {"max_steps": 2, "batch_tokens": 256, "eval_every": 2, "checkpoint_every": 2, "warmup_steps": 1},
        "evaluate": {"prompts": [str(prompts), str(code)]},
        "benchmark_serving": {"max_tokens": 6},
    })
    jobs, reasons, _ = dry_run(ws)
    made = reasons["output files have to be generated"]
    # one job, one engine, both answer sets
    assert jobs["regenerate_responses"] == 1 and "regenerate_eval_prompts" not in jobs
    assert "regenerate_responses" in made
    snakemake(ws, "results/tiny/data/train.jsonl")

    # the fixed prompts are the eval split, token for token; every training conversation trains
    data = ws / "results" / "tiny" / "data"
    fixed = [json.loads(line) for line in (ws / "results/tiny/regenerated/eval_prompts.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in evals] == [
        (r["id"], r["input_ids"], r["loss_mask"]) for r in fixed]
    assert len(fixed) == 5 and all(sum(r["loss_mask"]) <= 6 for r in fixed)  # greedy, benchmark_serving.max_tokens
    # each sample keeps the set it came from (the file's name), into the eval split
    assert [(r["id"], r["prompt_set"]) for r in evals] == [("c0", "prompts"), ("c1", "prompts"), ("c2", "prompts"),
                                                           ("k0", "code"), ("k1", "code")]
    # both files name their conversations c0, c1, ...: the fixed set keeps its ids, the data's
    # conversations reusing them are the counted duplicates, every other one trains
    train_ids = {json.loads(line)["id"].split("#")[0] for line in (data / "train.jsonl").read_text().splitlines()}
    assert train_ids == {f"c{i}" for i in range(3, 12)}
    stats = json.loads((data / "stats.json").read_text())
    assert stats["splits"]["eval"]["samples"] == 5 and stats["eval_data"].endswith("eval_prompts.jsonl")
    assert stats["read"] == 17 and stats["skipped_by_reason"] == {"duplicate_id": 3}

    regenerated = ws / "results" / "tiny" / "regenerated"
    load = json.loads((regenerated / "stats.json").read_text())["engine"]
    assert load == json.loads((regenerated / "eval_prompts_stats.json").read_text())["engine"]
    assert load["answered"] == ["results/tiny/regenerated/eval_prompts.jsonl", "results/tiny/regenerated/chats.jsonl"]
    chats_before = (regenerated / "chats.jsonl").read_bytes()

    jobs, _, _ = dry_run(ws)
    assert not {"regenerate_responses", "prepare_data"} & set(jobs)
    # written user turns reach the stage as flags, and only when asked for (a run without them keeps its params)
    written = "regenerate=" + json.dumps({**regenerate, "new_user_turns": {"count": 3, "temperature": 0.8}})
    out = snakemake(ws, "-n", "-p", "--config", written, "--", "results/tiny/data/train.jsonl").stdout
    assert "--new-user-turns-count 3 --new-user-turns-temperature 0.8 --new-user-turns-top-p 1.0" in out, out
    # so does the early stop of looping answers (regenerate.loop_stop_every)
    assert "--loop-stop-every" not in out, out
    stopped = "regenerate=" + json.dumps({**regenerate, "on_loop": "drop", "loop_stop_every": 32})
    out = snakemake(ws, "-n", "-p", "--config", stopped, "--", "results/tiny/data/train.jsonl").stdout
    assert "--loop-stop-every 32" in out, out
    jobs, reasons, out = dry_run(ws, "--config", "regenerate=" + json.dumps({**regenerate, "temperature": 0.9}))
    assert {"regenerate_responses", "prepare_data"} <= set(jobs), out
    assert any("regenerate_responses" in rules for reason, rules in reasons.items() if "params" in reason.lower()), out
    # an eval-only setting reruns the shared job, and the chats' parts are reused: no chat generated
    eval_only = 'benchmark_serving={"max_tokens": 7}'
    jobs, reasons, out = dry_run(ws, "--config", eval_only)
    assert {"regenerate_responses", "prepare_data"} <= set(jobs), out
    assert any("regenerate_responses" in rules for reason, rules in reasons.items() if "params" in reason.lower()), out
    snakemake(ws, "--config", eval_only, "--", "results/tiny/data/train.jsonl")
    chats_run = json.loads((regenerated / "stats.json").read_text())["run"]
    assert chats_run["parts_written"] == 0 and chats_run["parts_reused"] > 0 and chats_run["generated_tokens"] == 0
    evals = json.loads((regenerated / "eval_prompts_stats.json").read_text())
    assert evals["run"]["parts_written"] == 1 and evals["settings"]["max_new_tokens"] == 7
    assert (regenerated / "chats.jsonl").read_bytes() == chats_before
    # regeneration off: the eval prompts keep a job (one load) of their own
    jobs, _, out = dry_run(ws, "--config", eval_only, "regenerate=" + json.dumps({**regenerate, "enabled": False}))
    assert "regenerate_eval_prompts" in jobs and "regenerate_responses" not in jobs, out
    jobs, _, out = dry_run(ws, "--config", eval_only, 'train={"lr": 0.002}')
    assert not {"regenerate_responses", "prepare_data"} & set(jobs), out
    # how the engine uses the machine changes no answer (the parts' keys leave it out): no rerun
    engine = {"regenerate": {**regenerate, "hf_batch_size": 3}, "extract": {"gpu_memory_utilization": 0.5}}
    jobs, _, out = dry_run(ws, "--config", eval_only, *(f"{k}={json.dumps(v)}" for k, v in engine.items()))
    assert not {"regenerate_responses", "prepare_data"} & set(jobs), out

    # the offline estimate reports AL overall and per set, per token and as served; the sets add up
    snakemake(ws, "--config", eval_only, "--", "results/tiny/eval/offline.json")
    offline = json.loads((ws / "results/tiny/eval/offline.json").read_text())
    per_set = offline["strata"]["prompt_set"]
    assert sorted(per_set) == ["code", "prompts"]
    assert sum(s["anchors"] for s in per_set.values()) == offline["anchors"] > 0
    assert sum(s["as_served"]["drafts"] for s in per_set.values()) == offline["as_served"]["drafts"] > 0
    for s in per_set.values():
        assert 1.0 <= s["acceptance_length"] <= 1 + offline["k"] and 1.0 <= s["as_served"]["acceptance_length"]
    accepted = sum((s["as_served"]["acceptance_length"] - 1) * s["as_served"]["drafts"] for s in per_set.values())
    assert abs(1 + accepted / offline["as_served"]["drafts"] - offline["as_served"]["acceptance_length"]) < 1e-4
    card = (ws / "results/tiny/draft/README.md")
    snakemake(ws, "--config", eval_only, "--", str(card.relative_to(ws)))
    assert "| code |" in card.read_text() and "| prompts |" in card.read_text()
