"""Training on tiny-target shards: a step learns, the CLI writes its outputs, resume is exact,
changed settings start fresh, incomplete checkpoints are ignored."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from tiny_stages import categorize, make_run, metrics_rows, train_argv, weights

from eaglepipe import train_draft, training

SUMMARY_KEYS = {"best", "last", "steps", "best_eval", "last_eval", "layer_ids", "aux_layer_ids", "target_model",
                "draft_vocab_size", "ttt_steps", "train_tokens", "metrics", "best_selected_by", "optimizer_state_dtypes",
                "peak_gpu_memory_gib"}


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"), tiny_llama)


def test_one_step_on_a_fixed_batch_learns(run):
    from speculators.losses import resolve_loss_config

    from eaglepipe.draft_model import build_draft
    from eaglepipe.packed_data import PackedRows, pad_row
    from eaglepipe.shard_manifest import load_manifest

    torch.manual_seed(0)
    model = build_draft(run["model"], [1, 3, 5], run["vocab"], ttt_steps=3)
    batch = next(PackedRows(load_manifest(run["manifest"]), "train", 128, shuffle=False).once())
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")
    b = {k: batch[k] for k in keys}
    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "fc.weight" in trainable and "embed_tokens.weight" not in trainable and "lm_head.weight" not in trainable
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(params, lr=1e-2)
    _, loss0, m0 = model(**b, ttt_steps=3, loss_config=loss_config)
    # a row padded to flex attention's 128-token blocks (GPU rows) trains on the same loss
    padded = pad_row(dict(b, lengths=batch["lengths"]), 128)
    assert padded["input_ids"].shape[1] % 128 == 0 and (padded["document_ids"][0, b["input_ids"].shape[1]:] == -1).all()
    with torch.no_grad():
        _, loss_padded, m_padded = model(**{k: padded[k] for k in keys}, ttt_steps=3, loss_config=loss_config)
    assert torch.allclose(loss_padded, loss0, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(m_padded[f"full_acc_{s}_total"], m0[f"full_acc_{s}_total"]) for s in range(3))
    loss0.backward()
    opt.step()
    with torch.no_grad():
        _, loss1, _ = model(**b, ttt_steps=3, loss_config=loss_config)
    assert loss1 < loss0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "fc.weight" in changed and "layers.0.self_attn.q_proj.weight" in changed
    assert not changed & {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}


def test_cli_outputs_and_summary(run, tmp_path):
    out = tmp_path / "train"
    train_draft.main(train_argv(run, out))
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["steps"] == 6 and summary["last"] == "checkpoints/step-0000006"
    assert summary["layer_ids"] == [1, 3, 5, 6] and summary["aux_layer_ids"] == [1, 3, 5]
    assert summary["draft_vocab_size"] == 256 and summary["ttt_steps"] == 3 and summary["metrics"] == "metrics.jsonl"
    assert (out / summary["best"] / "COMPLETE").is_file()
    assert summary["best_eval"]["acceptance_length"] >= 1.0
    assert summary["best_eval"]["acceptance_length"] >= summary["last_eval"]["acceptance_length"]
    rows = metrics_rows(out)
    evals = [r for r in rows if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3, 4, 6]  # untrained draft, every 3, every checkpoint, the end
    assert summary["best_selected_by"] == "overall"
    # Muon on the matrices, AdamW on the rest: master weights and every moment in fp32
    states = summary["optimizer_state_dtypes"]
    assert {"Muon.param", "Muon.momentum_buffer", "AdamW.param", "AdamW.exp_avg", "AdamW.exp_avg_sq"} <= set(states)
    assert all(dtypes == ["float32"] for dtypes in states.values()), states
    assert summary["peak_gpu_memory_gib"] is None  # trained on the CPU
    for r in evals:  # every eval is also reported by stratum, and the strata add up
        for name in ("context", "turn"):
            assert sum(s["anchors"] for s in r["strata"][name].values()) == r["anchors"], (r["step"], name)
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    assert {"loss", "lr", "tokens_per_s", "acc_0", "acc_2"} <= set(train_rows[0])
    assert train_rows[-1]["train_tokens"] == summary["train_tokens"]
    ckpts = out / "checkpoints"
    kept = sorted(p.name for p in ckpts.glob("step-*"))
    best = (ckpts / "best").readlink().name
    assert set(kept) == {"step-0000004", "step-0000006", best}  # last two plus best
    assert (ckpts / "latest").readlink().name == "step-0000006" and not (ckpts / "latest").readlink().is_absolute()
    # the saved draft is speculators' format and reloads for evaluation
    from eaglepipe.draft_model import load_draft

    reloaded = load_draft(out / summary["last"], run["model"])
    assert reloaded.target_layer_ids == [1, 3, 5]
    assert torch.equal(reloaded.fc.weight, weights(out, 6)["fc.weight"])


def test_a_two_layer_draft_trains_every_layer_exports_and_reloads(run, tmp_path):
    """draft.layers 2: the first layer reads embedding + fused states (2 x hidden), the second the
    hidden states alone, as vLLM 0.26.0's Eagle3LlamaForCausalLM builds them; both train; the export
    is checked and reloads as the same two layers."""
    from eaglepipe import export_draft
    from eaglepipe.draft_model import load_draft

    out = tmp_path / "train"
    train_draft.main(train_argv(run, out, draft_layers=2, max_steps=4))
    hidden = json.loads((run["model"] / "config.json").read_text())["hidden_size"]
    early, late = weights(out, 2), weights(out, 4)
    assert early["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert early["layers.1.self_attn.q_proj.weight"].shape[1] == hidden
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert not torch.equal(early[name], late[name]), name
    assert not any(k.startswith("layers.2.") for k in late)
    draft = tmp_path / "draft"
    export_draft.export_draft(str(out / "summary.json"), "last", "org/tiny", 3, True, str(draft))
    served = json.loads((draft / "config.json").read_text())["transformer_layer_config"]
    assert served["num_hidden_layers"] == 2 and served["layer_types"] == ["full_attention"] * 2
    reloaded = load_draft(draft, run["model"])
    assert len(reloaded.layers) == 2
    assert torch.equal(reloaded.layers[1].mlp.down_proj.weight, late["layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float())
    with pytest.raises(SystemExit):
        train_draft.parse_args(train_argv(run, tmp_path, draft_layers=0))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_kill_gives_identical_weights(run, tmp_path, caplog, optimizer):
    straight = tmp_path / "straight"
    train_draft.train(train_draft.parse_args(train_argv(run, straight, optimizer=optimizer)))
    killed = tmp_path / "killed"
    # last checkpoint: 2
    assert train_draft.train(train_draft.parse_args(train_argv(run, killed, optimizer=optimizer)), stop_after=3) is None
    assert max(r["step"] for r in metrics_rows(killed)) == 3
    (killed / "metrics.jsonl").unlink()  # as Snakemake does with a failed job's declared outputs
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, killed, optimizer=optimizer)))
    assert "resuming from" in caplog.text and "step-0000002 at step 2" in caplog.text
    a, b = weights(straight, 6), weights(killed, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert strip(metrics_rows(straight)) == strip(metrics_rows(killed))  # rows after the checkpoint were redone
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (straight, killed))
    assert sa == sb


def test_rows_packed_by_a_worker_process_train_the_same_weights_and_resume_a_thread_run(run, tmp_path, caplog):
    thread = tmp_path / "thread"
    train_draft.train(train_draft.parse_args(train_argv(run, thread)))
    process = tmp_path / "process"
    assert train_draft.train(train_draft.parse_args(train_argv(run, process, row_loader="thread")), stop_after=3) is None
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, process, row_loader="process")))
    assert "step-0000002 at step 2" in caplog.text and "packed ahead by a worker process" in caplog.text
    a, b = weights(thread, 6), weights(process, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_changed_setting_starts_fresh_and_incomplete_checkpoint_is_ignored(run, tmp_path, caplog):
    out = tmp_path / "train"
    train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)), stop_after=4)
    (out / "checkpoints" / "step-0000004" / "COMPLETE").unlink()  # as if killed while writing it
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    assert "step-0000002 at step 2" in caplog.text  # the incomplete step-4 was skipped
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4, lr=1e-3)))
    assert "starting fresh" in caplog.text and "other settings" in caplog.text
    assert [r["step"] for r in metrics_rows(out) if r["split"] == "eval"][0] == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 4


def test_best_checkpoint_chosen_by_a_stratum(run, tmp_path):
    out = tmp_path / "train"
    summary = train_draft.train(train_draft.parse_args(train_argv(run, out, context_buckets=8, select_by="context:>8")))
    assert summary["best_selected_by"] == "context:>8"
    evals = {r["step"]: r for r in metrics_rows(out) if r["split"] == "eval" and r["step"] in (2, 4, 6)}
    chosen = [evals[s]["strata"]["context"][">8"]["acceptance_length"] for s in (2, 4, 6)]
    best_step = int(summary["best"].rsplit("-", 1)[1])
    assert evals[best_step]["strata"]["context"][">8"]["acceptance_length"] == max(chosen)
    assert summary["best_eval"]["strata"]["context"][">8"]["anchors"] > 0
    with pytest.raises(SystemExit, match=r"--select-by 'context:>9'.*context:<=8"):
        train_draft.train(train_draft.parse_args(train_argv(run, tmp_path / "bad", context_buckets=8,
                                                      select_by="context:>9")))


def test_best_checkpoint_chosen_by_a_category_stratum(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama)
    categorize(run["manifest"], ["coding", None, "writing"])
    out = tmp_path / "train"
    summary = train_draft.train(train_draft.parse_args(train_argv(run, out, select_by="category:writing")))
    assert summary["best_selected_by"] == "category:writing"
    evals = {r["step"]: r for r in metrics_rows(out) if r["split"] == "eval"}
    for r in evals.values():  # the categories add up, as every stratum does
        assert list(r["strata"]["category"]) == ["coding", "none", "writing"]
        assert sum(s["anchors"] for s in r["strata"]["category"].values()) == r["anchors"]
    chosen = [evals[s]["strata"]["category"]["writing"]["acceptance_length"] for s in (2, 4, 6)]
    best_step = int(summary["best"].rsplit("-", 1)[1])
    assert evals[best_step]["strata"]["category"]["writing"]["acceptance_length"] == max(chosen)
    with pytest.raises(SystemExit, match=r"--select-by 'category:math'.*category:coding, category:none"):
        train_draft.train(train_draft.parse_args(train_argv(run, tmp_path / "bad", select_by="category:math")))


def test_muon_takes_the_decoders_matrices_and_adamw_the_rest(run, tmp_path):
    from eaglepipe.draft_model import build_draft

    torch.manual_seed(0)
    model = build_draft(run["model"], [1, 3, 5], run["vocab"], ttt_steps=3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = training.Optimization(train_draft.parse_args(train_argv(run, tmp_path, optimizer="muon")),
                                           model).optimizers
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= in_muon
    assert "layers.0.input_layernorm.weight" in in_adamw and not in_muon & in_adamw
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    # speculators' defaults: the Muon group decays weights by 0.1 unless told
    assert muon.param_groups[0]["weight_decay"] == 0.1 and muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"]
    args = train_draft.parse_args([*train_argv(run, tmp_path, optimizer="muon"), "--muon-weight-decay", "0"])
    assert training.Optimization(args, model).optimizers[0].param_groups[0]["weight_decay"] == 0.0
    (only,) = training.Optimization(train_draft.parse_args(train_argv(run, tmp_path, optimizer="adamw")), model).optimizers
    assert type(only) is torch.optim.AdamW
    assert train_draft.parse_args(train_argv(run, tmp_path)).optimizer == "muon"  # the default, the schema's


def test_lm_head_stays_the_targets_rows_unless_trained(run, tmp_path):
    """frozen (speculators'): the checkpoint's lm_head is the target's rows of the draft vocabulary;
    trained: it moves, by AdamW under Muon too, and the checkpoint (what export copies) carries it."""
    from eaglepipe.draft_model import load_target_head, load_vocab_mapping

    rows = load_target_head(run["model"])[load_vocab_mapping(run["vocab"])[1]]
    frozen = tmp_path / "frozen"
    train_draft.main(train_argv(run, frozen, optimizer="muon"))
    assert torch.equal(weights(frozen, 6)["lm_head.weight"].float(), rows)
    trained = tmp_path / "trained"
    train_draft.main([*train_argv(run, trained, optimizer="muon"), "--lm-head", "trained"])
    moved = weights(trained, 6)["lm_head.weight"].float()
    assert moved.shape == rows.shape and not torch.allclose(moved, rows)
    args = train_draft.parse_args([*train_argv(run, tmp_path, optimizer="muon"), "--lm-head", "trained"])
    model = training.new_draft(args, [1, 3, 5], "cpu")
    muon, adamw = training.Optimization(args, model).optimizers
    assert any(p is model.lm_head.weight for g in adamw.param_groups for p in g["params"])
    assert not any(p is model.lm_head.weight for g in muon.param_groups for p in g["params"])


def test_bad_flags_and_inputs_are_clear_errors(run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_draft.parse_args(train_argv(run, tmp_path, max_steps=0))
    assert train_draft.parse_args(train_argv(run, tmp_path)).shuffle_buffer_gib == "global"  # the default
    assert train_draft.parse_args([*train_argv(run, tmp_path), "--shuffle-buffer-gib", "4"]).shuffle_buffer_gib == 4.0
    for bad in ("-1", "all", "nan"):
        with pytest.raises(SystemExit):
            train_draft.parse_args([*train_argv(run, tmp_path), "--shuffle-buffer-gib", bad])
        assert f"'{bad}': global or a number of GiB >= 0" in capsys.readouterr().err
    for bad in (["--optimizer", "adamw", "--muon-weight-decay", "0.1"], ["--muon-weight-decay", "-1"]):
        with pytest.raises(SystemExit):
            train_draft.parse_args([*train_argv(run, tmp_path), *bad])
        assert ("only with --optimizer muon" if "adamw" in bad else "-1.0: must be >= 0") in capsys.readouterr().err
    bad = tmp_path / "manifest.json"
    bad.write_text("{}")
    args = train_argv(run, tmp_path / "o")
    args[1] = str(bad)
    with pytest.raises(SystemExit, match="missing key"):
        train_draft.main(args)


def test_every_flag_changes_the_run_settings_unless_listed_as_neutral(run, tmp_path):
    """A new flag counts as changing results until RESULT_NEUTRAL lists it; every listed one is a flag."""
    args = train_draft.parse_args(train_argv(run, tmp_path))
    flags = set(vars(args))
    assert set(train_draft.RESULT_NEUTRAL) <= flags, set(train_draft.RESULT_NEUTRAL) - flags
    manifest = json.loads(run["manifest"].read_text())
    settings = train_draft.run_settings(args, manifest)
    assert flags - set(train_draft.RESULT_NEUTRAL) <= set(settings)
    for flag, value in (("eval_every", 2), ("checkpoint_every", 3), ("loss", "ce"), ("lm_head", "trained")):
        changed = train_draft.run_settings(train_draft.parse_args(train_argv(run, tmp_path, **{flag: value})), manifest)
        assert changed != settings, flag
    moved = train_draft.run_settings(train_draft.parse_args(train_argv(run, tmp_path / "elsewhere")), manifest)
    assert moved == settings


def test_a_rerun_over_a_finished_training_takes_its_result_without_a_step(run, tmp_path, caplog, monkeypatch):
    """What a rerun of the job does, whatever made Snakemake run it (an identical manifest rebuilt,
    `--forcerun train_draft`): the same outputs from the finished checkpoints, no model built."""
    out = tmp_path / "train"
    first = train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    written = {name: (out / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    ckpts = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").iterdir()}
    for name in written:
        (out / name).unlink()  # as Snakemake does before it runs the job
    monkeypatch.setattr(train_draft, "new_draft", None)  # a step would need the model
    with caplog.at_level(logging.INFO):
        assert train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4))) == first
    assert "reusing the finished training" in caplog.text and "starting fresh" not in caplog.text
    assert {name: (out / name).read_bytes() for name in written} == written
    assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").iterdir()} == ckpts


def test_a_finished_training_of_other_code_is_retrained_and_kept_until_the_first_new_checkpoint(
        run, tmp_path, caplog, monkeypatch):
    out = tmp_path / "train"
    train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    first = metrics_rows(out)
    finished = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    monkeypatch.setattr(train_draft, "code_digest", lambda *_: "edited")
    with caplog.at_level(logging.INFO):  # killed before its first checkpoint
        assert train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)), stop_after=1) is None
    assert "retraining from scratch" in caplog.text and "made by other code" in caplog.text
    assert sorted(p.name for p in (out / "checkpoints").glob("superseded-*")) == [f"superseded-{n}" for n in finished]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    assert "starting fresh" in caplog.text
    assert not list((out / "checkpoints").glob("superseded-*"))

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert strip(metrics_rows(out)) == strip(first) and first[-1]["step"] == 4  # the full curve again
    caplog.clear()
    with caplog.at_level(logging.INFO):  # made by this code now: reused
        train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    assert "reusing the finished training" in caplog.text


def test_a_failing_start_with_new_settings_removes_no_checkpoint(run, tmp_path):
    out = tmp_path / "train"
    train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4)))
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(SystemExit, match="--select-by 'context:>9'"):
        train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4, context_buckets=8,
                                                      select_by="context:>9")))
    shard = next((run["manifest"].parent / "shards").glob("train-*.safetensors"))
    data = shard.read_bytes()
    try:
        shard.write_bytes(data[: len(data) // 2])
        with pytest.raises(SystemExit, match=str(shard.name)):
            train_draft.train(train_draft.parse_args(train_argv(run, out, max_steps=4, lr=1e-3)))
    finally:
        shard.write_bytes(data)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept


def test_cpu_training_gives_the_same_weights_at_any_thread_count(run, tmp_path):
    """A run killed under one `snakemake --cores` and resumed under another must train the same
    weights. MKL's AVX2 path splits matrix products by thread count; eaglepipe turns on MKL's strict
    reproducible mode (MKL_CBWR, eaglepipe/__init__.py). Forced onto that path
    (MKL_ENABLE_INSTRUCTIONS=AVX2) so any x86 CPU tests it; skipped where MKL gives equal bits anyway."""
    def train(threads: int, out, mkl_cbwr: str | None):
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        env.update(OMP_NUM_THREADS=str(threads), MKL_ENABLE_INSTRUCTIONS="AVX2", **({"MKL_CBWR": mkl_cbwr} if mkl_cbwr else {}))
        subprocess.run([sys.executable, "-m", "eaglepipe.train_draft", *train_argv(run, out)], env=env, check=True,
                       capture_output=True)
        return weights(out, 6)

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    if same(*(train(n, tmp_path / f"default{n}", "AUTO") for n in (1, 2))):  # MKL's default mode
        pytest.skip("this CPU's MKL gives the same bits at 1 and 2 threads in its default mode")
    assert same(*(train(n, tmp_path / f"ours{n}", None) for n in (1, 2)))
