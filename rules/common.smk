# The run's configuration (loaded, the demo preset applied, checked against the schema and the
# target) and the helpers the rules call: the stage command prefix and get_* functions of it.
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.common.configfile import load_configfile
from snakemake.exceptions import WorkflowError
from snakemake.utils import update_config, validate

REPO = Path(workflow.basedir)
sys.path.insert(0, str(REPO / "scripts"))
from eaglepipe.atomic import sha256_file
from eaglepipe.code_digest import code_digest as _code_digest
from eaglepipe.config_check import (
    BUILT_TARGETS,
    changed_settings,
    coerce_cli_strings,
    config_errors,
    deploy_name,
    eval_prompt_sets,
    load_schema,
    names_target,
    target_errors,
)
from eaglepipe.settings import stage_flags

_schema = load_schema(str(REPO / "config" / "config.schema.yaml"))
coerce_cli_strings(config, _schema)
# The embedded default is a preset like any other: it applies only to a config that names no target,
# under what was given. (Not a second `configfile:`: Snakemake 9 merges --configfile and --config over
# those, so a user's own target would inherit every demo value it leaves out.)
DEMO_PRESET = "config/presets/smollm2-demo.yaml"
_preset = None
if not names_target(config):
    _preset = DEMO_PRESET
    _given = dict(config)
    config.clear()
    config.update(load_configfile(REPO / DEMO_PRESET))
    update_config(config, _given)
_errors = config_errors(config, _schema)
if _errors and not _preset and any("required property" in e for e in _errors):
    _errors.append(
        "(a config that names target.model takes nothing from the demo preset)"
    )
if _errors:
    raise WorkflowError("invalid configuration:\n  " + "\n  ".join(_errors))
validate(config, "../config/config.schema.yaml")
_errors = target_errors(config)
if _errors:
    raise WorkflowError("invalid configuration:\n  " + "\n  ".join(_errors))
# evaluate.prompts as a list of sets (one string is one set; [] for none)
EVAL_PROMPT_SETS = eval_prompt_sets(config["evaluate"]["prompts"])
# Nothing silent: every setting that is not the schema's default, and where the base came from.
print(
    f"eaglepipe config{f' (the demo preset {_preset}, with what was given on top)' if _preset else ''}; "
    "settings other than config/config.schema.yaml's defaults:\n  "
    + "\n  ".join(changed_settings(config, _schema)),
    file=sys.stderr,
)

PKG = REPO / "scripts" / "eaglepipe"
# The command prefix of every stage. scripts/ (relative to the working directory, so moving the
# checkout changes no command) goes in front of the caller's PYTHONPATH instead of replacing it:
# packages installed with `pip install --target DIR` + PYTHONPATH=DIR stay visible to the stages.
# Doubled braces: Snakemake formats the shell command once more.
STAGE_ENV = (
    f"PYTHONPATH={os.path.relpath(REPO / 'scripts')}${{{{PYTHONPATH:+:$PYTHONPATH}}}}"
)
# `exec` so that signals reach Python; a rule appends `.<module> <arguments>`.
STAGE = f"{STAGE_ENV} exec python -m eaglepipe"
# In front of STAGE in the rules that start vLLM: its cache root (vllm/envs.py of vLLM 0.26.0),
# where the torch.compile artifacts persist across runs.
VLLM_CACHE_ROOT = (
    config["vllm"]["cache_dir"] or f"results/{config['run_name']}/vllm-cache"
)
VLLM_ENV = f"VLLM_CACHE_ROOT={shlex.quote(VLLM_CACHE_ROOT)}"


wildcard_constraints:
    run=re.escape(config["run_name"]),
    i=r"\d+",
    r=r"\d+",


def code_digest(*modules):
    """Digest of the stage modules and all eaglepipe code they import (see code_digest.py)."""
    return _code_digest(PKG, *modules)


def get_target_input(wildcards=None):
    """The target as a job input when the pipeline builds it or it is a local directory."""
    model = config["target"]["model"]
    if config["target"]["build"]:
        return model
    if Path(model).is_dir():
        # ancient: a model directory is large and rarely rewritten; track its revision instead
        return ancient(model)
    return []


def get_target_arg(wildcards, input):
    """The target as the CLIs take it: the input directory, or the hub id."""
    return input.model if input.model else config["target"]["model"]


def get_data_input(wildcards=None):
    path = config["data"]["path"]
    return [] if path.startswith("package:") else path


def get_chat_template_input(wildcards=None):
    path = config["data"]["chat_template"]
    if path and not Path(path).is_file():
        raise WorkflowError(f"data.chat_template: template file {path} does not exist")
    return path or []


def get_chat_template_sha256():
    """The override's content as a param: an edit reruns prepare_data even when the file's mtime does not
    change it (a checkout can write an old mtime)."""
    path = config["data"]["chat_template"]
    return sha256_file(path) if path else None


def get_setting_flags(stage, *groups, overrides=None):
    """The flags of ``stage``'s setting groups (all when none are named) from the config; a group
    given as a param reruns the rule when one of its settings changes (eaglepipe/settings.py).
    """
    return stage_flags(config, stage, *groups, overrides=overrides)


def get_prepare_data_source(wildcards, input):
    """prepare_data's data arguments; data.max_samples was applied to conversations by regeneration."""
    if config["regenerate"]["enabled"]:
        data = f"--pretokenized --data {input.data}"
    else:
        data = f"--data {config['data']['path']} --max-samples {config['data']['max_samples'] or 0}"
    if config["evaluate"]["prompts"]:
        return f"{data} --eval-data {input.eval_data}"
    return f"{data} {get_setting_flags('prepare_data', 'split')}"


def get_verifier_name():
    return deploy_name(config["target"])


def get_extract_gpus():
    ex = config["extract"]
    if ex["backend"] == "vllm":
        return ex["tensor_parallel_size"]
    return 1 if ex["device"] == "cuda" else 0


def get_num_speculative_tokens():
    return config["export"]["num_speculative_tokens"] or config["train"]["ttt_steps"]


def get_serving_ks():
    """The K the serving benchmark times, one engine (one target load) each: benchmark_serving.k, or
    only the export's K (the one a user serves); lower K's acceptance is derived from the largest.
    """
    return config["benchmark_serving"]["k"] or [get_num_speculative_tokens()]


def get_parity_k():
    """The K whose concurrency-1 serving window the parity check replays."""
    bs = config["benchmark_serving"]
    k = bs["parity"]["k"] or get_num_speculative_tokens()
    if k not in get_serving_ks():
        raise WorkflowError(
            f"benchmark_serving.parity.k (or the export's K) {k} is not among the timed K "
            f"{get_serving_ks()} (benchmark_serving.k; null = the export's K)"
        )
    if 1 not in bs["concurrency"]:
        raise WorkflowError(
            f"benchmark_serving.concurrency {bs['concurrency']} must contain 1: the parity check "
            "replays the concurrency-1 window"
        )
    return k


def get_replica_parts(wildcards):
    return get_replica_part_files(wildcards.run)


def get_replica_part_files(run):
    r = config["extract"]["replicas"]
    # called once the rules are defined (rule all, job inputs)
    return expand(rules.extract_hidden_states.output.part, run=run, i=range(r), r=r)


def get_budget_inputs(wildcards):
    """What train_draft's extractor reads under a disk budget (extract.disk_budget_gib); nothing without one."""
    if config["extract"]["disk_budget_gib"] is None:
        return {}
    return {
        "train": expand(rules.prepare_data.output.train, **dict(wildcards.items())),
        "eval": expand(rules.prepare_data.output.eval, **dict(wildcards.items())),
    }


def get_budget_producer(wildcards, input):
    """train_draft's --producer under a disk budget: the extraction stage as rule extract_hidden_states
    runs it (its settings, one replica for all train shards), started by the training (shard_budget).
    """
    if config["extract"]["disk_budget_gib"] is None:
        return ""
    # a resource is not formatted again: single braces
    env = STAGE_ENV.replace("{{", "{").replace("}}", "}")
    command = (
        f"{VLLM_ENV} {env} exec python -m eaglepipe.extract_hidden_states --train {input.train} "
        f"--eval {input.eval} --model {get_target_arg(wildcards, input)} "
        f"{get_setting_flags('extract_hidden_states')} "
        f"--shard-dir results/{wildcards.run}/hidden_states/shards --replica 0 --replicas 1"
    )
    return f"--producer {shlex.quote(command)}"
