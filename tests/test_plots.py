"""plots: report SVGs from metrics, data stats and the manifest; tolerant of missing optional keys."""

import io
import json
import xml.etree.ElementTree as ET

import matplotlib.pyplot as plt
import pytest

from eaglepipe import plots
from eaglepipe.serving_sweep import derived_points, merge_windows, set_indices, sweep_rows
from eaglepipe.shard_manifest import write_manifest


def write_inputs(d, metrics_rows, stats, manifest, offline, junk_lines=()):
    d.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in metrics_rows] + list(junk_lines)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "stats.json").write_text(json.dumps(stats))
    write_manifest(d / "manifest.json", manifest)
    (d / "offline.json").write_text(json.dumps(offline))
    return [f"--metrics={d / 'metrics.jsonl'}", f"--stats={d / 'stats.json'}", f"--manifest={d / 'manifest.json'}",
            f"--offline={d / 'offline.json'}", f"--training-out={d / 'out' / 'training.svg'}",
            f"--data-out={d / 'out' / 'data_stats.svg'}"]


def full_set():
    rows = [{"step": 0, "split": "eval", "loss": 9.0, "acceptance_length": 1.01}]
    for s in range(1, 41):
        rows.append({"step": s, "split": "train", "loss": 9.0 / (1 + 0.1 * s), "lr": 3e-4, "tokens_per_s": 900.0,
                     **{f"acc_{k}": min(1.0, 0.02 * s / (k + 1)) for k in range(3)}})
        if s % 20 == 0:
            rows.append({"step": s, "split": "eval", "loss": 9.0 / (1 + 0.1 * s), "acceptance_length": 1.0 + s / 40})
    stats = {"read": 100, "kept": 90, "skipped": 10, "skipped_by_reason": {"no_assistant": 7, "empty": 3}}
    manifest = {"layer_ids": [2, 3, 5, 6], "target": {"model": "t"}, "shard_dir": "shards",
                "splits": {"train": {"samples": 85, "tokens": 20000, "bytes": 20000 * 512},
                           "eval": {"samples": 5, "tokens": 1000, "bytes": 1000 * 512}},
                "throughput": {"tokens": 21000, "seconds": 7.0, "tokens_per_s": 3000.0, "model_load_s": 1.5}}
    offline = {"acceptance_length": 1.93, "k": 3,
               "strata": {"context": {"<=512": {"acceptance_length": 2.31, "anchors": 1200},
                                      "<=2048": {"acceptance_length": 1.87, "anchors": 800},
                                      ">2048": {"acceptance_length": None, "anchors": 0}}}}
    return rows, stats, manifest, offline


def svg_texts(path):
    root = ET.parse(path).getroot()  # parses: well-formed SVG
    assert root.tag.endswith("svg")
    return path.read_text()


def test_full_inputs(tmp_path, capsys):
    args = write_inputs(tmp_path, *full_set(), junk_lines=['{"step": 41, "loss"'])
    plots.main(args)
    out = tmp_path / "out"
    for name in ("training.svg", "data_stats.svg"):
        assert (out / name).stat().st_size > 10_000
        svg_texts(out / name)
    assert not list(out.glob(".tmp-*"))
    printed = capsys.readouterr().out
    assert "skipped 1 malformed line(s)" in printed and "line 44" in printed
    # matplotlib writes text as glyph paths; the element ids keep the series labels
    training = (out / "training.svg").read_text()
    assert training.count("<path") > 50


def test_figures_as_png(tmp_path):
    """PNG renderings (kept in the test's tmp dir) to look at the figures by eye."""
    rows, stats, manifest, offline = full_set()
    for name, fig in (("training.png", plots.training_figure(rows, offline)),
                      ("data_stats.png", plots.data_figure(stats, manifest))):
        texts = {t.get_text() for ax in fig.axes for t in ax.texts} | {ax.get_title() for ax in fig.axes}
        fig.savefig(tmp_path / name, dpi=60)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
        if name == "training.png":
            assert {"1.01", "2.00"} <= texts  # untrained step-0 and last eval AL annotated
            labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
            assert labels == ["draft token 1", "draft token 2", "draft token 3"]
            assert "exported draft: 1.93" in [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
            assert [t.get_text() for t in fig.axes[3].get_xticklabels()] == ["<=512", "<=2048", ">2048"]
            assert [t.get_text() for t in fig.axes[3].texts] == ["2.31\n1,200 anchors", "1.87\n800 anchors",
                                                                 "no anchors"]
            assert [round(b.get_height(), 2) for b in fig.axes[3].patches] == [2.31, 1.87, 0.0]
        else:
            assert "Conversations (100 read)" in texts
            assert "3,000 tokens/s over 7.0 s" in fig.get_suptitle()
            assert "20,000" in texts and any("512 B/token" in t for t in texts)
            labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
            assert labels == ["kept", "skipped: empty", "skipped: no_assistant"]


def test_missing_optional_keys(tmp_path):
    rows = [{"step": 1, "loss": 3.0}, {"step": 2}, {"split": "eval"}, {"step": 3, "split": "eval"}]
    manifest = {"layer_ids": [2, 6], "target": {}, "shard_dir": "s", "splits": {"train": {}}}
    plots.main(write_inputs(tmp_path, rows, {}, manifest, {}))
    for name in ("training.svg", "data_stats.svg"):
        assert (tmp_path / "out" / name).stat().st_size > 5_000

    fig = plots.training_figure([], {})
    assert [t.get_text() for t in fig.axes[2].texts] == ["no acceptance length recorded"]
    assert [t.get_text() for t in fig.axes[3].texts] == ["no AL by context length recorded"]
    fig = plots.data_figure({"kept": 5, "skipped": 2}, manifest)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["kept", "skipped: total"]


def test_unreadable_optional_inputs_are_reported(tmp_path, capsys):
    args = write_inputs(tmp_path, *full_set())
    (tmp_path / "offline.json").write_text("not json")
    (tmp_path / "stats.json").write_text("[1, 2]")
    plots.main(args)
    assert "offline.json not used" in capsys.readouterr().out
    assert (tmp_path / "out" / "training.svg").is_file()


def test_bad_manifest_is_a_clear_error(tmp_path):
    args = write_inputs(tmp_path, *full_set())
    (tmp_path / "manifest.json").write_text('{"splits": {}}')
    with pytest.raises(SystemExit, match=r"plots: manifest .*manifest.json: missing key 'layer_ids'"):
        plots.main(args)


def test_serving_figure(tmp_path, capsys):
    points = [{"k": None, "concurrency": c, "output_tokens_per_s": 100.0 * c, "mean_tpot_ms": 10.0}
              for c in (1, 4)]
    points += [{"k": k, "concurrency": c, "output_tokens_per_s": 130.0 * c, "mean_tpot_ms": 7.5, "speedup": 1.3,
                "acceptance_length": 2.1, "identical_outputs_fraction": 0.9} for k in (1, 2) for c in (1, 4)]
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"points": points, "recommended": {"k": 2}}))
    out = tmp_path / "out" / "serving.svg"
    plots.main([f"--serving={serving}", f"--serving-out={out}"])
    text = svg_texts(out)
    assert out.stat().st_size > 10_000 and text.count("<path") > 20
    assert "wrote" in capsys.readouterr().out


def test_serving_figure_marks_derived_k_and_gives_them_no_speed(tmp_path):
    points = [{"k": None, "concurrency": 1, "output_tokens_per_s": 100.0, "mean_tpot_ms": 10.0},
              {"k": 3, "concurrency": 1, "output_tokens_per_s": 151.0, "mean_tpot_ms": 6.6, "speedup": 1.51,
               "acceptance_length": 2.25}]
    derived = [{"k": k, "concurrency": 1, "derived_from_k": 3, "acceptance_length": al}
               for k, al in ((1, 1.625), (2, 2.0))]
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"points": points, "derived_points": derived, "recommended": {"k": 3}}))
    out = tmp_path / "serving.svg"
    plots.main([f"--serving={serving}", f"--serving-out={out}"])
    text = svg_texts(out)
    assert "1 (derived from 3)" in text and "2 (derived from 3)" in text and "2.00" in text and "1.62" in text
    assert "derived K: acceptance only, not timed" in text and "among the timed K" in text
    assert "1.510" in text  # the timed K's speedup; the derived rows have none
    assert text.count("1.510") == 1


def test_cli_needs_a_complete_group(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plots.main([f"--serving={tmp_path / 's.json'}"])
    assert "--serving, --serving-out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plots.main([])
    assert "give the training/data flags, the serving flags, or both" in capsys.readouterr().err


def two_set_serving() -> dict:
    """serving.json's points as benchmark_serving builds them when evaluate.prompts lists two sets:
    one window per set at each point (merge_windows), K=3 timed, K=1 and 2 derived."""
    indices = set_indices(["mtbench", "humaneval", "humaneval"])

    def window(seconds, output_tokens, counters):
        return {"seconds": seconds, "output_tokens": output_tokens, "tpot_s": [0.01], "counters": counters,
                "finished": [{"id": "r", "prompt": 0, "tokens": [1]}]}

    mt = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 12, "accepted_per_pos": [6, 4, 2]}
    he = {"drafts": 20, "draft_tokens": 60, "accepted_tokens": 39, "accepted_per_pos": [18, 12, 9]}
    baseline = {"k": None, "points": {str(c): merge_windows(
        {"mtbench": window(2.0, 196 * c, None), "humaneval": window(2.0, 202 * c, None)}, indices) for c in (1, 4)}}
    k3 = {"k": 3, "points": {str(c): merge_windows(
        {"mtbench": window(2.0, 300 * c, mt), "humaneval": window(2.0, 420 * c, he)}, indices) for c in (1, 4)}}
    rows = sweep_rows(baseline, {3: k3})
    return {"points": rows, "derived_points": derived_points(rows), "recommended": {"k": 3},
            "prompt_sets": {"mtbench": 80, "humaneval": 164}}


def legend_labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_serving_figure_shows_each_prompt_set_beside_the_merged_point(tmp_path):
    serving = two_set_serving()
    fig = plots.serving_figure(serving)
    ax_speedup, ax_al, _ = fig.axes
    per_k = ["K=3, all sets", "K=3, mtbench", "K=3, humaneval"]
    assert legend_labels(ax_speedup) == per_k
    speedup = lines_by_label(ax_speedup)
    assert list(speedup["K=3, all sets"].get_ydata()) == [1.809, 1.809]  # (300 + 420) / (196 + 202), as recorded
    # a set's speedup: its window's tokens/s over the target alone's window of the same set
    assert speedup["K=3, mtbench"].get_ydata() == pytest.approx([300 / 196] * 2)
    assert speedup["K=3, humaneval"].get_ydata() == pytest.approx([420 / 202] * 2)
    assert list(speedup["K=3, humaneval"].get_xdata()) == [1, 4]
    assert {line.get_color() for label, line in speedup.items() if label in per_k} == {"C0"}  # one colour per K
    assert len({speedup[label].get_linestyle() for label in per_k}) == 3

    derived = ["K=1, derived from K=3, not timed", "K=2, derived from K=3, not timed"]
    assert legend_labels(ax_al) == per_k + derived
    al = lines_by_label(ax_al)
    assert list(al["K=3, all sets"].get_ydata()) == [2.7, 2.7]  # 1 + 51 / 30
    assert list(al["K=3, mtbench"].get_ydata()) == [2.2, 2.2]
    assert list(al["K=3, humaneval"].get_ydata()) == [2.95, 2.95]
    assert list(al[derived[0]].get_ydata()) == [1.8, 1.8]  # 1 + 24 / 30, the merged counts
    # derived K stay marked: hollow markers, never filled as a timed point's
    assert {al[label].get_markerfacecolor() for label in derived} == {"none"}
    assert al["K=3, mtbench"].get_markerfacecolor() != "none"
    assert "mtbench (80 prompts), humaneval (164 prompts)" in fig.get_suptitle()
    assert "all sets together" in fig.axes[2].get_title()

    path = tmp_path / "serving.json"
    path.write_text(json.dumps(serving))
    out = tmp_path / "serving.svg"
    plots.main([f"--serving={path}", f"--serving-out={out}"])
    text = svg_texts(out)
    for label in per_k + derived:
        assert label in text
    assert "1 (derived from 3)" in text  # the table's derived rows as before


def svg_of(serving) -> str:
    """The serving figure's SVG with matplotlib's date and ids fixed, to compare two figures."""
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": "test"}):
        fig = plots.serving_figure(serving)
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def test_serving_figure_of_one_prompt_set_is_the_merged_figure():
    serving = two_set_serving()
    for p in serving["points"]:
        p["by_prompt_set"] = {"mtbench": p["by_prompt_set"]["mtbench"]}
    plain = {**serving, "points": [{k: v for k, v in p.items() if k != "by_prompt_set"} for p in serving["points"]]}
    assert svg_of(serving) == svg_of(plain)
    fig = plots.serving_figure(serving)
    assert len(fig.axes) == 2 and not fig.get_suptitle()
    assert legend_labels(fig.axes[0]) == ["K=3"]
    assert "all sets" not in svg_of(serving) and "mtbench" not in svg_of(serving)
