"""The README's main command on the embedded default: a real small target, real chat data, CPU.

Slow (~8-10 minutes on 2 cores): the same run a user gets from `snakemake --cores all`.
"""

import json

import pytest

from workflow import copy_workflow, dry_run, snakemake


@pytest.mark.slow
def test_embedded_default_end_to_end(tmp_path):
    ws = copy_workflow(tmp_path)
    jobs, _, _ = dry_run(ws)
    assert "build_target" in jobs  # the target is built from the packaged GGUF, not downloaded
    snakemake(ws, timeout=1800)
    run = ws / "results" / "smollm2-demo"
    stats = json.loads((run / "data" / "stats.json").read_text())
    assert stats["read"] == stats["kept"] + stats["skipped"] and stats["kept"] >= 100
    manifest = json.loads((run / "hidden_states" / "manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 15, 27, 30]  # SmolLM2-135M: 30 layers, default ids
    evals = [json.loads(l) for l in (run / "train" / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in l]
    untrained = evals[0]["acceptance_length"]
    offline = json.loads((run / "eval" / "offline.json").read_text())
    # training on the real target's states must learn: the untrained draft accepts ~nothing
    assert untrained < 1.05
    assert offline["acceptance_length"] > untrained + 0.15, (untrained, offline)
    card = (run / "draft" / "README.md").read_text()
    assert "--speculative-config" in card
    jobs, _, out = dry_run(ws)
    assert jobs == {}, out
