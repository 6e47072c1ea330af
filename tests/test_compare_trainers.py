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
from test_packed_data import make_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compare_trainers as ct  # noqa: E402

from eaglepipe.shards import load_manifest, read_shard, shard_paths  # noqa: E402


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
    cfg = TrainConfig.resolve(ct.speculators_argv(args, manifest, out, conv, epochs=3)).flatten()
    expected = {
        "target_layer_ids": [1, 3, 5], "total_seq_len": 64, "lr": 0.002, "optimizer": "adamw", "weight_decay": 0.0,
        "scheduler_type": "cosine", "scheduler_warmup_steps": 2, "scheduler_num_cosine_cycles": 0.5,
        "max_steps": 7, "epochs": 3, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_fn": "kl_div",
        "num_layers": 1, "full_attention_indices": [0], "draft_vocab_size": conv["draft_vocab_size"],
        "norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True,
        "embed_requires_grad": False, "train_data_ratio": conv["train_data_ratio"], "data_path": str(out),
        "on_missing": "raise", "no_resume_from_checkpoint": True, "speculator_type": "eagle3",
    }
    assert {k: cfg[k] for k in expected} == expected


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
        ct.speculators_argv(args_for(run, tmp_path), manifest, out, conv, epochs=1)).flatten())
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


def test_our_trainer_runs_once_per_shuffle_buffer(run, tmp_path, capsys):
    assert args_for(run, tmp_path).ours_shuffle_buffers == [0]
    assert args_for(run, tmp_path, **{"--ours-shuffle-buffers": "4,0,4"}).ours_shuffle_buffers == [0, 4]
    assert [ct.ours_name(g) for g in (0, 4, 0.5)] == ["ours", "ours-buf4", "ours-buf0.5"]
    for bad in ("-1,4", "x"):
        with pytest.raises(SystemExit):
            args_for(run, tmp_path, **{"--ours-shuffle-buffers": bad})
    assert "--ours-shuffle-buffers" in capsys.readouterr().err
    row = {"steps": 7, "tokens_per_step": 60.0, "ms_per_step": 40.0, "tokens_per_s": 1500.0, "acceptance_length": 1.5,
           "per_position_acceptance": [0.3, 0.2, None]}
    results = {"ours": row, "ours-buf4": {**row, "acceptance_length": 1.6}, "speculators": row,
               "ratio_ours_over_speculators": {"ms_per_step": 1.0, "tokens_per_s": 1.0, "acceptance_length": 1.0},
               "ratio_ours-buf4_over_speculators": {"ms_per_step": 1.0, "tokens_per_s": 1.0, "acceptance_length": 1.067}}
    assert ct.trainers(results) == ["ours", "ours-buf4", "speculators"]
    lines = ct.report(results).splitlines()
    assert [line.split()[0] for line in lines[2:5]] == ["ours", "ours-buf4", "speculators"]
    assert lines[-1] == "ours-buf4 / speculators: ms/step 1.0, tokens/s 1.0, offline AL 1.067"
