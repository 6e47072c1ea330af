"""One statement per setting: config/config.schema.yaml. Each stage's flags are made from it
(eaglepipe/settings.py), every key reaches its stage, and no stage module, rule file or README.md
states a key's default, allowed values or description again."""

import argparse
import ast
import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from workflow import REPO, copy_workflow, snakemake, write_config

from eaglepipe import settings
from eaglepipe.settings import STAGE_SETTINGS, WORKFLOW_KEYS, add_arguments, group, leaf, leaf_keys, render

STAGE_KEYS = {f"{g.section}.{k}" for groups in STAGE_SETTINGS.values() for gs in groups.values() for g in gs
              for k in g.keys}
STAGE_IN_SHELL = re.compile(r"\beaglepipe\.(\w+) ")


def test_every_key_is_a_stage_setting_or_a_workflow_key():
    keys = set(leaf_keys())
    assert STAGE_KEYS | set(WORKFLOW_KEYS) == keys, (keys - STAGE_KEYS - set(WORKFLOW_KEYS),
                                                      (STAGE_KEYS | set(WORKFLOW_KEYS)) - keys)
    assert not STAGE_KEYS & set(WORKFLOW_KEYS)


# --- the flags ----------------------------------------------------------------------------------------

def parse(groups, words, types=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, groups, types)
    return vars(parser.parse_args(words))


def test_flags_render_and_parse_back():
    groups = [group("target", "revision", "trust_remote_code"), group("data", "chat_template_kwargs", "too_long"),
              group("train", "lr", "max_steps"), group("draft", "mlp_width", prefix="draft-"),
              group("extract", "layer_ids", "enforce_eager"), group("evaluate", "select_by"),
              group("benchmark_serving", "concurrency", "engine_args")]
    config = {"target": {"revision": None, "trust_remote_code": False},
              "data": {"chat_template_kwargs": {"thinking": True, "note": "it's"}, "too_long": "drop"},
              "train": {"lr": 0.003, "max_steps": 7}, "draft": {"mlp_width": 64},
              "extract": {"layer_ids": [2, 15, 27, 30], "enforce_eager": True},
              "evaluate": {"select_by": "context:>8192"},
              "benchmark_serving": {"concurrency": [1, 4], "engine_args": {"max_num_seqs": 8}}}
    line = render(config, groups)
    assert "--revision" not in line  # null: left out
    assert "--no-trust-remote-code" in line and "--enforce-eager" in line
    assert "--layer-ids 2,15,27,30" in line and "--select-by 'context:>8192'" in line
    assert parse(groups, shlex.split(line)) == {
        "revision": None, "trust_remote_code": False, "chat_template_kwargs": {"thinking": True, "note": "it's"},
        "too_long": "drop", "lr": 0.003, "max_steps": 7, "draft_mlp_width": 64, "layer_ids": [2, 15, 27, 30],
        "enforce_eager": True, "select_by": "context:>8192", "concurrency": [1, 4], "engine_args": {"max_num_seqs": 8}}


def test_the_parsers_defaults_are_the_schemas():
    groups = [group("data", "eval_fraction", "chat_template_kwargs"), group("benchmark_serving", "min_seconds", "k"),
              group("export", "drop_embedding"), group("draft", "mlp_width", prefix="draft-")]
    assert parse(groups, []) == {"eval_fraction": 0.05, "chat_template_kwargs": {}, "min_seconds": 10.0,
                                 "k": None, "drop_embedding": True, "draft_mlp_width": None}
    assert isinstance(parse(groups, [])["min_seconds"], float)  # a number, though the schema writes 10


def test_a_stage_type_reads_the_flag_and_the_default():
    def sorted_ints(text):
        return sorted(int(v) for v in text.split(","))

    got = parse([group("benchmark_serving", "concurrency")], [], types={"concurrency": sorted_ints})
    assert got == {"concurrency": [1, 4, 16, 64]}
    assert parse([group("benchmark_serving", "concurrency")], ["--concurrency", "4,1"],
                 types={"concurrency": sorted_ints}) == {"concurrency": [1, 4]}


def test_enum_values_are_the_choices_and_help_is_the_description():
    parser = argparse.ArgumentParser()
    add_arguments(parser, [group("target", "build"), group("data", "too_long")])
    actions = {a.dest: a for a in parser._actions}
    assert actions["build"].choices == ["smollm2-gguf"] and actions["build"].default is None
    assert actions["too_long"].help == leaf("data", "too_long")["description"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--too-long", "wrap"])


def test_a_flag_two_keys_would_share_is_refused():
    with pytest.raises(ValueError, match="--batch-size would be both extract.batch_size and regenerate.batch_size"):
        parse([group("extract", "batch_size"), group("regenerate", "batch_size")], [])
    assert parse([group("extract", "batch_size"), group("regenerate", "batch_size", prefix="regenerate-")], []) == {
        "batch_size": 64, "regenerate_batch_size": 256}


def test_a_type_for_a_key_the_groups_do_not_hold_is_refused():
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        parse([group("train", "seed")], [], types={"lr": float})


# --- every key reaches its stage ------------------------------------------------------------------------

# the GPU preset with every rule on and every key that may be null given a value
EVERY_RULE = {
    "target": {"revision": "0123abc"},
    "data": {"chat_template": "config/templates/kimi-k2.5-train.jinja", "chat_template_kwargs": {"thinking": False}},
    "draft": {"mlp_width": 96},
    "extract": {"layer_ids": [2, 15, 27, 30], "enforce_eager": True, "staging_dir": "shards"},
    "train": {"muon_weight_decay": 0.05},
    "vllm": {"kv_cache_gib": 6},
    "benchmark_serving": {"enabled": True, "parity": {"min_requests": 40}},
}


def planned_commands(tmp_path, extra: dict) -> dict[str, tuple[str, list[str]]]:
    """Rule -> (stage module, its arguments) as `snakemake -n -p` prints them for the H200 preset
    with ``extra`` on top."""
    tmp_path.mkdir(exist_ok=True)
    ws = copy_workflow(tmp_path)
    preset = yaml.safe_load((REPO / "config/presets/smollm2-h200.yaml").read_text())
    write_config(ws, merged(preset, extra))
    out = snakemake(ws, "-n", "-p").stdout
    commands = {}
    for rule, command in re.findall(r"rule (\w+):.*?\nShell command: (.*?)\n", out, re.S):
        m = STAGE_IN_SHELL.search(command)
        if m:
            commands[rule] = (m.group(1), shlex.split(command[m.end():].split(" > ")[0]))
    return commands, merged(preset, extra)


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def parsed(module: str, words: list[str]) -> dict:
    parser = importlib.import_module(f"eaglepipe.{module}").build_parser()
    for action in parser._actions:  # the paths and ids a rule names are not what this test checks
        action.required = False
    return vars(parser.parse_args(words))


@pytest.mark.parametrize("prompts", ["package:mtbench", None])
def test_every_setting_reaches_its_stage_with_the_configs_value(tmp_path, prompts):
    """Parsed by the stage's own parser, each setting flag of each rule's command is the config's value."""
    commands, config = planned_commands(tmp_path, merged(EVERY_RULE, {"evaluate": {"prompts": prompts}}))
    for stage, groups in STAGE_SETTINGS.items():
        rules = [r for r, (module, _) in commands.items() if module == stage and r != "regenerate_eval_prompts"]
        assert rules, f"no rule runs {stage}"
        for rule in rules:
            got = parsed(stage, commands[rule][1])
            # the eval set's sampling is the rule's own, never the config's (the test below)
            for g in (g for name, gs in groups.items() if name != "eval" for g in gs):
                for key in g.keys:
                    value, found = configured(config, g.section, key), got[(g.prefix + key).replace("-", "_")]
                    if g.section == "regenerate" and key == "modes":  # data.chat_template_kwargs under each
                        value = [{**m, "chat_template_kwargs": {"thinking": False}} for m in value]
                        found = [m._asdict() for m in found]
                    if f"{g.section}.{key}" == "data.eval_fraction" and prompts:
                        continue  # not passed: the fixed evaluation set is the eval split
                    if f"{g.section}.{key}" == "benchmark_serving.k" and value is None:  # the export's K
                        value = [configured(config, "export", "num_speculative_tokens")
                                 or configured(config, "train", "ttt_steps")]
                    assert found == value, (rule, f"{g.section}.{key}", found, value)


def configured(config: dict, section: str, key: str):
    """The value a run with ``config`` has: the schema's default where the config leaves it out."""
    try:
        return settings.config_value(config, section, key)
    except KeyError:
        return leaf(section, key).get("default")


EVAL_SAMPLING = ("first", 0, 1, "keep", "keep", 1, 0)  # rules/regenerate.smk's EVAL_PROMPTS_SAMPLING


def eval_sampling(args: dict, prefix: str = "") -> tuple:
    return tuple(args[prefix + k] for k in ("turns", "temperature", "top_p", "on_truncated", "on_loop",
                                            "answers_per_conversation", "loop_retries"))


def test_the_eval_prompts_are_answered_as_served_and_the_kv_cache_and_parity_window_only_when_set(tmp_path):
    commands, config = planned_commands(tmp_path / "set", EVERY_RULE)
    # regeneration on: one job, one engine, answers both sets; the eval set by its --eval-* flags
    assert "regenerate_eval_prompts" not in commands
    both = parsed("regenerate_responses", commands["regenerate_responses"][1])
    assert eval_sampling(both, "eval_") == EVAL_SAMPLING and both["eval_data"] == configured(config, "evaluate", "prompts")
    assert both["eval_max_new_tokens"] == configured(config, "benchmark_serving", "max_tokens")
    assert eval_sampling(both) == tuple(configured(config, "regenerate", k) for k in (
        "turns", "temperature", "top_p", "on_truncated", "on_loop", "answers_per_conversation", "loop_retries"))
    assert both["max_prompt_len"] == configured(config, "data", "max_length")
    # regeneration off: the eval set's own job, its sampling as the stage's own flags
    alone, _ = planned_commands(tmp_path / "alone", merged(EVERY_RULE, {"regenerate": {"enabled": False}}))
    assert "regenerate_responses" not in alone
    evals = parsed("regenerate_responses", alone["regenerate_eval_prompts"][1])
    assert eval_sampling(evals) == EVAL_SAMPLING and evals["eval_data"] is None
    assert evals["max_new_tokens"] == configured(config, "benchmark_serving", "max_tokens")
    assert evals["max_samples"] == 0 and evals["max_prompt_len"] == configured(config, "data", "max_length")
    vllm_rules = {"regenerate_responses", "regenerate_eval_prompts", "extract_hidden_states",
                  "extract_parity_hidden_states", "benchmark_serving"}
    for rule, (module, words) in commands.items():
        assert ("--kv-cache-gib" in words) == (rule in vllm_rules), rule
    assert parsed("benchmark_serving", commands["benchmark_serving"][1])["parity_min_requests"] == 40
    unset, _ = planned_commands(tmp_path / "unset", {"benchmark_serving": {"enabled": True}})
    assert not any("--kv-cache-gib" in words for _, words in unset.values())
    assert parsed("benchmark_serving", unset["benchmark_serving"][1])["parity_min_requests"] is None


# --- nothing states a setting again ---------------------------------------------------------------------

def stage_modules() -> dict[str, str]:
    rules = "\n".join(p.read_text() for p in (REPO / "rules").glob("*.smk"))
    names = set(re.findall(r"\beaglepipe\.(\w+) ", rules)) | set(re.findall(r"\{STAGE\}\.(\w+) ", rules))
    return {n: (REPO / "scripts" / "eaglepipe" / f"{n}.py").read_text() for n in names}


def restatements(name: str, text: str, python: bool) -> list[str]:
    """Where ``text`` states a schema key's description (its first 60 characters), its list of
    allowed values, or (Python: an add_argument of its flag) its default."""
    found = []
    flat = " ".join(text.split())
    schema = settings.load_schema()
    string_sets = literal_string_sets(text, python)
    defaults = argument_defaults(text) if python else {}
    for key in leaf_keys():
        section, _, last = key.rpartition(".")
        spec = leaf(section, last, schema)
        description = " ".join(spec.get("description", "").split())
        if len(description) >= 30 and description[:60] in flat:
            found.append(f"{name}: the description of {key}")
        enum = {v for v in spec.get("enum", []) if v is not None}
        if len(enum) > 1 and enum in string_sets:
            found.append(f"{name}: the allowed values of {key}")
        if python and key not in WORKFLOW_KEYS and "default" in spec:
            flag = "--" + last.replace("_", "-")
            if any(spec["default"] in values for f, values in defaults.items()
                   if f == flag or f.endswith("-" + flag[2:])):
                found.append(f"{name}: the default of {key}")
    return found


def literal_string_sets(text: str, python: bool) -> list[set]:
    """The sets of strings ``text`` writes as a list, tuple or set (Python: not the values of an
    unpacking assignment, ``A, B = "a", "b"``, which names values and lists no choices)."""
    if python:
        tree = ast.parse(text)
        unpacked = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and isinstance(n.targets[0], ast.Tuple)}
        return [{e.value for e in node.elts} for node in ast.walk(tree)
                if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and node.elts and id(node) not in unpacked
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)]
    return [set(re.findall(r"[\"']([\w.-]+)[\"']", m)) for m in re.findall(r"[\[(]((?:\s*[\"'][\w.-]+[\"']\s*,)+"
                                                                             r"\s*[\"'][\w.-]+[\"']\s*,?\s*)[\])]", text)]


def argument_defaults(text: str) -> dict[str, list]:
    """Flag -> the literal defaults of its add_argument calls in ``text``."""
    out = {}
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant)):
            out.setdefault(node.args[0].value, []).extend(
                ast.literal_eval(k.value) for k in node.keywords
                if k.arg == "default" and isinstance(k.value, (ast.Constant, ast.List, ast.Dict)))
    return out


def readme_defaults(text: str) -> list[str]:
    """Sentences of a Markdown text that name a key (`section.key`) and give its default."""
    schema, found = settings.load_schema(), []
    defaults = {}
    for key in leaf_keys():
        section, _, last = key.rpartition(".")
        default = leaf(section, last, schema).get("default")
        if default not in (None, {}, []):
            spellings = {str(default), yaml.safe_dump(default, default_flow_style=True).removesuffix("...\n").strip()}
            value = "|".join(re.escape(v) for v in spellings)
            defaults[key] = re.compile(rf"default\W{{0,3}}(?:{value})(?!\w)|(?:{value})\W{{0,3}}\(default\)")
    for paragraph in re.split(r"\n\s*\n|\n(?=#|- |\d+\. )", text):
        for sentence in re.split(r"(?<=[.;])\s", " ".join(paragraph.split())):
            found += [f"the default of {key}: {sentence[:100]}" for key, pattern in defaults.items()
                      if f"`{key}`" in sentence and pattern.search(sentence)]
    return found


def test_no_stage_module_restates_a_setting():
    found = [f for name, text in stage_modules().items() for f in restatements(f"{name}.py", text, python=True)]
    assert not found, found


def test_no_rule_file_restates_a_setting():
    files = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    found = [f for p in files for f in restatements(p.name, p.read_text(), python=False)]
    assert not found, found


def test_the_docs_restate_no_setting():
    """README.md and the configuration docs name keys and point to the schema."""
    docs = [REPO / "README.md", REPO / "config" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [f for p in docs if p.is_file()
             for f in restatements(p.name, p.read_text(), python=False)
             + [f"{p.name}: {d}" for d in readme_defaults(p.read_text())]]
    assert not found, found


def test_restatements_are_found():
    source = '''
p.add_argument("--lr", type=float, default=0.001)
p.add_argument("--draft-layers", type=int, default=1)
p.add_argument("--too-long", choices=["truncate", "drop"])
p.add_argument("--seed", help="Maximum tokens per sample. Regeneration does not ask a turn whose prompt")
p.add_argument("--replicas", type=int, default=1)
'''
    assert sorted(restatements("m.py", source, python=True)) == [
        "m.py: the allowed values of data.too_long", "m.py: the default of draft.layers",
        "m.py: the default of train.lr", "m.py: the description of data.max_length"]
    assert restatements("r.smk", 'x = ("drop", "truncate")', python=False) == [
        "r.smk: the allowed values of data.too_long"]
    assert readme_defaults("`draft.layers` (default 1, EAGLE-3's) stacks layers. `draft.architecture`: `auto` "
                           "(default) gives MLA. `train.lr` is 3e-3 in the presets.") == [
        "the default of draft.layers: `draft.layers` (default 1, EAGLE-3's) stacks layers.",
        "the default of draft.architecture: `draft.architecture`: `auto` (default) gives MLA."]


@pytest.mark.parametrize("stage, argv, message", [
    ("train_draft", ["--lr", "0"], "argument --lr: 0.0: must be > 0"),
    ("train_draft", ["--batch-tokens", "8"], "argument --batch-tokens: 8: must be >= 16"),
    ("regenerate_responses", ["--top-p", "1.5"], "argument --top-p: 1.5: must be <= 1"),
    ("benchmark_serving", ["--concurrency", "1,0"], "argument --concurrency: 0: must be >= 1"),  # each item
    ("evaluate", ["--context-buckets", "512,0"], "argument --context-buckets: 0: must be >= 1"),
])
def test_a_value_outside_the_schemas_bounds_is_refused_by_the_flag(stage, argv, message):
    """The schema's minimum / exclusiveMinimum / maximum (an array's: of each item) hold on the
    command line: no stage restates them."""
    p = subprocess.run([sys.executable, "-m", f"eaglepipe.{stage}", *argv], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO / "scripts")})
    assert p.returncode == 2 and message in p.stderr, p.stderr[-500:]
