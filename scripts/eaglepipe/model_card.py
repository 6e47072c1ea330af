"""Stage model_card: the README.md of an exported draft, written once it has been evaluated.

It reads what the run measured (the export's config.json, train/summary.json, data/stats.json,
eval/offline.json and, when serving was benchmarked, eval/serving.json) and tells the user how to
serve the draft: the serve command carries the run's tensor parallel size and --trust-remote-code
when the run used them, the engine arguments the serving benchmark measured with
(benchmark_serving.engine_args), and the K it recommends for one request at a time among the K
the benchmark timed (else the export's K), beside the acceptance of the lower K derived from it.

It also lists every start of the target as an engine the run made (regeneration, extraction per
replica, the extractor a training through a disk budget starts, the serving benchmark's engines,
parity extraction), with its seconds as each stage recorded it: at Kimi-K2.5's size one costs ~20
minutes of 8 GPUs. The same list is the run's summary (``--run-summary``, JSON).

    python -m eaglepipe.model_card --draft-config results/run/draft/config.json \
        --summary results/run/train/summary.json --which best --data-stats results/run/data/stats.json \
        --offline results/run/eval/offline.json [--serving results/run/eval/serving.json] \
        [--regeneration-stats results/run/regenerated/stats.json ...] \
        [--manifest results/run/hidden_states/manifest.json] \
        [--parity-manifest results/run/eval/parity/parts/replica-0-of-1.json] \
        --tensor-parallel-size 8 --trust-remote-code --out results/run/draft/README.md \
        [--run-summary results/run/summary.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import mla_draft
from .atomic import atomic_path, read_json_object, write_json
from .config_check import target_config_path
from .layers import CONVENTION
from .serving_limits import NORM_FLAGS, VLLM_VERSION, eagle3_target_error
from .serving_sweep import measured_point, serve_command
from .settings import add_stage_arguments
from .units import human_bytes


class CardError(ValueError):
    """An input the card cannot be written from; the message names the file and field."""


def _field(obj: dict, key: str, where: str):
    if key not in obj:
        raise CardError(f"{where}: missing field {key!r}")
    return obj[key]


def recommended_k(serving: dict | None, export_k: int, where: str) -> tuple[int, str]:
    """K for the serve command and where it comes from: serving.json's recommended.k, else the export's."""
    if serving is None:
        return export_k, "the export's num_speculative_tokens (serving was not benchmarked)"
    k = _field(_field(serving, "recommended", where), "k", f"{where} recommended")
    if not isinstance(k, int) or k < 1:
        raise CardError(f"{where}: recommended.k is {k!r}, expected a positive integer")
    return k, f"the serving benchmark's best K at concurrency 1, among the K it timed ({where})"


def assistant_tokens_line(assistant: dict | None) -> str:
    """What the loss saw of the assistant text: thinking vs answer (or the target's regenerated
    answers, where the two are not told apart), and the share trained."""
    if not assistant:
        return "- assistant tokens trained: n/a"
    return (f"- assistant tokens trained: {assistant['tokens_trained']} of {assistant['tokens_in_data']} "
            f"({assistant['trained_share']:.0%}; "
            f"{', '.join(f'{k} {n}' for k, n in assistant['tokens_trained_by_kind'].items()) or 'none'})")


def unservable(target_model: str) -> str | None:
    """Why the pinned vLLM cannot serve an EAGLE-3 draft on this target (its model class has no aux-state
    capture), or None; None too when the target's config.json is not at hand."""
    path = target_config_path(target_model)
    return eagle3_target_error(json.loads(path.read_text()).get("architectures")) if path else None


def target_loads(regeneration: list[dict], manifest: dict | None, disk_budget: dict | None, serving: dict | None,
                 parity: dict | None) -> list[dict]:
    """Every engine start of the target in the run, in pipeline order: {"stage", "seconds"}.

    ``regeneration``: the regeneration stats (one load may have answered two sets: its ``engine``
    record names both outputs, and is counted once); ``manifest``: the gathered extraction manifest
    (one load per replica); ``disk_budget``: train/summary.json's record of a training through a disk
    budget (its extractor's loads: one per training job that had a shard to make, so again after a
    kill); ``serving``: serving.json (its ``engines``: the target alone, then one per timed K);
    ``parity``: the parity extraction's part manifest. A stage that reused all of its work loaded
    nothing (an extraction's model_load_s, a regeneration's load_s is 0 then) and has no row;
    regeneration stats written before loads were recorded give seconds None."""
    loads, seen = [], set()
    for stats in regeneration:
        engine = stats.get("engine") or {"answered": [stats.get("output", "?")], "load_s": None}
        answered = tuple(engine["answered"])
        if answered not in seen and engine["load_s"] != 0:
            seen.add(answered)
            loads.append({"stage": "regeneration: " + " + ".join(Path(a).stem for a in answered),
                          "seconds": engine["load_s"]})
    if manifest is not None:
        tp = manifest.get("throughput") or {}
        replicas = tp.get("replicas") or [dict(tp, replica=0)]
        for r in replicas:
            if r.get("model_load_s"):
                loads.append({"stage": "extract_hidden_states" + (f" (replica {r['replica']} of {len(replicas)})"
                                                                  if len(replicas) > 1 else ""),
                              "seconds": r["model_load_s"]})
    budget_loads = [s for s in (disk_budget or {}).get("model_loads_s", []) if s]
    for i, s in enumerate(budget_loads, 1):
        loads.append({"stage": "train_draft (disk budget extraction"
                               + (f", load {i} of {len(budget_loads)})" if len(budget_loads) > 1 else ")"),
                      "seconds": s})
    for e in (serving or {}).get("engines", []):
        loads.append({"stage": "benchmark_serving: " + ("target alone" if e.get("k") is None else f"K={e['k']}"),
                      "seconds": e.get("load_s")})
    if parity is not None and (parity.get("throughput") or {}).get("model_load_s"):
        loads.append({"stage": "extract_parity_hidden_states", "seconds": parity["throughput"]["model_load_s"]})
    return loads


def loads_summary(loads: list[dict]) -> dict:
    known = [row["seconds"] for row in loads if row["seconds"] is not None]
    return {"count": len(loads), "seconds": round(sum(known), 2), "loads": loads}


def loads_section(loads: list[dict]) -> list[str]:
    if not loads:
        return []
    total = loads_summary(loads)
    return ["", "## Target loads",
            f"The run started the target {total['count']} time(s) as an engine, {total['seconds']:,.1f} s in all "
            "(from the engine call until it was ready, as each stage recorded it):", "",
            "| stage | seconds |", "| --- | --- |",
            *(f"| {row['stage']} | {seconds(row['seconds'])} |" for row in loads)]


def seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def acceptance_by_k_line(serving: dict) -> list[str]:
    """vLLM's acceptance length at the lowest concurrency for every K, timed or derived (marked)."""
    points = [p for p in serving.get("points", []) if p.get("k") is not None and p.get("acceptance_length")]
    derived = [p for p in serving.get("derived_points", []) if p.get("acceptance_length")]
    if not points:
        return []
    c = min(p["concurrency"] for p in points)
    by_k = {p["k"]: f"{p['acceptance_length']} (timed, {p['speedup']}x)" if p.get("speedup") is not None
            else f"{p['acceptance_length']} (timed)" for p in points if p["concurrency"] == c}
    by_k.update({p["k"]: f"{p['acceptance_length']} (derived from K={p['derived_from_k']}, not timed)"
                 for p in derived if p["concurrency"] == c and p["k"] not in by_k})
    return [f"- vLLM acceptance length by K at concurrency {c}: "
            + ", ".join(f"K={k} {v}" for k, v in sorted(by_k.items()))]


def disk_budget_lines(budget: dict | None) -> list[str]:
    """What training through a disk budget cost (train_draft's summary), none without one."""
    if not budget:
        return []
    return [f"- disk budget: {human_bytes(budget['budget_bytes'])} of hidden-state shards (peak on disk "
            f"{human_bytes(budget['peak_shard_bytes'])}, all shards {human_bytes(budget['projected_bytes'])}); "
            f"{budget['passes']} passes, {budget['samples_trained']} samples and {budget['tokens_trained']} tokens "
            f"trained; {budget['shards_extracted']} train shards extracted during training in "
            f"{budget['reextraction_s']} s; order {budget['order']}"]


def card(config: dict, summary: dict, which: str, data_stats: dict, offline: dict, serving: dict | None,
         draft_dir: Path, tensor_parallel_size: int, trust_remote_code: bool, where: dict[str, str],
         refused: str | None = None, loads: list[dict] | None = None, parity: dict | None = None,
         written: dict | None = None) -> str:
    """The card's text; ``refused`` (unservable()'s reason) replaces the serve command, which could not work;
    ``written``: the regeneration's record of the user turns the target wrote itself."""
    spec = _field(config, "speculators_config", where["config"])
    verifier = spec["verifier"]["name_or_path"]
    export_k = spec["proposal_methods"][0]["speculative_tokens"]
    k, k_source = recommended_k(serving, export_k, where.get("serving", ""))
    tl = _field(config, "transformer_layer_config", where["config"])
    ev = _field(summary, "best_eval", where["summary"])
    lines = [
        f"# EAGLE-3 draft for `{verifier}`",
        "",
        "Trained with eaglepipe (speculators EAGLE-3 model and losses); "
        + (f"served by vLLM as `{config['served_as']}`." if "served_as" in config
           else "speculators format, served natively by vLLM."),
        "",
        "## Serve",
        *([f"The pinned vLLM ({VLLM_VERSION}) cannot serve this draft: {refused}."] if refused else [
            "```",
            serve_command(verifier, str(draft_dir.resolve()), k, tensor_parallel_size, trust_remote_code,
                          (serving or {}).get("engine_args")),
            "```",
            f"num_speculative_tokens {k}: {k_source}.",
        ]),
        "",
        "## Draft",
        f"- target (verifier): `{verifier}`; trained against `{_field(summary, 'target_model', where['summary'])}`",
        f"- decoder: {tl.get('num_hidden_layers')} x {tl.get('model_type')} layer, hidden {tl.get('hidden_size')}, "
        f"draft vocab {config['draft_vocab_size']} of {tl.get('vocab_size')}",
        f"- aux layer ids {summary['aux_layer_ids']} (all captured ids {summary['layer_ids']}); convention: {CONVENTION}",
        "- norm flags: " + ", ".join(f"{f}={config[f]}" for f in NORM_FLAGS),
        f"- num_speculative_tokens in the export: {export_k} (trained with {summary['ttt_steps']} TTT steps)",
        "",
        "## Training",
        f"- checkpoint: {which} = `{_field(summary, which, where['summary'])}` of {summary['steps']} steps",
        f"- training tokens: {summary.get('train_tokens', 'n/a')}",
        f"- data: {data_stats.get('read', 'n/a')} conversations read, {data_stats.get('kept', 'n/a')} kept, "
        f"skipped {data_stats.get('skipped', {})}",
        assistant_tokens_line(data_stats.get("assistant")),
        *([f"- of them, user turns the target wrote itself (regenerate.new_user_turns): {written['kept']} kept of "
           f"{written['asked']} asked (dropped: {written['dropped_by_reason'] or 'none'})"] if written else []),
        *disk_budget_lines(summary.get("disk_budget")),
        f"- acceptance length at that checkpoint's eval (bonus token counted): {ev.get('acceptance_length', 'n/a')}",
        "",
        "## Evaluation",
        f"- offline acceptance length on held-out data: {_field(offline, 'acceptance_length', where['offline'])} "
        f"(k={offline.get('k')}, {offline.get('tokens_evaluated', 'n/a')} tokens)",
        f"- per-position acceptance: {offline.get('per_position_acceptance', 'n/a')}",
        f"- target tokens the draft vocabulary holds (bounds acceptance): {offline.get('draft_vocab_coverage', 'n/a')}",
    ]
    as_served = offline.get("as_served")
    if as_served:
        lines.append(f"- as vLLM would count it on the same text (tokens per draft, {as_served['drafts']} drafts): "
                     f"{as_served['acceptance_length']}")
    lines += prompt_set_table(offline, serving)
    if serving is not None:
        by_concurrency = serving["recommended"].get("by_concurrency") or {}
        among = serving["recommended"].get("among_timed_k")
        lines.append("- vLLM serving benchmark, best K by concurrency"
                     + (f" (among the timed K {', '.join(map(str, among))})" if among else "") + ": "
                     + (", ".join(f"{c}: {'the target alone' if v is None else v}"
                                  for c, v in by_concurrency.items()) or "n/a"))
        lines += acceptance_by_k_line(serving)
        lines += offline_vs_online(offline, serving)
    lines += parity_line(parity)
    lines += loads_section(loads or [])
    return "\n".join(lines) + "\n"


def prompt_set_table(offline: dict, serving: dict | None) -> list[str]:
    """AL per fixed evaluation set (evaluate.prompts): offline per token and as served, and vLLM's at
    concurrency 1 and the offline K when the serving benchmark timed one window per set."""
    per_set = (offline.get("strata") or {}).get("prompt_set")
    if not per_set:
        return []
    online = measured_point(serving, offline.get("k")).get("by_prompt_set") or {}
    lines = ["", f"Acceptance length per evaluation set (k={offline.get('k')}):", "",
             "| set | offline, per token | offline, as served | vLLM, concurrency 1 |", "| --- | --- | --- | --- |"]
    for name, s in per_set.items():
        lines.append(f"| {name} | {s.get('acceptance_length')} | {(s.get('as_served') or {}).get('acceptance_length')} "
                     f"| {(online.get(name) or {}).get('acceptance_length', 'n/a')} |")
    return lines + [""]


def offline_vs_online(offline: dict, serving: dict) -> list[str]:
    """The offline estimate as served beside vLLM's acceptance length at the same K, concurrency 1
    (how far the offline figure can be trusted); nothing when the two were taken at different K."""
    as_served = offline.get("as_served")
    online = measured_point(serving, offline.get("k"))
    if not as_served or not online.get("acceptance_length"):
        return []
    ratio = as_served["acceptance_length"] / online["acceptance_length"]
    return [f"- offline vs online at K={offline['k']}, concurrency 1: {as_served['acceptance_length']} as served "
            f"against vLLM's {online['acceptance_length']} over {online['requests_finished']} requests "
            f"(offline / online {ratio:.3f})"]


def parity_line(parity: dict | None) -> list[str]:
    """The parity gate's verdict (evaluate --parity), which writes its file only when vLLM's counts
    and the offline replay agree: the card waits for it, so a card beside a served AL that the gate
    rejects is never written."""
    if not parity:
        return []
    served, replay = parity.get("served_counts") or {}, parity.get("replay_counts") or {}
    tolerance = max((p.get("tolerance") or 0 for p in parity.get("positions", [])), default=0)
    return [f"- parity gate at K={parity.get('k')}, concurrency {parity.get('concurrency')}: "
            f"agree: vLLM's {parity.get('served_acceptance_length')} "
            f"over {served.get('drafts', 'n/a')} drafts against the offline replay's "
            f"{parity.get('replay_acceptance_length')} over {replay.get('drafts', 'n/a')} drafts of the same "
            f"{parity.get('requests', 'n/a')} requests (per-position tolerance {tolerance:.3f}, z={parity.get('z')})"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft-config", required=True, help="config.json of the exported draft")
    p.add_argument("--summary", required=True, help="train/summary.json")
    p.add_argument("--data-stats", required=True, help="data/stats.json")
    p.add_argument("--offline", required=True, help="eval/offline.json")
    p.add_argument("--serving", help="eval/serving.json, when serving was benchmarked")
    p.add_argument("--regeneration-stats", nargs="*", default=[],
                   help="regenerated/stats.json and eval_prompts_stats.json, where the run made them (their loads)")
    p.add_argument("--manifest", help="hidden_states/manifest.json (the extraction's loads)")
    p.add_argument("--parity-manifest", help="the parity extraction's part manifest (its load)")
    p.add_argument("--parity", help="eval/parity.json, the parity gate's verdict")
    add_stage_arguments(p, "model_card")
    p.add_argument("--out", required=True)
    p.add_argument("--run-summary", help="also write the run's summary here (JSON: the target loads)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    where = {"config": args.draft_config, "summary": args.summary, "offline": args.offline}
    if args.serving:
        where["serving"] = args.serving
    try:
        inputs = {name: read_json_object(Path(path), name, CardError) for name, path in where.items()}
        if mla_draft.is_served_config(inputs["config"]):  # an MLA draft: vLLM's plain config, not speculators'
            inputs["config"] = mla_draft.card_view(inputs["config"])
        stats = read_json_object(Path(args.data_stats), "data stats", CardError)

        def optional(path, what):
            return read_json_object(Path(path), what, CardError) if path else None

        regeneration = [read_json_object(Path(f), "regeneration stats", CardError) for f in args.regeneration_stats]
        loads = target_loads(regeneration,
                             optional(args.manifest, "extraction manifest"),
                             inputs["summary"].get("disk_budget"), inputs.get("serving"),
                             optional(args.parity_manifest, "parity extraction manifest"))
        text = card(inputs["config"], inputs["summary"], args.which, stats, inputs["offline"],
                    inputs.get("serving"), Path(args.draft_config).parent, args.tensor_parallel_size,
                    args.trust_remote_code, where, unservable(_field(inputs["summary"], "target_model", args.summary)),
                    loads, optional(args.parity, "parity gate"),
                    next((r["new_user_turns"] for r in regeneration if "new_user_turns" in r), None))
    except CardError as e:
        raise SystemExit(f"model_card: {e}") from None
    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"wrote {args.out}")
    if args.run_summary:
        write_json(args.run_summary, {"target_loads": loads_summary(loads)})
        print(f"wrote {args.run_summary}: {len(loads)} target load(s)")


if __name__ == "__main__":
    main()
