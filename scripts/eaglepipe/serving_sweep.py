"""Bookkeeping of the serving benchmark, free of vLLM: counters, points, speedups, the recommended K,
the explanation of non-identical greedy outputs, and the parity samples.

benchmark_serving.py drives the engines and hands this module plain numbers and token lists, so all
of it is testable on a CPU.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path

from .serving_limits import EXPORT_KEY

# vLLM 0.26.0's spec-decode counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm) as
# LLM.get_metrics() names them (vllm/v1/metrics/reader.py strips the "_total" suffix).
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"

CONVENTION = ("acceptance_length = 1 + accepted / drafts (the bonus token counted, vLLM's spec-decode counters); "
              "accepted_per_position[i] = drafts whose tokens 0..i were all accepted (vLLM's per-position "
              "counter), per_position_acceptance[i] = accepted_per_position[i] / drafts; speedup = output "
              "tokens/s with the draft / without, at the same concurrency; tpot = time per output token of a "
              "request, (finish - first token) / (tokens - 1), averaged over the requests finished in the window")

DERIVED_NOTE = ("derived_points: the acceptance of a K that was not timed, below the largest timed K_max, from "
                "K_max's window at the same concurrency: acceptance_length(K) = 1 + sum of "
                "accepted_per_position[i] for i < K, over drafts. Greedy drafting makes a draft's first K tokens the "
                "same whatever K, so at one anchor this is exact; the anchors a K engine visits differ from "
                "K_max's, so it is an estimate, checked against measured sweeps "
                "(benchmarks/check_derived_acceptance.py). No tokens/s, TPOT or speedup: those need an engine "
                "of their own, and the recommended K is chosen among the timed K only.")

# Significant bits of the logits' dtype (vLLM's lm_head runs in the model dtype)
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11}


def spec_counters(metrics) -> dict:
    """Sum vLLM's spec-decode counters over engines; ``metrics`` are vllm.v1.metrics.reader objects
    (anything with ``name`` and ``value`` or, for the per-position vector, ``values``)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    for m in metrics:
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POSITION:
            per = out["accepted_per_pos"]
            per.extend([0] * (len(m.values) - len(per)))
            for i, v in enumerate(m.values):
                per[i] += int(v)
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """What the counters counted between two snapshots (they are cumulative)."""
    pos_before = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {"drafts": after["drafts"] - before["drafts"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted_tokens": after["accepted_tokens"] - before["accepted_tokens"],
            "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]}


def acceptance(counts: dict) -> dict:
    """Acceptance figures from a counter delta."""
    drafts = counts["drafts"]
    return {
        "acceptance_length": round(1 + counts["accepted_tokens"] / drafts, 4) if drafts else None,
        "per_position_acceptance": [round(a / drafts, 4) for a in counts["accepted_per_pos"]] if drafts else [],
        "draft_acceptance_rate": round(counts["accepted_tokens"] / counts["draft_tokens"], 4)
        if counts["draft_tokens"] else None,
        "num_drafts": drafts,
        "accepted_per_position": counts["accepted_per_pos"],
    }


def derived_acceptance_length(accepted_per_position: list[int], drafts: int, k: int) -> float:
    """The acceptance length (bonus token counted) a K-token draft would have had at the anchors of a
    larger K's window: 1 + accepted at positions 0..K-1 / drafts (accepted_per_position[i] counts the
    drafts whose tokens 0..i were all accepted, so a K-token draft accepts min(run, K) at each)."""
    if not 1 <= k <= len(accepted_per_position):
        raise ValueError(f"K={k}: the counts cover positions 1..{len(accepted_per_position)}")
    return 1 + sum(accepted_per_position[:k]) / drafts


def derived_points(rows: list[dict]) -> list[dict]:
    """The acceptance of every K from 1 to the largest timed K_max that was not timed, at each
    concurrency K_max was timed at, from K_max's per-position counts (DERIVED_NOTE); timed K keep
    their measured rows only."""
    timed = {r["k"] for r in rows if r["k"] is not None}
    if not timed:
        return []
    k_max = max(timed)
    out = []
    for r in rows:
        counts, drafts = r.get("accepted_per_position") or [], r.get("num_drafts")
        if r["k"] != k_max or not drafts or len(counts) < k_max:
            continue
        for k in sorted(set(range(1, k_max)) - timed):
            out.append({"concurrency": r["concurrency"], "k": k, "derived_from_k": k_max,
                        "acceptance_length": round(derived_acceptance_length(counts, drafts, k), 4),
                        "per_position_acceptance": [round(a / drafts, 4) for a in counts[:k]],
                        "num_drafts": drafts})
    return sorted(out, key=lambda p: (p["k"], p["concurrency"]))


def window_done(seconds: float, output_tokens: int, finished: int, finished_this_step: bool, *,
                min_seconds: float, min_output_tokens: int, min_requests: int = 0) -> bool:
    """A timed window ends at the first step boundary where a request finished and every minimum is met.

    Ending only where a request finished makes a concurrency-1 window hold whole requests, so the
    spec-decode counters read at its ends count exactly the requests it finished (the parity check
    replays those)."""
    return (finished_this_step and seconds >= min_seconds and output_tokens >= min_output_tokens
            and finished >= min_requests)


PARITY_CONCURRENCY = 1  # the window the parity check replays: requests one after the other


def window_requests(k: int | None, concurrency: int, parity_k: int, parity_requests: int) -> int:
    """The requests a window must finish (besides its seconds and tokens): ``parity_requests`` in the
    concurrency-1 windows of the target alone and of the parity K, none elsewhere. With every prompt
    once (benchmark_serving's default) the parity K is measured on the prompts the offline estimate
    holds, and its speedup compares the same requests."""
    return parity_requests if concurrency == PARITY_CONCURRENCY and k in (None, parity_k) else 0


def set_indices(prompt_sets: list[str | None]) -> dict[str, list[int]]:
    """{set name: the indices of its prompts}, in the order the sets first appear; a prompt
    without a set is "none"'s. One entry for a single set (or none)."""
    out: dict[str, list[int]] = {}
    for i, name in enumerate(prompt_sets):
        out.setdefault(name or "none", []).append(i)
    return out


def set_share(bound: float | int, n_set: int, n_total: int) -> float:
    """A set's part of a point's window bound (seconds, tokens, requests), by its share of the
    prompts: the sets' windows together take what one mixed window would (the caller rounds a count up)."""
    return bound * n_set / n_total


def merge_windows(windows: dict[str, dict], indices: dict[str, list[int]]) -> dict:
    """One point's window from one timed window per prompt set (benchmark_serving.run_point, each
    over that set's prompts, in the same engine): seconds, tokens, requests and counters summed,
    each finished request's ``prompt`` mapped back to its index in all prompts, and each set's own
    counters kept as ``by_prompt_set`` (point_row reports its acceptance)."""
    merged = {"seconds": 0.0, "output_tokens": 0, "tpot_s": [], "finished": [], "counters": None, "by_prompt_set": {}}
    for name, w in windows.items():
        merged["seconds"] += w["seconds"]
        merged["output_tokens"] += w["output_tokens"]
        merged["tpot_s"] += w["tpot_s"]
        merged["finished"] += [{**f, "prompt": indices[name][f["prompt"]]} for f in w["finished"]]
        merged["by_prompt_set"][name] = {"seconds": w["seconds"], "output_tokens": w["output_tokens"],
                                         "requests_finished": len(w["finished"]), "counters": w["counters"]}
        if w["counters"] is not None:
            merged["counters"] = add_counters(merged["counters"], w["counters"])
    return merged


def add_counters(a: dict | None, b: dict) -> dict:
    if a is None:
        return {**b, "accepted_per_pos": list(b["accepted_per_pos"])}
    n = max(len(a["accepted_per_pos"]), len(b["accepted_per_pos"]))
    pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
    return {key: a[key] + b[key] for key in ("drafts", "draft_tokens", "accepted_tokens")} | {
        "accepted_per_pos": [x + y for x, y in zip(pad(a["accepted_per_pos"]), pad(b["accepted_per_pos"]))]}


def point_row(concurrency: int, k: int | None, window: dict) -> dict:
    """One measured point from an engine's window record (see benchmark_serving.run_point)."""
    tpot = window["tpot_s"]
    row = {
        "concurrency": concurrency, "k": k,
        "output_tokens": window["output_tokens"], "seconds": round(window["seconds"], 3),
        "output_tokens_per_s": round(window["output_tokens"] / window["seconds"], 1),
        "mean_tpot_ms": round(1000 * sum(tpot) / len(tpot), 3) if tpot else None,
        "requests_finished": len(window["finished"]),
    }
    if k is not None:
        row.update(acceptance(window["counters"]))
    if window.get("by_prompt_set"):  # one timed window per prompt set (merge_windows)
        row["by_prompt_set"] = {
            name: {"output_tokens_per_s": round(w["output_tokens"] / w["seconds"], 1) if w["seconds"] else None,
                   "requests_finished": w["requests_finished"],
                   **({"acceptance_length": acceptance(w["counters"])["acceptance_length"],
                       "num_drafts": w["counters"]["drafts"],
                       "accepted_per_position": w["counters"]["accepted_per_pos"]} if k is not None else {})}
            for name, w in window["by_prompt_set"].items()}
    return row


def measured_point(serving: dict | None, k: int | None, concurrency: int = 1) -> dict:
    """A serving.json's measured point at ``k`` (None: the target alone) and ``concurrency``; {} when
    that point was not timed (or nothing was served)."""
    return next((p for p in (serving or {}).get("points") or []
                 if p.get("concurrency") == concurrency and p.get("k") == k), {})


def sweep_rows(baseline: dict, speculative: dict[int, dict]) -> list[dict]:
    """Rows of every point: the baseline's, then each K's with its speedup over the baseline at the
    same concurrency. ``baseline``/``speculative[k]``: engine records with ``points`` keyed by
    concurrency (as strings, JSON keys)."""
    rows = [point_row(int(c), None, w) for c, w in baseline["points"].items()]
    base = {r["concurrency"]: r for r in rows}
    for k, engine in sorted(speculative.items()):
        for c, w in engine["points"].items():
            row = point_row(int(c), k, w)
            b = base.get(row["concurrency"])
            if b is None:
                raise ValueError(f"K={k} measured concurrency {c}, the baseline did not")
            row["speedup"] = round(row["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
            row["tpot_ratio"] = round(row["mean_tpot_ms"] / b["mean_tpot_ms"], 3) \
                if row["mean_tpot_ms"] and b["mean_tpot_ms"] else None
            rows.append(row)
    return rows


# The engine arguments the serving benchmark sets itself, and what sets each instead: a key of
# benchmark_serving.engine_args may not name them.
ENGINE_ARGS_SET_ELSEWHERE = {
    "model": "target.model",
    "tokenizer": "target.model",
    "speculative_config": "benchmark_serving.k, one engine per K, and the exported draft",
    "tensor_parallel_size": "extract.tensor_parallel_size",
    "dtype": "target.dtype",
    "trust_remote_code": "target.trust_remote_code",
    "gpu_memory_utilization": "extract.gpu_memory_utilization",
    "kv_cache_memory_bytes": "vllm.kv_cache_gib",
    "max_model_len": "the longest prompt plus benchmark_serving.max_tokens",
    "enable_prefix_caching": "always off: the prompts cycle, and each request pays its own prefill as distinct users' do",
    "seed": "always 0",
    "disable_log_stats": "always False: the spec-decode counters need vLLM's stat loggers",
    "logprobs_mode": "raw logits, for the target's reference pass",
}


def engine_args_errors(engine_args: dict, known: set[str] | None = None) -> list[str]:
    """What is wrong with benchmark_serving.engine_args, one sentence per key; ``known``: the installed
    vLLM's engine argument names (vllm.engine.arg_utils.EngineArgs), None where vLLM is not at hand."""
    errors = []
    for key, value in engine_args.items():
        where = f"benchmark_serving.engine_args.{key}"
        if key in ENGINE_ARGS_SET_ELSEWHERE:
            errors.append(f"{where}: the serving benchmark sets it ({ENGINE_ARGS_SET_ELSEWHERE[key]})")
        elif value is None:
            errors.append(f"{where} is null: leave the key out for vLLM's default")
        elif known is not None and key not in known:
            errors.append(f"{where}: not an engine argument of the installed vLLM (vllm.engine.arg_utils.EngineArgs)")
    return errors


def engine_arg_flags(engine_args: dict) -> list[str]:
    """``engine_args`` as `vllm serve` words, by vLLM 0.26.0's own CLI rules (engine/arg_utils.py
    _compute_kwargs): --key-with-dashes; booleans --key / --no-key; lists one value per word; dicts
    (e.g. compilation_config) as JSON."""
    words = []
    for key, value in engine_args.items():
        name = key.replace("_", "-")
        flag = f"--{name}"
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{name}")
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words


def draft_method(draft: str | os.PathLike) -> str:
    """vLLM's speculative method for a draft directory: the speculators type its config.json names
    (eagle3 for export_draft's; dflash for a DFlash draft), else eagle3 (the MLA draft's
    plain DeepseekV3 config, mla_draft.py, which vLLM serves as an EAGLE-3 draft)."""
    return json.loads((Path(draft) / "config.json").read_text()).get("speculators_model_type", "eagle3")


def draft_k(draft: str | os.PathLike) -> int:
    """The K the export recorded (export.num_speculative_tokens): speculators' proposal method, or the
    MLA draft's own record beside vLLM's plain config (mla_draft.served_config)."""
    config = json.loads((Path(draft) / "config.json").read_text())
    if "speculators_config" in config:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    return int(config[EXPORT_KEY]["num_speculative_tokens"])


def serve_command(model: str, draft: str, k: int, tensor_parallel_size: int, trust_remote_code: bool = False,
                  engine_args: dict | None = None, method: str = "eagle3") -> str:
    """The `vllm serve` line for the draft: the run's tensor parallel size, --trust-remote-code when the
    run used it, and the engine arguments the serving benchmark measured with."""
    spec = json.dumps({"model": draft, "method": method, "num_speculative_tokens": k})
    words = ["vllm", "serve", model, "--speculative-config", spec]
    if tensor_parallel_size > 1:
        words += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if trust_remote_code:
        words.append("--trust-remote-code")
    return shlex.join(words + engine_arg_flags(engine_args or {}))


def recommend(rows: list[dict], model: str, draft: str, tensor_parallel_size: int, trust_remote_code: bool = False,
              engine_args: dict | None = None, method: str = "eagle3") -> dict:
    """The K with the highest speedup at each concurrency (ties: the smaller K, it costs less draft
    compute), null where no K is faster than the target alone; ``k`` is the best K at the lowest
    concurrency measured (1 by default, the case speculative decoding is for), whatever its speedup,
    with its serve command."""
    best: dict[int, dict] = {}
    for r in rows:
        if r["k"] is None:
            continue
        c = r["concurrency"]
        if c not in best or (r["speedup"], -r["k"]) > (best[c]["speedup"], -best[c]["k"]):
            best[c] = r
    if not best:
        raise ValueError("no speculative point was measured")
    k = best[min(best)]["k"]
    return {"by_concurrency": {str(c): best[c]["k"] if best[c]["speedup"] > 1 else None for c in sorted(best)}, "k": k,
            # a derived K has no speedup: the choice is among the K that had an engine of their own
            "among_timed_k": sorted({r["k"] for r in rows if r["k"] is not None}),
            "serve_command": serve_command(model, draft, k, tensor_parallel_size, trust_remote_code, engine_args,
                                           method)}


# ---- non-identical greedy outputs

def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token; a strict prefix differs at its end; None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_ulp(value: float, dtype: str) -> float:
    """Spacing of representable numbers of ``dtype`` at ``value`` (one unit in the last place)."""
    bits = SIGNIFICAND_BITS[dtype]
    exponent = math.frexp(abs(value))[1] - 1 if value else -126
    return 2.0 ** (exponent - (bits - 1))


def near_tie_threshold(top_logit: float, dtype: str, ulps: float) -> float:
    """The margin below which two greedy runs of the same model may pick different tokens.

    Each run rounds both logits to ``dtype`` (half an ulp each, so up to 2 ulps on the margin when the
    two runs round opposite ways), and the final hidden state itself carries one rounding of relative
    size 2^-bits, which moves each logit by about half an ulp of its magnitude: about 2 ulps more
    (on top of that, batch-dependent kernels reorder sums in every layer). 4 ulps is the default."""
    return ulps * logit_ulp(top_logit, dtype)


def explain_divergences(reference: dict[str, dict], outputs: dict[str, list[int]], dtype: str,
                        ulps: float) -> dict:
    """Compare greedy outputs with the reference run of the target alone, per prompt.

    ``reference[prompt]``: {"tokens": [...], "top2": [[[token, logit], [token, logit]], ...]} (the
    target's two highest raw logits at each generated position); ``outputs[prompt]``: tokens.
    A difference is a near-tie when the reference's top-2 margin at the first differing position
    is under the bf16-scale threshold and the other run took the reference's second token there.
    """
    details = []
    compared = 0
    for prompt, tokens in sorted(outputs.items(), key=lambda kv: int(kv[0])):
        ref = reference.get(prompt)
        if ref is None:
            continue
        compared += 1
        pos = first_difference(ref["tokens"], tokens)
        if pos is None:
            continue
        d = {"prompt": int(prompt), "position": pos,
             "reference_token": ref["tokens"][pos] if pos < len(ref["tokens"]) else None,
             "token": tokens[pos] if pos < len(tokens) else None}
        top2 = ref["top2"][pos] if pos < len(ref["top2"]) else None
        if top2 is None or len(top2) < 2 or d["token"] is None or d["reference_token"] is None:
            d.update(margin=None, threshold=None, near_tie=False,
                     why="no top-2 logits at that position (one output ended first)")
        else:
            (_, z1), (t2, z2) = top2[0], top2[1]
            margin = z1 - z2
            threshold = near_tie_threshold(z1, dtype, ulps)
            second = d["token"] == t2
            d.update(margin=round(margin, 6), threshold=threshold, near_tie=second and margin <= threshold)
            if not d["near_tie"]:
                d["why"] = ("margin above the threshold" if second
                            else "the token taken is not the target's second choice")
        details.append(d)
    near = sum(d["near_tie"] for d in details)
    return {"compared": compared, "identical": compared - len(details), "differing": len(details),
            "near_ties": near, "not_near_ties": len(details) - near,
            "identical_fraction": round((compared - len(details)) / compared, 4) if compared else None,
            "differences": details}


# ---- parity samples

def parity_samples(prompts: list[list[int]], finished: list[dict]) -> list[dict]:
    """The sequences vLLM produced as tokenized samples for extraction: prompt + continuation, the
    loss mask on the continuation (the positions whose drafts vLLM counted)."""
    out = []
    for f in finished:
        prompt = prompts[f["prompt"]]
        out.append({"id": f["id"], "input_ids": prompt + list(f["tokens"]),
                    "loss_mask": [0] * len(prompt) + [1] * len(f["tokens"])})
    return out
