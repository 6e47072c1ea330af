"""The serving benchmark without vLLM: the request stream and timed windows on a fake engine, the
sweep bookkeeping and recommendation, the near-tie explanation, the parity samples and serving.json."""

from __future__ import annotations

import importlib.metadata
import json
import shlex
from types import SimpleNamespace

import pytest

from eaglepipe import benchmark_serving as bs
from eaglepipe.serving_sweep import (acceptance, counter_delta, derived_acceptance_length, derived_points, draft_k,
                                     draft_method, engine_args_errors, explain_divergences,
                                     first_difference, logit_ulp, near_tie_threshold, recommend, spec_counters,
                                     merge_windows, point_row, set_indices, set_share, sweep_rows, window_requests)
from eaglepipe.tokenized_samples import read_prepared


class FakeEngine:
    """LLMEngine's add_request/step/abort_request: a request gets ``length`` + len(prompt) - 1 tokens
    (so requests finish at different steps), ``per_step``
    a step, and counts one draft per request and step (``accepted`` of them accepted at position 0)."""

    def __init__(self, length: int = 4, per_step: int = 1):
        self.length, self.per_step = length, per_step
        self.requests: dict[str, dict] = {}
        self.steps = 0
        self.max_in_flight = 0
        self.aborted: list[str] = []
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [0, 0]}

    def add_request(self, rid, prompt, params):
        assert rid not in self.requests
        ids = prompt["prompt_token_ids"]
        n = self.length + len(ids) - 1
        self.requests[rid] = {"left": n, "n": n, "base": ids[0] * 100}
        self.max_in_flight = max(self.max_in_flight, len(self.requests))

    def step(self):
        assert self.requests, "step() with nothing in flight blocks in vLLM"
        self.steps += 1
        outs = []
        for rid, r in list(self.requests.items()):
            n = min(self.per_step, r["left"])
            done = r["n"] - r["left"]
            r["left"] -= n
            self.counters["drafts"] += 1
            self.counters["draft_tokens"] += 2
            self.counters["accepted_tokens"] += 1
            self.counters["accepted_per_pos"][0] += 1
            outs.append(SimpleNamespace(request_id=rid, finished=r["left"] == 0, outputs=[SimpleNamespace(
                token_ids=[r["base"] + done + i for i in range(n)], logprobs=None)]))
            if r["left"] == 0:
                del self.requests[rid]
        return outs

    def abort_request(self, ids):
        self.aborted += ids
        for rid in ids:
            del self.requests[rid]

    def clock(self) -> float:
        return self.steps * 0.5

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.counters))


PROMPTS = [[1, 2], [3], [5, 6, 7]]


def stream(engine, c, **kw):
    return bs.RequestStream(engine, PROMPTS, c, params=None, tag=f"c{c}", clock=engine.clock, **kw)


def test_stream_keeps_concurrency_and_window_meets_minimums():
    e = FakeEngine(length=4)
    w = bs.run_point(stream(e, 3), min_seconds=3.0, min_output_tokens=10, snapshot=e.snapshot)
    assert e.max_in_flight == 3
    assert w["seconds"] >= 3.0 and w["output_tokens"] >= 10 and w["finished"]
    # the window ended at a step where a request finished; what was still in flight was aborted
    assert e.aborted and not e.requests and not set(e.aborted) & {f["id"] for f in w["finished"]}
    # one token a step, steps 0.5 apart
    assert w["tpot_s"] == [0.5] * len(w["finished"])
    for f in w["finished"]:
        base = PROMPTS[f["prompt"]][0] * 100
        assert f["tokens"] == [base + i for i in range(4 + len(PROMPTS[f["prompt"]]) - 1)]
    assert w["counters"]["drafts"] > 0 and w["counters"]["accepted_per_pos"] == [w["counters"]["drafts"], 0]


def test_concurrency_one_window_holds_whole_requests():
    """At concurrency 1 the counters of the window count exactly the requests it finished."""
    e = FakeEngine(length=5)
    w = bs.run_point(stream(e, 1), min_seconds=0.1, min_output_tokens=1, min_requests=4, snapshot=e.snapshot)
    assert len(w["finished"]) == 4
    lengths = [5 + len(PROMPTS[p]) - 1 for p in (1, 2, 0, 1)]
    assert w["counters"]["drafts"] == sum(lengths) and w["output_tokens"] == sum(lengths)
    assert e.aborted == []
    # the prompts cycle and the request ids are unique
    assert [f["prompt"] for f in w["finished"]] == [1, 2, 0, 1]
    assert len({f["id"] for f in w["finished"]}) == 4


def test_by_default_the_parity_window_serves_every_prompt_once():
    """The window the offline estimate is held against: after the warm-up request, each prompt once."""
    e = FakeEngine(length=5)
    n = window_requests(3, 1, parity_k=3, parity_requests=len(PROMPTS))
    w = bs.run_point(stream(e, 1), min_seconds=0.1, min_output_tokens=1, min_requests=n, snapshot=e.snapshot)
    assert sorted(f["prompt"] for f in w["finished"]) == [0, 1, 2]
    # the target alone's concurrency-1 window too (its speedup compares the same requests); no other
    assert window_requests(None, 1, parity_k=3, parity_requests=80) == 80
    assert window_requests(2, 1, parity_k=3, parity_requests=80) == 0
    assert window_requests(3, 4, parity_k=3, parity_requests=80) == 0
    assert window_requests(None, 4, parity_k=3, parity_requests=80) == 0


def test_run_all_finishes_every_request_once():
    e = FakeEngine(length=3, per_step=2)
    done = stream(e, len(PROMPTS), limit=len(PROMPTS)).run_all()
    assert sorted(f["prompt"] for f in done) == [0, 1, 2]
    assert all(len(f["tokens"]) == 3 + len(PROMPTS[f["prompt"]]) - 1 for f in done)


def test_top_two_orders_by_value():
    lp = {7: SimpleNamespace(logprob=19.5), 3: SimpleNamespace(logprob=20.0), 9: SimpleNamespace(logprob=1.0)}
    assert bs.top_two(lp) == [[3, 20.0], [7, 19.5]]


def test_spec_counters_sum_engines_and_delta():
    m = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
         SimpleNamespace(name="vllm:spec_decode_num_drafts", value=5),
         SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=45),
         SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=20),
         SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[9, 7, 4]),
         SimpleNamespace(name="vllm:generation_tokens", value=999)]
    after = spec_counters(m)
    assert after == {"drafts": 15, "draft_tokens": 45, "accepted_tokens": 20, "accepted_per_pos": [9, 7, 4]}
    before = {"drafts": 5, "draft_tokens": 15, "accepted_tokens": 5, "accepted_per_pos": [3, 2]}
    d = counter_delta(before, after)
    assert d == {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15, "accepted_per_pos": [6, 5, 4]}
    a = acceptance(d)
    assert a["acceptance_length"] == 2.5 and a["per_position_acceptance"] == [0.6, 0.5, 0.4]
    assert a["draft_acceptance_rate"] == 0.5


def window(tok_per_s: float, seconds: float = 10.0, tpot: float = 0.01, counters=None, finished=()):
    return {"seconds": seconds, "output_tokens": int(tok_per_s * seconds), "tpot_s": [tpot, tpot],
            "finished": list(finished), "counters": counters}


def counters(drafts, per_pos):
    return {"drafts": drafts, "draft_tokens": drafts * len(per_pos), "accepted_tokens": sum(per_pos),
            "accepted_per_pos": per_pos}


def synthetic_engines():
    """Baseline 100/400 tok/s at c=1/4; K=1 best at c=4, K=3 best at c=1; K=2 ties K=3 nowhere."""
    f = [{"id": "c1-0", "prompt": 0, "tokens": [5, 6, 7]}, {"id": "c1-1", "prompt": 1, "tokens": [4, 4]}]
    base = {"k": None, "time": {"load_s": 30.0, "warmup_s": 2.0, "timed_s": 20.0, "total_s": 52.0},
            "points": {"1": window(100, finished=f), "4": window(400, finished=f)},
            "reference": {"0": {"tokens": [5, 6, 7], "top2": [[[5, 20.0], [9, 19.0]], [[6, 20.0], [8, 19.9375]],
                                                                [[7, 3.0], [1, 2.0]]]},
                          "1": {"tokens": [4, 4], "top2": [[[4, 9.0], [2, 1.0]], [[4, 9.0], [2, 1.0]]]}}}

    def spec(k, c1, c4, tokens0):
        fs = [{"id": "c1-0", "prompt": 0, "tokens": tokens0}, {"id": "c1-1", "prompt": 1, "tokens": [4, 4]}]
        return {"k": k, "time": {"load_s": 40.0, "warmup_s": 2.0, "timed_s": 20.0, "total_s": 62.0},
                "points": {"1": window(c1, tpot=0.005, counters=counters(100, [60] + [30] * (k - 1)), finished=fs),
                           "4": window(c4, counters=counters(100, [50] * k), finished=fs)}}

    return base, {1: spec(1, 120, 440, [5, 6, 7]), 2: spec(2, 150, 380, [5, 8, 1]),
                  3: spec(3, 150, 300, [5, 6, 1])}


def test_sweep_rows_and_recommendation():
    base, spec = synthetic_engines()
    rows = sweep_rows(base, spec)
    by = {(r["k"], r["concurrency"]): r for r in rows}
    assert by[(None, 1)]["output_tokens_per_s"] == 100.0 and "speedup" not in by[(None, 1)]
    assert by[(2, 1)]["speedup"] == 1.5 and by[(3, 4)]["speedup"] == 0.75
    assert by[(2, 1)]["tpot_ratio"] == 0.5 and by[(2, 1)]["mean_tpot_ms"] == 5.0
    assert by[(3, 1)]["acceptance_length"] == 2.2 and by[(3, 1)]["per_position_acceptance"] == [0.6, 0.3, 0.3]
    rec = recommend(rows, "org/target", "results/run/draft", 1)
    # K=2 and K=3 tie at c=1 (1.5x): the smaller K wins
    assert rec["by_concurrency"] == {"1": 2, "4": 1} and rec["k"] == 2
    cmd = shlex.split(rec["serve_command"])
    assert cmd[:3] == ["vllm", "serve", "org/target"] and "--tensor-parallel-size" not in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "model": "results/run/draft", "method": "eagle3", "num_speculative_tokens": 2}
    assert "--tensor-parallel-size 8" in recommend(rows, "m", "d", 8)["serve_command"]
    dflash = shlex.split(recommend(rows, "m", "d", 1, method="dflash")["serve_command"])
    assert json.loads(dflash[dflash.index("--speculative-config") + 1])["method"] == "dflash"
    # where no K beats the target alone there is no K to recommend
    slow = [dict(r, speedup=0.9) if r["concurrency"] == 4 and r["k"] else r for r in rows]
    assert recommend(slow, "m", "d", 1)["by_concurrency"] == {"1": 2, "4": None}


def test_engine_arguments_become_vllm_serve_flags_by_vllms_cli_rules():
    rows = sweep_rows(*synthetic_engines())
    args = {"max_num_seqs": 8, "async_scheduling": True, "enforce_eager": False,
            "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]},
            "cuda_graph_sizes": [1, 2]}
    cmd = shlex.split(recommend(rows, "org/m", "d", 2, trust_remote_code=True, engine_args=args)["serve_command"])
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8" and "--async-scheduling" in cmd and "--no-enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == args["compilation_config"]
    assert cmd[cmd.index("--cuda-graph-sizes") + 1:][:2] == ["1", "2"]
    assert "--trust-remote-code" in cmd and cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


def test_engine_args_errors_name_the_key_and_what_sets_it_instead():
    assert engine_args_errors({"max_num_seqs": 8}) == []
    assert engine_args_errors({"speculative_config": {}, "seed": 1, "enforce_eager": None, "max_num_seqs": 8,
                               "no_such_arg": 1}, known={"max_num_seqs", "enforce_eager"}) == [
        "benchmark_serving.engine_args.speculative_config: the serving benchmark sets it (benchmark_serving.k, "
        "one engine per K, and the exported draft)",
        "benchmark_serving.engine_args.seed: the serving benchmark sets it (always 0)",
        "benchmark_serving.engine_args.enforce_eager is null: leave the key out for vLLM's default",
        "benchmark_serving.engine_args.no_such_arg: not an engine argument of the installed vLLM "
        "(vllm.engine.arg_utils.EngineArgs)"]


def test_sweep_needs_the_baseline_at_every_concurrency():
    base, spec = synthetic_engines()
    del base["points"]["4"]
    with pytest.raises(ValueError, match="K=1 measured concurrency 4, the baseline did not"):
        sweep_rows(base, spec)


def test_logit_ulp_and_threshold():
    assert logit_ulp(20.0, "bfloat16") == 0.125  # [16, 32): 2^4 x 2^-7
    assert logit_ulp(-3.0, "bfloat16") == 2 ** -6
    assert logit_ulp(20.0, "float16") == 2 ** -6
    assert near_tie_threshold(20.0, "bfloat16", 4) == 0.5


def test_divergences_near_tie_and_flagged():
    ref = {"0": {"tokens": [5, 6, 7],
                 "top2": [[[5, 20.0], [9, 19.0]], [[6, 20.0], [8, 19.9375]], [[7, 3.0], [1, 2.0]]]},
           "1": {"tokens": [4, 4], "top2": [[[4, 9.0], [2, 1.0]], [[4, 9.0], [2, 1.0]]]},
           "2": {"tokens": [1, 2], "top2": [[[1, 20.0], [3, 19.875]], [[2, 5.0], [0, 4.0]]]}}
    out = {"0": [5, 8, 1], "1": [4, 4], "2": [1, 9], "3": [0]}  # prompt 3 has no reference: not compared
    d = explain_divergences(ref, out, "bfloat16", 4)
    assert (d["compared"], d["identical"], d["differing"], d["near_ties"], d["not_near_ties"]) == (3, 1, 2, 1, 1)
    first, second = d["differences"]
    assert first == {"prompt": 0, "position": 1, "reference_token": 6, "token": 8, "margin": 0.0625,
                     "threshold": 0.5, "near_tie": True}
    assert second["prompt"] == 2 and second["position"] == 1 and not second["near_tie"]
    assert second["why"] == "the token taken is not the target's second choice"
    # the second choice, but far from a tie
    d = explain_divergences(ref, {"0": [5, 6, 1]}, "bfloat16", 4)["differences"][0]
    assert d["margin"] == 1.0 and d["threshold"] == 4 * 2 ** -6 and not d["near_tie"]
    assert d["why"] == "margin above the threshold"


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_the_method_vllm_serves_a_draft_with_is_the_one_its_config_names(tmp_path):
    for config, method in [({"speculators_model_type": "eagle3"}, "eagle3"), ({"speculators_model_type": "dflash"}, "dflash"),
                           ({"model_type": "deepseek_v3"}, "eagle3")]:  # the MLA draft's plain config
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert draft_method(tmp_path) == method


def test_main_writes_serving_json_and_parity_samples(tmp_path, monkeypatch):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]},
        {"id": "b", "input_ids": [4, 5], "loss_mask": [0, 1]},
        {"id": "c", "input_ids": [6], "loss_mask": [1]}]))  # empty prompt: skipped
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text('{"speculators_model_type": "dflash"}')
    base, spec = synthetic_engines()
    calls = []

    def fake_run_isolated(settings, ps, k):
        calls.append(k)
        assert settings["draft"] == str(draft.resolve()) and ps == [[1, 2], [4]]
        assert settings["method"] == "dflash"
        assert settings["engine_args"] == {"max_num_seqs": 4}  # every engine gets them
        return base if k is None else spec[k]

    monkeypatch.setattr(bs, "run_isolated", fake_run_isolated)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    out, samples = tmp_path / "eval" / "serving.json", tmp_path / "eval" / "parity" / "eval.jsonl"
    bs.main(["--model", "m", "--serve-model", "org/m", "--draft", str(draft), "--prompts", str(prompts),
             "--concurrency", "4,1", "--k", "3,1,2", "--parity-k", "3", "--out", str(out),
             "--parity-samples", str(samples), "--engine-args", '{"max_num_seqs": 4}', "--kv-cache-gib", "8"])
    assert calls == [None, 1, 2, 3]  # one engine each, the baseline once
    res = json.loads(out.read_text())
    assert res["recommended"] == {"by_concurrency": {"1": 2, "4": 1}, "k": 2, "among_timed_k": [1, 2, 3],
                                  "serve_command": res["recommended"]["serve_command"]}
    assert res["derived_points"] == []  # every K up to the largest was timed
    assert "org/m" in res["recommended"]["serve_command"]
    assert "--max-num-seqs 4" in res["recommended"]["serve_command"]
    assert res["method"] == "dflash" and '"method": "dflash"' in res["recommended"]["serve_command"]
    # the engine settings the speedup was measured with are in the file
    assert (res["engine_args"], res["gpu_memory_utilization"], res["kv_cache_gib"]) == ({"max_num_seqs": 4}, 0.9, 8.0)
    assert res["concurrency"] == [1, 4] and res["k"] == [1, 2, 3] and res["skipped_prompts"] == {"empty prompt": 1}
    assert len(res["points"]) == 2 + 3 * 2
    assert [e["load_s"] for e in res["engines"]] == [30.0, 40.0, 40.0, 40.0]
    div = res["divergences"]
    assert div["points"]["k=2,c=1"]["near_ties"] == 1 and div["points"]["k=1,c=1"]["differing"] == 0
    assert div["points"]["target,c=4"]["identical"] == 2
    assert [(f["point"], f["prompt"], f["position"]) for f in div["flagged"]] == [("k=3,c=1", 0, 2), ("k=3,c=4", 0, 2)]
    row = next(r for r in res["points"] if r["k"] == 3 and r["concurrency"] == 1)
    assert row["identical_outputs_fraction"] == 0.5 and row["not_near_ties"] == 1
    assert res["parity_run"] == {"k": 3, "concurrency": 1, "requests": 2, "counters": counters(100, [60, 30, 30])}
    # the samples are what the extraction CLI reads: prompt + continuation, the mask on the continuation
    got = read_prepared(samples)
    assert [(s.id, s.input_ids, s.loss_mask) for s in got] == [
        ("c1-0", [1, 2, 5, 6, 1], [0, 0, 1, 1, 1]), ("c1-1", [4, 4, 4], [0, 1, 1])]


def test_a_lower_ks_acceptance_is_the_larger_ks_counts_up_to_k():
    # K=3 window: 100 drafts; 60 accepted their first token, 30 the first two, 20 all three
    counts = [60, 30, 20]
    assert [derived_acceptance_length(counts, 100, k) for k in (1, 2, 3)] == [1.6, 1.9, 2.1]
    assert derived_acceptance_length(counts, 100, 3) == acceptance(counters(100, counts))["acceptance_length"]
    with pytest.raises(ValueError, match="K=4: the counts cover positions 1..3"):
        derived_acceptance_length(counts, 100, 4)


def chain(runs: list[int], k: int, anchors=None) -> tuple[int, list[int], list[int]]:
    """Greedy speculative decoding of one text with a K-token draft: ``runs[p]`` is how many draft
    tokens the target accepts at anchor p when the draft may propose as many as it likes (greedy:
    the draft's first tokens do not depend on K). Returns (drafts, accepted per position, the
    anchors visited); ``anchors`` given: visit those instead of the chain's own."""
    pos, drafts, per_pos, visited = 0, 0, [0] * k, []
    for p in anchors if anchors is not None else iter(int, 1):
        if anchors is None:
            if pos >= len(runs):
                break
            p = pos
        accepted = min(runs[p], k)
        drafts += 1
        for i in range(accepted):
            per_pos[i] += 1
        visited.append(p)
        pos = p + accepted + 1
    return drafts, per_pos, visited


def test_the_derivation_is_exact_at_the_larger_ks_anchors_and_only_estimates_the_lower_ks_own():
    import random

    rng = random.Random(0)
    runs = [min(rng.choices(range(8), weights=[40, 25, 15, 8, 5, 3, 2, 2])[0], 7) for _ in range(5000)]
    drafts5, counts5, anchors5 = chain(runs, 5)
    for k in (1, 2, 3, 4):
        derived = derived_acceptance_length(counts5, drafts5, k)
        # a K-token draft at K=5's anchors accepts exactly what the counts say
        at_same, per_pos, _ = chain(runs, k, anchors5)
        assert derived == pytest.approx(1 + sum(per_pos) / at_same, abs=1e-12)
        # its own chain visits other anchors: close, not equal
        own, own_counts, own_anchors = chain(runs, k)
        measured = 1 + sum(own_counts) / own
        assert own_anchors != anchors5 and abs(derived / measured - 1) < 0.05


def test_derived_points_cover_every_untimed_k_below_the_largest_at_each_concurrency():
    rows = [{"k": None, "concurrency": 1}, {"k": None, "concurrency": 4},
            {"k": 2, "concurrency": 1, "num_drafts": 50, "accepted_per_position": [25, 10]},
            {"k": 4, "concurrency": 1, "num_drafts": 100, "accepted_per_position": [60, 30, 20, 10]},
            {"k": 4, "concurrency": 4, "num_drafts": 200, "accepted_per_position": [100, 50, 20, 10]}]
    got = derived_points(rows)
    assert [(p["k"], p["concurrency"]) for p in got] == [(1, 1), (1, 4), (3, 1), (3, 4)]  # K=2 was timed
    assert all(p["derived_from_k"] == 4 for p in got)
    assert got[0] == {"concurrency": 1, "k": 1, "derived_from_k": 4, "acceptance_length": 1.6,
                      "per_position_acceptance": [0.6], "num_drafts": 100}
    assert got[3]["acceptance_length"] == 1.85 and got[3]["per_position_acceptance"] == [0.5, 0.25, 0.1]
    assert derived_points([r for r in rows if r["k"] is None]) == []
    # a window without per-position counts (no drafts) derives nothing
    assert derived_points([{"k": 3, "concurrency": 1, "num_drafts": 0, "accepted_per_position": []}]) == []


def test_by_default_only_the_exports_k_is_timed_and_the_lower_ks_are_derived(tmp_path, monkeypatch):
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}) + "\n"
                               for i in "ab"))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(
        {"speculators_model_type": "eagle3", "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}))
    assert draft_k(draft) == 3
    base, spec = synthetic_engines()
    calls = []
    monkeypatch.setattr(bs, "run_isolated", lambda settings, ps, k: calls.append(k) or (base if k is None else spec[k]))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    out = tmp_path / "serving.json"
    bs.main(["--model", "m", "--draft", str(draft), "--prompts", str(prompts), "--concurrency", "1,4",
             "--parity-k", "3", "--out", str(out), "--parity-samples", str(tmp_path / "parity.jsonl")])
    assert calls == [None, 3]  # two target loads: the baseline and the served K
    res = json.loads(out.read_text())
    assert res["k"] == [3] and {r["k"] for r in res["points"]} == {None, 3}
    assert res["recommended"]["k"] == 3 and res["recommended"]["among_timed_k"] == [3]
    derived = {(p["k"], p["concurrency"]): p for p in res["derived_points"]}
    assert set(derived) == {(1, 1), (2, 1), (1, 4), (2, 4)}
    # K=3's windows: c=1 counted [60, 30, 30] of 100 drafts, c=4 [50, 50, 50]
    assert derived[(1, 1)]["acceptance_length"] == 1.6 and derived[(2, 1)]["acceptance_length"] == 1.9
    assert derived[(2, 4)]["acceptance_length"] == 2.0 and derived[(2, 4)]["derived_from_k"] == 3
    assert not any("speedup" in p or "output_tokens_per_s" in p for p in res["derived_points"])
    assert "the recommended K is chosen among the timed K only" in res["derivation"]


def test_load_prompts_reads_prepared_samples_no_further_than_needed(tmp_path):
    prompts = tmp_path / "eval.jsonl"
    good = [json.dumps({"id": f"s{i}", "input_ids": [1, 2, 3 + i], "loss_mask": [0, 0, 1]}) for i in range(2)]
    prompts.write_text("\n".join([*good, "not json"]) + "\n")
    assert bs.load_prompts(prompts, 2) == ([[1, 2], [1, 2]], {})
    with pytest.raises(SystemExit, match=f"{prompts} line 3: not valid JSON"):
        bs.load_prompts(prompts, 3)


@pytest.mark.parametrize("args, message", [
    (["--parity-k", "4"], "--parity-k 4 is not among --k"),
    (["--concurrency", "4,16"], "lacks 1"),
    (["--k", "1,1"], "expected distinct integers"),
    (["--k", "0,1"], "argument --k: 0: must be >= 1"),  # the schema's bounds (settings.bounded)
    (["--gpu-memory-utilization", "1.5"], "1.5: must be <= 1"),
    (["--engine-args", '{"dtype": "float16"}'], "benchmark_serving.engine_args.dtype: the serving benchmark sets it"),
    (["--engine-args", "[1]"], "expected a JSON object, got list"),
    (["--engine-args", "{max_num_seqs: 1}"], "not JSON"),
])
def test_cli_rejects_bad_settings(tmp_path, capsys, args, message):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    base = {"--model": "m", "--draft": str(draft), "--prompts": "p", "--k": "1,2,3", "--parity-k": "3",
            "--out": "o", "--parity-samples": "s"}
    base.update(dict(zip(args[::2], args[1::2])))
    with pytest.raises(SystemExit):
        bs.parse_args([x for kv in base.items() for x in kv])
    assert message in capsys.readouterr().err


def test_the_recorded_sweeps_derived_acceptance_is_within_five_percent_of_the_measured(tmp_path):
    """benchmarks/check_derived_acceptance.py on the recorded SmolLM2 sweeps (benchmarks/README.md)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import check_derived_acceptance as check

    out = tmp_path / "check.json"
    assert check.main(["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["points"]) == 11 and res["over_tolerance_k"] == []
    assert res["max_abs_relative_error"] == 0.032  # the figure in benchmarks/README.md
    h200_c1_k3 = next(r for r in res["points"] if r["draft"] == "results/smollm2-h200/draft"
                      and (r["concurrency"], r["k"]) == (1, 3))
    assert (h200_c1_k3["measured"], h200_c1_k3["derived"]) == (1.9661, 2.0179)
    # a K beyond the tolerance stays measured: the script says so and fails
    assert check.main(["--tolerance", "0.01"]) == 1


def test_one_window_per_prompt_set_gives_al_per_set_and_the_whole():
    sets = ["mtbench", "mtbench", "humaneval", "humaneval", "humaneval"]
    indices = set_indices(sets)
    assert indices == {"mtbench": [0, 1], "humaneval": [2, 3, 4]} and set_indices([None, None]) == {"none": [0, 1]}
    assert set_share(10, 2, 5) == 4 and set_share(5, 3, 5) == 3
    # fake spec-decode counter deltas of each set's window (K=3)
    mt = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 12, "accepted_per_pos": [6, 4, 2]}
    he = {"drafts": 20, "draft_tokens": 60, "accepted_tokens": 36, "accepted_per_pos": [16, 12, 8]}
    windows = {
        "mtbench": {"seconds": 2.0, "output_tokens": 22, "tpot_s": [0.1], "counters": mt,
                    "finished": [{"id": "a", "prompt": 1, "tokens": [1]}]},
        "humaneval": {"seconds": 3.0, "output_tokens": 56, "tpot_s": [0.2, 0.3], "counters": he,
                      "finished": [{"id": "b", "prompt": 0, "tokens": [2]}, {"id": "c", "prompt": 2, "tokens": [3]}]},
    }
    w = merge_windows(windows, indices)
    # each finished request points at its prompt among all prompts (the parity window replays them)
    assert [(f["id"], f["prompt"]) for f in w["finished"]] == [("a", 1), ("b", 2), ("c", 4)]
    assert w["counters"] == {"drafts": 30, "draft_tokens": 90, "accepted_tokens": 48, "accepted_per_pos": [22, 16, 10]}
    row = point_row(1, 3, w)
    assert row["acceptance_length"] == 2.6 and row["requests_finished"] == 3 and row["output_tokens_per_s"] == 15.6
    assert row["by_prompt_set"]["mtbench"]["acceptance_length"] == 2.2
    assert row["by_prompt_set"]["humaneval"]["acceptance_length"] == 2.8
    assert row["by_prompt_set"]["humaneval"]["output_tokens_per_s"] == 18.7
    assert row["by_prompt_set"]["mtbench"]["accepted_per_position"] == [6, 4, 2]
    # the target alone: tokens/s per set, no acceptance
    base = point_row(1, None, merge_windows({n: {**v, "counters": None} for n, v in windows.items()}, indices))
    assert "acceptance_length" not in base["by_prompt_set"]["mtbench"] and "acceptance_length" not in base
    # one window (one set): the row as before, no per-set key
    assert "by_prompt_set" not in point_row(1, 3, {**windows["mtbench"]})
