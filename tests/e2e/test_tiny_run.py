"""A tiny end-to-end run of tests/configs/tiny.yaml on CPU (the session's finished run, conftest.py):
its outputs, what reruns after a change of settings, code or data, and what never does."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors import safe_open

import tiny
from workflow import STAGES, dry_run, refused, summary, tree_digest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def done_run(finished_tiny, tmp_path_factory):
    """This module's copy of the session's finished tiny run (conftest.py), which its tests edit."""
    ws = tmp_path_factory.mktemp("ws") / "ws"
    shutil.copytree(finished_tiny.ws, ws, symlinks=True)
    return ws


def test_stages_keep_the_callers_pythonpath(finished_tiny):
    seen = finished_tiny.callers_stages
    stages = {f"eaglepipe.{m}" for m in ("prepare_data", "vocab_mapping", "extract_hidden_states",
                                          "gather_manifest", "train_draft", "export_draft",
                                          "evaluate", "model_card", "plots")}
    assert stages <= seen, seen


def test_end_to_end_outputs(done_run):
    run = done_run / "results" / "tiny"
    cfg = json.loads((run / "draft" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "tiny/llama"
    manifest = json.loads((run / "hidden_states" / "manifest.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"][:-1]
    assert manifest["layer_ids"] == [1, 3, 5, 6]  # the default for 6 layers: 3 distinct aux ids, then N
    with safe_open(str(run / "draft" / "model.safetensors"), "pt") as f:
        assert {"d2t", "t2d", "fc.weight"} <= set(f.keys())
    offline = json.loads((run / "eval" / "offline.json").read_text())
    assert offline["tokens_evaluated"] > 0
    assert 1.0 <= offline["acceptance_length"] <= 1 + offline["k"]
    for svg in ("training.svg", "data_stats.svg"):
        assert (run / "report" / svg).read_text().lstrip().startswith(("<?xml", "<svg"))
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["kept"] > 0
    # the run's one target load (hf extraction), in its summary and the card
    loads = json.loads((run / "summary.json").read_text())["target_loads"]
    assert loads["count"] == 1 and loads["loads"][0]["stage"] == "extract_hidden_states"
    assert loads["loads"][0]["seconds"] == manifest["throughput"]["model_load_s"] > 0
    assert "started the target 1 time(s)" in (run / "draft" / "README.md").read_text()


def test_nothing_to_do_after_a_full_run(done_run):
    jobs, _, out = dry_run(done_run)
    assert jobs == {}, out
    assert "Nothing to be done" in out
    rows = summary(done_run)
    assert rows and all(r["plan"] == "no update" for r in rows.values()), rows


def test_training_setting_reruns_training_and_what_follows_only(done_run):
    for setting in ('train={"lr": 0.002}', 'train={"optimizer": "muon", "muon_weight_decay": 0.05}',
                    'train={"lm_head": "trained"}', 'draft={"layers": 2}'):
        jobs, reasons, _ = dry_run(done_run, "--config", setting)
        assert set(jobs) == {"train_draft", "export_draft", "evaluate_offline", "model_card", "plot_report", "all"}
        assert "train_draft" in reasons["params have changed since last execution"]


def test_settings_that_change_no_output_rerun_nothing(done_run):
    """Where vLLM's files wait (extract.staging_dir) changes no shard: training must not rerun."""
    jobs, _, out = dry_run(done_run, "--config", f'extract={{"staging_dir": "{done_run / "staging"}"}}')
    assert jobs == {}, out


def test_data_setting_reruns_from_tokenization(done_run):
    jobs, _, _ = dry_run(done_run, "--config", 'data={"max_length": 80}')
    assert set(jobs) == STAGES


def test_template_settings_rerun_from_tokenization(done_run):
    jobs, reasons, _ = dry_run(done_run, "--config", 'data={"chat_template_kwargs": {"enable_thinking": false}}')
    assert set(jobs) == STAGES and "prepare_data" in reasons["params have changed since last execution"]
    template = done_run / "template.jinja"
    template.write_text(tiny.CHATML_TEMPLATE)
    jobs, _, _ = dry_run(done_run, "--config", f'data={{"chat_template": "{template}"}}')
    assert set(jobs) == STAGES
    jobs, _, _ = dry_run(done_run, "--config", 'data={"rerendered_turns": "context"}')
    assert set(jobs) == STAGES


def test_a_changed_data_stats_file_reruns_the_rules_that_read_it(done_run):
    stats = done_run / "results" / "tiny" / "data" / "stats.json"
    original, times = stats.read_text(), stats.stat()
    try:
        stats.write_text(original.replace("{", '{"edited": true, ', 1))
        jobs, reasons, _ = dry_run(done_run)
        assert set(jobs) == {"plot_report", "model_card", "all"}
        assert {"plot_report", "model_card"} <= set(reasons["updated input files"])
    finally:
        stats.write_text(original)
        os.utime(stats, ns=(times.st_atime_ns, times.st_mtime_ns))


def test_code_edit_reruns_that_stage_and_its_dependants(done_run):
    module = done_run / "scripts" / "eaglepipe" / "export_draft.py"
    original = module.read_text()
    try:
        module.write_text(original + "\n# an edit\n")
        jobs, reasons, _ = dry_run(done_run)
        assert set(jobs) == {"export_draft", "evaluate_offline", "model_card", "plot_report", "all"}
        assert "export_draft" in reasons["params have changed since last execution"]
    finally:
        module.write_text(original)
    module = done_run / "scripts" / "eaglepipe" / "extract_hf.py"
    original = module.read_text()
    try:
        module.write_text(original + "\n# an edit\n")
        jobs, _, _ = dry_run(done_run)
        assert set(jobs) == STAGES - {"prepare_data", "vocab_mapping"}
    finally:
        module.write_text(original)


def test_delivered_draft_is_write_protected(done_run):
    # The exporter writes the draft read-only and never over a delivered one (rules/export.smk,
    # tests/test_export_draft.py); the card is rewritten whenever the evaluation reruns.
    for name in ("config.json", "model.safetensors"):
        f = done_run / "results" / "tiny" / "draft" / name
        assert not (f.stat().st_mode & 0o222), f"{f} is writable"


def test_forced_reruns_never_touch_the_users_model_directory(finished_tiny, done_run):
    """The session's finished run was a forced one (`snakemake -F`, workflow.finish_tiny_run)."""
    assert "No rule to produce build_target" in refused(done_run, "--forcerun", "build_target")  # nothing builds it
    assert (done_run / "results" / "tiny" / "draft" / "README.md").is_file()
    assert tree_digest(finished_tiny.target) == finished_tiny.target_before
