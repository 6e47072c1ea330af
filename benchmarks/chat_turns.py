"""Assistant text in the data vs trained, per template family, for one or more eaglepipe checkouts.

    python benchmarks/chat_turns.py --scripts after=scripts --scripts before=/tmp/main/scripts

Builds the tiny targets of tests/tiny.py (Kimi-K2.5-style, Qwen3, Llama-3.1, a {% generation %}
template) and its thinking/tool-call chats, runs each checkout's prepare_data on them, and measures
from the written samples alone, the same way for every checkout: a turn's reasoning and its answer
(content, or the tool call's arguments) count as trained when their text lies inside a masked run of
one of the conversation's samples; tokens are the target tokenizer's tokens of that text.
"malformed" counts masked runs with a think block closed then reopened ("</think><think>").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import tiny  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from eaglepipe.chat_data import Chat, iter_chats  # noqa: E402

# (family, override template or None): Kimi-K2.5 with its own template and with the preset's
RUNS = [("kimi-k2.5", None), ("kimi-k2.5", tiny.KIMI_TRAIN_TEMPLATE), ("qwen3", None), ("llama3.1", None),
        ("generation", None)]


def pieces(message: dict) -> list[str]:
    """The texts an assistant turn wrote: reasoning, answer, tool-call arguments."""
    calls = [c["function"]["arguments"] for c in message.get("tool_calls") or []]
    return [t for t in [message.get("reasoning_content") or "", message["content"], *calls] if t.strip()]


def masked_runs(tok, ids, mask) -> list[str]:
    runs, cur = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs


def measure(tok, chats: list[Chat], out: Path) -> dict:
    runs = defaultdict(list)
    for name in ("train", "eval"):
        for line in (out / f"{name}.jsonl").read_text().splitlines():
            r = json.loads(line)
            runs[r["id"].split("#")[0]] += masked_runs(tok, r["input_ids"], r["loss_mask"])
    in_data = trained = 0
    for c in chats:
        for m in c.messages:
            if m["role"] != "assistant":
                continue
            for text in pieces(m):
                n = len(tok.encode(text.strip(), add_special_tokens=False))
                in_data += n
                trained += n * any(text.strip() in run for run in runs[c.id])
    malformed = sum("</think><think>" in run for rs in runs.values() for run in rs)
    return {"in_data": in_data, "trained": trained, "malformed": malformed}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scripts", action="append", required=True, metavar="NAME=DIR",
                   help="a checkout's scripts/ directory, by name (repeatable)")
    p.add_argument("--conversations", type=int, default=40)
    args = p.parse_args()
    checkouts = dict(s.split("=", 1) for s in args.scripts)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tiny.make_thinking_chats(tmp / "chats.jsonl", n=args.conversations)
        chats = [c for c in iter_chats(str(data)) if isinstance(c, Chat)]
        targets = {f: tiny.make_target(tmp / f, f) for f in {f for f, _ in RUNS}}
        print(f"{args.conversations} conversations, {sum(m['role'] == 'assistant' for c in chats for m in c.messages)} "
              "assistant turns; assistant tokens trained / in the data (share), malformed runs")
        print(f"| template | {' | '.join(checkouts)} |\n|---|{'---|' * len(checkouts)}")
        for family, override in RUNS:
            tok = AutoTokenizer.from_pretrained(str(targets[family]))
            cells = []
            for name, scripts in checkouts.items():
                out = tmp / f"{family}-{override is not None}-{name}"
                cmd = [sys.executable, "-m", "eaglepipe.prepare_data", "--data", str(data), "--model",
                       str(targets[family]), "--out-dir", str(out), "--max-length", "4096", "--eval-fraction", "0.2"]
                if override:
                    cmd += ["--chat-template", str(override)]
                env = {**os.environ, "PYTHONPATH": str(Path(scripts).resolve())}
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode:
                    last = (done.stderr.strip().splitlines() or ["?"])[-1]
                    cells.append(f"fails: {last[:60]}")
                    continue
                r = measure(tok, chats, out)
                cells.append(f"{r['trained']} / {r['in_data']} ({r['trained'] / r['in_data']:.0%}), {r['malformed']}")
            label = family + (f" + {override.name}" if override else "")
            print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
