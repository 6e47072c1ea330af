"""The whole pipeline on a DeepseekV3 target (tests/configs/tiny-mla.yaml): an MLA draft is delivered
(the MLA draft's parts: tests/test_mla_draft.py)."""

import json

import pytest

import tiny
from workflow import copy_workflow, snakemake, tiny_config, write_config

pytestmark = pytest.mark.e2e


def test_snakemake_run_on_a_deepseek_v3_target_delivers_an_mla_draft(tmp_path):
    """The embedded workflow, default draft.architecture (auto), on a tiny DeepseekV3 target."""
    ws = copy_workflow(tmp_path)
    target = tiny.make_deepseek_v3(ws / "target", num_layers=6)
    chats = tiny.make_chats(ws / "chats.jsonl", n=24)
    write_config(ws, tiny_config(target, chats, "tiny-mla"))
    snakemake(ws)
    run = ws / "results" / "tiny"
    served = json.loads((run / "draft" / "config.json").read_text())
    assert served["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and served["eaglepipe"]["verifier"] == "tiny/dsv3"
    card = (run / "draft" / "README.md").read_text()
    assert "served by vLLM as `Eagle3DeepseekV3ForCausalLM`" in card and "1 x deepseek_v3 layer" in card
    assert '"method": "eagle3", "num_speculative_tokens": 3' in card and "vllm serve tiny/dsv3" in card
    train_log = (run / "logs" / "train_draft.log").read_text()
    assert "draft architecture mla (auto requested): 1 x deepseek_v3 decoder layer" in train_log
    assert json.loads((run / "eval" / "offline.json").read_text())["acceptance_length"] >= 1.0
