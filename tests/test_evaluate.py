"""The evaluate CLI on an exported-style draft: offline.json fields and the aux-id check."""

from __future__ import annotations

import json

import pytest
from tiny_stages import categorize, export_like, make_run

from eaglepipe import evaluate

KEYS = {"acceptance_length", "k", "per_position_acceptance", "accuracy_per_position", "tokens_evaluated", "anchors",
        "convention", "reference", "draft", "manifest"}


def test_offline_json(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama, n_train=2)
    draft = export_like(tiny_llama, run, tmp_path / "draft")
    out = tmp_path / "eval" / "offline.json"
    evaluate.main(["--draft", str(draft), "--manifest", str(run["manifest"]), "--split", "eval",
                   "--model", str(tiny_llama), "--k", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert KEYS <= set(res)
    assert res["k"] == 2 and len(res["per_position_acceptance"]) == 2 and len(res["accuracy_per_position"]) == 2
    scored = sum(int(s["loss_mask"].sum()) for s in run["eval"])
    assert res["anchors"] == scored and res["chains_cut"] == 0
    assert res["tokens_evaluated"] == sum(len(s["input_ids"]) - 1 for s in run["eval"])
    assert 1.0 <= res["acceptance_length"] <= 3.0
    # by stratum: the tiny tokenizer has no <think> token, so no thinking stratum
    assert set(res["strata"]) == {"context", "turn"}
    assert list(res["strata"]["context"]) == ["<=512", "<=2048", "<=8192", ">8192"]
    for name, by_label in res["strata"].items():
        assert sum(s["anchors"] for s in by_label.values()) == res["anchors"], name
        assert all(len(s["per_position_acceptance"]) == 2 for s in by_label.values())


def test_category_stratum_from_the_manifest(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama, n_train=2)
    names = ["coding", None, "writing"]
    categorize(run["manifest"], names)
    draft = export_like(tiny_llama, run, tmp_path / "draft")
    out = tmp_path / "offline.json"
    evaluate.main(["--draft", str(draft), "--manifest", str(run["manifest"]), "--model", str(tiny_llama), "--k", "2",
                   "--out", str(out)])
    res = json.loads(out.read_text())
    by_category = res["strata"]["category"]
    assert list(by_category) == ["coding", "none", "writing"]
    for c, label in enumerate(["coding", "none", "writing"]):  # each sample's anchors under its own label
        scored = sum(int(s["loss_mask"].sum()) for i, s in enumerate(run["eval"]) if i % len(names) == c)
        assert by_category[label]["anchors"] == scored > 0, label
    assert sum(s["anchors"] for s in by_category.values()) == res["anchors"]


def test_context_buckets_flag(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama, n_train=2)
    draft = export_like(tiny_llama, run, tmp_path / "draft")
    out = tmp_path / "offline.json"
    args = ["--draft", str(draft), "--manifest", str(run["manifest"]), "--model", str(tiny_llama), "--k", "2",
            "--out", str(out), "--context-buckets"]
    evaluate.main(args + ["4,16"])
    by_context = json.loads(out.read_text())["strata"]["context"]
    assert list(by_context) == ["<=4", "<=16", ">16"] and all(s["anchors"] for s in by_context.values())
    with pytest.raises(SystemExit, match=r"--context-buckets \[16, 4\]: need positive, strictly ascending"):
        evaluate.main(args + ["16,4"])


def test_aux_ids_must_match_manifest(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama, n_train=2, n_eval=2)
    draft = export_like(tiny_llama, run, tmp_path / "draft", aux=(2, 3, 5))
    with pytest.raises(SystemExit, match=r"eagle_aux_hidden_state_layer_ids \[2, 3, 5\] differ"):
        evaluate.main(["--draft", str(draft), "--manifest", str(run["manifest"]), "--model", str(tiny_llama),
                       "--k", "2", "--out", str(tmp_path / "o.json")])


def test_stratum_config_reaches_both_clis(tmp_path):
    """evaluate.context_buckets and evaluate.select_by in the planned commands of `snakemake -n -p`."""
    from workflow import copy_workflow, snakemake

    ws = copy_workflow(tmp_path)
    p = snakemake(ws, "-n", "-p", "--config", 'evaluate={"context_buckets": [256, 4096], "select_by": "context:>4096"}')
    lines = p.stdout.splitlines()
    offline = next(line for line in lines if "eaglepipe.evaluate " in line and "offline.json" in line)
    train = next(line for line in lines if "eaglepipe.train_draft " in line)
    assert "--context-buckets 256,4096 " in offline
    assert "--context-buckets 256,4096 --select-by 'context:>4096'" in train
    bad = snakemake(ws, "-n", "--config", 'evaluate={"select_by": "length:>4096"}', check=False)
    assert bad.returncode != 0 and "select_by" in bad.stdout + bad.stderr


@pytest.mark.parametrize("select_by, ok", [("category:coding", True), ("category:none", True), ("category:", False),
                                           ("source:coding", False)])
def test_schema_takes_a_category_for_select_by(select_by, ok):
    from eaglepipe.config_check import config_errors, load_schema
    from workflow import REPO

    errors = config_errors({"evaluate": {"select_by": select_by}},
                           load_schema(str(REPO / "config" / "config.schema.yaml")))
    assert not any("evaluate.select_by" in e for e in errors) == ok, errors
