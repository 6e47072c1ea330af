import hashlib
import os
import re
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

REPO = Path(workflow.basedir)
sys.path.insert(0, str(REPO / "scripts"))
from eaglepipe.code_digest import code_digest as _code_digest
from eaglepipe.config_check import coerce_cli_strings, config_errors, load_schema

_schema = load_schema(str(REPO / "config" / "config.schema.yaml"))
coerce_cli_strings(config, _schema)
_errors = config_errors(config, _schema)
if _errors:
    raise WorkflowError("invalid configuration:\n  " + "\n  ".join(_errors))
validate(config, "../config/config.schema.yaml")

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


def trust_flag():
    return "--trust-remote-code" if config["target"]["trust_remote_code"] else ""


def revision_flag():
    rev = config["target"]["revision"]
    return f"--revision {rev}" if rev else ""


def extract_gpus():
    ex = config["extract"]
    if ex["backend"] == "vllm":
        return ex["tensor_parallel_size"]
    return 1 if ex["device"] == "cuda" else 0


def layer_ids_arg():
    ids = config["extract"]["layer_ids"]
    return ",".join(str(i) for i in ids) if ids else "auto"


def num_speculative_tokens():
    return config["export"]["num_speculative_tokens"] or config["train"]["ttt_steps"]


def replica_parts(wildcards):
    return replica_part_files(wildcards.run)


def replica_part_files(run):
    r = config["extract"]["replicas"]
    return expand(
        "results/{run}/hidden_states/parts/replica-{i}-of-{r}.json",
        run=run,
        i=range(r),
        r=r,
    )


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
    for r in (
        rules.prepare_data,
        rules.vocab_mapping,
        rules.gather_hidden_states,
        rules.train_draft,
    ):
        intermediate += expand(r.output, run=run)
    return final_outputs() + intermediate


def final_outputs():
    out = [
        "draft/config.json",
        "draft/model.safetensors",
        "eval/offline.json",
        "report/training.svg",
        "report/data_stats.svg",
    ]
    if config["benchmark_serving"]["enabled"]:
        out.append("eval/serving.json")
    return expand("results/{run}/{path}", run=config["run_name"], path=out)
