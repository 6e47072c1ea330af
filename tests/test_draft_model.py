"""The Llama-layer draft built for Llama and DeepseekV3 targets, and loading an exported draft without its embedding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglepipe.draft_model import NORM_FLAGS, build_draft, load_draft, load_vocab_mapping


def mapping(path, vocab=400, every=4):
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[::every] = True
    ids = t2d.nonzero().squeeze(1)
    save_file({"d2t": ids - torch.arange(len(ids)), "t2d": t2d}, str(path))
    return path


@pytest.mark.parametrize("target", ["tiny_llama", "tiny_dsv3"])
def test_build_draft_for_target(target, request, tmp_path):
    target_dir = request.getfixturevalue(target)
    model = build_draft(target_dir, [1, 2, 3], mapping(tmp_path / "vm.safetensors"), ttt_steps=2,
                        architecture="llama")  # the MLA layer: test_mla_draft.py
    cfg = model.config
    layer = cfg.transformer_layer_config
    assert cfg.eagle_aux_hidden_state_layer_ids == [1, 2, 3] and cfg.draft_vocab_size == 100
    assert {k: getattr(cfg, k) for k in NORM_FLAGS} == NORM_FLAGS
    assert layer.model_type == "llama" and layer.num_hidden_layers == 1
    assert layer.layer_types == ["full_attention"] and not layer.use_sliding_window
    assert layer._attn_implementation == "sdpa"
    # MLA target: a plain 4 x 16 multi-head layer, not qk_rope_head_dim (8) wide heads
    assert layer.head_dim * layer.num_attention_heads == layer.hidden_size == 64
    assert layer.num_key_value_heads == (4 if target == "tiny_dsv3" else 2)
    target_w = load_file(str(target_dir / "model.safetensors"))
    assert torch.equal(model.lm_head.weight, target_w["lm_head.weight"][::4])
    assert torch.equal(model.embed_tokens.weight, target_w["model.embed_tokens.weight"])
    assert torch.equal(model.verifier_norm.weight, target_w["model.norm.weight"])


def test_load_exported_draft_without_embedding(tiny_llama, tmp_path):
    model = build_draft(tiny_llama, [1, 3, 5], mapping(tmp_path / "vm.safetensors"), ttt_steps=3)
    with torch.no_grad():
        model.fc.weight.normal_()
    model.save_pretrained(str(tmp_path / "draft"))
    weights = load_file(str(tmp_path / "draft" / "model.safetensors"))
    del weights["embed_tokens.weight"]
    save_file(weights, str(tmp_path / "draft" / "model.safetensors"))
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"  # as exported
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    loaded = load_draft(tmp_path / "draft", tiny_llama)
    assert torch.equal(loaded.fc.weight, model.fc.weight)
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(loaded.d2t, model.d2t) and not loaded.training


def test_bad_inputs_are_clear_errors(tiny_llama, tmp_path):
    save_file({"d2t": torch.zeros(3, dtype=torch.long)}, str(tmp_path / "no_t2d.safetensors"))
    with pytest.raises(SystemExit, match=r"missing tensor\(s\) \['t2d'\]"):
        load_vocab_mapping(tmp_path / "no_t2d.safetensors")
    with pytest.raises(SystemExit, match="t2d covers 200 tokens but target"):
        build_draft(tiny_llama, [1, 3, 5], mapping(tmp_path / "vm.safetensors", vocab=200), ttt_steps=2)
    with pytest.raises(SystemExit, match="model.safetensors is missing"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        load_draft(tmp_path / "empty", tiny_llama)
