#!/usr/bin/env python3
"""Data helpers of benchmarks/gpu_check_mla_draft.sh (issue 21), for random tokenized data
(make_random_target.py --data-out), which has no chat template and no token counts.

  python benchmarks/mla_draft_check.py token-freq --data train.jsonl --target-vocab V --out token_freq.safetensors
      the token counts of the data, as prepare_data writes them, for the vocab_mapping stage
  python benchmarks/mla_draft_check.py prompts --data eval.jsonl --prompt-len 32 --out prompts.jsonl
      the same samples with their first --prompt-len tokens as the prompt (loss mask 0, then 1):
      benchmark_serving prompts with what precedes the first loss-masked token
"""

from __future__ import annotations

import argparse
import json

import torch


def token_freq(args) -> None:
    from safetensors.torch import save_file

    freq = torch.zeros(args.target_vocab, dtype=torch.int64)
    with open(args.data) as f:
        for line in f:
            freq += torch.bincount(torch.tensor(json.loads(line)["input_ids"]), minlength=args.target_vocab)
    save_file({"token_freq": freq}, args.out)
    print(f"token counts: {int(freq.sum())} tokens, {int((freq > 0).sum())} distinct", flush=True)


def prompts(args) -> None:
    kept = 0
    with open(args.data) as f, open(args.out, "w") as out:
        for line in f:
            rec = json.loads(line)
            n = len(rec["input_ids"])
            if n > args.prompt_len:
                rec["loss_mask"] = [0] * args.prompt_len + [1] * (n - args.prompt_len)
                out.write(json.dumps(rec) + "\n")
                kept += 1
    print(f"{kept} prompts of {args.prompt_len} tokens", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("token-freq")
    v.add_argument("--data", required=True)
    v.add_argument("--target-vocab", type=int, required=True)
    v.add_argument("--out", required=True)
    s = sub.add_parser("prompts")
    s.add_argument("--data", required=True)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--out", required=True)
    args = p.parse_args(argv)
    {"token-freq": token_freq, "prompts": prompts}[args.cmd](args)


if __name__ == "__main__":
    main()
