"""What vLLM 0.26.0 serves as trained: aux-id count, rope, and the default layer ids that follow."""

import math

import pytest

from eaglepipe.layers import aux_layer_ids, default_layer_ids
from eaglepipe.serving_limits import AUX_STATES, rope_error, servable_rope, yarn_attention_factors

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
