"""model_card: the draft's README.md from what the run measured, with a serve command that works."""

import json
import shlex

import pytest

from eaglepipe import model_card as mc


@pytest.fixture
def run(tmp_path):
    """The files the card reads, as export_draft, train_draft, prepare_data and evaluate write them."""
    draft = tmp_path / "draft"
    draft.mkdir()
    config = {"speculators_config": {"verifier": {"name_or_path": "moonshotai/Kimi-K2.5"},
                                     "proposal_methods": [{"speculative_tokens": 3}]},
              "transformer_layer_config": {"num_hidden_layers": 1, "model_type": "llama", "hidden_size": 7168,
                                           "vocab_size": 163840},
              "draft_vocab_size": 32000, "norm_before_residual": True, "norm_before_fc": True, "fc_norm": False,
              "norm_output": True}
    files = {
        "draft/config.json": config,
        "train/summary.json": {"best": "checkpoints/step-0040000", "last": "checkpoints/step-0040000",
                               "steps": 40000, "best_eval": {"acceptance_length": 2.9}, "layer_ids": [2, 30, 58, 61],
                               "aux_layer_ids": [2, 30, 58], "target_model": "moonshotai/Kimi-K2.5",
                               "ttt_steps": 3, "train_tokens": 123456},
        "data/stats.json": {"read": 40, "kept": 38, "skipped": {"no_assistant": 2}},
        "eval/offline.json": {"acceptance_length": 2.85, "k": 3, "tokens_evaluated": 999,
                              "per_position_acceptance": [0.7, 0.5, 0.3]},
        "eval/serving.json": {"recommended": {"by_concurrency": {"1": 4, "4": 3, "16": 2}, "k": 4,
                                              "serve_command": "vllm serve ..."}},
    }
    for name, obj in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(obj))
    return tmp_path


def write_card(run, *extra):
    out = run / "draft" / "README.md"
    mc.main(["--draft-config", str(run / "draft/config.json"), "--summary", str(run / "train/summary.json"),
             "--which", "best", "--data-stats", str(run / "data/stats.json"),
             "--offline", str(run / "eval/offline.json"), "--out", str(out), *extra])
    return out.read_text()


def serve_line(card):
    return next(line for line in card.splitlines() if line.startswith("vllm serve"))


def test_tp8_trust_remote_code_run_is_served_as_it_ran(run):
    card = write_card(run, "--tensor-parallel-size", "8", "--trust-remote-code")
    words = shlex.split(serve_line(card))
    assert words[:3] == ["vllm", "serve", "moonshotai/Kimi-K2.5"]
    assert words[words.index("--tensor-parallel-size") + 1] == "8" and "--trust-remote-code" in words
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"model": str((run / "draft").resolve()), "method": "eagle3", "num_speculative_tokens": 3}
    assert "2.85" in card and "[2, 30, 58]" in card and "38 kept" in card and "step-0040000" in card


def test_single_gpu_run_has_no_extra_flags(run):
    line = serve_line(write_card(run))
    assert "--tensor-parallel-size" not in line and "--trust-remote-code" not in line


def test_serving_benchmarks_k_is_the_one_recommended(run):
    card = write_card(run, "--serving", str(run / "eval/serving.json"))
    words = shlex.split(serve_line(card))
    assert json.loads(words[words.index("--speculative-config") + 1])["num_speculative_tokens"] == 4
    assert "best K by concurrency: 1: 4, 4: 3, 16: 2" in card


def test_serving_without_a_recommendation_is_one_sentence(run):
    (run / "eval/serving.json").write_text(json.dumps({"recommended": {"by_concurrency": {}}}))
    with pytest.raises(SystemExit, match=r"^model_card: .*serving.json recommended: missing field 'k'$"):
        write_card(run, "--serving", str(run / "eval/serving.json"))
    assert not (run / "draft" / "README.md").exists()


def test_card_says_what_the_loss_saw_of_thinking_and_answer(run):
    stats = json.loads((run / "data/stats.json").read_text())
    stats["assistant"] = {"tokens_in_data": 1000, "tokens_trained": 800, "trained_share": 0.8,
                          "tokens_trained_by_kind": {"answer": 300, "thinking": 500}}
    (run / "data/stats.json").write_text(json.dumps(stats))
    assert "assistant tokens trained: 800 of 1000 (80%; answer 300, thinking 500)" in write_card(run)
    # the target's regenerated answers: one kind, not a thinking/answer split of zeros
    stats["assistant"]["tokens_trained_by_kind"] = {"regenerated": 800}
    (run / "data/stats.json").write_text(json.dumps(stats))
    assert "assistant tokens trained: 800 of 1000 (80%; regenerated 800)" in write_card(run)


def test_a_concurrency_where_no_k_helps_reads_as_the_target_alone(run):
    (run / "eval/serving.json").write_text(json.dumps(
        {"recommended": {"by_concurrency": {"1": 3, "64": None}, "k": 3}}))
    assert "best K by concurrency: 1: 3, 64: the target alone" in write_card(run, "--serving",
                                                                           str(run / "eval/serving.json"))


def test_card_sets_the_offline_estimate_beside_vllms_at_the_same_k(run):
    offline = json.loads((run / "eval/offline.json").read_text())
    offline["as_served"] = {"acceptance_length": 2.105, "drafts": 8002}
    (run / "eval/offline.json").write_text(json.dumps(offline))
    serving = json.loads((run / "eval/serving.json").read_text())
    serving["points"] = [{"concurrency": 1, "k": None, "requests_finished": 80},
                         {"concurrency": 4, "k": 3, "acceptance_length": 1.9, "requests_finished": 200},
                         {"concurrency": 1, "k": 3, "acceptance_length": 2.028, "requests_finished": 80}]
    (run / "eval/serving.json").write_text(json.dumps(serving))
    card = write_card(run, "--serving", str(run / "eval/serving.json"))
    assert ("offline vs online at K=3, concurrency 1: 2.105 as served against vLLM's 2.028 over 80 requests "
            "(offline / online 1.038)") in card
    offline["k"] = 5  # an estimate at a K vLLM did not serve: nothing to set beside it
    (run / "eval/offline.json").write_text(json.dumps(offline))
    assert "offline vs online" not in write_card(run, "--serving", str(run / "eval/serving.json"))


def test_the_engine_arguments_serving_was_measured_with_are_in_the_serve_command(run):
    serving = json.loads((run / "eval/serving.json").read_text())
    serving["engine_args"] = {"max_num_seqs": 8, "async_scheduling": False,
                              "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
    (run / "eval/serving.json").write_text(json.dumps(serving))
    words = shlex.split(serve_line(write_card(run, "--serving", str(run / "eval/serving.json"))))
    assert words[words.index("--max-num-seqs") + 1] == "8" and "--no-async-scheduling" in words
    assert json.loads(words[words.index("--compilation-config") + 1]) == {"cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.mark.parametrize("architectures, served", [(["MixtralForCausalLM"], False), (["DeepseekV3ForCausalLM"], True)])
def test_a_target_the_pinned_vllm_cannot_serve_gets_no_serve_command(run, architectures, served):
    """A draft trained with the hf backends for a target whose vLLM class has no EAGLE-3 aux-state capture:
    the card says so instead of printing a `vllm serve` that fails at engine start."""
    target = run / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": architectures}))
    summary = json.loads((run / "train/summary.json").read_text())
    (run / "train/summary.json").write_text(json.dumps({**summary, "target_model": str(target)}))
    card = write_card(run)
    assert ("vllm serve" in card) is served
    assert ("The pinned vLLM (0.26.0) cannot serve this draft: architectures ['MixtralForCausalLM']: "
            "vLLM 0.26.0's class for it does not implement EAGLE-3 aux hidden states (SupportsEagle3)" in card) is not served


def test_derived_k_are_marked_and_the_recommendation_is_among_the_timed_k(run):
    serving = {"recommended": {"by_concurrency": {"1": 3}, "k": 3, "among_timed_k": [3]},
               "points": [{"k": None, "concurrency": 1, "output_tokens_per_s": 100.0},
                          {"k": 3, "concurrency": 1, "acceptance_length": 2.3, "speedup": 1.31,
                           "requests_finished": 80}],
               "derived_points": [{"k": 1, "concurrency": 1, "derived_from_k": 3, "acceptance_length": 1.6},
                                  {"k": 2, "concurrency": 1, "derived_from_k": 3, "acceptance_length": 2.0}]}
    (run / "eval/serving.json").write_text(json.dumps(serving))
    card = write_card(run, "--serving", str(run / "eval/serving.json"))
    assert "best K by concurrency (among the timed K 3): 1: 3" in card
    assert ("vLLM acceptance length by K at concurrency 1: K=1 1.6 (derived from K=3, not timed), "
            "K=2 2.0 (derived from K=3, not timed), K=3 2.3 (timed, 1.31x)") in card
    assert "among the K it timed" in card and json.loads(serve_line(card).split("'")[1])["num_speculative_tokens"] == 3


def train_through_a_disk_budget(run, model_loads_s: list[float]):
    """train/summary.json as a training through a disk budget writes it, its extractor's loads given."""
    summary = json.loads((run / "train/summary.json").read_text())
    summary["disk_budget"] = {"budget_bytes": 5 << 30, "peak_shard_bytes": 4 << 30, "projected_bytes": 50 << 30,
                              "passes": 2.0, "samples_trained": 76, "tokens_trained": 246912,
                              "shards_extracted": 24, "reextraction_s": 310.5, "order": "as without the budget",
                              "model_loads_s": model_loads_s}
    (run / "train/summary.json").write_text(json.dumps(summary))


def test_every_target_load_is_in_the_card_and_the_runs_summary_once(run):
    # one regeneration engine answered both sets: both stats record it, it counts once
    engine = {"backend": "vllm", "load_s": 43.2, "answered": ["r/regenerated/eval_prompts.jsonl",
                                                             "r/regenerated/chats.jsonl"]}
    files = {"regenerated/stats.json": {"engine": engine}, "regenerated/eval_prompts_stats.json": {"engine": engine},
             "hidden_states/manifest.json": {"throughput": {"model_load_s": 122.0, "replicas": [
                 {"replica": 0, "model_load_s": 122.0}, {"replica": 1, "model_load_s": 0.0}]}},  # 1 reused all
             "eval/parity/part.json": {"throughput": {"model_load_s": 101.5}},
             "eval/serving.json": {"recommended": {"by_concurrency": {"1": 3}, "k": 3},
                                   "engines": [{"k": None, "load_s": 83.0}, {"k": 3, "load_s": 111.0}]}}
    for name, obj in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps(obj))
    train_through_a_disk_budget(run, [95.0, 96.5])  # its extractor loaded the target again after a kill
    card = write_card(run, "--serving", str(run / "eval/serving.json"), "--regeneration-stats",
                      str(run / "regenerated/stats.json"), str(run / "regenerated/eval_prompts_stats.json"),
                      "--manifest", str(run / "hidden_states/manifest.json"), "--parity-manifest",
                      str(run / "eval/parity/part.json"), "--run-summary", str(run / "summary.json"))
    rows = [("regeneration: eval_prompts + chats", 43.2), ("extract_hidden_states (replica 0 of 2)", 122.0),
            ("train_draft (disk budget extraction, load 1 of 2)", 95.0),
            ("train_draft (disk budget extraction, load 2 of 2)", 96.5),
            ("benchmark_serving: target alone", 83.0), ("benchmark_serving: K=3", 111.0),
            ("extract_parity_hidden_states", 101.5)]
    assert "## Target loads\nThe run started the target 7 time(s) as an engine, 652.2 s in all" in card
    table = card[card.index("| stage | seconds |"):].splitlines()
    assert table[2:] == [f"| {stage} | {s:,.1f} |" for stage, s in rows]
    summary = json.loads((run / "summary.json").read_text())["target_loads"]
    assert (summary["count"], summary["seconds"]) == (7, 652.2)
    assert [(r["stage"], r["seconds"]) for r in summary["loads"]] == rows


def test_the_user_turns_the_target_wrote_are_in_the_card(run):
    (run / "regenerated").mkdir()
    stats = run / "regenerated/stats.json"
    stats.write_text(json.dumps({"new_user_turns": {"asked": 100, "kept": 61, "dropped_by_reason": {"loop": 39}}}))
    assert ("- of them, user turns the target wrote itself (regenerate.new_user_turns): 61 kept of 100 asked "
            "(dropped: {'loop': 39})") in write_card(run, "--regeneration-stats", str(stats))
    assert "new_user_turns" not in write_card(run)


def test_a_run_without_recorded_loads_has_no_loads_table(run):
    assert "## Target loads" not in write_card(run)
    # regeneration stats written before loads were recorded: the load is listed, its seconds unknown
    (run / "stats.json").write_text(json.dumps({"output": "r/regenerated/chats.jsonl"}))
    card = write_card(run, "--regeneration-stats", str(run / "stats.json"))
    assert "| regeneration: chats | n/a |" in card and "started the target 1 time(s)" in card


def test_a_disk_budget_extractor_that_loaded_nothing_has_no_row(run):
    # a producer that made no shard recorded no load; a load of 0 s started no engine (as for extraction)
    for nothing in ([], [0.0]):
        train_through_a_disk_budget(run, nothing)
        card = write_card(run)
        assert "train shards extracted during training" in card and "## Target loads" not in card
    train_through_a_disk_budget(run, [95.0])
    card = write_card(run, "--run-summary", str(run / "summary.json"))
    assert card.endswith("| stage | seconds |\n| --- | --- |\n| train_draft (disk budget extraction) | 95.0 |\n")
    assert json.loads((run / "summary.json").read_text())["target_loads"] == {
        "count": 1, "seconds": 95.0, "loads": [{"stage": "train_draft (disk budget extraction)", "seconds": 95.0}]}


def test_the_parity_gates_verdict_is_in_the_card(run):
    # as evaluate --parity wrote it in the Kimi-width rehearsal (benchmarks/SCALE.md)
    parity = {"agree": True, "k": 3, "z": 3.0, "replay_acceptance_length": 1.0, "served_acceptance_length": 1.0,
              "positions": [{"position": i, "tolerance": 0.0319, "agree": True} for i in range(3)],
              "requests": 244, "concurrency": 1, "replay_counts": {"drafts": 15128},
              "served_counts": {"drafts": 15372}}
    (run / "eval/parity.json").write_text(json.dumps(parity))
    card = write_card(run, "--parity", str(run / "eval/parity.json"))
    assert ("- parity gate at K=3, concurrency 1: agree: vLLM's 1.0 over 15372 drafts against the offline "
            "replay's 1.0 over 15128 drafts of the same 244 requests (per-position tolerance 0.032, z=3.0)") in card
    assert "parity gate" not in write_card(run)
