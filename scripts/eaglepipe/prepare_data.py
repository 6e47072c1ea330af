"""Stage prepare_data: raw chats -> tokenized train/eval JSONL, stats and token frequencies.

Each kept conversation becomes one line ``{"id", "input_ids", "loss_mask", "category"?}`` rendered with the
target's chat template (eaglepipe.chat_template), plus one line ``{"id": "ID#turnI", ...}`` for each
assistant turn the template renders differently in history (trained as its own sample). The split is
a hash of (seed, conversation id), so a conversation's samples share a split and stay in it when
--max-samples grows; with --eval-data (a fixed evaluation set, e.g. the target's answers to the
MT-Bench questions from rule regenerate_eval_prompts) that file is the eval split and every record
of --data trains (one reusing an eval sample's id is skipped as a duplicate). Every record read is either kept or a counted skip; every assistant turn and
token in the data is either trained or counted by the reason it is not (stats.json "assistant").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter, defaultdict
from itertools import chain, islice, repeat

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eaglepipe.atomic import atomic_path, write_json
from eaglepipe.chat_data import FORMS, Skip, iter_chats
from eaglepipe.chat_template import ChatTemplate, TemplateSkip, encode_chat, turn_text
from eaglepipe.tokenized_samples import Tokenized, as_encoded, iter_tokenized
from eaglepipe.model_dir import check_model_dir
from eaglepipe.settings import add_stage_arguments

EXAMPLES_PER_REASON = 5
HISTOGRAM_BINS = 20
UNTRAINED_WARNING_SHARE = 0.8  # warn when fewer assistant tokens than this share are trained


def in_eval(sample_id: str, seed: int, eval_fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}\x00{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < eval_fraction


def target_vocab_size(model: str, revision: str | None, trust_remote_code: bool) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    return config.get_text_config().vocab_size  # multimodal wrappers (Kimi-K2.5) keep it in text_config


class SplitStats:
    def __init__(self, max_length: int):
        self.samples = self.tokens = self.assistant_tokens = self.max_len = 0
        self.histogram = [0] * HISTOGRAM_BINS
        self.bin_width = -(-max_length // HISTOGRAM_BINS)

    def add(self, n_tokens: int, n_assistant: int):
        self.samples += 1
        self.tokens += n_tokens
        self.assistant_tokens += n_assistant
        self.max_len = max(self.max_len, n_tokens)
        self.histogram[min((n_tokens - 1) // self.bin_width, HISTOGRAM_BINS - 1)] += 1

    def as_dict(self) -> dict:
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "assistant_tokens": self.assistant_tokens,
            "assistant_share": self.assistant_tokens / self.tokens if self.tokens else 0.0,
            "mean_length": self.tokens / self.samples if self.samples else 0.0,
            "max_length": self.max_len,
            "length_histogram": self.histogram,
        }


class AssistantCounts:
    """Assistant turns and tokens in the data, trained (thinking / answer) and not trained by reason."""

    def __init__(self):
        self.turns_in_data = self.turns_trained = self.own_sample_turns = 0
        self.turns_by_reason, self.tokens_by_reason = Counter(), Counter()
        # trained tokens by chat_template.Part kind: "thinking" / "answer", or "regenerated" (the
        # target's token ids, where the two are not told apart)
        self.trained_by_kind = Counter()

    def not_trained(self, reason: str, turns: int, tokens: int):
        self.turns_by_reason[reason] += turns
        self.tokens_by_reason[reason] += tokens

    def as_dict(self) -> dict:
        trained = sum(self.trained_by_kind.values())
        in_data = trained + sum(self.tokens_by_reason.values())
        return {
            "turns_in_data": self.turns_in_data,
            "turns_trained": self.turns_trained,
            "turns_trained_as_own_sample": self.own_sample_turns,
            "turns_not_trained_by_reason": dict((+self.turns_by_reason).most_common()),  # + drops zero counts
            "tokens_in_data": in_data,
            "tokens_trained": trained,
            "tokens_trained_by_kind": dict(sorted(self.trained_by_kind.items())),
            "tokens_not_trained_by_reason": dict((+self.tokens_by_reason).most_common()),
            "trained_share": trained / in_data if in_data else 0.0,
        }


def prepare(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision,
                                              trust_remote_code=args.trust_remote_code)
    vocab = target_vocab_size(args.model, args.revision, args.trust_remote_code)
    template = ChatTemplate(tokenizer, args.chat_template, args.chat_template_kwargs)
    digest = template.digest()
    freq = torch.zeros(vocab, dtype=torch.int64)
    splits = {"train": SplitStats(args.max_length), "eval": SplitStats(args.max_length)}
    skipped, examples = Counter(), defaultdict(list)
    assistant = AssistantCounts()
    seen_ids: set[str] = set()
    read = kept = truncated = prompt_mismatches = 0

    def skip(source, reason, detail, messages=()):
        skipped[reason] += 1
        turns = [m for m in messages if m["role"] == "assistant"]
        assistant.not_trained(reason, len(turns), sum(template.count_tokens(turn_text(m)) for m in turns))
        if len(examples[reason]) < EXAMPLES_PER_REASON:
            examples[reason].append({"source": source, "detail": detail})
            print(f"skip ({reason}): {detail}", file=sys.stderr)

    def write(split, sample_id, ids, mask, category, prompt_set=None):
        category_field = {"category": category} if category else {}  # the data's (chat_data), for the strata
        # the fixed evaluation set a sample came from (regenerate_responses' prompt_set), for AL per set
        set_field = {"prompt_set": prompt_set} if prompt_set else {}
        files[split].write(json.dumps({"id": sample_id, "input_ids": ids, "loss_mask": mask, **category_field,
                                       **set_field}, separators=(",", ":")) + "\n")
        splits[split].add(len(ids), sum(mask))
        if split == "train":
            t = torch.tensor(ids)
            freq.index_add_(0, t[torch.tensor(mask, dtype=torch.bool)], torch.ones(sum(mask), dtype=torch.int64))

    out = args.out_dir
    with atomic_path(out / "train.jsonl") as train_tmp, atomic_path(out / "eval.jsonl") as eval_tmp, \
            open(train_tmp, "w") as train_f, open(eval_tmp, "w") as eval_f:
        files = {"train": train_f, "eval": eval_f}
        records = islice((iter_tokenized if args.pretokenized else iter_chats)(args.data), args.max_samples or None)
        # (record, its split): drawn by hash (None) unless --eval-data is the eval split; that set
        # is read first, so it stays the same whatever the data (a data record reusing one of its
        # ids is the counted duplicate)
        records = zip(records, repeat(None if args.eval_data is None else "train"))
        if args.eval_data is not None:
            records = chain(zip(iter_tokenized(args.eval_data), repeat("eval")), records)
        bar = tqdm(records, desc="conversations", unit="conv", mininterval=2.0)
        for item, fixed_split in bar:
            read += 1
            if isinstance(item, Skip):
                skip(*item)
                continue
            messages = () if isinstance(item, Tokenized) else item.messages  # a sample's turns are counted below
            assistant.turns_in_data += sum(m["role"] == "assistant" for m in messages)
            if item.id in seen_ids:
                skip(item.source, "duplicate_id", f"{item.source}: id {item.id!r} was already read", messages)
                continue
            if isinstance(item, Tokenized):
                # regenerate_responses' token-exact samples, validated by tokenized_samples: taken as
                # they are, never re-tokenized; split by their conversation, so its samples stay together
                seen_ids.add(item.id)
                enc, conversation = as_encoded(item), item.conversation
                assistant.turns_in_data += enc.turns
            elif not item.messages:
                skip(item.source, "empty_conversation", f"{item.source}: the conversation has no turns")
                continue
            elif not any(m["role"] == "assistant" for m in item.messages):
                skip(item.source, "no_assistant_turn", f"{item.source}: the conversation has no assistant turn")
                continue
            else:
                seen_ids.add(item.id)
                try:
                    enc = encode_chat(template, item.messages, item.tools, args.rerendered_turns)
                except TemplateSkip as e:
                    skip(item.source, e.reason, f"{item.source}: {e}", item.messages)
                    continue
                conversation = item.id
            prompt_mismatches += enc.prompt_mismatches
            assistant.turns_by_reason.update(enc.untrained_turns)
            assistant.tokens_by_reason.update(enc.untrained_tokens)
            split = fixed_split or ("eval" if in_eval(conversation, args.seed, args.eval_fraction) else "train")
            written = 0
            for sample in enc.samples:
                n = len(sample.input_ids)
                keep = n if n <= args.max_length else 0 if args.too_long == "drop" else args.max_length
                cut = "too_long" if keep == 0 else "truncated"
                kept_parts = [p for p in sample.token_parts[:keep] if p >= 0]
                assistant.tokens_by_reason[cut] += sum(p >= 0 for p in sample.token_parts[keep:])
                trained = {enc.parts[p].turn for p in kept_parts}
                assistant.turns_by_reason[cut] += len(set(sample.turns) - trained)
                if not kept_parts:
                    continue
                ids = sample.input_ids[:keep]
                if max(ids) >= vocab:
                    raise SystemExit(f"{item.source}: token id {max(ids)} is outside the model vocabulary "
                                     f"({vocab}) of {args.model}; tokenizer and model do not match")
                truncated += keep < n
                written += 1
                assistant.turns_trained += len(trained)
                assistant.own_sample_turns += 0 if sample.whole else len(trained)
                assistant.trained_by_kind.update(enc.parts[p].kind for p in kept_parts)
                # a turn of its own gets its own id; the split stays the conversation's (no shared prefix leaks)
                write(split, item.id if sample.whole else f"{item.id}#turn{sample.turns[0]}", ids,
                      sample.loss_mask[:keep], item.category, getattr(item, "prompt_set", None))
            if written:
                kept += 1
            elif args.too_long == "drop":
                skip(item.source, "too_long", f"{item.source}: every sample is longer than --max-length {args.max_length}")
            else:
                skip(item.source, "no_assistant_token_after_truncation",
                     f"{item.source}: no assistant token in the first {args.max_length} tokens")
        bar.close()
        reasons = ", ".join(f"{r}={n}" for r, n in skipped.most_common()) or "none"
        if kept == 0:
            raise SystemExit(f"{args.data}: no conversation kept out of {read} read (skipped: {reasons})")
        for name, s in splits.items():
            if s.samples == 0:
                source = args.eval_data if name == "eval" and args.eval_data else args.data
                hint = "" if args.eval_data else f", --eval-fraction {args.eval_fraction}); use more data or another --eval-fraction"
                raise SystemExit(f"{source}: the {name} split is empty ({kept} kept{hint or ')'}")

    counts = assistant.as_dict()
    stats = {
        "data": args.data,
        "eval_data": args.eval_data,
        "model": args.model,
        "revision": args.revision,
        "chat_template": args.chat_template,
        "chat_template_kwargs": args.chat_template_kwargs,
        "template_digest": digest,
        "vocab_size": vocab,
        "settings": {**{k: getattr(args, k) for k in ("max_samples", "max_length", "too_long", "eval_fraction", "seed",
                                                      "rerendered_turns")},
                     **({"eval_fraction": 0} if args.eval_data else {})},  # not used: every record trains
        "read": read,
        "kept": kept,
        "skipped": sum(skipped.values()),
        "skipped_by_reason": dict(skipped.most_common()),
        "truncated": truncated,
        "assistant": counts,
        "prompts_differing_from_tokenizer_template": prompt_mismatches,
        "histogram_bin_width": splits["train"].bin_width,
        "splits": {name: s.as_dict() for name, s in splits.items()},
        "skip_examples": dict(examples),
    }
    assert stats["read"] == stats["kept"] + stats["skipped"]
    metadata = {"vocab_size": str(vocab), "train_samples": str(splits["train"].samples),
                "loss_masked_tokens": str(int(freq.sum())), "template_digest": digest}
    with atomic_path(out / "token_freq.safetensors") as tmp:
        save_file({"token_freq": freq}, str(tmp), metadata=metadata)
    write_json(out / "stats.json", stats)
    print(f"read {read}: kept {kept} (samples: train {splits['train'].samples}, eval {splits['eval'].samples}), "
          f"skipped {stats['skipped']} ({reasons}), truncated {truncated}; assistant turns trained "
          f"{counts['turns_trained']} of {counts['turns_in_data']} ({counts['turns_trained_as_own_sample']} as their "
          f"own sample); assistant tokens trained {counts['tokens_trained']} of {counts['tokens_in_data']} "
          f"({', '.join(f'{k} {n}' for k, n in counts['tokens_trained_by_kind'].items()) or 'none'}; not trained: "
          f"{counts['tokens_not_trained_by_reason'] or 0})", file=sys.stderr)
    if counts["trained_share"] < UNTRAINED_WARNING_SHARE:
        print(f"WARNING: only {counts['trained_share']:.0%} of the assistant tokens in {args.data} are trained; "
              f"the rest: {counts['tokens_not_trained_by_reason']} (see stats.json 'assistant')", file=sys.stderr)
    if prompt_mismatches:
        print(f"WARNING: {prompt_mismatches} prompts rendered by {args.chat_template} differ from the tokenizer's own "
              "template; the target is served with the tokenizer's unless vLLM is given --chat-template",
              file=sys.stderr)
    return stats


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m eaglepipe.prepare_data", description=__doc__)
    p.add_argument("--data", required=True, help="chats: " + FORMS)
    p.add_argument("--pretokenized", action="store_true",
                   help="--data holds token-exact samples (regenerate_responses' output), not chats")
    p.add_argument("--model", required=True, help="target model directory or hub id (its tokenizer and config)")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--max-samples", type=int, default=0,
                   help="read at most this many records in file order (bad ones count); 0 = all")
    p.add_argument("--eval-data", default=None,
                   help="token-exact samples that are the eval split (the regenerated answers to evaluate.prompts); "
                        "then every record of --data trains and --eval-fraction is not used")
    add_stage_arguments(p, "prepare_data")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_samples < 0:
        p.error(f"--max-samples must be >= 0, got {args.max_samples}")
    check_model_dir(args.model)
    prepare(args)


if __name__ == "__main__":
    main()
