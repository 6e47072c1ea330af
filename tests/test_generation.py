"""The hf backend's batched decoder: the same answers whatever the batch, greedy as transformers'
generate, sampling by each request's own seed, top-p, stop tokens and the length cap; both
backends' early stop of a looping answer."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglepipe.degenerate import is_loop
from eaglepipe.generation import HFGenerator, LoopStop, LoopWatch, Sampling, VLLMGenerator

# prompts of different lengths, so a batch pads them
PROMPTS = [[5, 9, 13], [7] * 11, [3, 4, 5, 6, 7, 8, 9], [21, 22], list(range(30, 55))]


def answers(model, sampling: Sampling, batch_size: int, seeds=None, prompts=PROMPTS) -> dict[str, tuple]:
    gen = HFGenerator(str(model), sampling, batch_size=batch_size)
    for i, prompt in enumerate(prompts):
        gen.submit(f"r{i}", prompt, seeds[i] if seeds else 100 + i)
    out = []
    while gen.queue:
        out += gen.step()
    assert sorted(f.request_id for f in out) == sorted(f"r{i}" for i in range(len(prompts)))
    return {f.request_id: (f.token_ids, f.finish_reason) for f in out}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("target", ["tiny_llama", "tiny_dsv3"])
def test_a_batch_gives_each_request_the_answer_it_gets_alone(request, target, temperature):
    model = request.getfixturevalue(target)  # a Llama, and a DeepseekV3 (MLA attention, MoE)
    sampling = Sampling(temperature, 0.9, 12, (2,))
    alone = answers(model, sampling, batch_size=1)
    assert answers(model, sampling, batch_size=2) == alone
    assert answers(model, sampling, batch_size=len(PROMPTS)) == alone
    assert {len(ids) for ids, _ in alone.values()} != {0}


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9)])
def test_each_answer_is_what_generate_gives_that_request_alone(tiny_llama, temperature, top_p):
    """The backend this decoder replaced: torch.manual_seed(seed), then generate() one request at a
    time. The same draws, so parts it wrote hold the answers this decoder gives."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ours = answers(tiny_llama, Sampling(temperature, top_p, 10, (2,)), batch_size=3)
    sample = temperature > 0
    for i, prompt in enumerate(PROMPTS):
        torch.manual_seed(100 + i)
        theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=10, do_sample=sample, temperature=temperature if sample else None,
                                top_p=top_p if sample else None, top_k=None, eos_token_id=[2],
                                pad_token_id=2)[0, len(prompt):]
        assert ours[f"r{i}"][0] == theirs.tolist()[:len(ours[f"r{i}"][0])]


def test_sampling_follows_each_requests_seed(tiny_llama):
    sampling = Sampling(1.0, 1.0, 16, (2,))
    first = answers(tiny_llama, sampling, batch_size=5)
    assert answers(tiny_llama, sampling, batch_size=5) == first
    # another seed for r0 only: r0 changes, its batch partners do not
    other = answers(tiny_llama, sampling, batch_size=5, seeds=[999, 101, 102, 103, 104])
    assert other["r0"] != first["r0"]
    assert {k: v for k, v in other.items() if k != "r0"} == {k: v for k, v in first.items() if k != "r0"}


def test_a_tiny_nucleus_is_greedy(tiny_llama):
    """top_p so small that only the most likely token is in the nucleus: sampling must pick it."""
    assert answers(tiny_llama, Sampling(1.0, 1e-6, 10, (2,)), batch_size=5) == \
        answers(tiny_llama, Sampling(0.0, 1.0, 10, (2,)), batch_size=5)


def test_answers_end_at_a_stop_token_or_the_cap(tiny_llama):
    """With the token greedy decoding emits third as a stop token, that answer stops there; the others
    run to the cap; rows that finished early leave the batch without disturbing the rest."""
    free = answers(tiny_llama, Sampling(0.0, 1.0, 8, (2,)), batch_size=5)
    assert all(reason == "length" and len(ids) == 8 for ids, reason in free.values())
    stop = free["r0"][0][2]
    stopped = answers(tiny_llama, Sampling(0.0, 1.0, 8, (stop,)), batch_size=5)
    ids, reason = stopped["r0"]
    assert reason == "stop" and ids == free["r0"][0][:ids.index(stop) + 1] and ids[-1] == stop
    for rid, (ids, reason) in stopped.items():
        if stop not in free[rid][0]:
            assert (ids, reason) == free[rid]


def test_a_batch_takes_the_shortest_queued_prompts(tiny_llama):
    """Every prompt of a batch is padded to its longest, so long ones wait for each other."""
    gen = HFGenerator(str(tiny_llama), Sampling(0.0, 1.0, 2, (2,)), batch_size=2)
    for rid, length in (("long", 30), ("short", 3), ("longer", 40), ("shortest", 2), ("mid", 25)):
        gen.submit(rid, list(range(5, 5 + length)), 0)
    assert [sorted(f.request_id for f in gen.step()) for _ in range(3)] == [
        ["short", "shortest"], ["long", "mid"], ["longer"]]


def first_loop_check(tokens: list[int], stop: LoopStop) -> int | None:
    """The length at which ``stop`` ends ``tokens``: the first multiple of its step that loops."""
    return next((n for n in range(stop.every, len(tokens) + 1, stop.every)
                 if is_loop(tokens[:n], stop.ngram, stop.min_distinct_share)), None)


def test_a_looping_answer_is_stopped_at_the_first_check_that_finds_the_loop(tiny_llama):
    """A random tiny model's greedy answers loop; with a loop stop each is cut at the first multiple of
    the step where it loops (finish "loop"), exactly the prefix of the answer it had without the stop,
    and an answer that never loops at a check is the same as without the stop."""
    free = answers(tiny_llama, Sampling(0.0, 1.0, 64, (2,)), batch_size=5)
    stop = LoopStop(8, 4, 0.5)
    stopped = answers(tiny_llama, Sampling(0.0, 1.0, 64, (2,), stop), batch_size=5)
    cut = 0
    for rid, (ids, reason) in free.items():
        at = first_loop_check(ids, stop)
        if at is None or (reason == "stop" and at >= len(ids)):
            assert stopped[rid] == (ids, reason)
        else:
            assert stopped[rid] == (ids[:at], "loop")
            cut += 1
    assert cut >= 2  # the model loops: the test sees stops


class DeltaEngine:
    """``add_request`` / ``step`` / ``abort_request`` as vLLM's LLMEngine: each step gives every running
    request its next 1-3 tokens of a scripted answer, as DELTA outputs (FINAL_ONLY: once, at the end)."""

    def __init__(self, scripts: dict[str, list[int]]):
        self.scripts, self.running, self.params, self.aborted = scripts, {}, {}, []
        self.llm_engine, self.rng = self, random.Random(0)

    def add_request(self, request_id, prompt, params):
        self.running[request_id], self.params[request_id] = 0, params

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.aborted.append(rid)
            del self.running[rid]

    def step(self):
        out = []
        for rid, at in list(self.running.items()):
            script, kind = self.scripts[rid], self.params[rid].output_kind
            end = min(at + self.rng.randint(1, 3), len(script))
            self.running[rid] = end
            finished = end == len(script)
            if finished:
                del self.running[rid]
            tokens = script[at:end] if kind == "delta" else script[:end] if finished else None
            if tokens is not None:
                reason = "stop" if finished and script[-1] == 2 else "length" if finished else None
                out.append(SimpleNamespace(request_id=rid, finished=finished,
                                           outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason)]))
        return out


def test_vllm_requests_stream_only_with_a_loop_stop_and_a_loop_is_aborted_at_its_check():
    loop = [7, 8, 9] * 20  # loops, no stop token
    varied = list(range(10, 40)) + [2]
    scripts = {"loop": loop, "varied": varied, "plain-loop": loop}
    engine = DeltaEngine(scripts)
    stop = LoopStop(8, 4, 0.5)
    gen = VLLMGenerator(engine, Sampling(0.7, 0.9, 64, (2,), stop), SimpleNamespace, "bfloat16",
                        output_kinds=("final_only", "delta"))
    gen.submit("loop", [1], 1)
    gen.submit("varied", [1], 2)
    gen.sampling = Sampling(0.7, 0.9, 64, (2,))  # no stop: answered whole, in one output
    gen.submit("plain-loop", [1], 3)
    done = {}
    while engine.running:
        done.update({f.request_id: f for f in gen.step()})
    assert {rid: p.output_kind for rid, p in engine.params.items()} == {
        "loop": "delta", "varied": "delta", "plain-loop": "final_only"}
    assert engine.aborted == ["loop"]
    at = first_loop_check(loop, stop)
    # the check runs when the answer crosses a multiple of the step: it may hold a few tokens more
    assert done["loop"].finish_reason == "loop" and at <= len(done["loop"].token_ids) < at + 3
    assert done["loop"].token_ids == loop[:len(done["loop"].token_ids)]
    assert (done["varied"].token_ids, done["varied"].finish_reason) == (varied, "stop")
    assert (done["plain-loop"].token_ids, done["plain-loop"].finish_reason) == (loop, "length")
    assert not gen.streams


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_a_loop_watch_judges_as_is_loop_at_each_check(chunks):
    rng = random.Random(chunks)
    tokens = [rng.randrange(6) for _ in range(40)] + [1, 2, 3] * 30 + [rng.randrange(50) for _ in range(60)]
    stop = LoopStop(4, 3, 0.5)
    watch, seen = LoopWatch(stop), 0
    while seen < len(tokens):
        new = tokens[seen:seen + rng.randint(1, chunks)]
        crossed = (seen + len(new)) // 4 > seen // 4
        seen += len(new)
        assert watch.add(new) == (crossed and is_loop(tokens[:seen], 3, 0.5)), seen
    assert watch.tokens == tokens
