"""benchmarks/make_kimi_target.py: Kimi-K2.5's config keys and head dims, a tokenizer of exactly its vocabulary."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import make_kimi_target as mk  # noqa: E402

from eaglepipe.serving_limits import eagle3_target_error, mla_dims_error, rope_error, servable_rope  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi")
    mk.make(out, layers=2, routed_experts=4, seed=0, device="cpu", hidden=64, vocab=2048)
    return out


def test_config_keeps_kimis_keys_and_cuts_only_what_was_asked(target):
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]) == (2, 4, 4)
    assert (cfg["hidden_size"], cfg["vocab_size"]) == (64, 2048)  # the CPU check's narrowing
    for key in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "n_shared_experts", "first_k_dense_replace", "scoring_func", "topk_method", "routed_scaling_factor",
                "rope_theta", "max_position_embeddings"):
        assert cfg[key] == mk.KIMI_K25[key], key
    rope = cfg["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["mscale_all_dim"]) == ("yarn", 64.0, 1.0)
    # what the pipeline checks before starting vLLM on it passes, as for the real Kimi-K2.5
    assert eagle3_target_error(cfg["architectures"]) is None and mla_dims_error(cfg) is None
    assert rope_error(servable_rope(rope)) is None


def test_full_width_config_is_kimis_but_for_depth_and_experts():
    cfg = mk.kimi_config(layers=4, routed_experts=16)
    assert {k: v for k, v in cfg.items() if cfg[k] != mk.KIMI_K25[k]} == {"num_hidden_layers": 4, "n_routed_experts": 16}
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"]) == (
        7168, 163840, 18432, 2048)


def test_tokenizer_decodes_every_id_and_renders_kimis_template(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    cfg = json.loads((target / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] == 2048
    assert tok.convert_tokens_to_ids("<|im_end|>") == cfg["eos_token_id"]
    assert tok.decode([2047]) == "<|filler_2047|>"  # an id the random model may sample still decodes
    assert 2047 not in tok("<|filler_2047|> hello")["input_ids"]  # and is never produced by encoding
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
