"""Issue 45's data-scale curve: helpers of benchmarks/gpu_data_curve.sh, on CPU.

    python3 benchmarks/data_curve.py seed --dest results/curve-2000 [--source results/curve-all \
        --records 2000] [--shards-from results/curve-6000]
        Gives a smaller run the regeneration of the full one, before its snakemake: the full run's
        parts that cover its first RECORDS records (a part is a batch of regenerate.batch_size
        records, keyed by its records and the answer settings, never by the run, so a run that reads
        a prefix of the data makes the same parts; eaglepipe.regeneration) and every part of the
        fixed evaluation set, hard-linked (copied across file systems) into the run's own parts
        directories: its regenerate_responses job reuses them, generates nothing and starts no
        engine. --shards-from also gives it the eval shards of a run that
        extracted them (the same fixed set and extraction settings in every size): its extraction
        reuses them all and, under a disk budget, does not start the target.
    python3 benchmarks/data_curve.py steps RUN_DIR --passes P --row-tokens T
        The training steps that make P passes over a prepared run's train tokens (its
        data/stats.json) in rows of about T tokens: the steps of the size whose data is known only
        once made (the "new" size: every record and user turns the target writes itself).
    python3 benchmarks/data_curve.py curve RUN_DIR... [--steps TSV] [--logs DIR] [--k 3] [--json OUT] [--md OUT] \
        [--svg OUT] [--rows-from EARLIER.json]
        The curve: per run its data (records read, conversations kept, samples, train tokens),
        training (steps, tokens seen, passes, the budget's window), offline AL (overall and per
        fixed set) and online AL at concurrency 1 and K (per set), the wall time of each stage
        (Snakemake's job start and finish in the size's log under --logs, else its benchmark files)
        and the issue's stopping rule: the online AL gained per doubling of the conversations kept,
        against 2 % (offline AL as served on MT-Bench for a pair with a size not served). --rows-from
        puts an earlier curve's rows first (sizes of an earlier session). --svg: the curve as a figure, AL against the conversations kept beside each
        run's held-out AL during its training against the tokens it had seen (where the sizes' points
        lie on one another's training curves, the steps, not the unique data, made the difference).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eaglepipe.regeneration import PART_NAME  # noqa: E402
from eaglepipe.serving_sweep import measured_point  # noqa: E402

STOP_GAIN = 0.02  # issue 45: stop when doubling the unique conversations adds less than 2 % online AL


# ---------------------------------------------------------------------------------- seed
def link(src: Path, dst: Path) -> None:
    """dst as a hard link of src (a copy across file systems); an existing dst is replaced."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and os.path.samefile(src, dst):
        return
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def indexed_parts(parts_dir: Path) -> list[tuple[int, Path]]:
    """The parts of a finished regeneration, by index; SystemExit when an index has two files (a
    run that did not finish leaves stale ones, removed only when it completes)."""
    parts: dict[int, Path] = {}
    for p in sorted(parts_dir.glob("*.json")):
        m = PART_NAME.match(p.name)
        if not m:
            continue
        i = int(m.group(1))
        if i in parts:
            raise SystemExit(f"{parts_dir}: parts {parts[i].name} and {p.name} share index {i}: the regeneration "
                             "that wrote them did not finish (rerun it first)")
        parts[i] = p
    return sorted(parts.items())


def part_records(path: Path) -> int:
    return int(json.loads(path.read_text())["stats"]["read"])


def seed(dest: Path, source: Path | None = None, records: int | None = None, shards_from: Path | None = None) -> dict:
    """Link into run ``dest`` the parts of ``source``'s regeneration that cover its first ``records``
    records and every part of the fixed evaluation set, and the eval shards of ``shards_from``."""
    report = {"dest": str(dest)}
    if source is not None:
        report.update(seed_regeneration(source, dest, records))
    if shards_from is not None:
        shard_dir = shards_from / "hidden_states/shards"
        shards = sorted(shard_dir.glob("eval-*.safetensors"))
        if not shards:
            print(f"seed: {shard_dir} holds no eval shard: the run extracts its own", file=sys.stderr)
        for p in shards:
            link(p, dest / "hidden_states/shards" / p.name)
            checksum = p.with_name(p.name + ".checksum")
            if checksum.is_file():
                link(checksum, dest / "hidden_states/shards" / checksum.name)
        report.update(shards_from=str(shards_from), eval_shards=len(shards))
    print(json.dumps(report), file=sys.stderr)
    return report


def seed_regeneration(source: Path, dest: Path, records: int) -> dict:
    src = source / "regenerated"
    if not (src / "chats.jsonl").is_file():
        raise SystemExit(f"{src / 'chats.jsonl'} does not exist: run the full regeneration first")
    covered, linked = 0, 0
    for i, path in indexed_parts(src / "chats-parts"):
        if i != linked:
            raise SystemExit(f"{src / 'chats-parts'}: part {i} follows part {linked - 1}: parts are missing")
        n = part_records(path)
        if covered + n > records:
            break
        link(path, dest / "regenerated/chats-parts" / path.name)
        covered, linked = covered + n, linked + 1
    if covered != records:
        print(f"seed: the first {linked} parts cover {covered} of the {records} records: the run regenerates the "
              "rest (give data.max_samples a multiple of regenerate.batch_size to reuse them all)", file=sys.stderr)
    evals = [p for p in sorted((src / "eval_prompts-parts").glob("*.json")) if PART_NAME.match(p.name)]
    for p in evals:
        link(p, dest / "regenerated/eval_prompts-parts" / p.name)
    return {"source": str(source), "records": records, "parts": linked, "records_covered": covered,
            "eval_parts": len(evals)}


def steps_for(run: Path, passes: float, row_tokens: int) -> int:
    """Steps of ``row_tokens`` that make ``passes`` passes over the run's prepared train tokens."""
    stats = run / "data/stats.json"
    try:
        tokens = json.loads(stats.read_text())["splits"]["train"]["tokens"]
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"{stats}: no train tokens ({type(e).__name__}: {e}); prepare the run's data first") from e
    return max(1, math.ceil(passes * tokens / row_tokens))


# ---------------------------------------------------------------------------------- figure
def training_curve(run: Path) -> tuple[list[int], list[float]]:
    """(tokens seen, held-out AL as served) at each of the run's evaluations (train/metrics.jsonl)."""
    tokens, points = {0: 0}, []
    try:
        lines = (run / "train/metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return [], []
    for line in lines:
        row = json.loads(line)
        if row.get("split") == "train" and "train_tokens" in row:
            tokens[row["step"]] = row["train_tokens"]
        elif row.get("split") == "eval" and isinstance(row.get("as_served"), dict):
            points.append((row["step"], row["as_served"]["acceptance_length"]))
    seen = [(tokens[step], al) for step, al in points if step in tokens]
    return [t for t, _ in seen], [al for _, al in seen]


def figure(rows: list[dict], runs: list[Path], k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_data, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    kept = [r for r in rows if r["conversations_kept"]]
    for key, label, style in (("online_al", f"online, concurrency 1, K={k}", dict(marker="o")),
                              ("offline_al_as_served", "offline, as served", dict(marker="s", fillstyle="none"))):
        points = [(r["conversations_kept"], r[key], r) for r in kept if r[key]]
        if points:
            by_data.plot([x for x, _, _ in points], [y for _, y, _ in points], label=label, **style)
    for r in kept:
        al = r["online_al"] or r["offline_al_as_served"]
        if al:
            passes = "?" if r["passes"] is None else f"{r['passes']:.2f}"
            by_data.annotate(f"{r['steps']} steps, {passes} passes", (r["conversations_kept"], al),
                             textcoords="offset points", xytext=(4, -12), fontsize=8)
    by_data.set_xscale("log", base=2)
    by_data.set(xlabel="conversations kept (log2)", ylabel="acceptance length", title="AL against unique data")
    by_data.legend(fontsize=8)
    for run in runs:
        x, y = training_curve(run)
        if x:
            by_tokens.plot([t / 1e6 for t in x], y, marker=".", label=run.name)
    by_tokens.set(xlabel="tokens seen (millions)", ylabel="held-out AL, as served",
                  title="each run's AL during training")
    by_tokens.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)


# ---------------------------------------------------------------------------------- curve
def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def stage_seconds_from_log(log: Path) -> dict[str, float]:
    """Seconds of each job in a Snakemake log (its `[date]` lines before `rule X:` and `Finished
    jobid: N`), summed by rule; {} when there is no log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return {}
    now, pending, started, seconds = None, None, {}, {}
    for line in lines:
        if line.startswith("[") and line.endswith("]"):
            try:
                now = datetime.strptime(line[1:-1], "%a %b %d %H:%M:%S %Y")
            except ValueError:
                pass
            continue
        m = re.match(r"^(?:local)?rule (\w+):$", line)
        if m:
            pending = (m.group(1), now)
            continue
        m = re.match(r"^\s+jobid: (\d+)$", line)
        if m and pending:
            started[m.group(1)] = pending
            pending = None
            continue
        m = re.match(r"^Finished jobid: (\d+) \(Rule: (\w+)\)", line)
        if m and m.group(1) in started and now is not None:
            rule, t0 = started.pop(m.group(1))
            seconds[rule] = seconds.get(rule, 0.0) + (now - t0).total_seconds()
    return seconds


def stage_seconds_from_benchmarks(run: Path) -> dict[str, float]:
    """Seconds of the stages that keep a Snakemake benchmark file (the `s` column)."""
    seconds = {}
    for f in sorted((run / "benchmarks").glob("*.tsv")):
        with open(f, newline="") as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        if rows:
            seconds[f.stem.split(".replica-")[0]] = float(rows[0]["s"])
    return seconds


def chain_steps(path: Path | None) -> dict[str, dict]:
    """The chain's steps TSV (step, rc, seconds); the last row of each step."""
    if path is None or not path.is_file():
        return {}
    with open(path, newline="") as fh:
        return {r["step"]: r for r in csv.DictReader(fh, delimiter="\t")}


def per_set(strata: dict | None) -> dict[str, dict]:
    return ((strata or {}).get("prompt_set")) or {}


def curve_row(run: Path, k: int, steps: dict[str, dict], logs: Path | None) -> dict:
    regen = read_json(run / "regenerated/stats.json") or {}
    data = read_json(run / "data/stats.json") or {}
    summary = read_json(run / "train/summary.json") or {}
    offline = read_json(run / "eval/offline.json") or {}
    serving = read_json(run / "eval/serving.json")
    parity = read_json(run / "eval/parity.json")
    budget = summary.get("disk_budget") or {}
    train = (data.get("splits") or {}).get("train") or {}
    point = measured_point(serving, k)
    name = run.name
    # the size's step: its run without the disk budget when the chain fell back to one
    key = next((s for s in (f"size-{name}-nobudget", f"size-{name}") if s in steps), f"size-{name}")
    step = steps.get(key) or {}
    seconds = stage_seconds_from_log(logs / f"{key}.log") if logs else {}
    # stages the size's Snakemake did not run (the full run's regeneration has a step of its own)
    others = {s: v for s, v in stage_seconds_from_benchmarks(run).items() if s not in seconds}
    row = {
        "run": name,
        "records_read": regen.get("read"),
        "conversations_kept": regen.get("kept"),
        "answer_tokens_generated": (regen.get("run") or {}).get("generated_tokens"),
        "train_samples": train.get("samples"),
        "train_tokens": train.get("tokens"),
        "steps": summary.get("steps"),
        "tokens_seen": summary.get("train_tokens"),
        "passes": budget.get("passes"),
        "distinct_samples_trained": budget.get("distinct_samples_trained"),
        "disk_budget": {key: budget.get(key) for key in ("budget_bytes", "projected_bytes", "shuffle_window_shards",
                                                         "order", "shards_extracted", "reextraction_s",
                                                         "peak_shard_bytes", "model_loads_s")} if budget else None,
        "offline_al": offline.get("acceptance_length"),
        "offline_al_as_served": (offline.get("as_served") or {}).get("acceptance_length"),
        "offline_by_set": {name: {"al": s.get("acceptance_length"),
                                  "al_as_served": (s.get("as_served") or {}).get("acceptance_length")}
                           for name, s in per_set(offline.get("strata")).items()},
        "online_al": point.get("acceptance_length"),
        "online_by_set": {name: s.get("acceptance_length") for name, s in (point.get("by_prompt_set") or {}).items()},
        "online_requests": point.get("requests_finished"),
        "speedup": point.get("speedup"),
        "parity_agrees": None if parity is None else parity.get("agree"),
        "stage_seconds": {**seconds, **others},
        # where they come from: the size's Snakemake log (each job's start to its end), the others
        # from the stages' benchmark files
        "stage_seconds_from": {"snakemake log": sorted(seconds), "benchmark files": sorted(others)},
        "without_budget_fallback": key.endswith("-nobudget"),
        "wall_s": float(step["seconds"]) if step.get("seconds") else None,
        "chain_rc": int(step["rc"]) if step.get("rc") not in (None, "") else None,
    }
    return row


ONLINE, OFFLINE_MTBENCH = "online", "offline as served, mtbench"


def rule_al(row: dict, measure: str) -> float | None:
    return row["online_al"] if measure == ONLINE else (row["offline_by_set"].get("mtbench") or {}).get("al_as_served")


def stopping_rule(rows: list[dict]) -> dict:
    """AL gained per doubling of the conversations kept, between consecutive sizes; stop at the first
    pair that gains less than STOP_GAIN. Online AL; a pair where a size was not served (a session
    short of device time: OMIT_FROM=benchmark_serving) compares both sizes' offline AL as served on
    the same MT-Bench prompts, which has matched the served figure (benchmarks/README.md#data-scale-curve-issue-45)."""
    done = sorted((r for r in rows if r["conversations_kept"] and any(rule_al(r, m) for m in (ONLINE, OFFLINE_MTBENCH))),
                  key=lambda r: r["conversations_kept"])
    pairs = []
    for a, b in zip(done, done[1:]):
        measure = ONLINE if a["online_al"] and b["online_al"] else OFFLINE_MTBENCH
        if not (rule_al(a, measure) and rule_al(b, measure)):
            continue
        doublings = math.log2(b["conversations_kept"] / a["conversations_kept"])
        gain = rule_al(b, measure) / rule_al(a, measure) - 1
        per_doubling = gain / doublings if doublings > 0 else None
        pairs.append({"from": a["run"], "to": b["run"], "measure": measure, "doublings": round(doublings, 3),
                      "gain": round(gain, 4), "gain_per_doubling": None if per_doubling is None else round(per_doubling, 4),
                      "below_threshold": per_doubling is not None and per_doubling < STOP_GAIN})
    stop = next((p for p in pairs if p["below_threshold"]), None)
    verdict = (f"stop: {stop['from']} -> {stop['to']} gained {stop['gain_per_doubling']:+.2%} AL ({stop['measure']}) "
               "per doubling" if stop else "more data still pays (every measured doubling gained >= 2 %)" if pairs
               else "fewer than two sizes measured: no verdict")
    return {"threshold_per_doubling": STOP_GAIN, "pairs": pairs, "verdict": verdict}


def fmt(v, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict], rule: dict, k: int, chain: list[dict] = ()) -> str:
    sets = list(dict.fromkeys(s for r in rows for s in r["offline_by_set"]))
    online_sets = list(dict.fromkeys(s for r in rows for s in r["online_by_set"]))
    head = (["run", "records", "conversations kept", "train tokens", "steps", "tokens seen", "passes"]
            + ["offline AL (as served)"] + [f"offline {s}" for s in sets]
            + [f"online AL c=1 K={k}"] + [f"online {s}" for s in online_sets] + ["speedup", "wall s"])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["run"], fmt(r["records_read"], ","), fmt(r["conversations_kept"], ","), fmt(r["train_tokens"], ","),
                 fmt(r["steps"]), fmt(r["tokens_seen"], ","), fmt(r["passes"])]
        cells.append(f"{fmt(r['offline_al'], '.3f')} ({fmt(r['offline_al_as_served'], '.3f')})")
        cells += [fmt((r["offline_by_set"].get(s) or {}).get("al_as_served"), ".3f") for s in sets]
        cells.append(fmt(r["online_al"], ".3f"))
        cells += [fmt(r["online_by_set"].get(s), ".3f") for s in online_sets]
        cells += [fmt(r["speedup"], ".3f"), fmt(r["wall_s"], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    stages = list(dict.fromkeys(s for r in rows for s in r["stage_seconds"]))
    if stages:
        lines += ["", "| stage (s) | " + " | ".join(r["run"] for r in rows) + " |", "|" + " --- |" * (len(rows) + 1)]
        for s in stages:
            lines.append(f"| {s} | " + " | ".join(fmt(r["stage_seconds"].get(s), ".0f") for r in rows) + " |")
    lines += [""] + [f"- {p['from']} -> {p['to']}: {p['doublings']} doublings of the conversations, AL "
                     f"({p.get('measure', ONLINE)}) {p['gain']:+.2%}, {p['gain_per_doubling']:+.2%} per doubling"
                     for p in rule["pairs"]]
    lines.append(f"- stopping rule (< {rule['threshold_per_doubling']:.0%} per doubling): {rule['verdict']}")
    if chain:
        lines.append("- chain steps (s, rc): " + ", ".join(f"{c['step']} {c['seconds']:.0f}"
                                                           + (f" (rc {c['rc']})" if c["rc"] else "") for c in chain))
    return "\n".join(lines) + "\n"


def curve(runs: list[Path], k: int = 3, steps: Path | None = None, logs: Path | None = None,
          rows_from: Path | None = None) -> dict:
    """The curve of ``runs``, after the rows of an earlier curve's JSON (``rows_from``: sizes measured in
    an earlier device session, whose run directories are gone; a run measured again replaces its row)."""
    chain = chain_steps(steps)
    rows = [curve_row(r, k, chain, logs) for r in runs]
    if rows_from is not None:
        earlier = json.loads(rows_from.read_text())
        if earlier.get("k") != k:
            raise SystemExit(f"{rows_from}: its rows are at K={earlier.get('k')}, this curve's at K={k}")
        fresh = {r["run"] for r in rows}
        rows = [r for r in earlier["rows"] if r["run"] not in fresh] + rows
    return {"k": k, "concurrency": 1, "rows": rows, "stopping_rule": stopping_rule(rows),
            "chain_steps": [{"step": s, "rc": int(r["rc"]), "seconds": float(r["seconds"])} for s, r in chain.items()]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("seed", help="give a smaller run the full run's regeneration parts (and eval shards)")
    s.add_argument("--dest", type=Path, required=True, help="the run's directory (results/RUN)")
    s.add_argument("--source", type=Path, help="the full run's directory, whose regeneration to give it")
    s.add_argument("--records", type=int, help="with --source: the run's data.max_samples")
    s.add_argument("--shards-from", type=Path, help="a run directory whose eval shards to give it")
    t = sub.add_parser("steps", help="the steps that make PASSES passes over a prepared run's train tokens")
    t.add_argument("run", type=Path)
    t.add_argument("--passes", type=float, required=True)
    t.add_argument("--row-tokens", type=int, required=True, help="tokens a training row holds, on average")
    c = sub.add_parser("curve", help="the curve of finished runs, and the stopping rule")
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--k", type=int, default=3)
    c.add_argument("--steps", type=Path, help="the chain's steps TSV (step, rc, seconds)")
    c.add_argument("--logs", type=Path, help="where the chain's size-RUN.log (Snakemake's output) are")
    c.add_argument("--json", type=Path)
    c.add_argument("--md", type=Path)
    c.add_argument("--svg", type=Path, help="the curve as a figure")
    c.add_argument("--rows-from", type=Path, help="an earlier curve's JSON: its rows come first (their training "
                   "curves are not in it, so the figure's right panel shows only RUN_DIRs')")
    args = ap.parse_args(argv)
    if args.command == "seed":
        if (args.source is None) != (args.records is None):
            ap.error("--source and --records go together")
        if args.records is not None and args.records < 1:
            ap.error("--records must be >= 1")
        if args.source is None and args.shards_from is None:
            ap.error("nothing to give: --source/--records, --shards-from or both")
        seed(args.dest, args.source, args.records, args.shards_from)
        return
    if args.command == "steps":
        if args.passes <= 0 or args.row_tokens < 1:
            ap.error("--passes must be > 0 and --row-tokens >= 1")
        print(steps_for(args.run, args.passes, args.row_tokens))
        return
    result = curve(args.runs, args.k, args.steps, args.logs, args.rows_from)
    table = markdown(result["rows"], result["stopping_rule"], args.k, result["chain_steps"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    if args.svg:
        figure(result["rows"], args.runs, args.k, args.svg)
    print(table)


if __name__ == "__main__":
    main()
