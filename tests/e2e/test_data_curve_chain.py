"""benchmarks/gpu_data_curve.sh's chain rehearsed on CPU (issue 45's data-scale curve): the tiny target
with the hf backends in place of the SmolLM2 preset, a smaller size and the size beyond the data.
The full run's regeneration is made once; the smaller size reuses its parts (nothing generated) and
the next the smaller's eval shards (no target load under the disk budget); the parts brought back
in a pack give a fresh machine the same outputs without generating, and the engine settings the
regeneration step is given rerun nothing in the full size's run.
The plans of the real sizes on the SmolLM2 preset: tests/test_data_curve.py."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

import tiny
from workflow import REPO, copy_workflow

pytestmark = pytest.mark.e2e

SCRIPT = "benchmarks/gpu_data_curve.sh"


def workspace(root: Path, target: Path) -> Path:
    root.mkdir()
    ws = copy_workflow(root)
    (ws / "benchmarks").mkdir()
    for name in ("gpu_data_curve.sh", "device_chain.sh", "data_curve.py"):
        shutil.copy2(REPO / "benchmarks" / name, ws / "benchmarks" / name)
    chats = tiny.make_chats(ws / "chats.jsonl", n=24)
    prompts = ws / "prompts.jsonl"  # the fixed eval set, ids of its own (as MT-Bench's)
    prompts.write_text("".join(json.dumps({**json.loads(line), "id": f"p{i}"}) + "\n" for i, line in
                               enumerate(tiny.make_chats(ws / "p.jsonl", n=3, seed=7).read_text().splitlines())))
    preset = {  # in place of config/presets/smollm2-h200.yaml: regeneration on, a fixed eval set
        "run_name": "tiny",
        "target": {"model": str(target), "build": None, "deploy_name": "tiny/llama"},
        # relative paths, as package: data is named: a part's key holds each record's file:line as given
        "data": {"path": chats.name, "max_length": 96},
        "draft": {"vocab_size": 64},
        "extract": {"backend": "hf", "device": "cpu", "batch_size": 2},
        "regenerate": {"enabled": True, "max_new_tokens": 6, "on_loop": "keep"},
        "train": {"max_steps": 6, "batch_tokens": 128, "eval_every": 3, "checkpoint_every": 3, "warmup_steps": 1,
                  "shuffle_buffer_gib": 0},
        "evaluate": {"prompts": [prompts.name]},
        "benchmark_serving": {"max_tokens": 6},
    }
    overlay = {  # in place of benchmarks/data_curve.yaml: its keys, at this size
        "run_name": "curve-all",
        "data": {"max_samples": None},
        "regenerate": {"answers_per_conversation": 1, "batch_size": 4},
        "extract": {"disk_budget_gib": 0.0005},
        "train": {"max_steps": 6},
    }
    (ws / "preset.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    (ws / "overlay.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    return ws


def chain(ws: Path, *args: str, stage: Path, out: Path | None = None, verb: str = "chain", **extra_env: str) -> str:
    env = {**os.environ, **extra_env, "CURVE_PRESET": "preset.yaml", "CURVE_OVERLAY": "overlay.yaml", "CURVE_SIZES": "12:4 all",
           "CURVE_NEW_TURNS": "3", "CURVE_PASSES": "1", "CURVE_ROW_TOKENS": "120",
           "RUN_DIR": str(ws), "STAGE_DIR": str(stage),
           "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("PYTHONPATH", None)  # the rules put the copy's scripts/ first
    if out is not None:
        env["OUT"] = str(out)
    p = subprocess.run(["bash", SCRIPT, verb, *args], cwd=ws, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def steps(ws: Path) -> dict[str, str]:
    with open(ws / "results/data_curve_steps.tsv", newline="") as f:
        return {r["step"]: r["rc"] for r in csv.DictReader(f, delimiter="\t")}


def stats(ws: Path, run: str, name: str = "stats") -> dict:
    return json.loads((ws / f"results/{run}/regenerated/{name}.json").read_text())


def test_the_chain_regenerates_once_and_each_size_reuses_it(tmp_path, tiny_llama):
    ws = workspace(tmp_path / "ws", tiny_llama)
    stage = tmp_path / "stage"
    stage.mkdir()
    # the smaller size, then the size beyond the data: every record and the user turns the target
    # writes itself; OMIT_FROM as the device sessions give it, naming a rule a plan without serving
    # (CPU) lacks
    out = chain(ws, "all", "12", "new", stage=stage, OMIT_FROM="extract_parity_hidden_states")
    assert "CHAIN DONE" in out, out
    assert steps(ws) == {"regenerate": "0", "pack": "0", "size-curve-12": "0", "size-curve-new": "0", "curve": "0"}

    # regenerated once: the full run's 6 parts of 4 records; the 12 records' run reused the first 3
    full, small = stats(ws, "curve-all"), stats(ws, "curve-12")
    assert full["read"] == 24 and full["run"]["parts_written"] == 6 and full["run"]["generated_tokens"] > 0
    assert small["read"] == 12 and small["run"]["parts_written"] == 0 and small["run"]["parts_reused"] == 3
    assert small["run"]["generated_tokens"] == 0
    evals = stats(ws, "curve-12", "eval_prompts_stats")["run"]
    assert evals["parts_written"] == 0 and evals["parts_reused"] == 1
    full_chats = (ws / "results/curve-all/regenerated/chats.jsonl").read_text().splitlines()
    small_chats = (ws / "results/curve-12/regenerated/chats.jsonl").read_text().splitlines()
    assert small_chats == full_chats[:len(small_chats)] and len(full_chats) > len(small_chats)
    # beyond the data: the data's parts were given, only the written turns were answered
    new = stats(ws, "curve-new")
    written = new["new_user_turns"]
    assert written["asked"] == 3 and new["read"] == 24 + written["kept"]
    assert new["run"]["parts_reused"] == 6
    run = ws / "results/curve-new"
    sys.path.insert(0, str(REPO / "benchmarks"))
    import data_curve
    # its steps: one pass (CURVE_PASSES) over its own train tokens in rows of 120
    assert json.loads((run / "train/summary.json").read_text())["steps"] == data_curve.steps_for(run, 1, 120)
    # the size after the first reused its eval shards: its extraction loaded no target
    extract_log = (run / "logs/extract_hidden_states.replica-0-of-1.log").read_text()
    assert "reused 2 shards, wrote 0" in extract_log and "backend loaded" not in extract_log
    assert (run / "draft/README.md").is_file()  # OMIT_FROM of an absent rule left out nothing
    for size in ("curve-12", "curve-new"):  # both trained through the budget
        assert json.loads((ws / f"results/{size}/train/summary.json").read_text())["disk_budget"]["passes"] > 0

    # the curve: one row a run, its data, training and offline AL; the wall times of its stages
    curve = json.loads((ws / "results/data_curve.json").read_text())
    rows = {r["run"]: r for r in curve["rows"]}
    assert [r["run"] for r in curve["rows"]] == ["curve-12", "curve-all", "curve-new"]
    assert rows["curve-12"]["records_read"] == 12 and rows["curve-all"]["records_read"] == 24
    assert rows["curve-12"]["steps"] == 4 and rows["curve-all"]["steps"] is None  # regenerated only
    for r in (rows["curve-12"], rows["curve-new"]):
        assert r["tokens_seen"] > 0 and r["offline_al"] >= 1 and set(r["offline_by_set"]) == {"prompts"}
        assert r["online_al"] is None  # no serving on CPU
        assert "train_draft" in r["stage_seconds_from"]["snakemake log"] and r["wall_s"] >= 0
    # the full run's regeneration ran in a step of its own: its seconds from the benchmark file
    assert rows["curve-all"]["stage_seconds_from"]["benchmark files"] == ["regenerate_responses"]
    assert "regenerate_responses" in rows["curve-12"]["stage_seconds_from"]["snakemake log"]
    assert curve["stopping_rule"]["verdict"] == "fewer than two sizes measured: no verdict"

    # status brings back the small results, the curve and the regenerated parts
    returned = tmp_path / "out"
    returned.mkdir()
    status = chain(ws, stage=stage, out=returned, verb="status")
    assert "ENDED" in status and "regenerated parts returned: 1 piece(s)" in status, status
    assert sorted(p.name for p in returned.iterdir()) == ["data_curve.md", "data_curve.svg", "data_curve.tgz",
                                                          "regen.tgz.00"]
    assert "each run's AL during training" in (returned / "data_curve.svg").read_text()
    with tarfile.open(returned / "data_curve.tgz") as t:
        names = set(t.getnames())
    assert {"data_curve_steps.tsv", "curve-12/train/summary.json", "curve-new/eval/offline.json",
            "curve-all/regenerated/stats.json", "size-curve-12.log"} <= names
    with tarfile.open(fileobj=io.BytesIO((returned / "regen.tgz.00").read_bytes())) as t:
        assert sum(n.startswith("chats-parts/") and n.endswith(".json") for n in t.getnames()) == 6

    # a fresh machine given the pack: the full run's outputs again, nothing generated; its own size
    # run up to its data (OMIT_FROM), where the regeneration step's engine settings (the preset's,
    # no budget) rerun nothing
    ws2 = workspace(tmp_path / "ws2", tiny_llama)
    for piece in returned.glob("regen.tgz.*"):
        shutil.copy2(piece, stage / piece.name)
    out = chain(ws2, "curve", "all", stage=stage, OMIT_FROM="extract_hidden_states")
    assert steps(ws2) == {"unpack": "0", "regenerate": "0", "size-curve-all": "0", "curve": "0"}, out
    again = stats(ws2, "curve-all")
    assert again["run"]["parts_written"] == 0 and again["run"]["parts_reused"] == 6
    assert (ws2 / "results/curve-all/regenerated/chats.jsonl").read_text().splitlines() == full_chats
    size_log = (ws2 / "results/size-curve-all.log").read_text()
    assert "rule regenerate_responses" not in size_log and "rule prepare_data" in size_log, size_log
    assert not (ws2 / "results/curve-all/hidden_states").exists()
