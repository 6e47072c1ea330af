"""The vLLM backend's request stream, against an engine that behaves like vLLM's offline one.

vLLM itself runs only on the GPU check (benchmarks/gpu_check_extraction.sh); here the bookkeeping
is tested: every batch comes back once with its files in sample order, however the engine
reorders requests, the engine is fed continuously but never beyond the lookahead, and a missing
file path is an error that names the request.
"""

import random
from types import SimpleNamespace

import pytest

from eaglepipe.extract_vllm import stream_requests


class FakeEngine:
    """``llm_engine.add_request`` + ``step()``: each step finishes requests worth up to ``budget``
    tokens, in a shuffled order (vLLM finishes short prompts first, chunked prefill splits long
    ones)."""

    def __init__(self, budget: int, seed: int = 0, drop_path_of: str | None = None):
        self.budget, self.rng, self.drop_path_of = budget, random.Random(seed), drop_path_of
        self.order: list[str] = []
        self.queue: dict[str, int] = {}
        self.enqueued_tokens = 0
        self.max_queued = 0
        self.steps = 0
        self.llm_engine = self

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.queue
        self.order.append(request_id)
        self.queue[request_id] = len(prompt["prompt_token_ids"])
        self.enqueued_tokens += len(prompt["prompt_token_ids"])
        self.max_queued = max(self.max_queued, sum(self.queue.values()))

    def step(self):
        assert self.queue, "step() with nothing queued would block forever in vLLM"
        self.steps += 1
        rids = list(self.queue)
        self.rng.shuffle(rids)
        out, used = [], 0
        for rid in rids:
            if used and used + self.queue[rid] > self.budget:
                continue
            used += self.queue.pop(rid)
            params = None if rid == self.drop_path_of else {"hidden_states_path": f"/stage/{rid}.safetensors"}
            out.append(SimpleNamespace(request_id=rid, finished=True, kv_transfer_params=params))
        out.append(SimpleNamespace(request_id="unfinished-noise", finished=False, kv_transfer_params=None))
        return out


def make_batches(n_batches: int, batch_size: int, seed: int = 1):
    rng = random.Random(seed)
    return [(("train", b), [[0] * rng.randint(1, 300) for _ in range(rng.randint(1, batch_size))])
            for b in range(n_batches)]


def test_every_batch_once_with_its_files_in_sample_order():
    batches = make_batches(40, 8)
    engine = FakeEngine(budget=1000)
    got = dict(stream_requests(engine, None, batches, lookahead_tokens=2000))
    assert sorted(got) == [key for key, _ in batches]
    # requests were added in feed order; the file of sample i of a batch is its request's
    start = 0
    for key, seqs in batches:
        assert got[key] == [f"/stage/{rid}.safetensors" for rid in engine.order[start:start + len(seqs)]]
        start += len(seqs)
    assert engine.enqueued_tokens == sum(len(s) for _, seqs in batches for s in seqs)


def test_the_feed_is_continuous_but_bounded_by_the_lookahead():
    batches = make_batches(60, 8)
    biggest = max(sum(map(len, seqs)) for _, seqs in batches)
    engine = FakeEngine(budget=700)
    stream = stream_requests(engine, None, batches, lookahead_tokens=1500)
    next(stream)
    # the first batch is out before the rest was enqueued: writers start while the GPU runs on
    assert engine.enqueued_tokens < sum(len(s) for _, seqs in batches for s in seqs)
    rest = list(stream)
    assert len(rest) + 1 == len(batches)
    assert engine.max_queued < 1500 + biggest
    # the engine was never left idle with work still to feed: every step had requests queued
    # (FakeEngine.step asserts it), and it took about the minimum number of steps
    total = sum(len(s) for _, seqs in batches for s in seqs)
    assert engine.steps < 2 * total / 700 + len(batches)


def test_a_batch_larger_than_the_lookahead_is_still_fed_whole():
    batches = [(("train", 0), [[1] * 500] * 4), (("train", 1), [[1] * 10])]
    engine = FakeEngine(budget=600)
    got = dict(stream_requests(engine, None, batches, lookahead_tokens=100))
    assert [len(got[k]) for k in sorted(got)] == [4, 1]


def test_no_batches_never_steps_the_engine():
    engine = FakeEngine(budget=100)
    assert list(stream_requests(engine, None, [], lookahead_tokens=100)) == []
    assert engine.steps == 0


def test_a_request_without_a_file_path_is_an_error_naming_it():
    engine = FakeEngine(budget=10_000, drop_path_of="eaglepipe-1-0")
    with pytest.raises(RuntimeError, match="vLLM request eaglepipe-1-0 returned no hidden_states_path"):
        list(stream_requests(engine, None, make_batches(3, 4), lookahead_tokens=10_000))
