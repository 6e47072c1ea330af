"""How much one draft's speedup moves between serving engines, and whether an engine setting moves it.

    python benchmarks/serving_spread.py LABEL=serving.json [LABEL=serving.json ...] [--k 3] [--json out.json]

Each file is one ``eaglepipe.benchmark_serving`` run (a target-alone engine and one per K); files
sharing a LABEL are repeats of one setting (e.g. ``small`` for gpu_memory_utilization 0.1 with an
8 GiB KV cache, ``default`` for vLLM's 0.9). Per file, at concurrency 1 and the given K: the target's
ms a token, the speculative engine's, AL, speedup, and the speculative step in target steps
(AL x ms a token with the draft / ms a token alone: what a draft step costs against a plain one).
Then per label the mean and range of each, and each label's mean speedup against the first label's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ("target_ms", "draft_ms", "acceptance_length", "speedup", "step_in_target_steps")


def point(serving: dict, k: int | None) -> dict:
    found = [p for p in serving["points"] if p["concurrency"] == 1 and p["k"] == k]
    if not found:
        raise SystemExit(f"no concurrency-1 point for K={k} (have {[(p['concurrency'], p['k']) for p in serving['points']]})")
    return found[0]


def measure(serving: dict, k: int) -> dict:
    alone, drafted = point(serving, None), point(serving, k)
    al = drafted["acceptance_length"]
    return {"target_ms": alone["mean_tpot_ms"], "draft_ms": drafted["mean_tpot_ms"], "acceptance_length": al,
            "speedup": drafted["speedup"],
            "step_in_target_steps": round(al * drafted["mean_tpot_ms"] / alone["mean_tpot_ms"], 3)}


def summarize(runs: list[tuple[str, dict]]) -> dict:
    labels = list(dict.fromkeys(label for label, _ in runs))
    by_label = {}
    for label in labels:
        rows = [m for l, m in runs if l == label]
        by_label[label] = {c: {"mean": round(statistics.fmean(r[c] for r in rows), 4),
                               "min": min(r[c] for r in rows), "max": max(r[c] for r in rows)} for c in COLUMNS}
        by_label[label]["runs"] = len(rows)
    first = by_label[labels[0]]["speedup"]["mean"]
    for label in labels:
        by_label[label]["speedup_vs_first"] = round(by_label[label]["speedup"]["mean"] / first, 4)
    return by_label


def table(runs: list[tuple[str, dict]], by_label: dict, k: int) -> str:
    head = "| setting | target ms/token | with draft ms/token | AL | speedup | step in target steps |"
    lines = [f"K={k}, concurrency 1, one row per serving run", "", head, "|" + " --- |" * 6]
    lines += [f"| {label} | " + " | ".join(f"{m[c]:g}" for c in COLUMNS) + " |" for label, m in runs]
    lines += ["", "| setting | runs | " + " | ".join(f"{c} mean (min-max)" for c in COLUMNS) + " | speedup vs first |",
              "|" + " --- |" * (3 + len(COLUMNS))]
    for label, s in by_label.items():
        cells = " | ".join(f"{s[c]['mean']:g} ({s[c]['min']:g}-{s[c]['max']:g})" for c in COLUMNS)
        lines.append(f"| {label} | {s['runs']} | {cells} | {s['speedup_vs_first']:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="LABEL=serving.json")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    runs = []
    for item in a.files:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            p.error(f"{item!r}: give LABEL=serving.json")
        try:
            runs.append((label, measure(json.loads(Path(path).read_text()), a.k)))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise SystemExit(f"{path}: not a benchmark_serving result ({type(e).__name__}: {e})") from e
    by_label = summarize(runs)
    print(table(runs, by_label, a.k))
    if a.json:
        Path(a.json).write_text(json.dumps({"k": a.k, "runs": [dict(m, setting=l) for l, m in runs],
                                            "by_setting": by_label}, indent=1))


if __name__ == "__main__":
    main()
