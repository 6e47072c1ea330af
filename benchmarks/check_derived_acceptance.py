"""How close the derived acceptance of a lower K comes to a measured one (issue 44, part 2).

The serving benchmark times only the K a user serves and derives the acceptance length of every
lower K from that K's per-position counts (eaglepipe.serving_sweep.derived_points). This script
takes serving.json files that measured several K on the same draft and prompts, derives each lower
K from the largest K measured at the same concurrency, exactly as the pipeline does, and sets the
two side by side: measured, derived, relative error. A K whose error exceeds ``--tolerance`` at any
point would have to stay measured (the script says which and exits 1).

    python benchmarks/check_derived_acceptance.py                   # the recorded SmolLM2 sweeps
    python benchmarks/check_derived_acceptance.py A.json B.json --out check.json

Points are compared within one sweep: the same directory (machine), target, draft path, prompts
and answer length, at one concurrency; files of one sweep may each hold some of its K.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
from eaglepipe.serving_sweep import derived_acceptance_length  # noqa: E402

# the recorded sweeps of SmolLM2-135M drafts that measured more than one K (benchmarks/README.md#serving)
RECORDED = ["h200/pipeline_serving.json", "h200/regenerate_serving_t06_all_alone.json",
            "h100/serving_t06_all_x2_k2_k4.json", "h100/serving_t06_all_x2_default_1.json"]


def sweep_points(paths: list[Path]) -> dict[tuple, dict[int, dict]]:
    """(sweep, concurrency) -> K -> the measured point (with the file it came from)."""
    out: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        d = json.loads(path.read_text())
        sweep = (str(path.parent.name), d["model"], d["draft"], d["num_prompts"], d["max_tokens"])
        for p in d["points"]:
            if p.get("k") is None or not p.get("num_drafts"):
                continue
            at = out.setdefault((*sweep, p["concurrency"]), {})
            if p["k"] in at:
                continue  # a repeat of a K already read: the first file given wins
            at[p["k"]] = dict(p, file=str(path))
    return out


def compare(paths: list[Path]) -> list[dict]:
    rows = []
    for (machine, _, draft, _, _, concurrency), by_k in sorted(sweep_points(paths).items()):
        k_max = max(by_k)
        source = by_k[k_max]
        for k in sorted(by_k):
            if k == k_max:
                continue
            measured = by_k[k]["acceptance_length"]
            derived = derived_acceptance_length(source["accepted_per_position"], source["num_drafts"], k)
            rows.append({"machine": machine, "draft": draft, "concurrency": concurrency, "k": k,
                         "derived_from_k": k_max, "measured": measured, "derived": round(derived, 4),
                         "relative_error": round(derived / measured - 1, 4),
                         "measured_in": by_k[k]["file"], "derived_from": source["file"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="serving.json files (default: the recorded sweeps)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative error a derived K may have")
    p.add_argument("--out", type=Path, help="also write the comparison as JSON")
    args = p.parse_args(argv)
    files = args.files or [HERE / f for f in RECORDED]
    rows = compare(files)
    if not rows:
        raise SystemExit("no sweep measured two K at one concurrency: nothing to compare")
    print(f"{'machine':7} {'draft':34} {'conc':>4} {'K':>2} {'from':>4} {'measured':>8} {'derived':>8} {'error':>7}")
    for r in rows:
        print(f"{r['machine']:7} {r['draft'][-34:]:34} {r['concurrency']:>4} {r['k']:>2} {r['derived_from_k']:>4} "
              f"{r['measured']:>8.4f} {r['derived']:>8.4f} {r['relative_error']:>+7.2%}")
    worst = max(rows, key=lambda r: abs(r["relative_error"]))
    over = sorted({r["k"] for r in rows if abs(r["relative_error"]) > args.tolerance})
    print(f"{len(rows)} points; largest error {worst['relative_error']:+.2%} (K={worst['k']} from "
          f"K={worst['derived_from_k']}, concurrency {worst['concurrency']}, {worst['machine']}); "
          + (f"K {over} exceed {args.tolerance:.0%}: they stay measured" if over
             else f"every derived K within {args.tolerance:.0%}"))
    if args.out:
        args.out.write_text(json.dumps({"tolerance": args.tolerance, "files": [str(f) for f in files],
                                        "max_abs_relative_error": abs(worst["relative_error"]),
                                        "over_tolerance_k": over, "points": rows}, indent=1) + "\n")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
