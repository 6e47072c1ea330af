"""Stages plot_report, plot_serving: report figures (training curves, data/extraction statistics,
the serving benchmark) as SVG for `snakemake --report`.

    python -m eaglepipe.plots --metrics train/metrics.jsonl --stats data/stats.json \
        --manifest hidden_states/manifest.json --offline eval/offline.json \
        --training-out report/training.svg --data-out report/data_stats.svg
    python -m eaglepipe.plots --serving eval/serving.json --serving-out report/serving.svg

Every input key except the manifest's ``splits`` is optional: a missing series is left out of its
panel (and said so in it), never an error. Malformed metrics lines are skipped, counted and listed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .atomic import atomic_path, read_json_object  # noqa: E402
from .shard_manifest import load_manifest  # noqa: E402
from .units import human_bytes  # noqa: E402

ACC_KEY = re.compile(r"(?:full_)?acc_(\d+)")


def read_metrics(path: str | Path) -> tuple[list[dict], list[int]]:
    """Rows of metrics.jsonl and the line numbers that were not JSON objects (skipped)."""
    rows, bad = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad.append(n)
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append(n)
    return rows, bad


def read_json(path: str | Path) -> dict:
    """An optional JSON object input; unreadable or not an object -> {} (the figure says what is missing)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"plots: {path} not used ({e})")
        return {}
    return obj if isinstance(obj, dict) else {}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if _num(r.get("step")) and _num(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="grey")


def training_figure(rows: list[dict], offline: dict) -> Figure:
    train = [r for r in rows if r.get("split", "train") == "train"]
    evals = [r for r in rows if r.get("split") == "eval"]
    fig, (ax_loss, ax_acc, ax_al, ax_ctx) = plt.subplots(1, 4, figsize=(20, 4.2), layout="constrained")

    x, y = series(train, "loss")
    if x:
        ax_loss.plot(x, y, color="C0", lw=1.2, label="train")
    ex, ey = series(evals, "loss")
    if ex:
        ax_loss.plot(ex, ey, "o-", color="C3", ms=4, lw=1, label="eval")
    if x or ex:
        ax_loss.legend()
    else:
        _empty(ax_loss, "loss")
    ax_loss.set(title="Loss (sum over TTT steps)", xlabel="optimizer step", ylabel="loss")

    acc_keys = sorted({k for r in train for k in r if ACC_KEY.fullmatch(k)}, key=lambda k: int(ACC_KEY.fullmatch(k)[1]))
    for k in acc_keys:
        ax_acc.plot(*series(train, k), lw=1.2, label=f"draft token {int(ACC_KEY.fullmatch(k)[1]) + 1}")
    if acc_keys:
        ax_acc.legend(title="train accuracy")
        ax_acc.set_ylim(0, 1)
    else:
        _empty(ax_acc, "per-step accuracy")
    ax_acc.set(title="Accuracy per TTT step", xlabel="optimizer step", ylabel="top-1 accuracy")

    x, y = series(evals, "acceptance_length")
    if x:
        ax_al.plot(x, y, "o-", color="C2", ms=4, label="eval (offline estimate)")
        ax_al.annotate(f"{y[0]:.2f}", (x[0], y[0]), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax_al.annotate(f"{y[-1]:.2f}", (x[-1], y[-1]), textcoords="offset points", xytext=(-10, 6), fontsize=8)
    final = offline.get("acceptance_length")
    if _num(final):
        ax_al.axhline(final, color="k", ls="--", lw=1, label=f"exported draft: {final:.2f}")
    if x or _num(final):
        ax_al.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax_al.legend()
    else:
        _empty(ax_al, "acceptance length")
    k = offline.get("k")
    ax_al.set(title="Acceptance length" + (f" (K={k}, bonus token counted)" if k else ""),
              xlabel="optimizer step", ylabel="tokens per target step")
    context_panel(ax_ctx, offline)
    return fig


def context_panel(ax, offline: dict) -> None:
    """The exported draft's AL per prefix-length bucket (offline.json ``strata.context``), each bar
    labelled with its AL and anchors; a bucket without anchors is shown empty."""
    buckets = (offline.get("strata") or {}).get("context")
    if not isinstance(buckets, dict) or not buckets:
        _empty(ax, "AL by context length")
    else:
        labels = list(buckets)
        al = [b.get("acceptance_length") if isinstance(b, dict) else None for b in buckets.values()]
        anchors = [b.get("anchors", 0) if isinstance(b, dict) else 0 for b in buckets.values()]
        bars = ax.bar(range(len(labels)), [a if _num(a) else 0 for a in al], color="C2")
        for bar, a, n in zip(bars, al, anchors, strict=True):
            text = f"{a:.2f}\n{n:,} anchors" if _num(a) else "no anchors"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        textcoords="offset points", xytext=(0, 3), fontsize=8)
        ax.set_xticks(range(len(labels)), labels)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, max([a for a in al if _num(a)], default=1.0) * 1.25)
    ax.set(title="Acceptance length by context length (exported draft)", xlabel="prefix tokens at the anchor",
           ylabel="tokens per target step")


def skip_reasons(stats: dict) -> dict:
    """{reason: n} from ``skipped_by_reason`` or a dict-valued ``skipped``; a bare count -> {"total": n}."""
    for key in ("skipped_by_reason", "skipped"):
        value = stats.get(key)
        if isinstance(value, dict):
            return {str(r): n for r, n in sorted(value.items()) if _num(n)}
    return {"total": stats["skipped"]} if _num(stats.get("skipped")) else {}


def data_figure(stats: dict, manifest: dict) -> Figure:
    fig, (ax_keep, ax_tok, ax_bytes) = plt.subplots(1, 3, figsize=(15, 4.2), layout="constrained")

    bars = ([("kept", stats["kept"])] if _num(stats.get("kept")) else []) + [
        (f"skipped: {reason}", n) for reason, n in skip_reasons(stats).items()]
    if bars:
        labels, values = zip(*bars)
        colors = ["C2"] + ["C3"] * (len(bars) - 1) if _num(stats.get("kept")) else ["C3"] * len(bars)
        ax_keep.barh(labels, values, color=colors)
        ax_keep.invert_yaxis()
        for i, v in enumerate(values):
            ax_keep.text(v, i, f" {v:,}", va="center", fontsize=8)
        ax_keep.margins(x=0.2)
    else:
        _empty(ax_keep, "kept/skipped counts")
    read = stats.get("read")
    ax_keep.set(title="Conversations" + (f" ({read:,} read)" if _num(read) else ""), xlabel="conversations")

    splits = manifest.get("splits", {})
    names = sorted(splits, key=lambda n: ({"train": 0, "eval": 1}.get(n, 2), n))
    tokens = [splits[s].get("tokens", 0) for s in names]
    nbytes = [splits[s].get("bytes", 0) for s in names]
    ax_tok.bar(names, tokens, color="C0")
    for i, t in enumerate(tokens):
        ax_tok.text(i, t, f"{t:,}", ha="center", va="bottom", fontsize=8)
    ax_tok.set(title="Tokens per split", ylabel="tokens")
    ax_bytes.bar(names, nbytes, color="C1")
    for i, (b, t) in enumerate(zip(nbytes, tokens)):
        per_tok = f"\n{b / t:,.0f} B/token" if t else ""
        ax_bytes.text(i, b, f"{human_bytes(b)}{per_tok}", ha="center", va="bottom", fontsize=8)
    ax_bytes.margins(y=0.2)
    ax_bytes.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v)))
    ax_bytes.set(title="Hidden states on disk")
    tp = manifest.get("throughput") if isinstance(manifest.get("throughput"), dict) else {}
    if _num(tp.get("tokens_per_s")):
        line = f"Hidden-state extraction: {tp['tokens_per_s']:,.0f} tokens/s"
        if _num(tp.get("seconds")):
            line += f" over {tp['seconds']:,.1f} s"
        if _num(tp.get("model_load_s")):
            line += f" (+ {tp['model_load_s']:,.1f} s model load)"
        fig.suptitle(line)
    return fig


# Per prompt set: one marker and dash per set beside the merged point's circles and solid line, in
# its K's colour; a derived K's acceptance: hollow markers (no engine of its own, not timed).
MERGED_STYLE = {"marker": "o", "ls": "-"}
SET_STYLES = [{"marker": "s", "ls": "--"}, {"marker": "^", "ls": "-."}, {"marker": "D", "ls": (0, (5, 1, 1, 1, 1, 1))},
              {"marker": "v", "ls": (0, (8, 2))}]
DERIVED_STYLE = {"marker": "o", "ls": ":", "mfc": "none"}


def serving_prompt_sets(points: list[dict]) -> list[str]:
    """The fixed evaluation sets the points were timed one window each for (``by_prompt_set``), in
    their recorded order; none for a single set, whose one window is the merged point itself."""
    names = list(dict.fromkeys(name for p in points for name in p.get("by_prompt_set") or {}))
    return names if len(names) > 1 else []


def prompt_set_points(points: list[dict], sets: list[str]) -> list[dict]:
    """One row per speculative point and set: the set's acceptance length and its speedup, the set's
    window's tokens/s over the target alone's window of the same set at the same concurrency
    (serving.json records the speedup of the merged point only)."""
    baseline = {p["concurrency"]: p.get("by_prompt_set") or {} for p in points if p.get("k") is None}
    rows = []
    for p in points:
        if p.get("k") is None:
            continue
        for name in sets:
            timed = (p.get("by_prompt_set") or {}).get(name) or {}
            tokens_per_s = timed.get("output_tokens_per_s")
            base = (baseline.get(p["concurrency"], {}).get(name) or {}).get("output_tokens_per_s")
            rows.append({"k": p["k"], "concurrency": p["concurrency"], "prompt_set": name,
                         "acceptance_length": timed.get("acceptance_length"),
                         "speedup": tokens_per_s / base if _num(tokens_per_s) and _num(base) and base else None})
    return rows


def timed_series(ks: list[int], points: list[dict], sets: list[str], set_points: list[dict],
                 colors: dict) -> list[tuple[list[dict], dict]]:
    """(rows, line style and label) of each timed K's merged points, then of each set's."""
    out = []
    for k in ks:
        out.append(([p for p in points if p.get("k") == k],
                    {"color": colors[k], "label": f"K={k}, all sets" if sets else f"K={k}", **MERGED_STYLE}))
        out += [([r for r in set_points if r["k"] == k and r["prompt_set"] == name],
                 {"color": colors[k], "label": f"K={k}, {name}", **style})
                for name, style in zip(sets, itertools.cycle(SET_STYLES))]
    return out


def by_concurrency_line(ax, rows: list[dict], key: str, **style) -> None:
    pts = sorted((r["concurrency"], r[key]) for r in rows if _num(r.get(key)))
    ax.plot([c for c, _ in pts], [v for _, v in pts], ms=4, **style)


def acceptance_panel(ax, series: list[tuple[list[dict], dict]], derived: list[dict], colors: dict,
                     legend_title: str) -> None:
    """vLLM's acceptance length against concurrency: the timed K's series, then each derived K's
    (merged only: derived_points come from the merged window's counts)."""
    for rows, style in series:
        by_concurrency_line(ax, rows, "acceptance_length", **style)
    for k in sorted({p["k"] for p in derived}):
        rows = [p for p in derived if p["k"] == k]
        by_concurrency_line(ax, rows, "acceptance_length", color=colors[k], **DERIVED_STYLE,
                            label=f"K={k}, derived from K={rows[0].get('derived_from_k', '?')}, not timed")
    if ax.lines:
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.legend(title=legend_title)
    else:
        _empty(ax, "acceptance length")
    ax.set(title="Acceptance length in vLLM (bonus token counted)", xlabel="requests in flight",
           ylabel="tokens per target step")


def serving_figure(serving: dict) -> Figure:
    """Speedup against concurrency, one line per K, and the table of every point; with several
    prompt sets, each set's own line beside each K's merged one, and acceptance length in a panel
    of its own (derived K included, marked)."""
    points = serving.get("points", [])
    ks = sorted({p["k"] for p in points if p.get("k") is not None})
    # derived K: acceptance only, from the largest timed K's per-position counts (no engine of their own)
    derived = [p for p in serving.get("derived_points", []) if _num(p.get("acceptance_length"))]
    derived_ks = sorted({p["k"] for p in derived} - set(ks))
    # the timed K first: they keep C0, C1, ... whether derived K are drawn or not
    colors = {k: f"C{i}" for i, k in enumerate(ks + derived_ks)}
    sets = serving_prompt_sets(points)
    if sets:
        fig, (ax, ax_al, ax_table) = plt.subplots(1, 3, figsize=(22, 4.8), layout="constrained",
                                                  gridspec_kw={"width_ratios": [1, 1, 1.5]})
    else:
        fig, (ax, ax_table) = plt.subplots(1, 2, figsize=(15, 4.8), layout="constrained",
                                           gridspec_kw={"width_ratios": [1, 1.5]})
    series = timed_series(ks, points, sets, prompt_set_points(points, sets), colors)
    for rows, style in series:
        by_concurrency_line(ax, rows, "speedup", **style)
    legend_title = "draft tokens, prompt set" if sets else "draft tokens"
    if ks:
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.legend(title=legend_title)
    else:
        _empty(ax, "speculative point")
    best = serving.get("recommended", {})
    ax.set(title="Speedup of target + draft over the target alone"
           + (f"\n(recommended K={best['k']}, among the timed K)" if "k" in best else ""),  # one line is cut off
           xlabel="requests in flight", ylabel="output tokens/s ratio")
    if sets:
        acceptance_panel(ax_al, series, derived, colors, legend_title)
        counts = serving.get("prompt_sets") or {}
        fig.suptitle("One timed window per prompt set at each point: "
                     + ", ".join(f"{name} ({counts[name]} prompts)" if name in counts else name for name in sets)
                     + "; a set's speedup is over the target alone on the same set")

    ax_table.axis("off")
    header = ["K", "conc.", "tok/s", "TPOT ms", "speedup", "AL", "identical"]
    cells = [["-" if p.get("k") is None else str(p["k"]), str(p["concurrency"]), f"{p['output_tokens_per_s']:,.0f}",
              f"{p['mean_tpot_ms']:.2f}" if _num(p.get("mean_tpot_ms")) else "-",
              f"{p['speedup']:.3f}" if _num(p.get("speedup")) else "-",
              f"{p['acceptance_length']:.2f}" if _num(p.get("acceptance_length")) else "-",
              f"{p['identical_outputs_fraction']:.0%}" if _num(p.get("identical_outputs_fraction")) else "-"]
             for p in points]
    cells += [[f"{p['k']} (derived from {p.get('derived_from_k', '?')})", str(p["concurrency"]), "-", "-", "-",
               f"{p['acceptance_length']:.2f}", "-"] for p in derived]
    if cells:
        table = ax_table.table(cellText=cells, colLabels=header, loc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(7)
    else:
        _empty(ax_table, "serving point")
    ax_table.set_title("Every point (K - = the target alone" + ("; all sets together)" if sets else ")")
                       + ("; derived K: acceptance only, not timed" if derived else ""))
    return fig


def save_svg(fig: Figure, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="svg")
    plt.close(fig)


TRAINING_FLAGS = ("metrics", "stats", "manifest", "offline", "training_out", "data_out")
SERVING_FLAGS = ("serving", "serving_out")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics", help="train/metrics.jsonl")
    p.add_argument("--stats", help="data/stats.json")
    p.add_argument("--manifest", help="hidden_states/manifest.json")
    p.add_argument("--offline", help="eval/offline.json")
    p.add_argument("--training-out")
    p.add_argument("--data-out")
    p.add_argument("--serving", help="eval/serving.json")
    p.add_argument("--serving-out")
    args = p.parse_args(argv)
    groups = {name: [getattr(args, f) is not None for f in flags]
              for name, flags in (("training", TRAINING_FLAGS), ("serving", SERVING_FLAGS))}
    for name, given in groups.items():
        if any(given) and not all(given):
            flags = TRAINING_FLAGS if name == "training" else SERVING_FLAGS
            p.error(f"the {name} figures need all of " + ", ".join("--" + f.replace("_", "-") for f in flags))
    if not any(all(g) for g in groups.values()):
        p.error("give the training/data flags, the serving flags, or both")
    if all(groups["serving"]):
        try:
            serving = read_json_object(args.serving, "serving benchmark")
        except ValueError as e:
            raise SystemExit(f"plots: {e}") from None
        save_svg(serving_figure(serving), args.serving_out)
        print(f"plots: wrote {args.serving_out}")
    if not all(groups["training"]):
        return
    try:
        rows, bad = read_metrics(args.metrics)
        manifest = load_manifest(args.manifest)
    except (OSError, ValueError) as e:
        raise SystemExit(f"plots: {e}") from None
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
        print(f"plots: skipped {len(bad)} malformed line(s) of {args.metrics}: line {shown}")
    print(f"plots: {len(rows)} metrics rows")
    save_svg(training_figure(rows, read_json(args.offline)), args.training_out)
    save_svg(data_figure(read_json(args.stats), manifest), args.data_out)
    print(f"plots: wrote {args.training_out} and {args.data_out}")


if __name__ == "__main__":
    main()
