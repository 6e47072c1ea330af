"""Stage benchmark_serving: vLLM with the exported EAGLE-3 draft against the target alone, by
concurrency and K, what a user of speculative decoding pays for. (Any draft vLLM serves in the
speculators format: the method is the one its config names, serving_sweep.draft_method.)

    python -m eaglepipe.benchmark_serving --model TARGET --draft results/run/draft \
        --prompts results/run/data/eval.jsonl --num-prompts 64 --max-tokens 256 \
        --concurrency 1,4,16,64 --k 3 --min-seconds 10 --min-output-tokens 2000 \
        --parity-k 3 --out results/run/eval/serving.json --parity-samples results/run/eval/parity/samples.jsonl

Prompts are held-out conversations cut before their first assistant token. One engine per
configuration (the target alone, then the target + draft for each K of ``--k``; without it the K the
draft's export recorded, the one a user serves), each loaded once in its own
spawned process (GPU memory is released between them) and measured at every concurrency C: C
requests are kept in flight by streaming them through ``llm_engine.add_request``/``step`` (the
prompts cycle), greedy; with several fixed evaluation sets (the prompts' ``prompt_set``) each point
is one timed window per set in the same engine, each its share of the bounds, so every point
reports AL per set (``by_prompt_set``) beside the whole. Each engine is warmed up once, each point again until C requests finished;
a timed window then runs until ``--min-seconds`` and ``--min-output-tokens`` are both reached, and at
concurrency 1 for the target alone and ``--parity-k`` until every prompt was served once
(``--parity-min-requests``): the prompts the offline estimate replays when it holds the same file.
Acceptance comes from vLLM's own spec-decode counters read at the window's ends. The acceptance
length of every K below the largest timed one that was not timed is derived from that K's
per-position counts (``derived_points``, serving_sweep.DERIVED_NOTE): a target load saved per K.

Also written: greedy outputs that differ from the target alone, explained by the target's top-2
logit margin at the first difference (a reference pass of the target with ``logprobs=2``, raw
logits), and, for the parity check, the exact sequences of the concurrency-1 window at
``--parity-k`` as a samples file (prompt + continuation, loss mask on the continuation).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from .atomic import atomic_path, write_json
from .serving_sweep import (CONVENTION, DERIVED_NOTE, PARITY_CONCURRENCY, counter_delta, derived_points, draft_k,
                            draft_method, engine_args_errors, explain_divergences, merge_windows, parity_samples,
                            recommend, set_indices, set_share, spec_counters, sweep_rows, window_done,
                            window_requests)
from .tokenized_samples import iter_prepared
from .settings import add_stage_arguments
from .vllm_env import gib_above_zero, kv_cache_kwargs, set_vllm_env_defaults

ENGINE_WARMUP_TOKENS = 16
NEAR_TIE_NOTE = ("near_tie: the target's top-2 raw-logit margin at the first difference is at most "
                 "near_tie_ulps units in the last place of the logit dtype at the top logit (two roundings "
                 "of each logit plus one of the final hidden state), and the other run took the second token")


def log(msg: str) -> None:
    print(f"benchmark_serving: {msg}", file=sys.stderr, flush=True)


def load_prompts(path: str | os.PathLike, num_prompts: int, sets: list | None = None) -> tuple[list[list[int]], Counter]:
    """The first ``num_prompts`` usable prompts: input_ids before the first loss-masked token;
    ``sets`` gets each one's fixed evaluation set (its sample's ``prompt_set``, None without)."""
    prompts, skipped = [], Counter()
    sets = [] if sets is None else sets
    samples = iter_prepared(path)  # read no further than needed
    while len(prompts) < num_prompts and (sample := next(samples, None)) is not None:
        first = next((i for i, m in enumerate(sample.loss_mask) if m), None)
        if first is None:
            skipped["no assistant token"] += 1
        elif first == 0:
            skipped["empty prompt"] += 1
        else:
            prompts.append(sample.input_ids[:first])
            sets.append(sample.prompt_set)
    if not prompts:
        raise SystemExit(f"{path}: no usable prompt (skipped: {dict(skipped) or 'file is empty'})")
    return prompts, skipped


def top_two(position_logprobs: dict) -> list[list]:
    """[[token, value], [token, value]] of the two highest entries of one position's logprobs dict."""
    best = sorted(position_logprobs.items(), key=lambda kv: -kv[1].logprob)[:2]
    return [[int(t), float(lp.logprob)] for t, lp in best]


class RequestStream:
    """Keeps ``concurrency`` requests in flight in a vLLM ``LLMEngine`` (add_request/step, as
    extract_vllm does), cycling through the prompts; ``limit`` caps the requests added."""

    def __init__(self, engine, prompts: list[list[int]], concurrency: int, params, tag: str,
                 limit: int | None = None, clock=time.perf_counter):
        self.engine, self.prompts, self.concurrency, self.params = engine, prompts, concurrency, params
        self.tag, self.limit, self.clock = tag, limit, clock
        self.added = 0
        self.in_flight: dict[str, dict] = {}

    def fill(self) -> None:
        while len(self.in_flight) < self.concurrency and (self.limit is None or self.added < self.limit):
            rid = f"{self.tag}-{self.added}"
            prompt = self.added % len(self.prompts)
            self.engine.add_request(rid, {"prompt_token_ids": self.prompts[prompt]}, self.params)
            self.in_flight[rid] = {"id": rid, "prompt": prompt, "tokens": [], "top2": [], "first": None}
            self.added += 1

    def step(self) -> tuple[int, list[dict], float]:
        """One engine step: (output tokens it delivered, requests it finished, when it returned)."""
        outs = self.engine.step()
        now = self.clock()
        new, done = 0, []
        for out in outs:
            state = self.in_flight.get(out.request_id)
            if state is None:  # the last output of a request aborted by an earlier window
                continue
            completion = out.outputs[0]  # DELTA outputs: the tokens (and logprobs) new in this step
            state["tokens"].extend(int(t) for t in completion.token_ids)
            new += len(completion.token_ids)
            if completion.logprobs:
                state["top2"].extend(top_two(lp) for lp in completion.logprobs)
            if state["first"] is None and completion.token_ids:
                state["first"] = now
            if out.finished:
                state["end"] = now
                done.append(self.in_flight.pop(out.request_id))
        return new, done, now

    def abort(self) -> None:
        if self.in_flight:
            self.engine.abort_request(list(self.in_flight))
            self.in_flight.clear()

    def run_all(self) -> list[dict]:
        """Step until every request (``limit`` of them) finished; the finished requests."""
        finished = []
        while True:
            self.fill()
            if not self.in_flight:
                return finished
            finished += self.step()[1]


def run_point(stream: RequestStream, *, min_seconds: float, min_output_tokens: int, min_requests: int = 0,
              snapshot=None) -> dict:
    """Warm up until ``concurrency`` requests finished, then time one window (serving_sweep.window_done);
    ``snapshot()`` -> spec-decode counters, read at both ends of the window."""
    warm = 0
    while warm < stream.concurrency:
        stream.fill()
        warm += len(stream.step()[1])
    before = snapshot() if snapshot else None
    t0 = stream.clock()
    tokens, finished = 0, []
    while True:
        stream.fill()
        new, done, now = stream.step()
        tokens += new
        finished += done
        if window_done(now - t0, tokens, len(finished), bool(done), min_seconds=min_seconds,
                       min_output_tokens=min_output_tokens, min_requests=min_requests):
            break
    counters = counter_delta(before, snapshot()) if snapshot else None
    stream.abort()
    return {"seconds": now - t0, "output_tokens": tokens,
            "tpot_s": [(f["end"] - f["first"]) / (len(f["tokens"]) - 1) for f in finished if len(f["tokens"]) > 1],
            "finished": [{"id": f["id"], "prompt": f["prompt"], "tokens": f["tokens"]} for f in finished],
            "counters": counters}


def run_engine(settings: dict, prompts: list[list[int]], k: int | None, result_path: str) -> None:
    """One engine (k None: the target alone), every concurrency; runs in a spawned child, writes JSON."""
    set_vllm_env_defaults()
    import dataclasses

    from vllm import LLM, SamplingParams  # lazy: only this GPU stage needs vLLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import RequestOutputKind

    label = "target alone" if k is None else f"target + draft, K={k}"
    errors = engine_args_errors(settings["engine_args"], {f.name for f in dataclasses.fields(EngineArgs)})
    if errors:
        raise SystemExit("benchmark_serving: " + "; ".join(errors))
    t_start = time.perf_counter()
    llm = LLM(
        model=settings["model"], tensor_parallel_size=settings["tensor_parallel_size"],
        trust_remote_code=settings["trust_remote_code"], dtype=settings["dtype"], seed=0,
        gpu_memory_utilization=settings["gpu_memory_utilization"], **kv_cache_kwargs(settings["kv_cache_gib"]),
        max_model_len=max(map(len, prompts)) + settings["max_tokens"] + (k or 0) + 1,
        # every request pays its own prefill, as distinct user prompts would (the prompts cycle)
        enable_prefix_caching=False,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        speculative_config={"model": settings["draft"], "method": settings["method"], "num_speculative_tokens": k}
        if k is not None else None,
        # the reference pass's logprobs are the target's raw logits (margins on the logit scale);
        # requests without logprobs, the timed ones, are unaffected
        **({"logprobs_mode": "raw_logits"} if k is None else {}),
        **settings["engine_args"],
    )
    engine = llm.llm_engine
    load_s = time.perf_counter() - t_start

    def params(max_tokens: int, logprobs: int | None = None):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, logprobs=logprobs,
                              output_kind=RequestOutputKind.DELTA)

    concurrencies = settings["concurrency"]
    t0 = time.perf_counter()
    RequestStream(engine, prompts, max(concurrencies), params(ENGINE_WARMUP_TOKENS), "warmup",
                  limit=max(concurrencies)).run_all()
    warmup_s = time.perf_counter() - t0
    snapshot = (lambda: spec_counters(llm.get_metrics())) if k is not None else None
    points, timed_s = {}, 0.0
    indices = set_indices(settings.get("prompt_sets") or [None] * len(prompts))
    for c in concurrencies:
        t0 = time.perf_counter()
        min_requests = window_requests(k, c, settings["parity_k"], settings["parity_min_requests"])
        if len(indices) == 1:
            w = run_point(RequestStream(engine, prompts, c, params(settings["max_tokens"]), f"c{c}"),
                          min_seconds=settings["min_seconds"], min_output_tokens=settings["min_output_tokens"],
                          min_requests=min_requests, snapshot=snapshot)
        else:  # one timed window per prompt set, each its share of the bounds: AL per set, same engine
            share = {name: lambda bound, n=len(idx): set_share(bound, n, len(prompts)) for name, idx in indices.items()}
            w = merge_windows({name: run_point(
                RequestStream(engine, [prompts[i] for i in idx], c, params(settings["max_tokens"]), f"c{c}-{name}"),
                min_seconds=share[name](settings["min_seconds"]),
                min_output_tokens=math.ceil(share[name](settings["min_output_tokens"])),
                min_requests=math.ceil(share[name](min_requests)), snapshot=snapshot)
                for name, idx in indices.items()}, indices)
        timed_s += w["seconds"]
        warmup_s += time.perf_counter() - t0 - w["seconds"]
        points[str(c)] = w
        log(f"{label}, concurrency {c}: {w['output_tokens'] / w['seconds']:,.1f} output tokens/s over "
            f"{w['seconds']:.1f}s ({w['output_tokens']} tokens, {len(w['finished'])} requests finished)"
            + (f", acceptance length {1 + w['counters']['accepted_tokens'] / w['counters']['drafts']:.3f}"
               if w["counters"] and w["counters"]["drafts"] else ""))
    result = {"k": k, "points": points}
    if k is None:
        t0 = time.perf_counter()
        ref = RequestStream(engine, prompts, len(prompts), params(settings["max_tokens"], logprobs=2), "reference",
                            limit=len(prompts)).run_all()
        result["reference"] = {str(f["prompt"]): {"tokens": f["tokens"], "top2": f["top2"]} for f in ref}
        log(f"reference pass (logprobs=2, raw logits): {len(ref)} prompts in {time.perf_counter() - t0:.1f}s")
    total_s = time.perf_counter() - t_start
    result["time"] = {"load_s": round(load_s, 2), "warmup_s": round(warmup_s, 2), "timed_s": round(timed_s, 2),
                      "total_s": round(total_s, 2)}
    log(f"{label}: engine load {load_s:.1f}s, warm-up {warmup_s:.1f}s, timed {timed_s:.1f}s of {total_s:.1f}s")
    Path(result_path).write_text(json.dumps(result))


def run_isolated(settings: dict, prompts: list[list[int]], k: int | None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        proc = ctx.Process(target=run_engine, args=(settings, prompts, k, path))
        proc.start()
        proc.join()
        label = "target alone" if k is None else f"target + draft, K={k}"
        if proc.exitcode != 0 or not os.path.exists(path):
            raise SystemExit(f"benchmark_serving: the vLLM run ({label}) failed with exit code {proc.exitcode}; "
                             f"its error is in the log above")
        return json.loads(Path(path).read_text())


def first_outputs(point: dict) -> dict[str, list[int]]:
    """Each prompt's first finished output in a window."""
    out: dict[str, list[int]] = {}
    for f in point["finished"]:
        out.setdefault(str(f["prompt"]), f["tokens"])
    return out


def summarize(settings: dict, prompts: list[list[int]], baseline: dict,
              speculative: dict[int, dict]) -> tuple[dict, list[dict]]:
    """serving.json's content and the parity samples, from the engines' records."""
    rows = sweep_rows(baseline, speculative)
    divergences = {}
    for engine in [baseline, *speculative.values()]:
        for c, point in engine["points"].items():
            d = explain_divergences(baseline["reference"], first_outputs(point), settings["dtype"],
                                    settings["near_tie_ulps"])
            divergences[f"{'target' if engine['k'] is None else 'k=' + str(engine['k'])},c={c}"] = d
            row = next(r for r in rows if r["k"] == engine["k"] and str(r["concurrency"]) == c)
            row.update(identical_outputs_fraction=d["identical_fraction"], differing_outputs=d["differing"],
                       near_ties=d["near_ties"], not_near_ties=d["not_near_ties"])
    flagged = [dict(d, point=key) for key, div in divergences.items() for d in div["differences"] if not d["near_tie"]]
    parity_point = speculative[settings["parity_k"]]["points"][str(PARITY_CONCURRENCY)]
    result = {
        "model": settings["model"], "draft": settings["draft"], "method": settings["method"],
        "serve_model": settings["serve_model"],
        "tensor_parallel_size": settings["tensor_parallel_size"], "dtype": settings["dtype"],
        "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_tokens": settings["max_tokens"],
        "sampling": "greedy", "concurrency": settings["concurrency"], "k": sorted(speculative),
        "min_seconds": settings["min_seconds"], "min_output_tokens": settings["min_output_tokens"],
        "vllm_version": settings["vllm_version"],
        "gpu_memory_utilization": settings["gpu_memory_utilization"], "kv_cache_gib": settings["kv_cache_gib"],
        "engine_args": settings["engine_args"],
        "points": rows,
        # the acceptance of the K not timed, from the largest timed K's per-position counts
        "derived_points": derived_points(rows),
        "derivation": DERIVED_NOTE,
        "recommended": recommend(rows, settings["serve_model"], settings["draft"], settings["tensor_parallel_size"],
                                 settings["trust_remote_code"], settings["engine_args"], settings["method"]),
        "engines": [{"k": e["k"], **e["time"]} for e in [baseline, *speculative.values()]],
        "divergences": {"near_tie_ulps": settings["near_tie_ulps"], "rule": NEAR_TIE_NOTE,
                        "reference": f"the target alone, all {len(prompts)} prompts at once, logprobs=2 (raw logits)",
                        "flagged": flagged, "points": divergences},
        "parity_run": {"k": settings["parity_k"], "concurrency": PARITY_CONCURRENCY,
                       "requests": len(parity_point["finished"]), "counters": parity_point["counters"]},
        "convention": CONVENTION,
    }
    return result, parity_samples(prompts, parity_point["finished"])


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or len(set(values)) != len(values):  # the items' bounds: the schema's (settings.bounded)
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers")
    return sorted(values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target: local dir or hub id")
    p.add_argument("--serve-model", default=None, help="the name `vllm serve` is given (default: --model)")
    p.add_argument("--draft", required=True, help="exported draft dir (export_draft)")
    p.add_argument("--prompts", required=True, help="eval JSONL of {input_ids, loss_mask}")
    p.add_argument("--parity-k", type=int, required=True, help="the K whose concurrency-1 window the parity replays")
    add_stage_arguments(p, "benchmark_serving",
                        types={"concurrency": int_list, "k": int_list, "kv_cache_gib": gib_above_zero})
    p.add_argument("--out", required=True, help="serving.json")
    p.add_argument("--parity-samples", required=True, help="JSONL of the parity window's sequences")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    errors = engine_args_errors(a.engine_args)
    if errors:
        p.error("--engine-args: " + "; ".join(errors))
    if not (Path(a.draft) / "config.json").is_file():
        p.error(f"--draft {a.draft}: no config.json (give the directory export_draft wrote)")
    if a.k is None:  # the K the export recorded: the one a user serves
        a.k = [draft_k(a.draft)]
    if a.parity_k not in a.k:
        p.error(f"--parity-k {a.parity_k} is not among --k {a.k} (config: benchmark_serving.parity.k must be "
                f"one of benchmark_serving.k)")
    if PARITY_CONCURRENCY not in a.concurrency:
        p.error(f"--concurrency {a.concurrency} lacks {PARITY_CONCURRENCY}: the parity check replays the "
                f"concurrency-{PARITY_CONCURRENCY} window (config: benchmark_serving.concurrency)")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    set_vllm_env_defaults()
    from importlib.metadata import version

    prompt_sets: list = []
    prompts, skipped = load_prompts(a.prompts, a.num_prompts, prompt_sets)
    log(f"{len(prompts)} prompts ({sum(map(len, prompts)):,} tokens) from {a.prompts}; "
        f"skipped {dict(skipped) or 'none'}")
    settings = {"model": a.model, "serve_model": a.serve_model or a.model, "draft": a.draft,
                "method": draft_method(a.draft),
                "tensor_parallel_size": a.tensor_parallel_size, "gpu_memory_utilization": a.gpu_memory_utilization,
                "kv_cache_gib": a.kv_cache_gib, "engine_args": a.engine_args,
                "trust_remote_code": a.trust_remote_code,
                "dtype": a.dtype, "max_tokens": a.max_tokens, "concurrency": a.concurrency,
                "min_seconds": a.min_seconds, "min_output_tokens": a.min_output_tokens, "parity_k": a.parity_k,
                "parity_min_requests": a.parity_min_requests or len(prompts), "near_tie_ulps": a.near_tie_ulps,
                "vllm_version": version("vllm")}
    # vLLM resolves a relative draft path against its own working directory: give it the absolute one
    engine_settings = dict(settings, draft=str(Path(a.draft).resolve()), prompt_sets=prompt_sets)
    baseline = run_isolated(engine_settings, prompts, None)
    speculative = {k: run_isolated(engine_settings, prompts, k) for k in a.k}
    result, samples = summarize(settings, prompts, baseline, speculative)
    result["skipped_prompts"] = dict(skipped)
    if len(set_indices(prompt_sets)) > 1:  # several fixed sets: each point timed one window per set
        result["prompt_sets"] = {name: len(idx) for name, idx in set_indices(prompt_sets).items()}
    for key, div in result["divergences"]["points"].items():
        log(f"{key}: {div['differing']} of {div['compared']} outputs differ from the reference, "
            f"{div['near_ties']} near-ties")
    for d in result["divergences"]["flagged"]:
        log(f"WARNING {d['point']}, prompt {d['prompt']}: output differs at token {d['position']} and it is not a "
            f"near-tie ({d['why']}; margin {d['margin']}, threshold {d['threshold']})")
    with atomic_path(a.parity_samples) as tmp, open(tmp, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    write_json(a.out, result)
    log(f"recommended: {json.dumps(result['recommended'])}")


if __name__ == "__main__":
    main()
