#!/usr/bin/env python3
"""Random-weight bf16 targets and random tokenized data for the GPU checks and benchmarks.

  python benchmarks/make_random_target.py --arch llama|llama1b|dsv3 --out DIR
  python benchmarks/make_random_target.py --data-out DIR --n 256 --len 1024 [--n-eval 8] [--vocab 32000]
      (--len A-B draws each sample's length uniformly from A..B)

The architectures are those vLLM 0.26.0's extraction was verified on (benchmarks/README.md): llama =
8 layers, hidden 1024; llama1b = 16 layers, hidden 2048 (~1.1B); dsv3 = DeepseekV3 in small (MLA
+ MoE, 4 layers, hidden 1024) with the routing keys of the real DeepSeek-V3 / Kimi-K2.5 config.
Both modes can be given in one call. The data are {id, input_ids, loss_mask} JSONL (train.jsonl,
eval.jsonl) as prepare_data writes them.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny  # noqa: E402  (make_tokenized: the one writer of random tokenized JSONL)

VOCAB = 32000


def config(arch: str):
    from transformers import DeepseekV3Config, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                           tie_word_embeddings=False)
    if arch == "llama1b":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                           tie_word_embeddings=False)
    if arch == "dsv3":
        return DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=1,
            n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=512, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
            tie_word_embeddings=False,
            # vLLM reads these; without them it routes by softmax without the correction bias
            scoring_func="sigmoid", topk_method="noaux_tc")
    raise SystemExit(f"--arch {arch}: allowed llama, llama1b, dsv3")


def make_model(arch: str, out: str, device: str, seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    t = time.time()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(arch), dtype=torch.bfloat16)
    model.save_pretrained(out)
    # a loadable tokenizer (byte-level BPE on a small corpus: it names only the first ids of the
    # vocabulary), since training and vLLM load one; the data are token ids, never text
    tiny.make_tokenizer(out, vocab_size=VOCAB)
    n = sum(p.numel() for p in model.parameters())
    print(f"made {arch}: {n / 1e6:.1f}M params -> {out} in {time.time() - t:.1f}s", flush=True)


def lengths(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["llama", "llama1b", "dsv3"])
    ap.add_argument("--out", help="model directory to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to initialise the weights (faster on cuda)")
    ap.add_argument("--data-out", help="directory for train.jsonl and eval.jsonl")
    ap.add_argument("--n", type=int, default=256, help="train samples")
    ap.add_argument("--n-eval", type=int, default=8)
    ap.add_argument("--len", default="1024", help="tokens per sample, or a range A-B")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not (args.arch and args.out) and not args.data_out:
        ap.error("give --arch and --out, or --data-out, or both")
    if args.arch and args.out:
        make_model(args.arch, args.out, args.device, args.seed)
    if args.data_out:
        d = Path(args.data_out)
        d.mkdir(parents=True, exist_ok=True)
        lens = lengths(args.len)
        tiny.make_tokenized(d / "train.jsonl", args.n, args.vocab, lens, seed=args.seed + 1, prefix="t")
        tiny.make_tokenized(d / "eval.jsonl", args.n_eval, args.vocab, lens, seed=args.seed + 2, prefix="e")
        print(f"wrote {args.n} + {args.n_eval} samples of {args.len} tokens to {d}", flush=True)


if __name__ == "__main__":
    main()
