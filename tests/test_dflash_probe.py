"""benchmarks/dflash_probe.py on a tiny target's shards: speculators' DFlash draft trains on our
rows, is scored by our estimator on every eval anchor (its API is read at the pinned version), and is
saved in the speculators format the serving benchmark hands vLLM as a dflash draft."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny_stages import LAYER_IDS, make_run

from eaglepipe.serving_sweep import draft_method

REPO = Path(__file__).resolve().parents[1]


def test_the_probe_trains_a_dflash_draft_and_scores_every_eval_anchor(tmp_path, tiny_llama):
    run = make_run(tmp_path, tiny_llama)
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dflash_probe.py"),
                        "--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(tiny_llama),
                        "--aux-ids", *map(str, LAYER_IDS[:-1]), "--max-steps", "3", "--batch-tokens", "256",
                        "--eval-at", "2", "--out", str(out), "--mask-token-id", "5", "--save", str(tmp_path / "draft")],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(result["evals"]) == ["2", "3"]
    final = result["evals"]["3"]
    scored = sum(int(sum(s["loss_mask"][1:])) for s in run["eval"])  # every scored eval position is an anchor
    assert final["anchors"] == scored > 0
    assert 1.0 <= final["acceptance_length"] <= 4.0 and len(final["accuracy_per_slot_at_anchors"]) == 3
    # speculators' slot-1 target is the target's greedy token, our estimator's reference
    assert final["slot1_reference_agreement"] == 1.0
    # saved as speculators saves it: vLLM reads the method, K, mask token and aux layers from here
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert draft_method(tmp_path / "draft") == "dflash"
    assert config["mask_token_id"] == 5 and config["aux_hidden_state_layer_ids"] == list(LAYER_IDS[:-1])
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert not config["sliding_window_non_causal"]  # served causal, as trained
    assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]


def test_the_probe_will_not_save_a_draft_whose_mask_token_the_target_emits(tmp_path, tiny_llama):
    run = make_run(tmp_path, tiny_llama)  # the tiny tokenizer has no free id: speculators falls back to pad (0)
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dflash_probe.py"),
                        "--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(tiny_llama),
                        "--aux-ids", *map(str, LAYER_IDS[:-1]), "--max-steps", "1", "--save", str(tmp_path / "draft")],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "--save: the mask token would be 0" in r.stderr
    assert "pass --mask-token-id" in r.stderr and not (tmp_path / "draft").exists()
