"""What vLLM 0.26.0 serves as trained: aux-id count, rope, and the default layer ids that follow."""

import ast
import math
import zipfile

import pytest

from eaglepipe.layers import aux_layer_ids, default_layer_ids
from eaglepipe.serving_limits import (AUX_STATES, EAGLE3_TARGETS, MLA_PREFILL_DIMS, eagle3_target_error, mla_dims_error,
                                      rope_error, servable_rope, yarn_attention_factors)

# Kimi-K2.5's text config rope (DeepseekV3 yarn), as speculators copies it into the draft's config.
KIMI_ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def transformers_attention_factor(rope: dict) -> float:
    """What transformers 5.19 trains the draft with: its own yarn init on a Llama config of this rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=4096 * 64,
                      rope_parameters=dict(rope))
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")[1]


def test_yarn_trained_factor_is_transformers_own():
    for rope in (KIMI_ROPE, servable_rope(KIMI_ROPE), {**KIMI_ROPE, "attention_factor": 0.8}):
        trained, _ = yarn_attention_factors(rope)
        assert trained == pytest.approx(transformers_attention_factor(rope))


def test_kimi_yarn_is_refused_and_the_servable_rope_agrees():
    trained, served = yarn_attention_factors(KIMI_ROPE)
    assert trained == 1.0 and served == pytest.approx(0.1 * math.log(64) + 1)
    assert "yarn attention factor 1 in training" in rope_error(KIMI_ROPE)
    plain = servable_rope(KIMI_ROPE)
    assert rope_error(plain) is None
    assert {k: v for k, v in KIMI_ROPE.items() if k not in ("mscale", "mscale_all_dim")} == plain


@pytest.mark.parametrize("rope", [None, {"rope_type": "default", "rope_theta": 1e4},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}])
def test_ropes_served_as_trained_pass(rope):
    assert rope_error(rope) is None
    assert servable_rope(rope) == rope


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "factor": 4.0, "attn_factor": 2.0}, "yarn attention factor 1.139 in training"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "yarn without a factor"),
    ({"rope_type": "longrope", "factor": 4.0}, "rope_type 'longrope' is not served"),
])
def test_ropes_served_otherwise_are_refused(rope, message):
    assert message in rope_error(rope)


@pytest.mark.parametrize("n", range(4, 70))
def test_default_layer_ids_give_three_distinct_aux_ids(n):
    ids = default_layer_ids(n)
    aux = aux_layer_ids(ids)
    assert len(aux) == AUX_STATES and aux == sorted(set(aux)) and 1 <= aux[0] and aux[-1] < n and ids[-1] == n
    if n > 6:
        assert aux == [2, n // 2, n - 3]


def test_aux_layer_ids_are_all_but_the_final_id():
    assert aux_layer_ids([2, 30, 58, 61]) == [2, 30, 58]
    assert aux_layer_ids([1]) == []


def test_default_layer_ids_refuse_targets_too_small():
    with pytest.raises(ValueError, match="give extract.layer_ids explicitly"):
        default_layer_ids(3)


def test_a_kimi_style_target_gets_a_draft_rope_vllm_serves_as_trained(tiny_dsv3, tmp_path):
    """draft_model.draft_layer_config on a DeepseekV3 with Kimi-K2.5's yarn rope (config.json only)."""
    import json

    from eaglepipe.draft_model import draft_layer_config

    cfg = json.loads((tiny_dsv3 / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_scaling={"type": "yarn", **{k: v for k, v in KIMI_ROPE.items() if k not in ("rope_type", "rope_theta")}},
               rope_theta=KIMI_ROPE["rope_theta"], max_position_embeddings=4096 * 64)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rope = draft_layer_config(tmp_path).rope_parameters
    assert rope_error(rope) is None
    assert rope["rope_type"] == "yarn" and rope["factor"] == 64.0 and "mscale" not in rope
    assert yarn_attention_factors(rope) == pytest.approx((transformers_attention_factor(rope),) * 2)


# ----------------------------------------------------------------------------- read from the pinned wheel
def wheel_or_skip():
    from pinned_vllm import vllm_wheel

    wheel = vllm_wheel()
    if wheel is None or not wheel.is_file():
        pytest.skip("the vllm 0.26.0 wheel is not here: pip download --no-deps vllm==0.26.0 -d /tmp/vllmwheel")
    return zipfile.ZipFile(wheel)


def _assigned(tree: ast.Module, name: str):
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == name:
            return node.value
    raise AssertionError(f"{name} not found")


def wheel_eagle3_targets(z: zipfile.ZipFile) -> set[str]:
    """The registered generative architectures whose class has SupportsEagle3 among its bases, followed
    through the model files' classes and their `from vllm.model_executor.models.X import Y` imports."""
    base = "vllm/model_executor/models/"
    registry = ast.parse(z.read(base + "registry.py").decode())
    archs = {}
    for table in ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS"):
        value = _assigned(registry, table)
        archs.update({k.value: tuple(e.value for e in v.elts) for k, v in zip(value.keys, value.values)})
    modules = {}

    def module(name):
        if name not in modules:
            path = f"{base}{name.replace('.', '/')}.py"
            if path not in z.namelist():  # a package's __init__ or a lazily generated module: no class here
                modules[name] = ({}, {})
                return modules[name]
            tree = ast.parse(z.read(path).decode())
            imports = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                       if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
            modules[name] = ({n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}, imports)
        return modules[name]

    def implements(mod, cls):
        if cls == "SupportsEagle3":
            return True
        classes, imports = module(mod)
        if cls in classes:
            names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in classes[cls].bases]
            return any(n and implements(mod, n) for n in names)
        source = imports.get(cls, ("", ""))
        prefix = "vllm.model_executor.models."
        return source[0].startswith(prefix) and implements(source[0][len(prefix):], source[1])

    return {arch for arch, (mod, cls) in archs.items() if implements(mod, cls)}


def test_eagle3_targets_are_the_wheels():
    found = wheel_eagle3_targets(wheel_or_skip())
    assert found == EAGLE3_TARGETS
    assert {"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "LlamaForCausalLM"} <= found
    assert "MixtralForCausalLM" not in found  # registered, but without EAGLE-3 capture


def test_mla_prefill_dims_are_the_wheels():
    tree = ast.parse(wheel_or_skip().read("vllm/v1/attention/backends/mla/prefill/flash_attn.py").decode())
    method = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "supports_mla_dimensions")
    dims = {tuple(kw.value.value for kw in call.keywords) for call in ast.walk(method)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "MLADimensions"}
    assert dims == set(MLA_PREFILL_DIMS)
    selector = wheel_or_skip().read("vllm/v1/attention/backends/mla/prefill/selector.py").decode()
    hopper = selector[selector.index("else:  # Hopper (SM90) and older"):]
    assert hopper[: hopper.index("]")].count("MLAPrefillBackendEnum.") == 1  # FlashAttention only


def test_refusals_name_the_value_and_what_is_allowed():
    assert eagle3_target_error(["KimiK25ForConditionalGeneration"]) is None and eagle3_target_error(None) is None
    error = eagle3_target_error(["MixtralForCausalLM"])
    assert error.startswith("architectures ['MixtralForCausalLM']: vLLM 0.26.0's class") and "LlamaForCausalLM" in error
    kimi = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert mla_dims_error(kimi) is None and mla_dims_error({"num_hidden_layers": 2}) is None
    assert mla_dims_error({**kimi, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}) == (
        "MLA head dims (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) = (32, 16, 32): vLLM 0.26.0's FlashAttention "
        "MLA prefill (its only one on Hopper) has kernels for (128, 64, 128), (192, 64, 256), (64, 64, 128) only")
