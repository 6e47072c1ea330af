import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.common.configfile import load_configfile
from snakemake.exceptions import WorkflowError
from snakemake.io import is_flagged, strip_wildcard_constraints
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


def target_input(wildcards=None):
    """The target as a job input when the pipeline builds it or it is a local directory."""
    model = config["target"]["model"]
    if config["target"]["build"]:
        return model
    if Path(model).is_dir():
        # ancient: a model directory is large and rarely rewritten; track its revision instead
        return ancient(model)
    return []


def target_arg(wildcards, input):
    """The target as the CLIs take it: the input directory, or the hub id."""
    return input.model if input.model else config["target"]["model"]


def data_input(wildcards=None):
    path = config["data"]["path"]
    return [] if path.startswith("package:") else path


def chat_template_input(wildcards=None):
    path = config["data"]["chat_template"]
    if path and not Path(path).is_file():
        raise WorkflowError(f"data.chat_template: template file {path} does not exist")
    return path or []


def chat_template_sha256():
    """The override's content as a param: an edit reruns prepare_data even when the file's mtime does not
    change it (a checkout can write an old mtime)."""
    path = config["data"]["chat_template"]
    return sha256_file(path) if path else None


def settings_flags(stage, *groups, overrides=None):
    """The flags of ``stage``'s setting groups (all when none are named) from the config; a group
    given as a param reruns the rule when one of its settings changes (eaglepipe/settings.py).
    """
    return stage_flags(config, stage, *groups, overrides=overrides)


def verifier_name():
    return deploy_name(config["target"])


def extract_gpus():
    ex = config["extract"]
    if ex["backend"] == "vllm":
        return ex["tensor_parallel_size"]
    return 1 if ex["device"] == "cuda" else 0


def num_speculative_tokens():
    return config["export"]["num_speculative_tokens"] or config["train"]["ttt_steps"]


def parity_k():
    """The K whose concurrency-1 serving window the parity check replays."""
    bs = config["benchmark_serving"]
    k = bs["parity"]["k"] or num_speculative_tokens()
    if k not in bs["k"]:
        raise WorkflowError(
            f"benchmark_serving.parity.k (or the export's K) {k} is not among benchmark_serving.k {bs['k']}"
        )
    if 1 not in bs["concurrency"]:
        raise WorkflowError(
            f"benchmark_serving.concurrency {bs['concurrency']} must contain 1: the parity check "
            "replays the concurrency-1 window"
        )
    return k


def replica_parts(wildcards):
    return replica_part_files(wildcards.run)


def replica_part_files(run):
    r = config["extract"]["replicas"]
    # called once the rules are defined (rule all, job inputs)
    return expand(rules.extract_hidden_states.output.part, run=run, i=range(r), r=r)


def inputs_before(*producers):
    """Input function, named ``earlier`` in the rules that read other rules' outputs: what the
    jobs of ``producers`` read, and (through their own ``earlier``) what every job before them read.

    Snakemake reruns a job whose output exists only when one of its inputs is newer than that output
    (or its params, code, ... changed), and rebuilds a missing intermediate file only for a job that
    has to run (snakemake 9.27.1, dag.py ``update_needrun``). A job that fails or is killed after its
    inputs were remade has lost its outputs, so a request for one later file (``snakemake
    results/RUN/eval/offline.json``) saw only old or missing inputs and said "Nothing to be done"
    over a result of the old ones. Among the earlier inputs the remade file is newer than the
    requested one: the request reruns, and Snakemake rebuilds the missing files on the way (the
    default target requests them as well, every_output). The producers' side outputs that nothing
    after them reads (data/stats.json) are not among them, so editing one still reruns only its
    readers.
    """

    def earlier(wildcards):
        found = {}
        for producer in producers:
            for item in producer.input:
                files = (
                    item(wildcards)
                    if callable(item)
                    else (
                        expand(item, **dict(wildcards.items())) if "{" in item else item
                    )
                )
                for f in [files] if isinstance(files, str) else files:
                    found.setdefault(str(f), f)
        return list(found.values())

    earlier.producers = {producer.rule.name for producer in producers}
    return earlier


def check_earlier_inputs(all_rules):
    """Stops the workflow as it loads when a rule reads another rule's output without naming that rule
    in its ``earlier`` input (inputs_before): without it a request for one file after a failed job
    can call a stale result up to date, and no run shows it until that happens. Inputs given by a
    function are known only per job and are not checked; an ancient input never reruns its reader;
    a producer that reads no files has nothing for ``earlier`` to add."""
    producer_of = {
        strip_wildcard_constraints(f): producer.name
        for producer in all_rules
        if producer.input
        for f in producer.output
    }
    # rules without outputs (all) only request files, and never call anything up to date
    for reader in (r for r in all_rules if r.output):
        read = {
            producer_of[str(f)]
            for f in reader.input
            if not callable(f)
            and str(f) in producer_of
            and not is_flagged(f, "ancient")
        }
        named = getattr(reader.input.get("earlier"), "producers", set())
        if read - named:
            # lineno counts lines of the Python Snakemake compiled the file to
            line = workflow.linemaps.get(reader.snakefile, {}).get(
                reader.lineno, reader.lineno
            )
            raise WorkflowError(
                f"{reader.snakefile}:{line}: rule {reader.name} reads the output of "
                f"{', '.join(sorted(read - named))} but its input `earlier` does not name "
                f"{'it' if len(read - named) == 1 else 'them'}: add "
                f"earlier=inputs_before({', '.join(f'rules.{r}' for r in sorted(read | named))})"
            )


def regeneration_rules():
    """The rules whose answers prepare_data reads."""
    return [rules.regenerate_responses] * bool(config["regenerate"]["enabled"]) + [
        rules.regenerate_eval_prompts
    ] * bool(config["evaluate"]["prompts"])


def every_output():
    """The deliverables and every intermediate output, all requested by ``rule all``.

    Snakemake rebuilds a missing intermediate file only when a job that reads it has to run
    (snakemake 9.27.1, dag.py ``update_needrun``: the missing-output check is made for target jobs,
    other jobs are reached through the needrun ones). A job killed after a setting changed has
    lost its outputs (Snakemake removes them when the job starts and when it fails), while the
    deliverables made with the old settings are still there and their own rules unchanged: a
    rerun said "Nothing to be done" over them. As targets, the missing files rerun their job and
    everything after it.
    """
    run = config["run_name"]
    intermediate = replica_part_files(run)
    producers = [
        rules.prepare_data,
        rules.vocab_mapping,
        rules.gather_hidden_states,
        rules.train_draft,
    ]
    if config["regenerate"]["enabled"]:
        producers.append(rules.regenerate_responses)
    if config["benchmark_serving"]["enabled"]:
        producers += [rules.benchmark_serving, rules.extract_parity_hidden_states]
    for r in producers:
        # the parity set is extracted by one replica (rule evaluate_parity)
        intermediate += expand(r.output, run=run, i=0, r=1)
    return final_outputs() + intermediate


def final_outputs():
    out = [
        "draft/config.json",
        "draft/model.safetensors",
        "draft/README.md",
        "eval/offline.json",
        "report/training.svg",
        "report/data_stats.svg",
    ]
    if config["benchmark_serving"]["enabled"]:
        out += ["eval/serving.json", "eval/parity.json", "report/serving.svg"]
    return expand("results/{run}/{path}", run=config["run_name"], path=out)


REGENERATED = "results/{run}/regenerated/chats.jsonl"


def prepare_data_input():
    """What prepare_data reads: the target's regenerated answers when regenerate.enabled."""
    return REGENERATED if config["regenerate"]["enabled"] else data_input()


def prepare_data_source(wildcards, input):
    """prepare_data's data arguments; data.max_samples was applied to conversations by regeneration."""
    if config["regenerate"]["enabled"]:
        data = f"--pretokenized --data {input.data}"
    else:
        data = f"--data {config['data']['path']} --max-samples {config['data']['max_samples'] or 0}"
    if config["evaluate"]["prompts"]:
        return f"{data} --eval-data {input.eval_data} --eval-fraction 0"
    return f"{data} {settings_flags('prepare_data', 'split')}"


REGENERATED_EVAL = "results/{run}/regenerated/eval_prompts.jsonl"
# the fixed evaluation set's answers: what the serving benchmark's target says to the same prompts
EVAL_PROMPTS_SAMPLING = {
    "turns": "first",
    "temperature": 0,
    "top_p": 1,
    "max_new_tokens": config["benchmark_serving"]["max_tokens"],
    "on_truncated": "keep",
    "on_loop": "keep",
    "answers_per_conversation": 1,
    "loop_retries": 0,
}


def eval_data_input():
    """prepare_data's eval split when evaluate.prompts names a fixed set (else drawn from the data)."""
    return REGENERATED_EVAL if config["evaluate"]["prompts"] else []


def eval_prompts_source_input(wildcards=None):
    path = config["evaluate"]["prompts"]
    return [] if not path or path.startswith("package:") else path


def regenerate_modes():
    """regenerate.modes as the CLI takes them: data.chat_template_kwargs under each mode's own."""
    base = config["data"]["chat_template_kwargs"]
    return [
        {**m, "chat_template_kwargs": {**base, **m["chat_template_kwargs"]}}
        for m in config["regenerate"]["modes"]
    ]


def regenerate_gpus():
    rg = config["regenerate"]
    if rg["backend"] == "vllm":
        return config["extract"]["tensor_parallel_size"]
    return 1 if rg["device"] == "cuda" else 0


def regenerate_params(data, max_samples, sampling):
    """Every parameter of one regeneration job; ``sampling``: regenerate.* values given instead of
    the config's. How the job uses the machine is not among them: the rules pass the group "engine"
    as a resource, which no Snakemake rerun trigger looks at, so changing it reruns nothing (as
    params it would rerun training and all after it); the parts' keys leave it out too.
    """
    overrides = {f"regenerate.{k}": v for k, v in sampling.items()}
    return dict(
        data=data,
        model=target_arg,
        max_samples=max_samples,
        max_prompt_len=config["data"]["max_length"],
        settings=settings_flags(
            "regenerate_responses",
            "answers",
            overrides={"regenerate.modes": regenerate_modes(), **overrides},
        ),
        template_sha256=chat_template_sha256(),
        parts=lambda wc, output: os.path.splitext(output.chats)[0] + "-parts",
        code=code_digest("regenerate_responses"),
    )


REGENERATE_SHELL = (
    f"{VLLM_ENV} {STAGE}.regenerate_responses "
    "--data {params.data} --out {output.chats} --stats {output.stats} --parts-dir {params.parts} "
    "--model {params.model} --max-samples {params.max_samples} --max-prompt-len {params.max_prompt_len} "
    "{params.settings} {resources.engine} > {log} 2>&1"
)
