"""The whole DAG planned on CPU (`snakemake -n`): presets, user configs, refusals; lint. The tiny
end-to-end run and its reruns: tests/e2e/test_tiny_run.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tiny
from workflow import REPO, copy_workflow, dry_run, planned_target_loads, refused, snakemake


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
    # one engine answers the chats and the fixed eval prompts
    assert "rule regenerate_eval_prompts:" not in out
    assert "--eval-data package:mtbench" in regenerate and "--eval-temperature 0 " in regenerate
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


@pytest.mark.parametrize("extra", [[], ["benchmarks/kimi_rehearsal.yaml"]], ids=["preset", "rehearsal"])
def test_a_kimi_run_with_the_serving_benchmark_starts_the_target_five_times(tmp_path, extra):
    """Regeneration (chats and eval prompts, one engine), extraction, the serving baseline, the served K
    (the export's; lower K derived), parity extraction: 5 loads (issue 44: 10 before)."""
    ws = copy_workflow(tmp_path)
    if extra:  # the rehearsal's stand-in target: its config is what the plan reads
        sys.path.insert(0, str(REPO / "benchmarks"))
        from make_kimi_target import kimi_config

        target = ws / "results/models/kimi-k2.5-width"
        target.mkdir(parents=True)
        (target / "config.json").write_text(json.dumps(
            {**kimi_config(layers=4, routed_experts=16), "architectures": ["DeepseekV3ForCausalLM"],
             "model_type": "deepseek_v3"}))
    p = snakemake(ws, "-n", "-p", "--configfile", str(REPO / "config/presets/kimi-k2.5.yaml"),
                  *(str(REPO / e) for e in extra), "--config", 'benchmark_serving={"enabled": true}')
    loads = planned_target_loads(p.stdout)
    assert sorted(loads) == sorted([
        ("regenerate_responses", "eval prompts + chats"), ("extract_hidden_states", ""),
        ("benchmark_serving", "target alone"), ("benchmark_serving", "K=3"), ("extract_parity_hidden_states", "")]), loads
    assert "rule regenerate_eval_prompts:" not in p.stdout


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
    assert "--parity results/smollm2-demo/eval/parity.json" in cmds["model_card"]  # the card states the gate's verdict
    bad = snakemake(ws, "-n", "--config", 'benchmark_serving={"enabled": true, "k": [1, 2]}', check=False)
    assert bad.returncode != 0
    assert "benchmark_serving.parity.k (or the export's K) 3 is not among" in bad.stdout + bad.stderr
