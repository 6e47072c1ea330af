"""benchmarks/compare_trainers.py on CPU: our shards -> speculators' offline format, read back by
speculators' own dataset and collate code; its trainer flags resolve to our draft's settings; a
checkpoint saved by speculators' checkpointer loads into our evaluator; the timing parsers; the
clear refusal without CUDA (the trainers themselves only run on a GPU)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_stages import make_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compare_trainers as ct  # noqa: E402

from eaglepipe.shard_manifest import load_manifest, shard_paths  # noqa: E402
from eaglepipe.shards import read_shard  # noqa: E402


@pytest.fixture(scope="module")
def run(tiny_llama, tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("run"), tiny_llama, n_train=12, n_eval=5)


@pytest.fixture(scope="module")
def converted(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "data"
    manifest = load_manifest(run["manifest"])
    return manifest, out, ct.convert_to_speculators(manifest, out, run["vocab"])


def our_samples(manifest, split):
    out = []
    for path, _ in shard_paths(manifest, split):
        shard = read_shard(path)
        out += [(shard.sample(b), path) for b in range(shard.num_samples)]
    return out


def args_for(run, tmp_path, **over):
    flags = {"--steps": "7", "--batch-tokens": "64", "--lr": "0.002", "--warmup-steps": "2"}
    flags.update(over)
    return ct.parse_args(["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
                          "--work", str(tmp_path / "work"), "--json", str(tmp_path / "out.json"),
                          *[x for kv in flags.items() for x in kv]])


def test_conversion_is_read_back_by_speculators_dataset(converted):
    from speculators.train.data import ArrowDataset

    manifest, out, conv = converted
    assert (conv["train_rows"], conv["eval_rows"]) == (12, 5)
    for split, theirs in (("train", "train"), ("eval", "val")):
        ds = ArrowDataset(max_len=4096, datapath=out, train_ratio=conv["train_data_ratio"], split=theirs,
                          on_missing="raise", hidden_states_dtype=torch.float32)
        ours = our_samples(manifest, split)
        assert len(ds) == len(ours)
        for i, (s, _) in enumerate(ours):
            item = ds[i]
            hs = s["hidden_states"]
            assert torch.equal(item["input_ids"], s["input_ids"].long())
            assert torch.equal(item["loss_mask"].long(), s["loss_mask"].long())
            assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
            assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])
    assert conv["train_lengths"] == [int(s["input_ids"].numel()) for s, _ in our_samples(manifest, "train")]


def test_speculators_collate_matches_our_packed_row(converted):
    """Same samples, packed by speculators' CollateFn (with its shift_batch) and by our PackedRows:
    the aligned tensors agree position by position; speculators pads the rest with document -1."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    from eaglepipe.packed_data import PackedRows

    manifest, out, conv = converted
    ds = ArrowDataset(max_len=512, datapath=out, train_ratio=conv["train_data_ratio"], split="train",
                      on_missing="raise", hidden_states_dtype=torch.float32)
    hidden = manifest["target"]["hidden_size"]
    picks = [0, 1, 2]  # the first shard's first samples, which are dataset rows 0..2
    theirs = CollateFn(512, hidden, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)(
        [ds[i] for i in picks])
    rows = PackedRows(manifest, "train", 512, shuffle=False)
    lengths = rows.offsets(0).diff()
    ours = rows.materialize([(0, b, int(lengths[b])) for b in picks])
    n = ours["input_ids"].shape[1]
    assert n == int(lengths[picks].sum()) - len(picks)  # shift_batch drops one token per sample
    for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids",
                "document_ids"):
        assert torch.equal(theirs[key][:, :n].to(ours[key].dtype), ours[key]), key
    assert (theirs["document_ids"][:, n:] == -1).all()
    assert theirs["input_ids"].shape[1] == 512


def test_vocab_mapping_and_split_ratio(converted, run):
    from eaglepipe.draft_model import load_vocab_mapping

    _, out, conv = converted
    d2t, t2d = load_vocab_mapping(run["vocab"])
    assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy())
    assert np.array_equal(np.load(out / "t2d.npy"), t2d.numpy())
    assert conv["draft_vocab_size"] == d2t.numel()
    total = conv["train_rows"] + conv["eval_rows"]
    assert int(total * conv["train_data_ratio"]) == conv["train_rows"]


def test_epochs_give_exactly_the_steps(converted):
    _, _, conv = converted
    for steps in (1, 5, 40):
        epochs, per_epoch = ct.speculators_epochs(conv["train_lengths"], 64, steps, seed=0)
        assert len(per_epoch) == epochs
        assert sum(per_epoch[:-1]) < steps <= sum(per_epoch)


def test_speculators_flags_resolve_to_our_draft_settings(converted, run, tmp_path):
    from speculators.train.config import TrainConfig

    manifest, out, conv = converted
    args = args_for(run, tmp_path)
    cfg = TrainConfig.resolve(ct.speculators_argv(args, manifest, out, conv, epochs=3, lr=0.0025,
                                                  name="speculators@lr0.0025")).flatten()
    expected = {
        "target_layer_ids": [1, 3, 5], "total_seq_len": 64, "lr": 0.0025, "optimizer": "adamw", "weight_decay": 0.0,
        "scheduler_type": "cosine", "scheduler_warmup_steps": 2, "scheduler_num_cosine_cycles": 0.5,
        "max_steps": 7, "epochs": 3, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_fn": "kl_div",
        "num_layers": 1, "full_attention_indices": [0], "draft_vocab_size": conv["draft_vocab_size"],
        "norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True,
        "embed_requires_grad": False, "train_data_ratio": conv["train_data_ratio"], "data_path": str(out),
        "on_missing": "raise", "no_resume_from_checkpoint": True, "speculator_type": "eagle3",
        "save_path": str(tmp_path / "work" / "speculators@lr0.0025" / "checkpoints"),
    }
    assert {k: cfg[k] for k in expected} == expected


def test_speculators_defaults_leave_optimizer_rate_and_schedule_to_speculators(converted, run, tmp_path):
    from speculators.train.config import TrainConfig

    manifest, out, conv = converted
    argv = ct.speculators_argv(args_for(run, tmp_path), manifest, out, conv, epochs=3, lr=None, name=ct.SPEC_DEFAULTS)
    assert not {"--optimizer", "--lr", "--weight-decay", "--scheduler-type", "--scheduler-warmup-steps"} & set(argv)
    cfg = TrainConfig.resolve(argv).flatten()
    # speculators 0.9.0's own: what `speculators train` gives a user who sets none of them
    assert {k: cfg[k] for k in ("optimizer", "lr", "weight_decay", "scheduler_type", "max_steps", "ttt_steps")} == {
        "optimizer": "muon", "lr": 1e-3, "weight_decay": 0.01, "scheduler_type": "linear", "max_steps": 7, "ttt_steps": 3}
    assert cfg["save_path"] == str(tmp_path / "work" / ct.SPEC_DEFAULTS / "checkpoints")


def test_speculators_checkpoint_loads_into_our_evaluator(converted, run, tmp_path):
    """A draft built by speculators' trainer code and saved by its checkpointer (bf16) is evaluated
    by eaglepipe.evaluate, as the GPU run does with speculators' final checkpoint."""
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.cli import build_draft_model
    from speculators.train.config import TrainConfig

    from eaglepipe import evaluate

    manifest, out, conv = converted
    ns = argparse.Namespace(**TrainConfig.resolve(
        ct.speculators_argv(args_for(run, tmp_path), manifest, out, conv, epochs=1, lr=0.002)).flatten())
    d2t, t2d = torch.from_numpy(np.load(out / "d2t.npy")), torch.from_numpy(np.load(out / "t2d.npy"))
    torch.manual_seed(0)
    model = build_draft_model(ns, Eagle3DraftModel, t2d, d2t, int(d2t.numel()))
    SingleGPUCheckpointer(tmp_path / "ckpt").save_checkpoint(model, torch.optim.AdamW(model.parameters()), 0)
    result = tmp_path / "offline.json"
    evaluate.main(["--draft", str(tmp_path / "ckpt" / "0"), "--manifest", str(run["manifest"]), "--split", "eval",
                   "--model", str(run["model"]), "--k", "3", "--out", str(result)])
    ev = json.loads(result.read_text())
    assert ev["k"] == 3 and ev["anchors"] > 0 and 1.0 <= ev["acceptance_length"] <= 4.0
    saved = load_file(str(tmp_path / "ckpt" / "0" / "model.safetensors"))
    assert saved["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(saved["fc.weight"].float(), model.fc.weight.detach().bfloat16().float())


def test_timing_parsers(tmp_path):
    ours = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "split": "eval"}]
    for step in range(2, 41, 2):  # windows of 2 steps x 100 tokens; 10 ms/step after step 10, 50 before
        ms = 50.0 if step <= 10 else 10.0
        rows.append({"step": step, "split": "train", "loss": 1.0 / step, "train_tokens": 100 * step,
                     "tokens_per_s": 200 / (2 * ms / 1000)})
    ours.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = ct.ours_timing(ours, warmup=10)
    assert t["steps"] == 40 and t["tokens_per_step"] == 100 and t["ms_per_step"] == pytest.approx(10.0)
    assert t["final_train_loss"] == pytest.approx(1 / 40)

    spec = tmp_path / "spec.jsonl"
    rows = [{"global_step": s, "epoch": 0, "train": {"loss": 2.0 - s / 100},
             "profile": {"step_ms": 80.0 if s < 5 else 20.0, "tokens_per_s": 90 / 0.02 if s >= 5 else 90 / 0.08}}
            for s in range(30)]
    rows.append({"val": {"loss_epoch": 1.0}, "epoch": 0})
    spec.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = ct.speculators_timing(spec, warmup=5)
    assert t["steps"] == 30 and t["tokens_per_step"] == pytest.approx(90) and t["ms_per_step"] == 20.0
    assert t["final_train_loss"] == pytest.approx(2.0 - 29 / 100)


def test_refuses_to_run_without_cuda(run, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        ct.main(["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
                 "--work", str(tmp_path / "w"), "--json", str(tmp_path / "o.json")])
    assert not (tmp_path / "w").exists()


def test_our_trainer_runs_once_per_shuffle_buffer_and_both_once_per_learning_rate(run, tmp_path, capsys):
    assert args_for(run, tmp_path).ours_shuffle_buffers == ["global"]
    assert args_for(run, tmp_path, **{"--ours-shuffle-buffers": "global,4,0,4"}).ours_shuffle_buffers == [0, 4, "global"]
    assert args_for(run, tmp_path, **{"--lr": "0.002,0.001,0.002"}).lr == [0.001, 0.002]
    assert [ct.ours_name(g) for g in (0, 4, 0.5, "global")] == ["ours", "ours-buf4", "ours-buf0.5", "ours-global"]
    assert ct.ours_name(4, "process") == "ours-buf4-process"
    assert ct.ours_name(4, "thread", "lk_hybrid") == "ours-buf4-lk_hybrid"
    assert ct.ours_name("global", "thread", "kl_div", 5, 0.8) == "ours-global-ttt5-decay0.8"
    assert ct.ours_name("global", optimizer="muon") == "ours-global-muon"
    assert ct.ours_name("global", optimizer="muon", lm_head="trained") == "ours-global-muon-lmhead"
    assert args_for(run, tmp_path).ours_lm_heads == ["frozen"]
    assert args_for(run, tmp_path, **{"--ours-lm-heads": "trained,frozen"}).ours_lm_heads == ["trained", "frozen"]
    assert args_for(run, tmp_path).ours_optimizers == ["adamw"]
    assert args_for(run, tmp_path, **{"--ours-optimizers": "muon,adamw,muon"}).ours_optimizers == ["muon", "adamw"]
    assert args_for(run, tmp_path).ours_ttt_steps == [3] and args_for(run, tmp_path).ours_loss_decays == [1.0]
    assert args_for(run, tmp_path).ours_losses == ["kl_div"]
    assert args_for(run, tmp_path, **{"--ours-losses": "lk_hybrid,kl_div,lk_hybrid"}).ours_losses == [
        "lk_hybrid", "kl_div"]
    assert args_for(run, tmp_path, **{"--ours-row-loaders": "process,thread,process"}).ours_row_loaders == [
        "process", "thread"]
    # one rate: the names of a single comparison; a grid: each run names its rate
    assert ct.run_name("ours-buf4", 0.001, [0.001]) == "ours-buf4"
    assert [ct.run_name("speculators", lr, [0.001, 0.0015]) for lr in (0.001, 0.0015)] == [
        "speculators@lr0.001", "speculators@lr0.0015"]
    for flag, bad in (("--ours-shuffle-buffers", "-1,4"), ("--ours-shuffle-buffers", "x"), ("--lr", "0,0.001"),
                      ("--lr", "1e-3,fast"), ("--ours-row-loaders", "thread,auto"), ("--ours-losses", "kl_div,kl"),
                      ("--ours-ttt-steps", "3,0"), ("--ours-ttt-steps", "3.5"), ("--ours-loss-decays", "0,1"),
                      ("--ours-optimizers", "adamw,sgd"), ("--ours-lm-heads", "frozen,tied")):
        with pytest.raises(SystemExit):
            args_for(run, tmp_path, **{flag: bad})
        assert flag in capsys.readouterr().err


def test_our_runs_pass_their_variant_to_train_draft(run, tmp_path, monkeypatch):
    """The command train_ours builds is one train_draft parses, with the variant's settings."""
    from eaglepipe import train_draft

    class Ran(Exception):
        pass

    def run_logged(cmd, log, env=None):
        assert cmd[1:3] == ["-m", "eaglepipe.train_draft"]
        raise Ran(train_draft.parse_args(cmd[3:]))

    monkeypatch.setattr(ct, "run_logged", run_logged)
    variant = {"shuffle_buffer_gib": "global", "row_loader": "thread", "loss": "kl_div", "ttt_steps": 5,
               "ttt_step_loss_decay": 0.8, "optimizer": "muon", "lm_head": "trained"}
    (tmp_path / "work").mkdir()
    with pytest.raises(Ran) as ran:
        ct.train_ours(args_for(run, tmp_path), tmp_path / "work", variant, 0.003, "ours-x")
    got = vars(ran.value.args[0])
    assert {k: got[k] for k in variant} == variant and got["lr"] == 0.003 and got["max_steps"] == 7


def grid_results(runs: dict, lrs: list[float]) -> dict:
    pairs = [(n, ct.run_name("speculators", r["lr"], lrs)) for n, r in runs.items() if n.startswith("ours")]
    return {"runs": runs, "ratios": {f"{a} / {b}": ct.ratios(runs[a], runs[b]) for a, b in pairs},
            "grid": ct.grid(runs), "settings": {"lr": lrs}}


def row(lr, al, ms):
    return {"lr": lr, "steps": 7, "tokens_per_step": 60.0, "ms_per_step": ms, "tokens_per_s": 60_000.0 / ms,
            "acceptance_length": al, "per_position_acceptance": [0.3, 0.2, None]}


def test_grid_takes_each_trainer_at_its_best_rate_and_times_it_over_all_its_runs():
    lrs = [0.001, 0.0015, 0.002]
    runs = {"ours-buf4@lr0.001": row(0.001, 1.72, 35.5), "speculators@lr0.001": row(0.001, 1.73, 38.4),
            "ours-buf4@lr0.0015": row(0.0015, 1.78, 31.0), "speculators@lr0.0015": row(0.0015, 1.70, 40.0),
            "ours-buf4@lr0.002": row(0.002, 1.71, 33.0), "speculators@lr0.002": row(0.002, 1.74, 36.0)}
    g = ct.grid(runs)
    assert g["best"]["ours-buf4"] == {"lr": 0.0015, "acceptance_length": 1.78, "runs": 3, "ms_per_step_median": 33.0,
                                      "ms_per_step_range": [31.0, 35.5]}
    assert g["best"]["speculators"]["lr"] == 0.002 and g["best"]["speculators"]["ms_per_step_median"] == 38.4
    assert g["over_speculators"] == {"ours-buf4": {"acceptance_length": round(1.78 / 1.74, 3),
                                                   "ms_per_step": round(33.0 / 38.4, 3)}}
    lines = ct.report(grid_results(runs, lrs)).splitlines()
    assert [line.split()[0] for line in lines[2:8]] == list(runs)
    assert "ours-buf4@lr0.0015 / speculators@lr0.0015: ms/step 0.775, tokens/s 1.29, offline AL 1.047" in lines
    assert lines[-1] == f"  ours-buf4 / speculators, each at its best: offline AL {round(1.78 / 1.74, 3)}, " \
                        f"ms/step {round(33.0 / 38.4, 3)}"


def test_one_rate_reports_the_plain_comparison():
    runs = {"ours": row(0.001, 1.5, 40.0), "ours-buf4": row(0.001, 1.6, 40.0), "speculators": row(0.001, 1.5, 40.0)}
    lines = ct.report(grid_results(runs, [0.001])).splitlines()
    assert [line.split()[0] for line in lines[2:5]] == ["ours", "ours-buf4", "speculators"]
    assert lines[-1] == "ours-buf4 / speculators: ms/step 1.0, tokens/s 1.0, offline AL 1.067"


def test_a_saved_stage_is_reused_only_for_the_settings_it_was_made_from(tmp_path, capsys):
    calls = []
    def fn():
        calls.append(1)
        return {"ms_per_step": 30.0 + len(calls)}
    path = tmp_path / "ours.json"
    assert ct.stage(path, fn, {"lr": 0.001}) == {"ms_per_step": 31.0, "made_from": {"lr": 0.001}}
    assert ct.stage(path, fn, {"lr": 0.001})["ms_per_step"] == 31.0 and len(calls) == 1
    assert ct.stage(path, fn, {"lr": 0.0015}) == {"ms_per_step": 32.0, "made_from": {"lr": 0.0015}}
    assert "ours.json: made from other settings ({'lr': 0.001}), making it again" in capsys.readouterr().out
    assert json.loads(path.read_text())["made_from"] == {"lr": 0.0015} and len(calls) == 2


def test_main_runs_the_grid_interleaved_and_resumes(run, tmp_path, monkeypatch, capsys):
    """main() end to end with the trainers and the evaluator stood in (they need CUDA): run order,
    names, the JSON, the report; a second call reuses every stage."""
    order = []
    def train_ours(args, work, variant, lr, name):
        order.append(name)
        return {"lr": lr, "draft": f"{work}/{name}/ckpt", "steps": args.steps, "tokens_per_step": 60.0,
                "ms_per_step": 30.0 + 1000 * lr}
    def train_speculators(args, work, manifest, lr, name):
        order.append(name)
        return {"lr": lr, "draft": f"{work}/{name}/0", "steps": args.steps, "tokens_per_step": 60.0, "ms_per_step": 40.0}
    def evaluate(args, work, name, draft):
        return {"acceptance_length": 1.5 + (0.1 if "ours" in name else 0) + (0.05 if "0.0015" in name else 0),
                "per_position_acceptance": [0.4, 0.3, 0.2], "anchors": 9, "tokens_evaluated": 99}
    monkeypatch.setattr(ct, "train_ours", train_ours)
    monkeypatch.setattr(ct, "train_speculators", train_speculators)
    monkeypatch.setattr(ct, "evaluate", evaluate)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "stand-in GPU")
    argv = ["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
            "--work", str(tmp_path / "w"), "--json", str(tmp_path / "o.json"), "--steps", "7",
            "--lr", "0.0015,0.001", "--ours-shuffle-buffers", "0,4", "--ours-row-loaders", "thread,process"]
    ct.main(argv)
    assert order == [f"{name}@lr{lr}" for lr in ("0.001", "0.0015")
                     for name in ("ours", "ours-process", "ours-buf4", "ours-buf4-process", "speculators")]
    out = json.loads((tmp_path / "o.json").read_text())
    assert list(out["ratios"]) == [f"{o}@lr{lr} / speculators@lr{lr}" for lr in ("0.001", "0.0015")
                                   for o in ("ours", "ours-process", "ours-buf4", "ours-buf4-process")]
    assert out["runs"]["ours-buf4@lr0.0015"]["acceptance_length"] == pytest.approx(1.65)
    assert out["runs"]["ours-buf4-process@lr0.0015"]["made_from"]["shuffle_buffer_gib"] == 4
    assert out["runs"]["ours-buf4-process@lr0.0015"]["made_from"]["row_loader"] == "process"
    assert out["grid"]["best"]["ours"]["lr"] == 0.0015 and out["grid"]["best"]["speculators"]["lr"] == 0.0015
    assert out["grid"]["over_speculators"]["ours"] == {"acceptance_length": round(1.65 / 1.55, 3),
                                                       "ms_per_step": round(31.25 / 40.0, 3)}
    assert out["settings"]["gpu"] == "stand-in GPU" and out["settings"]["lr"] == [0.001, 0.0015]
    printed = capsys.readouterr().out
    assert "FINAL_OFFLINE_AL speculators@lr0.0015 1.55 (k=3)" in printed
    ct.main(argv)  # every stage saved: nothing runs again
    assert len(order) == 10 and "reusing" in capsys.readouterr().out
    ct.main([*argv, "--spec-defaults"])  # one more run, speculators at its own settings; the rest reused
    assert order[10:] == [ct.SPEC_DEFAULTS]
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["runs"][ct.SPEC_DEFAULTS]["lr"] is None
    assert "ours-buf4@lr0.0015 / speculators-defaults" in out["ratios"]
    assert out["grid"]["over_speculators_defaults"]["ours"] == {"acceptance_length": round(1.65 / 1.5, 3),
                                                                "ms_per_step": round(31.25 / 40.0, 3)}
    printed = capsys.readouterr().out
    assert "speculators-defaults" in printed and "its defaults: AL 1.500" in printed
    del order[10:]
    ct.main([*argv[:-6], "--steps", "8", "--lr", "0.0015,0.001", "--ours-shuffle-buffers", "4"])  # other steps
    assert order[10:] == [f"{name}@lr{lr}" for lr in ("0.001", "0.0015") for name in ("ours-buf4", "speculators")]
    assert json.loads((tmp_path / "o.json").read_text())["runs"]["speculators@lr0.001"]["made_from"]["steps"] == 8
    del order[10:]
    ct.main([*argv[:-6], "--lr", "0.0015", "--ours-shuffle-buffers", "4", "--ours-losses", "kl_div,lk_hybrid"])
    assert order[10:] == ["ours-buf4", "ours-buf4-lk_hybrid", "speculators"]
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["runs"]["ours-buf4-lk_hybrid"]["made_from"]["loss"] == "lk_hybrid"
    assert list(out["ratios"]) == ["ours-buf4 / speculators", "ours-buf4-lk_hybrid / speculators"]
    del order[10:]  # TTT depths and loss decays: ours once per pair; speculators (at --ttt-steps, 1.0) is reused
    ct.main([*argv[:-6], "--lr", "0.0015", "--ours-ttt-steps", "5,3", "--ours-loss-decays", "0.8,1"])
    assert order[10:] == ["ours-global-decay0.8", "ours-global", "ours-global-ttt5-decay0.8", "ours-global-ttt5"]
    made = json.loads((tmp_path / "o.json").read_text())["runs"]["ours-global-ttt5-decay0.8"]["made_from"]
    assert made["ttt_steps"] == 5 and made["ttt_step_loss_decay"] == 0.8
    del order[10:]  # optimizers: ours once per optimizer, speculators reused
    ct.main([*argv[:-6], "--lr", "0.0015", "--ours-optimizers", "adamw,muon"])
    assert order[10:] == ["ours-global-muon"]  # ours-global (adamw) is the run above, reused
    made = json.loads((tmp_path / "o.json").read_text())["runs"]["ours-global-muon"]["made_from"]
    assert made["optimizer"] == "muon"
    del order[10:]  # the lm_head trained: ours once more, speculators reused
    ct.main([*argv[:-6], "--lr", "0.0015", "--ours-lm-heads", "frozen,trained"])
    assert order[10:] == ["ours-global-lmhead"]
    made = json.loads((tmp_path / "o.json").read_text())["runs"]["ours-global-lmhead"]["made_from"]
    assert made["lm_head"] == "trained"


def test_a_comparison_cut_short_keeps_the_runs_it_finished_scored(run, tmp_path, monkeypatch):
    """Each run is scored right after its training and the JSON rewritten: a deadline that kills the
    comparison during speculators' run still leaves our run with its AL."""
    def train_ours(args, work, variant, lr, name):
        return {"lr": lr, "draft": f"{work}/{name}/ckpt", "steps": args.steps, "tokens_per_step": 60.0, "ms_per_step": 30.0}
    def cut(*a):
        raise KeyboardInterrupt  # what the deadline's SIGTERM/SIGINT looks like mid-run
    monkeypatch.setattr(ct, "train_ours", train_ours)
    monkeypatch.setattr(ct, "train_speculators", cut)
    monkeypatch.setattr(ct, "evaluate", lambda args, work, name, draft: {
        "acceptance_length": 1.7, "per_position_acceptance": [0.5, 0.3, 0.2], "anchors": 9, "tokens_evaluated": 99})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "stand-in GPU")
    with pytest.raises(KeyboardInterrupt):
        ct.main(["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
                 "--work", str(tmp_path / "w"), "--json", str(tmp_path / "o.json"), "--steps", "7"])
    out = json.loads((tmp_path / "o.json").read_text())
    assert list(out["runs"]) == ["ours-global"] and out["runs"]["ours-global"]["acceptance_length"] == 1.7
    assert out["ratios"] == {} and out["grid"]["over_speculators"] == {}
