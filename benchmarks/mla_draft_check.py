#!/usr/bin/env python3
"""Helpers of benchmarks/gpu_check_mla_draft.sh (issue 21: the MLA draft served by vLLM 0.26.0).

  python benchmarks/mla_draft_check.py vocab --data train.jsonl --target-vocab V --draft-vocab N --out vm.safetensors
      draft vocab mapping from the token counts of tokenized JSONL (eaglepipe.vocab_mapping.build)
  python benchmarks/mla_draft_check.py serve --target DIR --draft DIR --data eval.jsonl --k 3 \
        --prompt-len 32 --max-tokens 128 --json serve.json --generated generated.jsonl
      vLLM with the exported draft: logs the architecture vLLM resolved for it and the draft model
      class, greedy-generates, reports vLLM's per-position acceptance (eaglepipe.benchmark_serving's
      counters) and writes prompt + completion as tokenized JSONL (completion loss-masked), so our
      offline estimator can replay exactly the tokens vLLM served.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def vocab(args) -> None:
    from safetensors.torch import save_file

    from eaglepipe.vocab_mapping import build

    freq = torch.zeros(args.target_vocab, dtype=torch.int64)
    with open(args.data) as f:
        for line in f:
            freq += torch.bincount(torch.tensor(json.loads(line)["input_ids"]), minlength=args.target_vocab)
    d2t, t2d, info = build(freq, args.draft_vocab)
    save_file({"d2t": d2t, "t2d": t2d}, args.out)
    print(f"vocab mapping: {info}", flush=True)


def serve(args) -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not staged (shared/device/README.md)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eaglepipe.benchmark_serving import acceptance, spec_counters

    with open(args.data) as f:
        prompts = [json.loads(line)["input_ids"][: args.prompt_len] for line in f if line.strip()]
    llm = LLM(model=args.target, tensor_parallel_size=1, enforce_eager=args.enforce_eager, disable_log_stats=False,
              max_model_len=args.prompt_len + args.max_tokens + 64, seed=0,
              speculative_config={"model": args.draft, "method": "eagle3", "num_speculative_tokens": args.k})
    spec = llm.llm_engine.vllm_config.speculative_config
    draft_cfg = spec.draft_model_config
    resolved = {"method": spec.method, "draft_architectures": list(draft_cfg.architectures),
                "draft_hf_config": type(draft_cfg.hf_config).__name__,
                "draft_model_type": getattr(draft_cfg.hf_config, "model_type", None),
                "draft_use_mla": bool(getattr(draft_cfg, "use_mla", False))}
    print(f"vLLM resolved the draft as {json.dumps(resolved)}", flush=True)
    before = spec_counters(llm.get_metrics())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    result = {"resolved": resolved, "prompts": len(prompts), "k": args.k,
              **acceptance(before, spec_counters(llm.get_metrics()))}
    with open(args.generated, "w") as f:
        for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
            done = list(out.outputs[0].token_ids)
            f.write(json.dumps({"id": f"g{i}", "input_ids": p + done,
                                "loss_mask": [0] * len(p) + [1] * len(done)}) + "\n")
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"vLLM acceptance length {result['acceptance_length']}, per position {result['per_position_acceptance']}",
          flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vocab")
    v.add_argument("--data", required=True)
    v.add_argument("--target-vocab", type=int, required=True)
    v.add_argument("--draft-vocab", type=int, required=True)
    v.add_argument("--out", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--target", required=True)
    s.add_argument("--draft", required=True)
    s.add_argument("--data", required=True, help="tokenized JSONL; the first --prompt-len tokens are the prompts")
    s.add_argument("--k", type=int, default=3)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--json", required=True)
    s.add_argument("--generated", required=True)
    args = p.parse_args(argv)
    {"vocab": vocab, "serve": serve}[args.cmd](args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
