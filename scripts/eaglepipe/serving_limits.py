"""What the pinned vLLM (0.26.0) serves of an EAGLE-3 draft the way it was trained, read from its wheel.

Each rule cites the file of the vllm==0.26.0 wheel it rests on. Used by the Snakefile's config check
(parse time: kept free of heavy imports), by the draft's construction and by the export.
"""

from __future__ import annotations

import math

VLLM_VERSION = "0.26.0"

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
