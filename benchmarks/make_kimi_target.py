#!/usr/bin/env python3
"""A random-weight, seeded stand-in for Kimi-K2.5 at its real widths, for the one-GPU rehearsal.

  python benchmarks/make_kimi_target.py --out DIR [--layers 4] [--routed-experts 16] [--seed 0]
                                        [--device cuda] [--hidden H --vocab V]  (smaller: CPU checks)

The config is Kimi-K2.5's text config (KIMI_K25 below: moonshotai/Kimi-K2.5's config.json,
text_config) as a DeepseekV3ForCausalLM: hidden 7,168, vocabulary 163,840, 64 heads of MLA
(q_lora 1,536, kv_lora 512, qk_nope 128, qk_rope 64, v 128), dense FFN 18,432, experts of 2,048,
one shared expert, first_k_dense_replace 1, sigmoid scoring with the noaux_tc correction bias,
DeepSeek yarn (factor 64). Only the depth (61) and the routed experts (384, top-8) are cut so
that it fits one GPU; the top-k stays 8 unless fewer experts are asked for. --hidden and --vocab
exist for the CPU dry run of the rehearsal config and are refused with --device cuda, so that a
GPU figure is always at the real widths.

The tokenizer stand-in is a byte-level BPE (tests/tiny.py) with Kimi's special tokens and chat
template, padded with never-produced filler entries to exactly the model's vocabulary, so every
id the random model samples decodes (the real tokenizer is tiktoken-based, 163,840 entries).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402  (make_tokenizer and Kimi's template family)

# moonshotai/Kimi-K2.5 config.json, text_config (model_type kimi_k2, served by vLLM's DeepseekV3 code)
KIMI_K25 = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
    n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
    moe_layer_freq=1, routed_scaling_factor=2.827, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=262144, rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    attention_bias=False, tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585,
    pad_token_id=163839, scoring_func="sigmoid", topk_method="noaux_tc", aux_loss_alpha=0.001, seq_aux=True,
    num_nextn_predict_layers=0,
)
EOS = "<|im_end|>"


def kimi_config(layers: int, routed_experts: int, hidden: int | None = None, vocab: int | None = None) -> dict:
    cfg = dict(KIMI_K25, num_hidden_layers=layers, n_routed_experts=routed_experts,
               num_experts_per_tok=min(KIMI_K25["num_experts_per_tok"], routed_experts))
    if hidden:  # CPU checks only: the heads keep their real dims, the projections shrink
        cfg.update(hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 4,
                   q_lora_rank=hidden // 4)
    if vocab:
        cfg.update(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return cfg


def write_tokenizer(out: Path, vocab_size: int) -> dict:
    """Kimi's template and special tokens on a byte-level BPE padded to exactly vocab_size entries;
    returns the ids the config should name (eos, pad)."""
    tiny.make_tokenizer(out, vocab_size=1000, eos=EOS, **tiny.FAMILIES["kimi-k2.5"])
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok["added_tokens"]}
    # fillers no merge produces (BPE only emits merged symbols): they decode, they are never encoded
    free = (i for i in range(vocab_size) if i not in taken)
    for i in free:
        vocab[f"<|filler_{i}|>"] = i
    path.write_text(json.dumps(tok, ensure_ascii=False))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    return {"eos_token_id": ids[EOS], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None}


def make(out: Path, layers: int, routed_experts: int, seed: int, device: str, hidden: int | None,
         vocab: int | None) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    cfg = kimi_config(layers, routed_experts, hidden, vocab)
    cfg.update(write_tokenizer(out, cfg["vocab_size"]))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**cfg), dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    # transformers rewrites rope_scaling as rope_parameters; vLLM and the pipeline read either, and the
    # keys transformers' DeepseekV3Config does not know (scoring_func, topk_method, ...) must be there
    written = json.loads((out / "config.json").read_text())
    missing = {k: v for k, v in cfg.items() if k not in written and k != "rope_scaling"}
    (out / "config.json").write_text(json.dumps({**written, **missing}, indent=1) + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "params": params, "bytes": sum(f.stat().st_size for f in out.iterdir()),
                      "seconds": round(time.perf_counter() - t0, 1), "device": device,
                      **{k: cfg[k] for k in ("hidden_size", "vocab_size", "num_hidden_layers", "n_routed_experts",
                                             "num_experts_per_tok", "intermediate_size", "moe_intermediate_size")}}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Kimi-K2.5: 61)")
    ap.add_argument("--routed-experts", type=int, default=16, help="routed experts per MoE layer (Kimi-K2.5: 384)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the weights are initialised (cuda: seconds; cpu: only with --hidden)")
    ap.add_argument("--hidden", type=int, help="CPU checks only: a narrower hidden size")
    ap.add_argument("--vocab", type=int, help="CPU checks only: a smaller vocabulary")
    args = ap.parse_args()
    if args.device == "cuda" and (args.hidden or args.vocab):
        ap.error("--hidden/--vocab are for CPU checks; a GPU target keeps Kimi-K2.5's widths")
    if args.layers < 2:
        ap.error("--layers must be >= 2 (layer 0 is dense, first_k_dense_replace 1)")
    make(args.out, args.layers, args.routed_experts, args.seed, args.device, args.hidden, args.vocab)


if __name__ == "__main__":
    main()
