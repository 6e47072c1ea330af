"""The MLA draft layer for DeepseekV3 / Kimi targets, and the checkpoint vLLM serves it from.

speculators 0.9.0 builds EAGLE-3 drafts from a table of decoder-layer classes keyed by the layer
config's ``model_type`` (``speculators.models.eagle3.model_definitions.model_classes``: llama,
qwen3). It has no MLA entry, so this module adds one, ``deepseek_v3``, and everything else stays
speculators': ``Eagle3DraftModel`` (fc over the aux states, TTT loop and masks, losses, draft
vocab mapping, save/load), so the MLA draft trains, checkpoints, resumes and is evaluated exactly as
the Llama-layer draft. The layer itself is transformers' ``DeepseekV3DecoderLayer`` (its MLA
attention and dense MLP) with the two input projections widened to 2 x hidden (embeddings ‖ fused
aux states), as speculators widens q/k/v for Llama.

vLLM 0.26.0 serves such a draft as ``Eagle3DeepseekV2ForCausalLM``
(vllm/model_executor/models/deepseek_eagle3.py in the vllm-0.26.0 wheel), but not from the
speculators format: its converter (transformers_utils/configs/speculators/algos.py,
``update_eagle3``) knows only llama and qwen3 layers. The export is therefore a plain DeepseekV3
config naming that architecture, with the EAGLE-3 keys the class reads (``served_config``), and
speculators' tensor names, which the class maps itself (``layers.0.*`` as is; ``q_a_proj`` +
``kv_a_proj_with_mqa`` and ``gate_proj`` + ``up_proj`` stacked; ``d2t``; ``t2d`` skipped).
"""

from __future__ import annotations

from .serving_limits import EXPORT_KEY, MLA_DRAFT_LAYERS, mla_layers_error

MODEL_TYPE = "deepseek_v3"
SERVED_ARCHITECTURE = "Eagle3DeepseekV3ForCausalLM"  # registry alias of Eagle3DeepseekV2ForCausalLM
# The exported config's model_type. Not deepseek_v3: vLLM 0.26.0's SpeculativeConfig.hf_config_override
# (vllm/config/speculative.py) turns a draft of model_type deepseek_v3 into DeepSeek MTP, and the
# H200 refused our first export ("Model architectures ['Eagle3DeepSeekMTPModel'] are not supported").
# kimi_k2 is read as DeepseekV3Config (vllm/transformers_utils/config.py _CONFIG_REGISTRY), is an MLA
# model type for vLLM and is left alone by that override; NVIDIA ModelOpt's Kimi-K2 EAGLE export
# writes the same.
SERVED_MODEL_TYPE = "kimi_k2"
# vLLM's DeepseekV2Eagle3Model has no norm over the concatenated aux states before fc (the Llama
# draft's norm_before_fc), so the MLA draft trains without it; the other three flags it honours.
NORM_FLAGS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": True}
# Keys of the exported config that are EAGLE-3 settings, not DeepseekV3 layer fields.
EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
              "num_aux_hidden_states", *NORM_FLAGS, EXPORT_KEY)


def draft_rope(tcfg) -> dict:
    """RoPE parameters of the draft layer, chosen so that vLLM computes the rotation we train.

    vLLM's draft layer (deepseek_eagle3.py, DeepseekV2Eagle3DecoderLayer.__init__) turns any truthy
    ``config.rope_scaling`` into ``deepseek_yarn``, and transformers 5 always sets it (it aliases
    ``rope_parameters``). So the draft is always a YaRN layer: the target's own YaRN (Kimi-K2.5:
    factor 64) or, for an unscaled target, YaRN with factor 1, which is the plain rotation in both
    vLLM (DeepseekScalingRotaryEmbedding) and transformers (mscale 1, no interpolation).
    """
    rope = dict(getattr(tcfg, "rope_parameters", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", getattr(tcfg, "rope_theta", None))
    if theta is None:
        raise ValueError("target config: no rope_theta, cannot give the MLA draft the target's rotation")
    if kind == "yarn":
        keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        return {"rope_type": "yarn", "rope_theta": float(theta), **{k: rope[k] for k in keep if k in rope}}
    if kind != "default":
        raise ValueError(f"target config: rope type {kind!r}; the MLA draft (served as deepseek_yarn by vLLM) "
                         "supports a default or yarn target rotation")
    return {"rope_type": "yarn", "rope_theta": float(theta), "factor": 1.0,
            "original_max_position_embeddings": int(tcfg.max_position_embeddings),
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def layer_config(tcfg, mlp_width: int | None = None, num_layers: int = MLA_DRAFT_LAYERS):
    """DeepseekV3 config of the one-layer draft: the target's MLA shapes, a dense MLP.

    ``mlp_width`` None keeps the target's dense FFN width (intermediate_size: 18432 for Kimi).
    ``num_layers`` (draft.layers) other than one is refused (serving_limits.MLA_DRAFT_LAYERS says why).
    """
    from transformers import DeepseekV3Config

    refused = mla_layers_error(num_layers)
    if refused:
        raise ValueError(refused)
    width = mlp_width or tcfg.intermediate_size
    return DeepseekV3Config(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=width,
        num_hidden_layers=MLA_DRAFT_LAYERS,
        first_k_dense_replace=MLA_DRAFT_LAYERS,  # dense MLP (vLLM's draft layer is never MoE)
        num_mtp_layers=0,
        num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_attention_heads,
        q_lora_rank=tcfg.q_lora_rank, kv_lora_rank=tcfg.kv_lora_rank, qk_nope_head_dim=tcfg.qk_nope_head_dim,
        qk_rope_head_dim=tcfg.qk_rope_head_dim, v_head_dim=tcfg.v_head_dim, hidden_act=tcfg.hidden_act,
        rms_norm_eps=tcfg.rms_norm_eps, max_position_embeddings=tcfg.max_position_embeddings,
        rope_parameters=draft_rope(tcfg),
        rope_interleave=True,  # vLLM's MLA rotary is GPT-J style (is_neox_style=False), i.e. interleaved
        attention_bias=False, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def _first_layer_class():
    # imported here: the model card reads this module's config helpers and needs no torch
    import torch
    from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
        """DeepseekV3 layer taking cat(embeddings, hidden): the MLA input projections read 2 x hidden.

        Shapes and norms as vLLM's DeepseekV2MLAAttention builds them with input_size = 2 x hidden
        (latent norms with the config's eps, where transformers uses its 1e-6 default).
        """

        def __init__(self, config, layer_idx: int, norm_before_residual: bool = False):
            super().__init__(config, layer_idx)
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            attn, wide = self.self_attn, 2 * config.hidden_size
            if config.q_lora_rank is None:
                attn.q_proj = torch.nn.Linear(wide, config.num_attention_heads * attn.qk_head_dim, bias=False)
            else:
                attn.q_a_proj = torch.nn.Linear(wide, config.q_lora_rank, bias=False)
                attn.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
            attn.kv_a_proj_with_mqa = torch.nn.Linear(wide, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
            attn.kv_a_layernorm = DeepseekV3RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)

    return DeepseekV3DecoderEagle3FirstLayer


def register_with_speculators() -> None:
    """Add the MLA layer to speculators' EAGLE-3 layer table (idempotent); see the module docstring."""
    from speculators.models import base_components
    from speculators.models.eagle3.model_definitions import model_classes
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    if MODEL_TYPE not in model_classes:
        model_classes[MODEL_TYPE] = base_components.ModelComponents(
            first_layer_class=_first_layer_class(), decoder_layer_class=DeepseekV3DecoderLayer,
            norm_class=DeepseekV3RMSNorm, rotary_emb_class=DeepseekV3RotaryEmbedding,
        )


def is_mla_checkpoint(config: dict) -> bool:
    """A speculators checkpoint config whose draft layer is the MLA layer."""
    return config.get("transformer_layer_config", {}).get("model_type") == MODEL_TYPE


def is_served_config(config: dict) -> bool:
    return config.get("architectures") == [SERVED_ARCHITECTURE]


def check_servable(config: dict, layer: dict, where: str) -> None:
    """Refuse an MLA draft (its EAGLE-3 ``config``, its ``layer`` fields) that vLLM's
    Eagle3DeepseekV2ForCausalLM would serve differently from what was trained."""
    differ = {k: config.get(k, False) for k, v in NORM_FLAGS.items() if bool(config.get(k, False)) != v}
    if differ:
        raise ValueError(f"{where}: norm flag(s) {differ} differ from the MLA draft's {NORM_FLAGS}; vLLM's "
                         "Eagle3DeepseekV2ForCausalLM has no norm before fc, so it would serve another model")
    if layer.get("hidden_act") != "silu":  # DeepseekV2MLP (deepseek_v2.py) raises on anything else
        raise ValueError(f"{where}: hidden_act is {layer.get('hidden_act')!r}; vLLM's DeepseekV2MLP supports silu only")
    refused = mla_layers_error(layer.get("num_hidden_layers"))
    if refused:
        raise ValueError(f"{where}: num_hidden_layers: {refused}")


def served_config(export_cfg: dict) -> dict:
    """The config.json vLLM 0.26.0 loads as Eagle3DeepseekV3ForCausalLM, from the checkpoint's
    speculators config (deploy fields already set by export_draft.export_config).

    Read by vLLM: the DeepseekV3 layer fields, ``architectures``, ``draft_vocab_size``,
    ``target_hidden_size``, ``num_aux_hidden_states`` and ``eagle_aux_hidden_state_layer_ids``
    (gpu_model_runner._get_eagle3_aux_layers_from_config), ``norm_before_residual``,
    ``norm_output``, ``fc_norm``. The method (eagle3) and K come from ``--speculative-config``.
    """
    layer = {k: v for k, v in export_cfg["transformer_layer_config"].items()
             if k not in ("_attn_implementation", "architectures", "transformers_version")}
    aux = list(export_cfg["eagle_aux_hidden_state_layer_ids"])
    spec = export_cfg["speculators_config"]
    return {
        **layer,
        "architectures": [SERVED_ARCHITECTURE],
        "model_type": SERVED_MODEL_TYPE,
        "dtype": export_cfg.get("dtype", "bfloat16"),
        "draft_vocab_size": export_cfg["draft_vocab_size"],
        "target_hidden_size": layer["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": aux,
        "num_aux_hidden_states": len(aux),
        **{k: bool(export_cfg.get(k, False)) for k in NORM_FLAGS},
        EXPORT_KEY: {"draft_architecture": "mla", "verifier": spec["verifier"]["name_or_path"],
                     "num_speculative_tokens": spec["proposal_methods"][0]["speculative_tokens"]},
    }


def card_view(served: dict) -> dict:
    """The exported config in the speculators layout the model card reads, with ``served_as``."""
    spec = served[EXPORT_KEY]
    return {**{k: served[k] for k in ("draft_vocab_size", *NORM_FLAGS)}, "served_as": SERVED_ARCHITECTURE,
            # the layer trained and served is DeepseekV3's (model_type kimi_k2 only steers vLLM's loader)
            "transformer_layer_config": {**{k: v for k, v in served.items() if k not in EAGLE_KEYS},
                                         "model_type": MODEL_TYPE},
            "speculators_config": {"verifier": {"name_or_path": spec["verifier"]},
                                   "proposal_methods": [{"speculative_tokens": spec["num_speculative_tokens"]}]}}


def served_layer_config(served: dict):
    """The draft's DeepseekV3 layer config back from an exported config.json (for evaluation)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{k: v for k, v in served.items()
                               if k not in EAGLE_KEYS and k not in ("architectures", "model_type")})


def served_shapes(served: dict) -> dict[str, tuple]:
    """Tensor name -> shape that Eagle3DeepseekV2ForCausalLM (vLLM 0.26.0) loads, for ``served``.

    Written from the class's constructors (deepseek_eagle3.py; DeepseekV2MLAAttention and
    DeepseekV2MLP in deepseek_v2.py), in checkpoint names before its mapping; tests/test_mla_draft.py
    re-derives them by evaluating those constructors' arguments in the wheel's source. ``t2d`` is
    skipped by vLLM's loader but kept for our own loading; ``embed_tokens.weight`` is optional.
    """
    hidden, heads = served["hidden_size"], served["num_attention_heads"]
    qk_head = served["qk_nope_head_dim"] + served["qk_rope_head_dim"]
    q_lora, kv_lora = served.get("q_lora_rank"), served["kv_lora_rank"]
    width, draft_vocab = served["intermediate_size"], served["draft_vocab_size"]
    wide = 2 * hidden  # layer 0: input_size=2 * self.hidden_size
    attn = "layers.0.self_attn."
    shapes = {
        "fc.weight": (hidden, served.get("target_hidden_size", hidden) * served["num_aux_hidden_states"]),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (served["vocab_size"],),
        "embed_tokens.weight": (served["vocab_size"], hidden),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.hidden_norm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "layers.0.mlp.gate_proj.weight": (width, hidden),
        "layers.0.mlp.up_proj.weight": (width, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, width),
        attn + "kv_a_proj_with_mqa.weight": (kv_lora + served["qk_rope_head_dim"], wide),
        attn + "kv_a_layernorm.weight": (kv_lora,),
        attn + "kv_b_proj.weight": (heads * (served["qk_nope_head_dim"] + served["v_head_dim"]), kv_lora),
        attn + "o_proj.weight": (hidden, heads * served["v_head_dim"]),
    }
    if q_lora is None:
        shapes[attn + "q_proj.weight"] = (heads * qk_head, wide)
    else:
        shapes.update({attn + "q_a_proj.weight": (q_lora, wide), attn + "q_a_layernorm.weight": (q_lora,),
                       attn + "q_b_proj.weight": (heads * qk_head, q_lora)})
    if served.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (hidden,) for i in range(served["num_aux_hidden_states"])})
    return shapes
