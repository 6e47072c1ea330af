"""Stages evaluate_offline, evaluate_parity: offline evaluation of an exported draft, acceptance
length by greedy chain replay on held-out hidden-state shards (acceptance.py), written to
``offline.json``: overall and by stratum (context length, assistant turn, inside/outside
thinking, the data's category; ``strata``), and ``as_served``: the same text counted at the
positions vLLM drafts at (tokens per draft), the figure to hold against vLLM's AL.

With ``--parity serving.json`` (``rule evaluate_parity``) the shards hold the sequences vLLM produced
in the serving benchmark's parity window instead; the replay follows vLLM's drafting positions on them
and must agree with vLLM's spec-decode counters for that window (parity.py); it exits with an error
naming both numbers and the likely causes when it does not."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from .atomic import read_json_object, write_json
from .layers import aux_layer_ids
from .settings import add_stage_arguments
from .shard_manifest import load_manifest

log = logging.getLogger("eaglepipe.evaluate")

# rows only bound memory: the estimate is the same for any packing; longer samples are truncated (logged)
EVAL_BATCH_TOKENS = 8192


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglepipe.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--draft", required=True, help="exported draft directory (config.json + model.safetensors)")
    p.add_argument("--manifest", required=True)
    p.add_argument("--split", default="eval")
    p.add_argument("--model", required=True, help="target model directory")
    p.add_argument("--k", type=int, required=True, help="draft tokens per chain (num_speculative_tokens)")
    p.add_argument("--parity", default=None, metavar="SERVING_JSON",
                   help="compare with the counters of benchmark_serving's parity window instead")
    p.add_argument("--out", required=True)
    add_stage_arguments(p, "evaluate")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.k < 1:
        p.error(f"--k {args.k}: must be >= 1")
    return args


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    from speculators.losses import resolve_loss_config

    from .draft_model import LOSS_IMPLEMENTATION, load_draft
    from .evaluation import Evaluation
    from .runtime import set_threads

    set_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    served = parity_run(args.parity, args.k) if args.parity else None
    try:
        manifest = load_manifest(args.manifest)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    model = load_draft(args.draft, args.model, device)
    aux = [int(i) for i in aux_layer_ids(manifest["layer_ids"])]
    if list(model.target_layer_ids) != aux:
        raise SystemExit(f"draft {args.draft}: eagle_aux_hidden_state_layer_ids {model.target_layer_ids} differ "
                         f"from the manifest's aux ids {aux} ({args.manifest})")
    evaluation = Evaluation(manifest, args.split, args.model, args.context_buckets, args.trust_remote_code, device)
    loss_config = resolve_loss_config("kl_div", LOSS_IMPLEMENTATION)
    if args.parity:
        run_parity(args, served, model, evaluation.rows(EVAL_BATCH_TOKENS), evaluation.head, loss_config, device)
        return
    result = evaluation(model, args.k, loss_config, EVAL_BATCH_TOKENS)
    result.update(split=args.split, draft=str(Path(args.draft)), manifest=str(Path(args.manifest)),
                  target_model=str(args.model))
    write_json(args.out, result)
    log.info("acceptance length %s (k=%d) over %d anchors; per-position acceptance %s",
             result["acceptance_length"], args.k, result["anchors"], result["per_position_acceptance"])
    log.info("as vLLM would count it on this text: acceptance length %s over %d drafts",
             result["as_served"]["acceptance_length"], result["as_served"]["drafts"])
    for name, by_label in result["strata"].items():
        shown = (f"{label} {s['acceptance_length']} ({s['anchors']} anchors)" for label, s in by_label.items())
        log.info("acceptance length by %s: %s", name, ", ".join(shown))


def parity_run(path: str, k: int) -> dict:
    """The parity window benchmark_serving recorded in serving.json."""
    try:
        run = read_json_object(path, "serving benchmark")["parity_run"]
        if run["k"] != k:
            raise SystemExit(f"{path}: parity_run.k is {run['k']}, --k {k}; replay the K that was served")
        if not run["counters"]:
            raise SystemExit(f"{path}: parity_run has no spec-decode counters")
        return run
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"{path}: no usable parity_run ({e!r}); rerun benchmark_serving") from e


def run_parity(args, served: dict, model, rows, head, loss_config, device) -> None:
    from .acceptance import replay_walk
    from .parity import compare, report

    walk = replay_walk(model, rows, head, args.k, loss_config, device=device)
    result = compare(walk, served["counters"], z=args.parity_z)
    result.update(requests=served["requests"], concurrency=served["concurrency"], manifest=str(Path(args.manifest)),
                  draft=str(Path(args.draft)), serving=str(Path(args.parity)), replay_counts=walk,
                  served_counts=served["counters"])
    text = report(result)
    log.info("%s", text)
    if not result["agree"]:
        raise SystemExit(text)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
