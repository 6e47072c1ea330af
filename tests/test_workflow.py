"""The whole DAG on CPU: a tiny end-to-end run, dry-run plans, rerun behaviour, lint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

import tiny
from workflow import REPO, copy_workflow, dry_run, snakemake, summary, write_config

STAGES = {"prepare_data", "vocab_mapping", "extract_hidden_states", "gather_hidden_states",
          "train_draft", "export_draft", "evaluate_offline", "model_card", "plot_report", "all"}


def tiny_config(target: Path, chats: Path) -> dict:
    return {
        "run_name": "tiny",
        "target": {"model": str(target), "build": None, "deploy_name": "tiny/llama"},
        "data": {"path": str(chats), "max_samples": None, "max_length": 96, "eval_fraction": 0.25},
        "draft": {"vocab_size": 64},
        "extract": {"backend": "hf", "device": "cpu", "batch_size": 4},
        "train": {"max_steps": 6, "lr": 0.001, "batch_tokens": 256, "eval_every": 3,
                  "checkpoint_every": 3, "warmup_steps": 1},
    }


# On the caller's PYTHONPATH only: every stage interpreter that sees it records its module.
SITECUSTOMIZE = """
import atexit, os, sys
def _record():
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    with open(os.path.join(os.path.dirname(__file__), "stages.txt"), "a") as f:
        f.write((spec.name if spec else "?") + "\\n")
atexit.register(_record)
"""


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished tiny end-to-end run in a copy of the workflow, started with a PYTHONPATH of
    the caller's own (as `pip install --target DIR` users have)."""
    ws = copy_workflow(tmp_path_factory.mktemp("ws"))
    target = tiny.make_llama(ws / "target")
    chats = tiny.make_chats(ws / "chats.jsonl", n=24)
    write_config(ws, tiny_config(target, chats))
    jobs, reasons, _ = dry_run(ws)
    assert set(jobs) == STAGES, jobs
    assert set(reasons["output files have to be generated"]) == STAGES - {"all"}
    callers = tmp_path_factory.mktemp("callers_site")
    (callers / "sitecustomize.py").write_text(SITECUSTOMIZE)
    snakemake(ws, pythonpath=str(callers))
    (ws / "callers_stages.txt").write_text((callers / "stages.txt").read_text())
    return ws


def test_stages_keep_the_callers_pythonpath(done_run):
    seen = set((done_run / "callers_stages.txt").read_text().split())
    stages = {f"eaglepipe.{m}" for m in ("prepare_data", "vocab_mapping", "extract_hidden_states",
                                          "gather_manifest", "train_draft", "export_draft",
                                          "evaluate", "model_card", "plots")}
    assert stages <= seen, seen


def test_end_to_end_outputs(done_run):
    run = done_run / "results" / "tiny"
    cfg = json.loads((run / "draft" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny/llama"
    manifest = json.loads((run / "hidden_states" / "manifest.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"][:-1]
    assert manifest["layer_ids"] == [1, 3, 5, 6]  # the default for 6 layers: 3 distinct aux ids, then N
    with safe_open(str(run / "draft" / "model.safetensors"), "pt") as f:
        assert {"d2t", "t2d", "fc.weight"} <= set(f.keys())
    offline = json.loads((run / "eval" / "offline.json").read_text())
    assert offline["tokens_evaluated"] > 0
    assert 1.0 <= offline["acceptance_length"] <= 1 + offline["k"]
    for svg in ("training.svg", "data_stats.svg"):
        assert (run / "report" / svg).read_text().lstrip().startswith(("<?xml", "<svg"))
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["kept"] > 0


def test_nothing_to_do_after_a_full_run(done_run):
    jobs, _, out = dry_run(done_run)
    assert jobs == {}, out
    assert "Nothing to be done" in out
    rows = summary(done_run)
    assert rows and all(r["plan"] == "no update" for r in rows.values()), rows


def test_training_setting_reruns_training_and_what_follows_only(done_run):
    for setting in ('train={"lr": 0.002}', 'train={"optimizer": "muon", "muon_weight_decay": 0.05}',
                    'train={"lm_head": "trained"}', 'draft={"layers": 2}'):
        jobs, reasons, _ = dry_run(done_run, "--config", setting)
        assert set(jobs) == {"train_draft", "export_draft", "evaluate_offline", "model_card", "plot_report", "all"}
        assert "train_draft" in reasons["params have changed since last execution"]


def test_settings_that_change_no_output_rerun_nothing(done_run):
    """Where vLLM's files wait (extract.staging_dir) changes no shard: training must not rerun."""
    jobs, _, out = dry_run(done_run, "--config", f'extract={{"staging_dir": "{done_run / "staging"}"}}')
    assert jobs == {}, out


def test_data_setting_reruns_from_tokenization(done_run):
    jobs, _, _ = dry_run(done_run, "--config", 'data={"max_length": 80}')
    assert set(jobs) == STAGES


def test_template_settings_rerun_from_tokenization(done_run):
    jobs, reasons, _ = dry_run(done_run, "--config", 'data={"chat_template_kwargs": {"enable_thinking": false}}')
    assert set(jobs) == STAGES and "prepare_data" in reasons["params have changed since last execution"]
    template = done_run / "template.jinja"
    template.write_text(tiny.CHATML_TEMPLATE)
    jobs, _, _ = dry_run(done_run, "--config", f'data={{"chat_template": "{template}"}}')
    assert set(jobs) == STAGES
    jobs, _, _ = dry_run(done_run, "--config", 'data={"rerendered_turns": "context"}')
    assert set(jobs) == STAGES


def test_a_changed_data_stats_file_reruns_the_rules_that_read_it(done_run):
    stats = done_run / "results" / "tiny" / "data" / "stats.json"
    original, times = stats.read_text(), stats.stat()
    try:
        stats.write_text(original.replace("{", '{"edited": true, ', 1))
        jobs, reasons, _ = dry_run(done_run)
        assert set(jobs) == {"plot_report", "model_card", "all"}
        assert {"plot_report", "model_card"} <= set(reasons["updated input files"])
    finally:
        stats.write_text(original)
        os.utime(stats, ns=(times.st_atime_ns, times.st_mtime_ns))


def test_code_edit_reruns_that_stage_and_its_dependants(done_run):
    module = done_run / "scripts" / "eaglepipe" / "export_draft.py"
    original = module.read_text()
    try:
        module.write_text(original + "\n# an edit\n")
        jobs, reasons, _ = dry_run(done_run)
        assert set(jobs) == {"export_draft", "evaluate_offline", "model_card", "plot_report", "all"}
        assert "export_draft" in reasons["params have changed since last execution"]
    finally:
        module.write_text(original)
    module = done_run / "scripts" / "eaglepipe" / "extract_hf.py"
    original = module.read_text()
    try:
        module.write_text(original + "\n# an edit\n")
        jobs, _, _ = dry_run(done_run)
        assert set(jobs) == STAGES - {"prepare_data", "vocab_mapping"}
    finally:
        module.write_text(original)


def test_delivered_draft_is_write_protected(done_run):
    # The exporter writes the draft read-only and never over a delivered one (rules/export.smk,
    # tests/test_export_draft.py); the card is rewritten whenever the evaluation reruns.
    for name in ("config.json", "model.safetensors"):
        f = done_run / "results" / "tiny" / "draft" / name
        assert not (f.stat().st_mode & 0o222), f"{f} is writable"


def test_kimi_preset_dry_run_plans_one_tp8_vllm_job(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "all", "--directory", str(REPO),
         "--workflow-profile", "none", "--configfile", str(REPO / "config/presets/kimi-k2.5.yaml")],
        capture_output=True, text=True, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    block = out[out.index("rule extract_hidden_states:"):]
    block = block[: block.index("\n\n")]
    assert block.count("rule extract_hidden_states:") == 1
    assert "gpu=8" in block
    for flag in ("--backend vllm", "--tensor-parallel-size 8", "--layer-ids 2,30,58,61", "--trust-remote-code"):
        assert flag in block, (flag, block)
    assert "build_target" not in out  # a hub model is not built
    card = out[out.index("rule model_card:"):]
    assert "--tensor-parallel-size 8 --trust-remote-code" in card[: card.index("\n\n")]
    train = out[out.index("rule train_draft:"):]
    assert "--draft-architecture mla" in train[: train.index("\n\n")]  # an MLA target gets an MLA draft


def plan(ws: Path, *args: str) -> str:
    """The output of `snakemake -n -p`: the config printout and every planned shell command."""
    p = snakemake(ws, "-n", "-p", *args)
    return p.stdout + p.stderr


def refused(ws: Path, *args: str) -> str:
    """The output of a `snakemake -n` that must fail."""
    p = snakemake(ws, "-n", *args, check=False)
    assert p.returncode != 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def planned_commands(out: str) -> dict[str, str]:
    """rule name -> its shell command, from the output of `snakemake -n -p`."""
    commands = {}
    for block in out.split("\n\n"):
        m = re.search(r"^rule (\w+):", block, re.M)
        if m and m.group(1) not in commands:
            commands[m.group(1)] = block.strip().splitlines()[-1]
    return commands


def assert_schema_defaults_not_the_demos(out: str, verifier: str) -> None:
    assert "smollm2" not in out.lower() and "build_target" not in out, out
    cmd = planned_commands(out)
    for flag in ("--max-samples 0 ", "--max-length 2048 ", "--eval-fraction 0.05 "):
        assert flag in cmd["prepare_data"], cmd["prepare_data"]
    assert "--draft-vocab-size 32000 " in cmd["vocab_mapping"]
    assert "--max-steps 1000 " in cmd["train_draft"]
    assert f"--verifier-name '{verifier}'" in cmd["export_draft"]


def test_a_user_config_file_naming_a_target_takes_the_schema_defaults(tmp_path):
    ws = copy_workflow(tmp_path)
    chats = tiny.make_chats(ws / "chats.jsonl", n=4)
    (ws / "mine.yaml").write_text(yaml.safe_dump(
        {"run_name": "mine", "target": {"model": "Qwen/Qwen3-8B", "build": None}, "data": {"path": str(chats)}}))
    out = plan(ws, "--configfile", str(ws / "mine.yaml"))
    assert_schema_defaults_not_the_demos(out, "Qwen/Qwen3-8B")
    assert 'eaglepipe config; settings other than' in out and 'target.model: "Qwen/Qwen3-8B"' in out


def test_config_on_the_command_line_naming_a_target_takes_the_schema_defaults(tmp_path):
    ws = copy_workflow(tmp_path)
    chats = tiny.make_chats(ws / "chats.jsonl", n=4)
    out = plan(ws, "--config", "run_name=mine", "target={'model': 'Qwen/Qwen3-8B'}", f"data={{'path': '{chats}'}}")
    assert_schema_defaults_not_the_demos(out, "Qwen/Qwen3-8B")
    out = refused(ws, "--config", "target={'model': 'Qwen/Qwen3-8B'}")  # not even the demo's run name and data
    assert "'run_name' is a required property" in out and "takes nothing from the demo preset" in out, out


def test_build_null_on_the_command_line_uses_the_directory_as_it_is(tmp_path):
    ws = copy_workflow(tmp_path)
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    chats = tiny.make_chats(ws / "chats.jsonl", n=4)
    given = ("run_name=mine", f"data={{'path': '{chats}'}}")
    out = plan(ws, "--config", *given, f"target={{'model': '{model}', 'build': null, 'deploy_name': 'me/my-model'}}")
    cmd = planned_commands(out)
    assert "build_target" not in cmd and f"--model {model} " in cmd["prepare_data"]
    assert "--verifier-name 'me/my-model'" in cmd["export_draft"]
    # a local directory without the name vLLM serves it under, or under a recipe's name, is one sentence
    out = refused(ws, "--config", *given, f"target={{'model': '{model}', 'build': null}}")
    assert "config key target.deploy_name is not set" in out, out
    out = refused(ws, "--config", *given, f"target={{'model': '{model}', 'deploy_name': 'a/b', 'build': 'smollm2-gguf'}}")
    assert "builds results/models/SmolLM2-135M-Instruct, not target.model" in out, out


def test_layer_ids_beyond_the_target_stop_the_plan(tmp_path):
    ws = copy_workflow(tmp_path)
    target = tiny.make_llama(ws / "target", tokenizer=False)
    chats = tiny.make_chats(ws / "chats.jsonl", n=4)
    out = refused(ws, "--config", "run_name=mine", f"data={{'path': '{chats}'}}",
                  f"target={{'model': '{target}', 'build': null, 'deploy_name': 'a/b'}}",
                  "extract={'layer_ids': [2, 3, 4, 8]}")
    assert "config key extract.layer_ids = [2, 3, 4, 8] does not fit the target" in out, out


def tree_digest(root: Path) -> dict[str, tuple[int, str]]:
    return {str(f.relative_to(root)): (f.stat().st_mode, hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(root.rglob("*")) if f.is_file()} | {"/": (root.stat().st_mode, "")}


def test_forced_reruns_never_touch_the_users_model_directory(tmp_path):
    ws = copy_workflow(tmp_path)
    target = tiny.make_llama(tmp_path / "users-model")
    chats = tiny.make_chats(ws / "chats.jsonl", n=16)
    cfg = tiny_config(target, chats)
    cfg["train"].update(max_steps=2, eval_every=2, checkpoint_every=2)
    write_config(ws, cfg)
    before = tree_digest(target)
    assert "No rule to produce build_target" in refused(ws, "--forcerun", "build_target")  # nothing builds it
    snakemake(ws, "-F")
    assert (ws / "results" / "tiny" / "draft" / "README.md").is_file()
    assert tree_digest(target) == before


def test_replicas_plan_one_job_each_and_one_gather(tmp_path):
    ws = copy_workflow(tmp_path)
    jobs, _, out = dry_run(ws, "--config", 'extract={"replicas": 3}')
    assert jobs["extract_hidden_states"] == 3 and jobs["gather_hidden_states"] == 1, out


def test_a_rule_reading_another_rules_output_without_naming_it_in_earlier_stops_the_plan(tmp_path):
    """A new rule that forgets `earlier` would let a request for its file after a failed job call a
    stale result up to date (test_faults); the workflow refuses to load instead."""
    ws = copy_workflow(tmp_path)
    rules = ws / "rules" / "evaluate.smk"
    shipped = rules.read_text()
    planted = ("\n\nrule summarize_draft:\n    input:\n        config=rules.export_draft.output.record,\n"
               "        offline=rules.evaluate_offline.output[0],\n{earlier}    output:\n"
               '        "results/{{run}}/eval/summary.txt",\n    shell:\n        "cat {{input.config}} > {{output}}"\n')
    rules.write_text(shipped + planted.format(earlier=""))
    line = shipped.count("\n") + 3
    out = refused(ws)
    assert (f"{rules}:{line}: rule summarize_draft reads the output of evaluate_offline, export_draft but its "
            "input `earlier` does not name them: add earlier=inputs_before(rules.evaluate_offline, "
            "rules.export_draft)") in out, out
    # naming one of the two is not enough
    rules.write_text(shipped + planted.format(earlier="        earlier=inputs_before(rules.export_draft),\n"))
    out = refused(ws)
    assert "rule summarize_draft reads the output of evaluate_offline but its input `earlier` does not name it" in out
    rules.write_text(shipped + planted.format(
        earlier="        earlier=inputs_before(rules.export_draft, rules.evaluate_offline),\n"))
    jobs, _, out = dry_run(ws, "--", "results/smollm2-demo/eval/summary.txt")
    assert jobs["summarize_draft"] == 1 and jobs["evaluate_offline"] == 1, out


def test_lint_is_clean():
    p = subprocess.run([sys.executable, "-m", "snakemake", "--lint", "--directory", str(REPO),
                        "--workflow-profile", "none"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr


def test_snakefmt_is_clean():
    p = subprocess.run([sys.executable, "-m", "snakefmt", "--check", "Snakefile", "rules"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr


def test_ruff_is_clean():
    # the rules chosen in pyproject.toml: syntax errors, unused imports and variables, undefined names
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "scripts", "tests", "benchmarks"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr


def test_h200_preset_dry_run_plans_every_stage_on_one_gpu(tmp_path):
    ws = copy_workflow(tmp_path)
    p = snakemake(ws, "-n", "-p", "--configfile", str(REPO / "config/presets/smollm2-h200.yaml"))
    out = p.stdout + p.stderr

    def block(rule: str) -> str:
        b = out[out.index(f"rule {rule}:"):]
        return b[: b.index("\n\n")]

    assert "--recipe smollm2-gguf" in block("build_target")  # SmolLM2 built, as in the default
    regenerate, prepare = block("regenerate_responses"), block("prepare_data")
    assert "gpu=1" in regenerate and "--backend vllm" in regenerate and "--max-samples 6000" in regenerate
    assert "--answers-per-conversation 2 " in regenerate  # measured: two sets beat one (benchmarks/README.md)
    assert "--data package:mtbench" in block("regenerate_eval_prompts") and "--temperature 0 " in block(
        "regenerate_eval_prompts")
    assert "--pretokenized" in prepare and "--eval-data" in prepare and "--max-length 1024" in prepare
    extract = block("extract_hidden_states")
    assert out.count("rule extract_hidden_states:") == 1 and "gpu=1" in extract
    for flag in ("VLLM_CACHE_ROOT=results/smollm2-h200/vllm-cache ", "--backend vllm",
                 "--tensor-parallel-size 1", "--max-model-len 2048"):
        assert flag in extract, (flag, extract)
    train = block("train_draft")
    assert "gpu=1" in train and "exec python -m eaglepipe.train_draft" in train
    for flag in ("--max-steps 1000 ", "--batch-tokens 8192 ", "--optimizer muon ", "--lm-head frozen ", "--lr 0.003 ",
                 "--warmup-steps 50 "):
        assert flag in train, (flag, train)
    assert "VLLM_CACHE_ROOT=results/smollm2-h200/vllm-cache " in block("benchmark_serving")
    assert "--draft-vocab-size 16384" in block("vocab_mapping")


def test_serving_benchmark_plans_parity_rules(tmp_path):
    ws = copy_workflow(tmp_path)
    jobs, _, out = dry_run(ws, "--config", 'benchmark_serving={"enabled": true}')
    for rule in ("benchmark_serving", "extract_parity_hidden_states", "evaluate_parity", "plot_serving"):
        assert jobs.get(rule) == 1, (rule, out)
    p = snakemake(ws, "-n", "-p", "--config",
                  'benchmark_serving={"enabled": true, "k": [2, 4], "engine_args": {"max_num_seqs": 8, '
                  '"async_scheduling": true}}', 'export={"num_speculative_tokens": 4}')
    cmds = {line.split("eaglepipe.")[1].split()[0]: line for line in p.stdout.splitlines() if "exec python -m" in line}
    assert "--concurrency 1,4,16,64 --k 2,4" in cmds["benchmark_serving"]
    words = shlex.split(cmds["benchmark_serving"].split("exec python -m ")[1])
    assert json.loads(words[words.index("--engine-args") + 1]) == {"max_num_seqs": 8, "async_scheduling": True}
    assert "--parity-k 4" in cmds["benchmark_serving"]
    parity_extract = [line for line in p.stdout.splitlines()
                      if "eaglepipe.extract_hidden_states" in line and "/eval/parity/eval.jsonl" in line]
    assert len(parity_extract) == 1 and "/eval/parity/shards --replica 0 --replicas 1" in parity_extract[0]
    bad = snakemake(ws, "-n", "--config", 'benchmark_serving={"enabled": true, "k": [1, 2]}', check=False)
    assert bad.returncode != 0
    assert "benchmark_serving.parity.k (or the export's K) 3 is not among" in bad.stdout + bad.stderr
