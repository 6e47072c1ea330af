"""What the pinned vLLM (0.26.0) serves of an EAGLE-3 draft the way it was trained, read from its wheel.

Each rule cites the file of the vllm==0.26.0 wheel it rests on. Used by the Snakefile's config check
(parse time: kept free of heavy imports), by the draft's construction and by the export.
"""

from __future__ import annotations

import math

VLLM_VERSION = "0.26.0"

# Where the MLA draft's served config (mla_draft.served_config) records what vLLM does not read (the
# draft architecture, the deploy verifier, K for evaluation and serving); not "speculators_config":
# vLLM would then parse the file as the speculators format and refuse its deepseek_v3 layer. Here,
# free of imports, for the stages that only read an export (the serving benchmark).
EXPORT_KEY = "eaglepipe"

# vllm/transformers_utils/configs/speculators/algos.py (update_eagle3): the draft architectures it maps.
DRAFT_ARCHS = ("llama", "qwen3")
# The same function reads these norm flags (with vLLM's own defaults, so an export writes them all).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

# vllm/model_executor/models/llama_eagle3.py (LlamaModel.__init__): fc takes target_hidden_size *
# num_aux_hidden_states inputs, the count read from `num_aux_hidden_states` or `eagle_config`, else 3.
# A speculators-format config sets neither (speculators/base.py + algos.py copy only
# eagle_aux_hidden_state_layer_ids), so the served fc takes 3 aux states, while the target returns one
# per listed id (v1/worker/gpu_model_runner.py) and speculators trains fc with one per id.
AUX_STATES = 3

# vllm/model_executor/layers/rotary_embedding/__init__.py (get_rope) computes these as transformers
# 5.19's modeling_rope_utils does; yarn only when its attention factor agrees (yarn_attention_factors).
SAME_ROPE_TYPES = ("default", "linear", "llama3")
ALLOWED_ROPE = "rope_type default, linear, llama3, or yarn without mscale, mscale_all_dim, attention_factor and attn_factor"


# vllm/model_executor/models/registry.py (_TEXT_GENERATION_MODELS, _MULTIMODAL_MODELS) with each class's
# bases: the architectures whose vLLM class implements SupportsEagle3 (models/interfaces.py:
# set_aux_hidden_state_layers). v1/worker/gpu_model_runner.py (_setup_eagle3_aux_hidden_state_outputs)
# raises "Model does not support EAGLE3 interface" at engine start for any other, both when extracting
# hidden states (extract_hidden_states) and when serving an EAGLE-3 draft. tests/test_serving_limits.py
# derives this set from the wheel.
EAGLE3_TARGETS = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "Cosmos3ForConditionalGeneration",
    "CwmForCausalLM", "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM", "Ernie4_5ForCausalLM", "Exaone4_5_ForConditionalGeneration",
    "Fairseq2LlamaForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "GlmForCausalLM", "GlmMoeDsaForCausalLM", "GptOssForCausalLM",
    "GritLM", "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "HunYuanVLForConditionalGeneration",
    "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "KimiK25ForConditionalGeneration", "LLaMAForCausalLM",
    "LagunaForCausalLM", "LightOnOCRForConditionalGeneration", "Llama4ForConditionalGeneration",
    "LlamaForCausalLM", "LlavaForConditionalGeneration", "MiMoForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM", "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM",
    "MistralLarge3ForCausalLM", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "Phi3ForCausalLM",
    "PixtralForConditionalGeneration", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration",
    "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
})

# v1/attention/backends/mla/prefill/flash_attn.py (FlashAttnPrefillBackend.supports_mla_dimensions): the
# (qk_nope, qk_rope, v) head dims of MLA prefill. It is the only MLA prefill backend vLLM has on Hopper
# and older (prefill/selector.py), and the first it tries on Blackwell; other dims fail at engine start
# with "No valid MLA prefill backend" (seen on an H100 with 32/16/32).
MLA_PREFILL_DIMS = ((128, 64, 128), (192, 64, 256), (64, 64, 128))


def eagle3_target_error(architectures: list[str] | None) -> str | None:
    """Why vLLM cannot capture the aux states of (so cannot extract for, nor serve an EAGLE-3 draft
    on) a target of these config.json architectures, or None (None too when the config names none)."""
    if not architectures or set(architectures) & EAGLE3_TARGETS:
        return None
    return (f"architectures {list(architectures)}: vLLM {VLLM_VERSION}'s class for it does not implement "
            f"EAGLE-3 aux hidden states (SupportsEagle3), or it is not a vLLM architecture; allowed: "
            f"{', '.join(sorted(EAGLE3_TARGETS))}")


def mla_dims_error(cfg: dict) -> str | None:
    """Why vLLM has no MLA prefill kernel for a target's (or MLA draft's) head dims, or None."""
    if not is_mla_target(cfg):
        return None
    dims = tuple(cfg.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if dims in MLA_PREFILL_DIMS:
        return None
    allowed = ", ".join(str(d) for d in MLA_PREFILL_DIMS)
    return (f"MLA head dims (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) = {dims}: vLLM {VLLM_VERSION}'s "
            f"FlashAttention MLA prefill (its only one on Hopper) has kernels for {allowed} only")


# The MLA draft has one decoder layer: the draft whose serving benchmarks/gpu_check_mla_draft.sh checked
# against our replay. vllm/model_executor/models/deepseek_eagle3.py (DeepseekV2Eagle3Model) would build
# num_hidden_layers dense layers (layer 0 reading 2 x hidden), but a deeper MLA draft has never been
# served here, and a second Llama layer gained 0.2 % AL (benchmarks/README.md): not built.
MLA_DRAFT_LAYERS = 1


def is_mla_target(cfg) -> bool:
    """MLA targets (DeepseekV2/V3, Kimi) compress K/V through a latent of rank kv_lora_rank; ``cfg`` a
    transformers config or its config.json as a dict."""
    value = cfg.get("kv_lora_rank") if isinstance(cfg, dict) else getattr(cfg, "kv_lora_rank", None)
    return value is not None


# draft.architecture: the decoder layer the draft trains and vLLM serves.
ARCHITECTURES = ("auto", "llama", "mla")


def resolve_architecture(architecture: str, target_config) -> str:
    """``auto`` -> ``mla`` for MLA targets (DeepseekV3 / Kimi), ``llama`` otherwise."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"draft architecture {architecture!r}: allowed {list(ARCHITECTURES)}")
    if architecture == "auto":
        return "mla" if is_mla_target(target_config) else "llama"
    if architecture == "mla" and not is_mla_target(target_config):
        raise ValueError("draft architecture 'mla' needs an MLA target (kv_lora_rank in its config); "
                         "use 'llama' or 'auto'")
    return architecture


def mla_layers_error(num_layers: int) -> str | None:
    """Why an MLA draft of ``num_layers`` decoder layers is not built, or None."""
    if num_layers == MLA_DRAFT_LAYERS:
        return None
    return (f"the MLA draft has {MLA_DRAFT_LAYERS} decoder layer (the one checked against vLLM {VLLM_VERSION}'s "
            f"Eagle3DeepseekV2ForCausalLM), not {num_layers}; use draft.layers {MLA_DRAFT_LAYERS} or "
            f"draft.architecture llama")


def aux_count_error(aux_layer_ids: list[int]) -> str | None:
    """Why vLLM would not load a draft with these aux ids, or None."""
    if len(aux_layer_ids) == AUX_STATES:
        return None
    return (f"{len(aux_layer_ids)} aux layer ids {list(aux_layer_ids)}, but vLLM {VLLM_VERSION}'s EAGLE-3 draft "
            f"reads exactly {AUX_STATES} aux states (its fc is sized for {AUX_STATES})")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factors(rope: dict) -> tuple[float, float]:
    """(trained, served) cos/sin scale of a yarn rope.

    Trained: transformers 5.19 modeling_rope_utils._compute_yarn_parameters (attention_factor, else
    mscale/mscale_all_dim ratio, else 0.1 ln(factor) + 1). Served: vLLM 0.26.0
    rotary_embedding/yarn_scaling_rope.py (0.1 ln(factor) + 1, times attn_factor; mscale,
    mscale_all_dim and attention_factor are not read on this path).
    """
    factor = rope["factor"]
    trained = rope.get("attention_factor")
    if trained is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            trained = _mscale(factor, rope["mscale"]) / _mscale(factor, rope["mscale_all_dim"])
        else:
            trained = _mscale(factor)
    attn = rope.get("attn_factor", 1.0)
    served = _mscale(factor) * attn if rope.get("apply_yarn_scaling", True) else attn
    return float(trained), float(served)


def rope_error(rope: dict | None) -> str | None:
    """Why vLLM would serve the draft's rope differently from how transformers trained it, or None."""
    rope = rope or {}
    kind = rope.get("rope_type", "default")
    if kind in SAME_ROPE_TYPES:
        return None
    if kind != "yarn":
        return f"rope_type {kind!r} is not served by vLLM {VLLM_VERSION} as transformers trains it; allowed: {ALLOWED_ROPE}"
    if rope.get("factor") is None:
        return f"yarn without a factor (vLLM {VLLM_VERSION} needs it); allowed: {ALLOWED_ROPE}"
    trained, served = yarn_attention_factors(rope)
    if not math.isclose(trained, served, rel_tol=1e-6):
        return (f"yarn attention factor {trained:.4g} in training (transformers) but {served:.4g} when served "
                f"(vLLM {VLLM_VERSION} ignores mscale, mscale_all_dim and attention_factor); allowed: {ALLOWED_ROPE}")
    return None


def servable_rope(rope: dict | None) -> dict | None:
    """The draft's rope: the target's, less the DeepSeek-style yarn attention-factor keys vLLM does not read.

    The draft is trained from scratch, so its rope need not be the target's; plain yarn (attention
    factor 0.1 ln(factor) + 1) is what both transformers and vLLM compute alike.
    """
    if not rope or rope.get("rope_type") != "yarn":
        return rope
    return {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim", "attention_factor", "attn_factor")}
