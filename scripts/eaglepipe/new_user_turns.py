"""New conversations whose user turn the target writes itself (``regenerate.new_user_turns``).

The target is given what its chat template renders before a user's text (the template's default
system prompt, if any, and the user header) and continues it: an instruction-tuned model writes a
plausible user request there (Magpie, Xu et al. 2024, arXiv:2406.08464). Each such turn becomes a
one-turn conversation ``new-<i>`` that regeneration then answers like a record of the data, so a
target brings more unique prompts than its data has, in its own distribution.

Found generically: the template renders a single user message holding a marker, and the text
before the marker is the prompt, so any template (ChatML, Llama 3, Kimi's, a default system
prompt or none) is handled alike. The turn ends at the first special token the target writes
(its end-of-turn marker, or the header of the next turn where a template has no end marker); the
tokens before it are the text. Written turns are dropped, counted by reason, when empty, when they
hit ``max_new_tokens`` without ending, when they loop (regeneration's measure: ``loop_ngram``,
``loop_min_distinct_share``), or when they repeat an earlier written turn or a first user turn of
the data (compared case- and whitespace-insensitively).

Resumable as regeneration is: the turns are written in parts of ``batch_size`` requests in a
directory of their own, keyed by every setting that changes a turn and the part's indices; the
duplicate filter runs over all parts in order once they are on disk, so the kept turns do not
depend on which parts a rerun reused. Each request's seed is drawn from the seed and ``new-<i>``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from eaglepipe.atomic import read_json_object, remove_stale_temporaries, write_json
from eaglepipe.chat_data import Chat
from eaglepipe.chat_template import ChatTemplate, token_ids
from eaglepipe.degenerate import is_loop
from eaglepipe.generation import Sampling
from eaglepipe.regeneration import EXAMPLES_PER_REASON, Mode, pick_mode, remove_stale_parts, request_seed

PART_FORMAT = 1
PREFIX = "new-"  # the conversations' ids: new-<index>
# a user text no template produces on its own: where it lands in the rendering, the user's text starts
MARKER = "EAGLEPIPE_USER_TEXT_3f9c1a"
PROMPT_SET = "new_user_turns"  # the set name these conversations carry where sets are named


@dataclass(frozen=True)
class TurnSettings:
    """Everything that changes a written turn; its JSON keys every part."""
    model: str
    revision: str | None
    template_digests: tuple[str, ...]
    backend: str
    precision: str
    seed: int
    modes: tuple[Mode, ...]
    temperature: float
    top_p: float
    max_new_tokens: int

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def user_header(template: ChatTemplate) -> list[int]:
    """The token ids the template renders before a lone user message's text."""
    text, _ = template.render([{"role": "user", "content": MARKER}])
    at = text.find(MARKER)
    if at < 0:
        raise SystemExit("regenerate.new_user_turns: the chat template does not render a user message's text as "
                         "given (a marker text put in a user turn does not appear in its rendering), so there is no "
                         "user header to continue; set regenerate.new_user_turns.count to 0")
    return token_ids(template.tokenizer, text[:at])


def special_ids(tokenizer) -> tuple[int, ...]:
    """Every special token of the vocabulary: any of them ends a written user turn."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return tuple(sorted(ids))


def normalized(text: str) -> str:
    """What two turns must share to be the same request: the text without case and spacing."""
    return " ".join(text.casefold().split())


def part_key(settings: TurnSettings, first: int, count: int) -> str:
    return hashlib.sha256(f"{PART_FORMAT}\x00{settings.key()}\x00{first}\x00{count}".encode()).hexdigest()


class Writer:
    """Asks ``count`` user turns of a generator, part by part, reusing the parts on disk."""

    def __init__(self, generator, templates: dict[str, ChatTemplate], settings: TurnSettings, parts_dir: Path,
                 batch_size: int, loop_ngram: int, loop_min_distinct_share: float):
        self.gen, self.settings, self.parts_dir, self.batch_size = generator, settings, parts_dir, batch_size
        self.tok = next(iter(templates.values())).tokenizer
        self.headers = {name: user_header(t) for name, t in templates.items()}
        self.loop = (loop_ngram, loop_min_distinct_share)
        self.stops = set(special_ids(self.tok))
        self.written = self.reused = 0

    def sampling(self) -> Sampling:
        s = self.settings
        return Sampling(s.temperature, s.top_p, s.max_new_tokens, tuple(sorted(self.stops)))

    def _file(self, index: int, key: str) -> Path:
        return self.parts_dir / f"{index:06d}-{key[:16]}.json"

    def _turn(self, token_ids: list[int]) -> dict:
        """A written turn: its text up to the first special token, and why it is not kept (None: kept)."""
        end = next((i for i, t in enumerate(token_ids) if t in self.stops), None)
        content = token_ids[:end]
        text = self.tok.decode(content).strip()
        reason = ("empty" if not text else "truncated" if end is None else
                  "loop" if is_loop(content, *self.loop) else None)
        return {"text": text, "tokens": len(token_ids), "reason": reason}

    def run(self, count: int, progress) -> list[list[dict]]:
        """Every part's turns, in order (each turn: index, text, tokens generated, reason)."""
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.parts_dir)
        starts = range(0, count, self.batch_size)
        parts: dict[int, list[dict | None]] = {}
        keys = {p: part_key(self.settings, first, min(self.batch_size, count - first))
                for p, first in enumerate(starts)}
        pending: dict[str, tuple[int, int]] = {}  # request id -> (part, slot)
        open_parts: dict[int, int] = {}  # part -> requests still out
        feed = iter(enumerate(starts))
        while True:
            # as regeneration's parts: up to the generator's lookahead of requests out at once
            while len(pending) < max(self.gen.lookahead, 1) and (nxt := next(feed, None)) is not None:
                p, first = nxt
                saved = self._load(p, keys[p])
                if saved is not None:
                    parts[p] = saved
                    self.reused += 1
                    continue
                n = min(self.batch_size, count - first)
                parts[p], open_parts[p] = [None] * n, n
                for slot in range(n):
                    i = first + slot
                    cid = f"{PREFIX}{i}"
                    mode = pick_mode(self.settings.modes, self.settings.seed, cid)
                    rid = f"user-{i}"
                    self.gen.submit(rid, self.headers[mode.name], request_seed(self.settings.seed, cid, 0))
                    pending[rid] = (p, slot)
            if not pending:
                break
            for done in self.gen.step():
                p, slot = pending.pop(done.request_id)
                progress.update(len(done.token_ids))
                turn = self._turn(done.token_ids) if done.finish_reason in ("stop", "length") else {
                    "text": "", "tokens": len(done.token_ids), "reason": "failed"}
                parts[p][slot] = {"index": starts[p] + slot, **turn}
                open_parts[p] -= 1
                if open_parts[p] == 0:
                    write_json(self._file(p, keys[p]), {"format": PART_FORMAT, "key": keys[p], "turns": parts[p]})
                    self.written += 1
        remove_stale_parts(self.parts_dir, {self._file(p, k) for p, k in keys.items()})
        return [parts[p] for p in range(len(starts))]

    def _load(self, index: int, key: str) -> list[dict] | None:
        path = self._file(index, key)
        if not path.is_file():
            return None
        saved = read_json_object(path, "written user turns part", SystemExit)
        return saved["turns"] if saved.get("format") == PART_FORMAT and saved.get("key") == key else None


def conversations(parts: list[list[dict]], known: Iterator[str]) -> tuple[list[Chat], dict]:
    """The kept turns as one-turn conversations, and their accounting. ``known``: user texts a
    written turn must not repeat (the data's first user turns)."""
    seen = {normalized(t) for t in known}
    chats, dropped, examples = [], Counter(), []
    tokens = 0
    for turn in (t for part in parts for t in part):
        tokens += turn["tokens"]
        reason = turn["reason"]
        if reason is None and normalized(turn["text"]) in seen:
            reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        seen.add(normalized(turn["text"]))
        cid = f"{PREFIX}{turn['index']}"
        chats.append(Chat(cid, [{"role": "user", "content": turn["text"]}], f"{PROMPT_SET}:{turn['index']}"))
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(turn["text"][:300])
    asked = sum(len(part) for part in parts)
    return chats, {"asked": asked, "kept": len(chats), "dropped_by_reason": dict(dropped),
                   "tokens_generated": tokens, "examples": examples}


def first_user_texts(items) -> Iterator[str]:
    """The first user turn's text of each conversation among ``items`` (chats and skips)."""
    for item in items:
        if isinstance(item, Chat):
            text = next((m["content"] for m in item.messages if m["role"] == "user"), None)
            if isinstance(text, str):
                yield text
