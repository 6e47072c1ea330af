"""Config contract: the schema's defaults and errors, and presets that fully override the default."""

from pathlib import Path

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from eaglepipe.config_check import coerce_cli_strings, config_errors, load_schema

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "config" / "config.schema.yaml")
DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
PRESETS = sorted((REPO / "config" / "presets").glob("*.yaml"))


def leaves(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v, prefix + (k,))
        else:
            yield prefix + (k,)


def test_default_config_validates_and_gets_defaults():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(cfg, SCHEMA)
    assert cfg["train"]["ttt_steps"] == 3
    assert cfg["extract"]["layer_ids"] is None
    assert cfg["export"]["drop_embedding"] is True
    assert cfg["benchmark_serving"]["enabled"] is False


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_presets_override_every_key_of_the_default(preset):
    # Snakemake merges --configfile over config/config.yaml: a key the preset leaves out would
    # silently keep the embedded default's (CPU, 240 samples) value.
    cfg = yaml.safe_load(preset.read_text())
    validate(cfg, SCHEMA)
    missing = []
    for path in leaves(DEFAULT):
        d = cfg
        for k in path:
            if not isinstance(d, dict) or k not in d:
                missing.append(".".join(path))
                break
            d = d[k]
    assert not missing, f"{preset.name} leaves the embedded default's values for {missing}"


def test_kimi_preset_is_the_real_plan():
    cfg = yaml.safe_load((REPO / "config/presets/kimi-k2.5.yaml").read_text())
    assert cfg["extract"]["layer_ids"] == [2, 30, 58, 61]
    assert cfg["extract"]["tensor_parallel_size"] == 8
    assert cfg["extract"]["backend"] == "vllm"
    assert cfg["target"]["trust_remote_code"] is True


@pytest.mark.parametrize(
    "patch, key, allowed",
    [
        ({"extract": {"backend": "sglang"}}, "extract.backend = 'sglang'", "'hf', 'vllm'"),
        ({"extract": {"layer_ids": [0, 2, 4]}}, "extract.layer_ids.0 = 0", ">= 1"),
        ({"extract": {"layer_ids": [4, 2]}}, "extract.layer_ids = [4, 2]", "ascending"),
        ({"train": {"lr": -1}}, "train.lr = -1", "> 0"),
        ({"data": {"eval_fraction": 1.5}}, "data.eval_fraction = 1.5", "< 1"),
        ({"run_name": "a b"}, "run_name = 'a b'", "matching"),
        ({"extract": {"batchsize": 3}}, "extract.batchsize is not a known setting", "batch_size"),
    ],
)
def test_bad_values_get_one_sentence_naming_key_value_and_allowed(patch, key, allowed):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for k, v in patch.items():
        if isinstance(v, dict):
            cfg.setdefault(k, {}).update(v)
        else:
            cfg[k] = v
    errors = config_errors(cfg, load_schema(SCHEMA))
    assert len(errors) == 1, errors
    assert key in errors[0] and allowed in errors[0], errors[0]
    if "ascending" not in allowed:  # a rule of ours, beyond the schema
        with pytest.raises(WorkflowError):  # snakemake's own validation agrees
            validate(cfg, SCHEMA)


def test_cli_strings_are_typed_by_the_schema():
    # what snakemake makes of --config 'train={"lr": 0.01, "gpus": 2}' 'export={"num_speculative_tokens": null}'
    cfg = {"train": {"lr": "0.01", "gpus": "2"}, "export": {"num_speculative_tokens": "null"},
           "extract": {"layer_ids": ["2", "4"]}, "run_name": "123"}
    coerce_cli_strings(cfg, load_schema(SCHEMA))
    assert cfg["train"] == {"lr": 0.01, "gpus": 2}
    assert cfg["export"]["num_speculative_tokens"] is None
    assert cfg["extract"]["layer_ids"] == [2, 4]
    assert cfg["run_name"] == "123"  # strings stay strings where the schema wants one
    # --config 'data={"chat_template_kwargs": {"thinking": false}}': a template sees False, not "false"
    cfg = {"data": {"path": "x", "chat_template_kwargs": {"thinking": "false", "name": "kimi"}}}
    coerce_cli_strings(cfg, load_schema(SCHEMA))
    assert cfg["data"]["chat_template_kwargs"] == {"thinking": False, "name": "kimi"}
