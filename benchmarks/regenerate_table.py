"""Issue 17's table from finished runs: drafts trained on the data's answers vs the target's own.

    python benchmarks/regenerate_table.py results/RUN_A results/RUN_B ... [--serving results/x/serving_RUN.json ...]
        [--json table.json]

Per run (a results/<run_name> directory): the regeneration's accounting (answers kept, loops and
answers at max_new_tokens among those generated, tok/s), the tokens trained, the offline AL on the
fixed evaluation set (eval/offline.json: evaluate.prompts, e.g. MT-Bench; per token, and as served:
the positions vLLM drafts at, tokens per draft, where the file has it), vLLM's online AL at
concurrency 1 with its speedup (eval/serving.json), and offline / online at the offline estimate's
K (as served where known, else per token). ``--serving`` files
(benchmark_serving run on its own, e.g. with the GPU to itself) replace a run's serving figures when
their draft is that run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def concurrency_one(serving: dict) -> dict:
    """The best K at concurrency 1: its AL, speedup and K (None where nothing was measured)."""
    points = [p for p in serving["points"] if p["concurrency"] == 1 and p["k"] is not None]
    if not points:
        return {}
    best = max(points, key=lambda p: p["speedup"])
    return {"k": best["k"], "online_al": best["acceptance_length"], "speedup": best["speedup"],
            "by_k": {p["k"]: {"al": p["acceptance_length"], "speedup": p["speedup"]} for p in points}}


def row(run: Path, isolated: dict[str, dict]) -> dict:
    regen, data = read(run / "regenerated" / "stats.json"), read(run / "data" / "stats.json")
    offline, serving = read(run / "eval" / "offline.json"), read(run / "eval" / "serving.json")
    r = {"run": run.name, "answers": "the data's" if regen is None else "the target's"}
    if regen:
        st = regen["settings"]
        modes = regen["by_mode"].values()
        generated = sum(m["answers"] for m in modes)
        r.update(temperature=st["temperature"], top_p=st["top_p"], turns=st["turns"], on_loop=st["on_loop"],
                 answer_sets=st.get("answers_per_conversation", 1), loop_retries=st.get("loop_retries", 0),
                 max_new_tokens=st["max_new_tokens"], conversations_kept=regen["kept"], read=regen["read"],
                 loops=sum(m["loops"] for m in modes) / max(generated, 1),
                 at_max_new_tokens=sum(m["truncated"] for m in modes) / max(generated, 1),
                 generated_tok_per_s=regen["run"].get("generated_tokens_per_s"))
    if data:
        r["trained_tokens"] = data["splits"]["train"]["assistant_tokens"]
        r["eval_samples"] = data["splits"]["eval"]["samples"]
    if offline:
        r["offline_al"] = offline["acceptance_length"]
        r["offline_k"] = offline["k"]
        r["offline_al_as_served"] = (offline.get("as_served") or {}).get("acceptance_length")
    src = isolated.get(str((run / "draft").resolve())) or serving
    if src:
        r.update(concurrency_one(src), serving_measured="alone on the GPU" if src is not serving else "in the run")
        online = r.get("by_k", {}).get(r.get("offline_k"), {}).get("al")
        estimate = r.get("offline_al_as_served") or r.get("offline_al")
        if estimate and online:
            r["offline_over_online"] = estimate / online
    return r


def fmt(v, spec=""):
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--serving", nargs="*", type=Path, default=[])
    p.add_argument("--shared-gpu", action="store_true",
                   help="the runs shared the GPU: their own serving speedups are marked as not comparable")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    isolated = {}
    for f in a.serving:
        s = read(f)
        if s:
            isolated[str(Path(s["draft"]).resolve())] = s
    rows = [row(r, isolated) for r in a.runs]
    print("| run | answers | T / top_p / turns | kept / read | loops, at cap | regen tok/s | trained tokens "
          "| offline AL (fixed set): per token, as served | online AL c=1 (K) | speedup c=1 "
          "| offline / online (same K) |")
    print("|" + " --- |" * 11)
    for r in rows:
        temperature = "greedy" if r.get("temperature") == 0 else f"{r.get('temperature')} / {r.get('top_p')}"
        sampling = "-"
        if "turns" in r:
            sampling = (f"{temperature} / {r['turns']}" + {"keep": ", loops kept", "trim": ", loops trimmed"}.get(r["on_loop"], "")
                        + (f", loops asked again up to {r['loop_retries']}x" if r["loop_retries"] else "")
                        + (f", {r['answer_sets']} answer sets" if r["answer_sets"] > 1 else ""))
        kept = f"{r['conversations_kept']} / {r['read']}" if "read" in r else "-"
        degenerate = f"{r['loops']:.0%}, {r['at_max_new_tokens']:.0%}" if "loops" in r else "-"
        print(f"| {r['run']} | {r['answers']} | {sampling} | {kept} | {degenerate} | {fmt(r.get('generated_tok_per_s'), ',.0f')} "
              f"| {fmt(r.get('trained_tokens'), ',')} | {fmt(r.get('offline_al'), '.3f')}, {fmt(r.get('offline_al_as_served'), '.3f')} "
              f"| {fmt(r.get('online_al'), '.3f')} ({fmt(r.get('k'))}) | {fmt(r.get('speedup'), '.2f')}"
              f"{'*' if a.shared_gpu and r.get('serving_measured') == 'in the run' else ''} | {fmt(r.get('offline_over_online'), '.3f')} |")
    if a.shared_gpu and any(r.get("serving_measured") == "in the run" for r in rows):
        print("\n* measured while the other runs shared the GPU: AL holds, the speedup does not")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
