"""Serving benchmark on a GPU: vLLM with the exported EAGLE-3 draft against the target alone.

Prompts are held-out conversations cut before their first assistant token (the chat template's
generation header included), so both runs continue real chat-templated prompts. Each run is a fresh
vLLM offline ``LLM`` in its own spawned process (GPU memory is fully released between them),
greedy, ``--max-tokens`` per prompt. Acceptance comes from vLLM's own spec-decode counters
(``LLM.get_metrics()``), counted as vLLM does: AL = 1 + accepted / drafts (bonus token counted).

    python -m eaglepipe.benchmark_serving --model TARGET --draft results/run/draft \
        --prompts results/run/data/eval.jsonl --num-prompts 64 --max-tokens 256 --k 3 \
        --tensor-parallel-size 8 --out results/run/eval/serving.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from .atomic import write_json

# Verified on the H200 with vLLM 0.26.0 (shared/device/README.md): flashinfer is not installed
# there, and a parent that touched CUDA breaks forked workers.
ENV_DEFAULTS = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
WARMUP_PROMPTS = 4


def load_prompts(path: str | os.PathLike, num_prompts: int) -> tuple[list[list[int]], Counter]:
    """The first ``num_prompts`` usable prompts: input_ids before the first loss-masked token."""
    prompts, skipped = [], Counter()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if len(prompts) == num_prompts:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids, mask = rec["input_ids"], rec["loss_mask"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: expected a JSON object with input_ids and loss_mask ({e})") from None
            if len(ids) != len(mask):
                raise SystemExit(f"{path}:{n}: input_ids has {len(ids)} tokens, loss_mask {len(mask)}")
            first = next((i for i, m in enumerate(mask) if m), None)
            if first is None:
                skipped["no assistant token"] += 1
            elif first == 0:
                skipped["empty prompt"] += 1
            else:
                prompts.append([int(t) for t in ids[:first]])
    if not prompts:
        raise SystemExit(f"{path}: no usable prompt (skipped: {dict(skipped) or 'file is empty'})")
    return prompts, skipped


def spec_counters(metrics) -> dict:
    """Sum vLLM's spec-decode counters over engines; metrics are vllm.v1.metrics.reader objects."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per = out["accepted_per_pos"]
            per.extend([0.0] * (len(m.values) - len(per)))
            for i, v in enumerate(m.values):
                per[i] += v
    return out


def acceptance(before: dict, after: dict) -> dict:
    """Acceptance over the timed run only (counters are cumulative, the warm-up is subtracted)."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0.0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in per_pos] if drafts else [],
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "num_drafts": int(drafts), "num_draft_tokens": int(drafted), "num_accepted_tokens": int(accepted),
    }


def run_engine(args: dict, prompts: list[list[int]], speculative: bool, result_path: str) -> None:
    """One vLLM engine, one timed greedy generate; runs in a spawned child, result as JSON in a file."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams  # lazy: only this GPU stage needs vLLM

    t0 = time.perf_counter()
    llm = LLM(
        model=args["model"], tensor_parallel_size=args["tensor_parallel_size"],
        trust_remote_code=args["trust_remote_code"],
        max_model_len=max(map(len, prompts)) + args["max_tokens"] + args["k"] + 1,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        speculative_config={"model": args["draft"], "method": "eagle3", "num_speculative_tokens": args["k"]}
        if speculative else None,
    )
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:WARMUP_PROMPTS]],
                 SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False)
    before = spec_counters(llm.get_metrics())
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, tokens))
    result = {"load_s": round(load_s, 2), "seconds": round(seconds, 3), "output_tokens": n_out,
              "output_tokens_per_s": round(n_out / seconds, 1), "tokens": tokens}
    if speculative:
        result.update(acceptance(before, spec_counters(llm.get_metrics())))
    Path(result_path).write_text(json.dumps(result))


def run_isolated(args: dict, prompts: list[list[int]], speculative: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        proc = ctx.Process(target=run_engine, args=(args, prompts, speculative, path))
        proc.start()
        proc.join()
        label = "target + draft" if speculative else "target alone"
        if proc.exitcode != 0 or not os.path.exists(path):
            raise SystemExit(f"benchmark_serving: the vLLM run ({label}) failed with exit code {proc.exitcode}; "
                             f"its error is in the log above")
        return json.loads(Path(path).read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target: local dir or hub id")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--draft", required=True, help="exported draft dir (export_draft)")
    p.add_argument("--prompts", required=True, help="eval JSONL of {input_ids, loss_mask}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--k", type=int, required=True, help="num_speculative_tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    for flag in ("num_prompts", "max_tokens", "k", "tensor_parallel_size"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be at least 1")
    if not (Path(a.draft) / "config.json").is_file():
        raise SystemExit(f"--draft {a.draft}: no config.json (give the directory export_draft wrote)")
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)

    prompts, skipped = load_prompts(a.prompts, a.num_prompts)
    print(f"benchmark_serving: {len(prompts)} prompts ({sum(map(len, prompts)):,} tokens) from {a.prompts}; "
          f"skipped {dict(skipped) or 'none'}", flush=True)
    args = {"model": a.model, "draft": str(Path(a.draft).resolve()), "k": a.k, "max_tokens": a.max_tokens,
            "tensor_parallel_size": a.tensor_parallel_size, "trust_remote_code": a.trust_remote_code}
    base = run_isolated(args, prompts, speculative=False)
    print(f"benchmark_serving: target alone {base['output_tokens_per_s']:,} output tokens/s", flush=True)
    spec = run_isolated(args, prompts, speculative=True)
    print(f"benchmark_serving: target + draft {spec['output_tokens_per_s']:,} output tokens/s, "
          f"acceptance length {spec['acceptance_length']}", flush=True)

    # greedy speculative decoding is lossless up to numerics: a low share means the runs diverged
    same = sum(x == y for x, y in zip(base.pop("tokens"), spec.pop("tokens"))) / len(prompts)
    from importlib.metadata import version

    result = {
        "model": a.model, "draft": args["draft"], "k": a.k, "tensor_parallel_size": a.tensor_parallel_size,
        "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "skipped": dict(skipped),
        "max_tokens": a.max_tokens, "sampling": "greedy", "vllm_version": version("vllm"),
        "baseline": base, "speculative": spec,
        "speedup": round(spec["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
        "acceptance_length": spec["acceptance_length"],
        "per_position_acceptance": spec["per_position_acceptance"],
        "identical_outputs_fraction": round(same, 4),
        "convention": "acceptance_length = 1 + accepted / drafts (bonus token counted, vLLM spec-decode "
                      "counters); per_position_acceptance[i] = drafts whose token i was accepted / drafts",
    }
    write_json(a.out, result)
    print(json.dumps({k: result[k] for k in ("speedup", "acceptance_length", "per_position_acceptance",
                                             "identical_outputs_fraction")}))


if __name__ == "__main__":
    main()
