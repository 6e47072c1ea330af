"""benchmarks/bench_regenerate.py on CPU with a stand-in vLLM engine: both rows ask for the same
answers (same prompts, same per-request seeds, same sampling), so a seeded engine gives them the same
token count; the table and the JSON carry both rows."""

from __future__ import annotations

import json
import re
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


class SeededLLM:
    """``LLM.generate`` and ``llm_engine.add_request``/``step`` of one engine: an answer's length
    depends on its request's seed and prompt only, as a seeded sampler's would."""

    def __init__(self):
        self.llm_engine = self
        self.queue = {}
        self.generate_params = []
        self.prefix_resets = 0

    @staticmethod
    def answer(prompt_ids, params):
        rng = random.Random(f"{params.seed}/{len(prompt_ids)}")
        return [rng.randrange(5, 300) for _ in range(rng.randrange(1, params.max_tokens))] + [params.stop_token_ids[0]]

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.generate_params += params
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=self.answer(p["prompt_token_ids"], sp))])
                for p, sp in zip(prompts, params)]

    def add_request(self, request_id, prompt, params):
        self.queue[request_id] = (prompt["prompt_token_ids"], params)

    def step(self):
        rid = next(iter(self.queue))
        ids, params = self.queue.pop(rid)
        return [SimpleNamespace(request_id=rid, finished=True,
                                outputs=[SimpleNamespace(token_ids=self.answer(ids, params), finish_reason="stop")])]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


@pytest.fixture
def bench(monkeypatch):
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.SamplingParams = lambda **kw: SimpleNamespace(**{"seed": None, "stop_token_ids": [0], **kw})
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    import bench_regenerate
    from eaglepipe.generation import VLLMGenerator

    llm = SeededLLM()
    monkeypatch.setattr(bench_regenerate.VLLMGenerator, "load", classmethod(
        lambda cls, model, sampling, **kw: VLLMGenerator(llm, sampling, SimpleNamespace, kw["dtype"])))
    return bench_regenerate, llm


def test_both_rows_generate_the_same_answers(bench, tmp_path, monkeypatch, capsys):
    bench_regenerate, llm = bench
    model = tiny.make_llama(tmp_path / "model")
    chats = tiny.make_chats(tmp_path / "chats.jsonl", n=12)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_regenerate.py", "--model", str(model), "--data", str(chats),
                                      "--max-new-tokens", "40", "--max-model-len", "512", "--temperature", "0.6",
                                      "--top-p", "0.9", "--batch-size", "5", "--repeat", "2", "--json", str(out)])
    bench_regenerate.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["plain vllm", "ours", "ours", "plain vllm"]  # the order alternates
    assert len({r["tokens"] for r in rows}) == 1 and rows[0]["tokens"] > 12 and rows[0]["prompts"] == 12
    assert llm.prefix_resets == 4
    plain = [p for p in llm.generate_params if p.max_tokens == 40]
    assert {(p.temperature, p.top_p) for p in plain} == {(0.6, 0.9)}
    assert len({p.seed for p in plain}) == 12  # a seed per conversation, as the stage gives
    table = capsys.readouterr().out
    assert "| plain vllm generate |" in table and re.search(r"\| ours \| [0-9.]+ \([0-9.]+x\) \|", table)
