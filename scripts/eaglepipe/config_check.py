"""One clear sentence per bad config value: key, value, what is allowed.

snakemake.utils.validate reports a schema dump per error; users need the key path and the allowed
values first. This runs before it (validate still applies the schema's defaults) and adds the
checks a schema cannot express. Kept free of heavy imports: it runs at Snakefile parse time.
"""

from __future__ import annotations

import jsonschema
import yaml


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _allowed(err: jsonschema.ValidationError) -> str:
    s = err.schema if isinstance(err.schema, dict) else {}
    v = err.validator
    if v == "enum":
        return "one of " + ", ".join(repr(x) for x in err.validator_value)
    if v == "type":
        t = err.validator_value
        return "of type " + (" or ".join(t) if isinstance(t, list) else t)
    if v in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        word = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[v]
        return f"a number {word} {err.validator_value}"
    if v == "additionalProperties":
        return "one of the documented keys: " + ", ".join(sorted(s.get("properties", {})))
    if v == "pattern":
        return f"a string matching {err.validator_value}"
    if v == "minItems":
        return f"a list of at least {err.validator_value} items"
    if v == "required":
        return "present"
    return f"valid under '{v}' = {err.validator_value!r}"


def load_schema(schema_path: str) -> dict:
    with open(schema_path) as f:
        return yaml.safe_load(f)


def coerce_cli_strings(config: dict, schema: dict) -> None:
    """Type the strings of nested ``--config`` values in place.

    Snakemake parses ``--config 'train={"lr": 0.01}'`` with YAML's BaseLoader, so every nested
    value arrives as a string ('0.01', 'true', 'null'). Where the schema does not allow a string,
    re-read it as YAML.
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
        if err.validator == "required":
            out.append(f"config: {err.message} (under {_key(err.absolute_path)})")
            continue
        out.append(f"config key {_key(err.absolute_path)} = {err.instance!r} is not allowed: "
                   f"it must be {_allowed(err)}")
    ids = (config.get("extract") or {}).get("layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids) and ids != sorted(set(ids)):
        out.append(f"config key extract.layer_ids = {ids} is not allowed: it must be strictly "
                   f"ascending with the final layer (num_hidden_layers) last")
    return out
