"""The EAGLE-3 draft: speculators' ``Eagle3DraftModel`` built for a target, and loaded back for evaluation.

Heavy imports (speculators takes ~17 s to import) happen inside the functions, so CLIs that only
parse flags or validate inputs stay quick.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from . import mla_draft
from .serving_limits import is_mla_target, resolve_architecture, servable_rope

log = logging.getLogger("eaglepipe.draft_model")

# The one place the norm flags are chosen. vLLM 0.26.0 honours all four (algos.py update_eagle3 and
# llama_eagle3.py, read from its wheel), so speculators 0.9.0's eagle3 defaults train what vLLM serves.
NORM_FLAGS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}

# The loss implementation every stage passes to speculators' resolve_loss_config. speculators'
# fused (triton) losses need CUDA, and on the H200 (torch 2.11) torch.compile's trace of the
# training forward failed on them ("ListVariable ... already tracked" on the kernels' autotune
# configs); the eager losses run everywhere and are compiled with the forward on GPUs.
LOSS_IMPLEMENTATION = "eager"


def attn_impl_for(device: torch.device | str, layer_model_type: str | None = None) -> str:
    """sdpa on CPU (flex attention has no CPU backward) and for MLA layers; speculators' compiled
    flex attention for other layers on CUDA. MLA's 192-wide query/key heads make the flex kernel
    torch 2.11 compiles ask 361,472 B of shared memory per block, over the H200's 232,448 (measured
    2026-12-03), and speculators 0.9.0's simple_flex_attention passes no kernel_options to shrink it."""
    if torch.device(device).type != "cuda" or layer_model_type == mla_draft.MODEL_TYPE:
        return "sdpa"
    return "simple_flex_attention"


def row_length(device: torch.device | str, batch_tokens: int) -> int | None:
    """The padded length of every row, or None (any length). Flex attention (GPU) builds its block
    mask for whole 128-token blocks, and its compiled forward wants one shape: rows are padded to
    batch_tokens rounded up to 128, as speculators' collate pads to total_seq_len."""
    if attn_impl_for(device) != "simple_flex_attention":
        return None
    return -(-batch_tokens // 128) * 128


def training_row_options(device: torch.device, batch_tokens: int) -> dict:
    """How training rows are made for ``device`` (PackedRows keyword arguments).

    GPUs: bf16 rows in page-locked memory. The step runs under bf16 autocast, which casts the states
    to bf16 at their first matmul anyway, and extraction stores them in the target's dtype (bf16 for
    every preset), so nothing is lost; packing and copying half the bytes matters at scale (an
    8,192-token row of Kimi-K2.5's 4 x 7,168 states is 940 MB in fp32). speculators' Trainer loads
    its states in bf16 too. CPU: fp32, no autocast (resume is tested bit for bit there)."""
    on_gpu = device.type == "cuda"
    return {"dtype": torch.bfloat16 if on_gpu else torch.float32, "pin_memory": on_gpu,
            "pad_to": row_length(device, batch_tokens)}


def target_text_config(target: str | Path, trust_remote_code: bool = False):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(target), trust_remote_code=trust_remote_code).get_text_config()


def draft_layer_config(target: str | Path, trust_remote_code: bool = False, mlp_width: int | None = None,
                       num_layers: int = 1):
    """Llama decoder config of the draft's ``num_layers`` layers, full attention (no sliding window).

    The first layer takes the token embedding beside the fused states (2 x hidden), the others are
    plain Llama layers: speculators' Eagle3DraftModel and vLLM 0.26.0's Eagle3LlamaForCausalLM
    (llama_eagle3.py, qkv_input_size by layer_idx) build the same stack.

    Speculators derives it from the target. For MLA targets (DeepseekV3 / Kimi) its head_dim
    aliases qk_rope_head_dim (64, a rope detail, not a head width), so we set head_dim =
    hidden / heads and KV heads = heads (a plain multi-head layer of the target's width, as
    SpecForge's Kimi-K2.5 recipe: 64 x 112, 64 KV heads) and keep the dense FFN width (18432
    for Kimi, also SpecForge's choice).
    """
    from speculators.train.cli import create_transformer_layer_config

    cfg = create_transformer_layer_config(
        str(target), num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=None, full_attention_indices=list(range(num_layers)),
        trust_remote_code=trust_remote_code,
    )
    tcfg = target_text_config(target, trust_remote_code)
    if is_mla_target(tcfg):
        if tcfg.hidden_size % tcfg.num_attention_heads:
            raise ValueError(f"target {target}: hidden_size {tcfg.hidden_size} is not divisible by "
                             f"num_attention_heads {tcfg.num_attention_heads}; give the draft shape explicitly")
        cfg.head_dim = tcfg.hidden_size // tcfg.num_attention_heads
        cfg.num_key_value_heads = tcfg.num_attention_heads
        cfg.intermediate_size = tcfg.intermediate_size
    if mlp_width:
        cfg.intermediate_size = mlp_width
    # Kimi's DeepSeek-style yarn (mscale, mscale_all_dim) trains at attention factor 1.0 but vLLM's
    # Llama yarn serves 1.42: the draft takes plain yarn, which both compute alike (serving_limits.py).
    cfg.rope_parameters = servable_rope(cfg.rope_parameters)
    cfg.sliding_window = None
    cfg.use_sliding_window = False
    cfg.layer_types = ["full_attention"] * num_layers
    return cfg


def load_vocab_mapping(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [V_draft], t2d bool [V_target]) from vocab_mapping.safetensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            missing = {"d2t", "t2d"} - keys
            if missing:
                raise SystemExit(f"vocab mapping {path}: missing tensor(s) {sorted(missing)} (has {sorted(keys)})")
            d2t, t2d = f.get_tensor("d2t").long(), f.get_tensor("t2d").bool()
    except OSError as e:
        raise SystemExit(f"vocab mapping {path}: cannot be read ({e})") from e
    if int(t2d.sum()) != d2t.numel():
        raise SystemExit(f"vocab mapping {path}: t2d selects {int(t2d.sum())} tokens but d2t has "
                         f"{d2t.numel()} entries; they must agree")
    return d2t, t2d


def build_draft(target: str | Path, aux_layer_ids: list[int], vocab_mapping: str | Path, ttt_steps: int,
                device: torch.device | str = "cpu", trust_remote_code: bool = False, architecture: str = "auto",
                mlp_width: int | None = None, num_layers: int = 1):
    """A fresh draft for ``target``: aux ids from the manifest, draft vocab from the mapping.

    ``architecture`` (auto/llama/mla, see resolve_architecture) picks the decoder layer;
    ``mlp_width`` its dense MLP width (None: the target's intermediate_size); ``num_layers`` how many
    decoder layers (Llama only: mla_draft.layer_config refuses more).
    Embeddings, the draft lm_head (target lm_head rows of t2d) and the verifier's final norm are
    loaded from the target's safetensors by speculators (frozen); fc and the decoder layers train.
    """
    d2t, t2d = load_vocab_mapping(vocab_mapping)
    tcfg = target_text_config(target, trust_remote_code)
    try:
        resolved = resolve_architecture(architecture, tcfg)
        if resolved == "mla":
            layer_cfg, norm_flags = mla_draft.layer_config(tcfg, mlp_width, num_layers), mla_draft.NORM_FLAGS
        else:
            layer_cfg, norm_flags = draft_layer_config(target, trust_remote_code, mlp_width, num_layers), NORM_FLAGS
    except ValueError as e:
        raise SystemExit(f"target {target}: {e}") from e
    log.info("draft architecture %s (%s requested): %d x %s decoder layer, MLP width %d", resolved, architecture,
             layer_cfg.num_hidden_layers, layer_cfg.model_type, layer_cfg.intermediate_size)
    if t2d.numel() != layer_cfg.vocab_size:
        raise SystemExit(f"vocab mapping {vocab_mapping}: t2d covers {t2d.numel()} tokens but target "
                         f"{target} has vocab_size {layer_cfg.vocab_size}")
    return _new_draft(layer_cfg, norm_flags, target, aux_layer_ids, d2t, t2d, ttt_steps, device, trust_remote_code)


def _new_draft(layer_cfg, norm_flags: dict, target, aux_layer_ids, d2t, t2d, ttt_steps: int, device,
               trust_remote_code: bool):
    from speculators.models.eagle3 import Eagle3DraftModel

    mla_draft.register_with_speculators()
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target), target_layer_ids=list(aux_layer_ids),
        draft_vocab_size=int(d2t.numel()), ttt_steps=ttt_steps, draft_attn_impl=attn_impl_for(device, layer_cfg.model_type),
        trust_remote_code=trust_remote_code, **norm_flags,
    )
    return model.to(device)


def load_draft(draft_dir: str | Path, target: str | Path, device: torch.device | str = "cpu"):
    """Load a saved or exported draft in float32 for evaluation.

    The exported config names the deploy-time verifier (a hub id this machine may not have), so
    the verifier path is pointed at the local target; an absent ``embed_tokens.weight`` (dropped
    at export, vLLM shares the target's) is taken from the target.
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    draft_dir = Path(draft_dir)
    for name in ("config.json", "model.safetensors"):
        if not (draft_dir / name).is_file():
            raise SystemExit(f"draft {draft_dir}: {name} is missing")
    mla_draft.register_with_speculators()
    served = json.loads((draft_dir / "config.json").read_text())
    if mla_draft.is_served_config(served):
        return _load_served_mla(draft_dir, served, target, device)
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    config.speculators_config.verifier.name_or_path = str(target)
    config.transformer_layer_config._attn_implementation = attn_impl_for(device)  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config, dtype=torch.float32)
    with safe_open(str(draft_dir / "model.safetensors"), framework="pt") as f:
        has_embedding = "embed_tokens.weight" in f.keys()
    if not has_embedding:
        load_target_embedding(model, target)
    return model.to(device).eval()


def load_target_embedding(model, target: str | Path) -> None:
    """Fill a speculators draft loaded from a file without ``embed_tokens.weight`` (an export
    may drop it: vLLM shares the target's) with the target's. speculators refills only a NaN
    embedding, but transformers 5 leaves a missing weight uninitialised (not NaN)."""
    from speculators.utils.loading import load_model_layers

    embed = load_model_layers(["embed_tokens.weight"], str(target))["embed_tokens.weight"]
    model.embed_tokens.load_state_dict({"weight": embed})


def _load_served_mla(draft_dir: Path, served: dict, target: str | Path, device) -> torch.nn.Module:
    """An exported MLA draft (vLLM's format, not speculators'): rebuilt as speculators' model for
    ``target`` (embedding, heads and norm from the target), then the exported tensors loaded."""
    weights = {k: v.float() if v.is_floating_point() else v
               for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    if "d2t" not in weights or "t2d" not in weights:
        raise SystemExit(f"draft {draft_dir}: model.safetensors lacks d2t/t2d")
    flags = {k: served[k] for k in mla_draft.NORM_FLAGS}
    model = _new_draft(mla_draft.served_layer_config(served), flags, target,
                       served["eagle_aux_hidden_state_layer_ids"], weights["d2t"], weights["t2d"].bool(),
                       served[mla_draft.EXPORT_KEY]["num_speculative_tokens"], device, trust_remote_code=False)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    from_target = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if unexpected or set(missing) - from_target:
        raise SystemExit(f"draft {draft_dir}: tensors missing {sorted(set(missing) - from_target)}, "
                         f"unexpected {sorted(unexpected)}")
    return model.float().eval()


def load_target_head(target: str | Path) -> torch.Tensor:
    """The target's full-vocabulary lm_head weight [V, H] (tied models: the embedding)."""
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["embed_tokens.weight", "lm_head.weight"], str(target))
    return w.get("lm_head.weight", w["embed_tokens.weight"]).float()
