"""Command-line flags from config/config.schema.yaml, the one statement of every setting.

A stage's parser takes its settings' flags from the schema (``add_stage_arguments``) and a rule
renders the same flags from the run's config (``render``), so a stage run by hand behaves as the
pipeline does. A key ``section.some_key`` is the flag ``--some-key`` (a group may put a prefix in
front, ``--draft-layers``); its type, default, allowed values and help are the schema's:

- integer / number / string: ``--key VALUE``; a key that may be null is left out when null
  (the parser's default is then None);
- boolean: ``--key`` / ``--no-key``;
- an array of integers or numbers: a comma list (``--concurrency 1,4,16``);
- an object or an array of objects: JSON.

A value outside the schema's bounds (``minimum``, ``exclusiveMaximum``, ...; an array's, of each
item) is refused as the flag's value, so a stage restates none of them.

STAGE_SETTINGS says which keys each stage takes, in named groups: a rule passes a group as one
param (a rerun trigger) or, for settings that change none of its outputs, as a resource (which no
rerun trigger looks at). WORKFLOW_KEYS are the keys that reach no stage as their own flag.

Imported by the Snakefile: standard library and yaml only.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from .atomic import json_object_argument

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "config.schema.yaml"


@dataclass(frozen=True)
class Group:
    """Keys of one schema section (dotted: ``benchmark_serving.parity``) and their flags' prefix."""

    section: str
    keys: tuple[str, ...]
    prefix: str = ""

    def flag(self, key: str) -> str:
        return "--" + (self.prefix + key).replace("_", "-")


def group(section: str, *keys: str, prefix: str = "") -> Group:
    return Group(section, keys, prefix)


_TARGET = group("target", "revision", "trust_remote_code", "dtype")
_TRUST = group("target", "trust_remote_code")
_ENGINE = group("extract", "gpu_memory_utilization", "enforce_eager")
_KV_CACHE = group("vllm", "kv_cache_gib")
_BUCKETS = group("evaluate", "context_buckets")

# stage -> group name -> groups. The groups a rule passes as a resource (reruns nothing):
# regenerate_responses "engine" (how the machine is used, not what is answered) and
# extract_hidden_states "staging" (where vLLM's files wait; RESULT_NEUTRAL there).
STAGE_SETTINGS: dict[str, dict[str, tuple[Group, ...]]] = {
    "prepare_data": {
        "data": (group("target", "revision", "trust_remote_code"),
                 group("data", "max_length", "too_long", "seed", "rerendered_turns", "chat_template",
                       "chat_template_kwargs")),
        # given only when the eval split is drawn from the data (rule prepare_data)
        "split": (group("data", "eval_fraction"),),
    },
    "regenerate_responses": {
        "answers": (_TARGET,
                    group("data", "chat_template"),
                    group("extract", "tensor_parallel_size", "max_model_len"),
                    group("regenerate", "backend", "device", "seed", "modes", "turns", "temperature", "top_p",
                          "max_new_tokens", "on_truncated", "on_loop", "loop_ngram", "loop_min_distinct_share",
                          "answers_per_conversation", "loop_retries", "batch_size")),
        "engine": (_ENGINE, _KV_CACHE, group("regenerate", "hf_batch_size")),
        # given only when regenerate.new_user_turns.count > 0 (rule regenerate_responses): a run
        # without written turns keeps the flags, and so the params, it had before the setting
        "new_user_turns": (group("regenerate.new_user_turns", "count", "temperature", "top_p", "max_new_tokens",
                                 prefix="new-user-turns-"),),
        # given only when regenerate.loop_stop_every > 0, for the same reason
        "loop_stop": (group("regenerate", "loop_stop_every"),),
        # The fixed evaluation set answered by the same engine (rule regenerate_responses when
        # evaluate.prompts is set): its own values of the sampling keys, as --eval-<key>. The rule gives
        # them from its EVAL_PROMPTS_SAMPLING (greedy, first turn, ...), never the config's values.
        "eval": (group("regenerate", "turns", "temperature", "top_p", "max_new_tokens", "on_truncated", "on_loop",
                       "answers_per_conversation", "loop_retries", prefix="eval-"),),
    },
    "vocab_mapping": {"vocab": (group("draft", "vocab_size", prefix="draft-"),)},
    "extract_hidden_states": {
        # in the order of the part manifest's settings (its dests' order in the parser)
        "shards": (group("target", "revision", "trust_remote_code"),
                   group("extract", "backend", "device", "tensor_parallel_size", "layer_ids", "batch_size",
                         "storage_dtype"),
                   group("target", "dtype"), group("extract", "max_model_len"), _ENGINE, _KV_CACHE,
                   group("extract", "disk_budget_gib")),
        "staging": (group("extract", "staging_dir"),),
    },
    "train_draft": {
        # in the order of summary.json's settings (its dests' order in the parser)
        "training": (_TRUST,
                     group("draft", "architecture", "mlp_width", "layers", prefix="draft-"),
                     group("train", "lm_head", "ttt_steps", "ttt_step_loss_decay", "optimizer", "lr", "weight_decay",
                           "muon_weight_decay", "warmup_steps", "max_steps", "batch_tokens", "shuffle_buffer_gib",
                           "eval_every", "checkpoint_every", "loss", "seed"),
                     _BUCKETS, group("evaluate", "select_by")),
    },
    "export_draft": {"export": (group("export", "which", "drop_embedding"),)},
    "evaluate": {
        "offline": (_TRUST, _BUCKETS),
        "parity": (_TRUST, group("benchmark_serving.parity", "z", prefix="parity-")),
    },
    "benchmark_serving": {
        "serving": (group("target", "trust_remote_code", "dtype"),
                    group("extract", "tensor_parallel_size", "gpu_memory_utilization"), _KV_CACHE,
                    group("benchmark_serving", "num_prompts", "max_tokens", "concurrency", "k", "min_seconds",
                          "min_output_tokens", "near_tie_ulps", "engine_args"),
                    group("benchmark_serving.parity", "min_requests", prefix="parity-")),
    },
    "model_card": {"card": (group("export", "which"), group("extract", "tensor_parallel_size"), _TRUST)},
}

# Keys the Snakefile itself uses (paths, job counts, which rules run) or turns into a value of its own
# before a stage sees it; every other key reaches a stage as its flag (tests/test_settings.py).
WORKFLOW_KEYS = {
    "run_name": "the results directory",
    "target.model": "the target as a job input or hub id (--model)",
    "target.build": "whether rule build_target exists, and its recipe",
    "target.deploy_name": "export_draft's --verifier-name and benchmark_serving's --serve-model",
    "data.path": "prepare_data's or regeneration's --data",
    "data.max_samples": "prepare_data's or regeneration's --max-samples, whichever reads the data",
    "regenerate.enabled": "whether regeneration runs",
    "extract.replicas": "the extraction jobs",
    "train.gpus": "the training launcher",
    "export.num_speculative_tokens": "export_draft's --num-speculative-tokens (null: train.ttt_steps)",
    "evaluate.k": "evaluate's --k (null: train.ttt_steps)",
    "evaluate.prompts": "regeneration's --eval-data (or rule regenerate_eval_prompts') and prepare_data's --eval-data",
    "vllm.cache_dir": "VLLM_CACHE_ROOT of the vLLM rules",
    "benchmark_serving.enabled": "whether the serving rules run",
    "benchmark_serving.parity.k": "benchmark_serving's and evaluate's --parity-k / --k (null: the export's K)",
}


@cache
def load_schema(path: Path = SCHEMA) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def leaf(section: str, key: str, schema: dict | None = None) -> dict:
    """The schema of ``section.key``."""
    node = schema or load_schema()
    for name in (*filter(None, section.split(".")), key):
        try:
            node = node["properties"][name]
        except KeyError:
            raise KeyError(f"{SCHEMA}: no key {section}.{key}") from None
    return node


def leaf_keys(schema: dict | None = None, prefix: str = "") -> list[str]:
    """Every settable key of the schema, dotted (objects with properties are sections, not keys)."""
    node = schema or load_schema()
    keys = []
    for name, sub in node["properties"].items():
        if "properties" in sub:
            keys += leaf_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _kind(spec: dict) -> str:
    """The one non-null JSON type of a key (an enum without a type: its values' type)."""
    types = spec.get("type")
    if types is None and "enum" in spec:
        types = sorted({"string" if isinstance(v, str) else "number" for v in spec["enum"] if v is not None})
    types = [t for t in ([types] if isinstance(types, str) else types or []) if t != "null"]
    if len(types) != 1:
        raise ValueError(f"{spec}: a flag needs one type besides null")
    return types[0]


def _item_kind(spec: dict) -> str | None:
    return spec.get("items", {}).get("type")


SCALARS = {"integer": int, "number": float, "string": str}
ITEM_NAMES = {int: "integers", float: "numbers"}


def _comma_list(item: type):
    def parse(text: str) -> list:
        try:
            return [item(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {ITEM_NAMES[item]}") from None
    return parse


def parser_type(spec: dict):
    """What argparse turns a flag's text into (the inverse of ``flag_value``)."""
    kind = _kind(spec)
    if kind in SCALARS:
        return SCALARS[kind]
    if kind == "array" and _item_kind(spec) in ("integer", "number"):
        return _comma_list(SCALARS[_item_kind(spec)])
    if kind == "object":
        return json_object_argument
    raise ValueError(f"{spec}: an array of objects needs the stage's own type")


# JSON Schema's numeric bounds: the test a value passes, and how the refusal says it
BOUNDS = {"minimum": (operator.ge, ">="), "exclusiveMinimum": (operator.gt, ">"),
          "maximum": (operator.le, "<="), "exclusiveMaximum": (operator.lt, "<")}


def bounded(parse, spec: dict):
    """``parse``, refusing a value (an array: any item) outside the schema's bounds of ``spec``."""
    where = spec.get("items", {}) if "oneOf" not in spec and _kind(spec) == "array" else spec
    limits = [(test, sign, where[k]) for k, (test, sign) in BOUNDS.items() if k in where]
    if not limits:
        return parse

    def parse_within_bounds(text: str):
        value = parse(text)
        for item in value if isinstance(value, list) else [value]:
            for test, sign, bound in limits:
                if not test(item, bound):
                    raise argparse.ArgumentTypeError(f"{item}: must be {sign} {bound}")
        return value
    return parse_within_bounds


def flag_value(spec: dict, value) -> str:
    """A non-null, non-boolean value as its flag's text."""
    if "oneOf" in spec:  # read by the stage's own type
        return str(value)
    kind = _kind(spec)
    if kind == "array" and _item_kind(spec) in ("integer", "number"):
        return ",".join(str(v) for v in value)
    if kind in ("array", "object"):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _help(spec: dict) -> str | None:
    text = " ".join(spec.get("description", "").split())
    return text.replace("%", "%%") or None  # argparse %-formats help


def add_arguments(parser: argparse.ArgumentParser, groups, types: dict | None = None) -> None:
    """The groups' flags on ``parser``. ``types``: key -> an argparse type of the stage's own for a key
    whose text it checks or turns into its own objects (its default is that type applied to the
    schema default's flag text). A flag two different keys would give is an error."""
    types = dict(types or {})
    seen: dict[str, str] = {}
    for g in groups:
        for key in g.keys:
            name, flag, spec = f"{g.section}.{key}", g.flag(key), leaf(g.section, key)
            if seen.get(flag, name) != name:
                raise ValueError(f"{flag} would be both {seen[flag]} and {name}: give one group a prefix")
            if flag in seen:
                continue
            seen[flag] = name
            kind_type = types.pop(key, None)
            default = spec.get("default")
            if spec.get("type") == "boolean":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_help(spec))
                continue
            if "oneOf" in spec and kind_type is None:
                raise ValueError(f"{name}: a oneOf key needs the stage's own type")
            kind_type = bounded(kind_type or parser_type(spec), spec)
            if default is not None:
                default = kind_type(flag_value(spec, default))
            choices = [v for v in spec.get("enum", []) if v is not None] or None
            parser.add_argument(flag, type=kind_type, default=default, choices=choices, help=_help(spec))
    if types:
        raise ValueError(f"types for keys the groups do not hold: {sorted(types)}")


def add_stage_arguments(parser: argparse.ArgumentParser, stage: str, types: dict | None = None) -> None:
    """Every setting flag of ``stage`` (all its groups)."""
    add_arguments(parser, [g for groups in STAGE_SETTINGS[stage].values() for g in groups], types)


def config_value(config: dict, section: str, key: str):
    node = config
    for name in section.split("."):
        node = node[name]
    return node[key]


def render(config: dict, groups, overrides: dict | None = None) -> str:
    """The groups' flags as a rule passes them, shell-quoted; ``overrides``: ``"section.key"`` -> the
    value given instead of the config's."""
    overrides = overrides or {}
    words = []
    for g in groups:
        for key in g.keys:
            name, flag = f"{g.section}.{key}", g.flag(key)
            value = overrides[name] if name in overrides else config_value(config, g.section, key)
            if isinstance(value, bool):
                words.append(flag if value else re.sub("^--", "--no-", flag))
            elif value is not None:
                words += [flag, shlex.quote(flag_value(leaf(g.section, key), value))]
    return " ".join(words)


def stage_flags(config: dict, stage: str, *names: str, overrides: dict | None = None) -> str:
    """The flags of ``stage``'s groups ``names`` (all when none are named) from ``config``."""
    chosen = names or tuple(STAGE_SETTINGS[stage])
    groups = list(dict.fromkeys(g for name in chosen for g in STAGE_SETTINGS[stage][name]))
    return render(config, groups, overrides)
