"""export_draft: a speculators checkpoint -> the directory vLLM serves, checked and round-trip loaded."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglepipe import export_draft as ex
from eaglepipe.serving_limits import NORM_FLAGS

AUX = [2, 3, 5]
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """A run dir as train_draft leaves it: train/summary.json + one COMPLETE speculators checkpoint."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution({i: 1000 - i for i in range(0, 400, 3)}, DRAFT_VOCAB, 400)
    layer_cfg = create_transformer_layer_config(str(tiny_llama), 1, "llama", None, 2048, [0])
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
        norm_before_fc=True, norm_output=True, ttt_steps=3, verifier_name_or_path=str(tiny_llama),
        target_layer_ids=AUX, draft_attn_impl="sdpa")
    run = tmp_path_factory.mktemp("run")
    ckpt = run / "train" / "checkpoints" / "step-0000004"
    model.save_pretrained(str(ckpt))
    (ckpt / "COMPLETE").write_text("")
    summary = {"best": "checkpoints/step-0000004", "last": "checkpoints/step-0000004", "steps": 4,
               "best_eval": {"acceptance_length": 1.42, "accuracy_per_position": [0.3, 0.1, 0.05]},
               "last_eval": {"acceptance_length": 1.42}, "layer_ids": AUX + [6], "aux_layer_ids": AUX,
               "target_model": str(tiny_llama), "draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 3,
               "train_tokens": 1234, "metrics": "metrics.jsonl"}
    (run / "train" / "summary.json").write_text(json.dumps(summary))
    (run / "data").mkdir()
    (run / "data" / "stats.json").write_text(json.dumps({"read": 40, "kept": 38, "skipped": {"no_assistant": 2}}))
    return run


@pytest.fixture
def run(trained, tmp_path):
    """A private copy, so failure tests may damage it."""
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


def export(run, **kw):
    args = dict(summary_path=str(run / "train" / "summary.json"), which="best", verifier_name="org/tiny-target",
                k=4, drop_embedding=True, out_dir=str(run / "draft"))
    args.update(kw)
    return ex.export_draft(**args)


def ckpt_tensors(run):
    return load_file(str(run / "train" / "checkpoints" / "step-0000004" / "model.safetensors"))


@pytest.mark.parametrize("drop", [True, False])
def test_round_trip(run, tiny_llama, drop, capsys):
    info = export(run, drop_embedding=drop)  # includes the speculators round-trip load
    out = run / "draft"
    # the card is model_card's; export.json records the checkpoint and the files' checksums
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export.json", "model.safetensors"]
    record = json.loads((out / "export.json").read_text())
    assert record["checkpoint"] == info["checkpoint"] and record["files"]["model.safetensors"]["bytes"] == info["bytes"]
    assert not any((out / name).stat().st_mode & 0o222 for name in ex.DRAFT)  # read-only, as protected() left them
    assert not list(run.glob(".tmp-*"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["transformer_layer_config"]["vocab_size"] == 400
    assert cfg["dtype"] == "bfloat16"
    assert {f: cfg[f] for f in NORM_FLAGS} == {
        "norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}

    src, got = ckpt_tensors(run), load_file(str(out / "model.safetensors"))
    assert torch.equal(got["d2t"], src["d2t"]) and got["d2t"].dtype == torch.int64
    assert torch.equal(got["t2d"], src["t2d"]) and got["t2d"].dtype == torch.bool
    assert (ex.EMBED in got) is not drop
    assert all(t.dtype == torch.bfloat16 for n, t in got.items() if n not in ("d2t", "t2d"))
    assert torch.equal(got["fc.weight"], src["fc.weight"].to(torch.bfloat16))
    assert info["embedding_bytes_saved"] == (400 * 64 * 2 if drop else 0)

    # speculators loads the export; a dropped embedding comes from the target
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    scfg = Eagle3SpeculatorConfig.from_pretrained(str(out))
    scfg.speculators_config.verifier.name_or_path = str(tiny_llama)
    model = Eagle3DraftModel.from_pretrained(str(out), config=scfg, dtype=torch.bfloat16)
    if not drop:
        assert torch.equal(model.embed_tokens.weight, src[ex.EMBED].to(torch.bfloat16))
    assert torch.equal(model.d2t, src["d2t"]) and model.target_layer_ids == AUX
    assert torch.equal(model.layers[0].self_attn.q_proj.weight, src["layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))


def test_cli_flags_and_bytes_saved(run, capsys):
    ex.main(["--summary", str(run / "train" / "summary.json"), "--which", "last", "--verifier-name", "org/t",
             "--num-speculative-tokens", "3", "--drop-embedding", "--out-dir", str(run / "draft")])
    printed = capsys.readouterr().out
    assert f"{400 * 64 * 2:,} bytes saved" in printed
    assert ex.validate_export(run / "draft")["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


def expect_error(run, match, **kw):
    with pytest.raises(ex.ExportError, match=match):
        export(run, **kw)
    assert not (run / "draft").exists() and not list(run.glob(".tmp-*"))


def ckpt_dir(run):
    return run / "train" / "checkpoints" / "step-0000004"


def test_refuses_incomplete_checkpoint(run):
    (ckpt_dir(run) / "COMPLETE").unlink()
    expect_error(run, r"not finished \(no COMPLETE marker\)")


def test_refuses_missing_weights(run):
    (ckpt_dir(run) / "model.safetensors").unlink()
    expect_error(run, "model.safetensors is missing")


def rewrite_tensors(run, edit):
    t = ckpt_tensors(run)
    edit(t)
    save_file(t, str(ckpt_dir(run) / "model.safetensors"))


def test_refuses_missing_tensor(run):
    rewrite_tensors(run, lambda t: t.pop("fc.weight"))
    expect_error(run, r"tensor\(s\) \['fc.weight'\] missing")


def test_refuses_wrong_shape(run):
    rewrite_tensors(run, lambda t: t.__setitem__("lm_head.weight", torch.zeros(32, 64)))
    expect_error(run, r"'lm_head.weight' has shape \[32, 64\], the config says \[64, 64\]")


def test_refuses_inconsistent_vocab_mapping(run):
    rewrite_tensors(run, lambda t: t["d2t"].__setitem__(0, 5))
    expect_error(run, "d2t and t2d disagree")


def test_keep_embedding_needs_it(run):
    rewrite_tensors(run, lambda t: t.pop(ex.EMBED))
    expect_error(run, "--no-drop-embedding, but the checkpoint has no embed_tokens.weight", drop_embedding=False)


def edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.pop("aux_layer_ids"), r"missing key\(s\) \['aux_layer_ids'\]"),
    (lambda s: s.__setitem__("aux_layer_ids", [2, 4]), r"aux_layer_ids \[2, 4\] must be layer_ids"),
    (lambda s: s.__setitem__("best", "checkpoints/step-9"), "does not exist"),
])
def test_refuses_bad_summary(run, edit, match):
    edit_json(run / "train" / "summary.json", edit)
    expect_error(run, match)


def test_refuses_unparsable_summary(run):
    (run / "train" / "summary.json").write_text("{not json")
    expect_error(run, "cannot be read as JSON")


def test_refuses_layer_ids_that_disagree_with_config(run):
    edit_json(run / "train" / "summary.json", lambda s: s.update(aux_layer_ids=[1, 3, 5], layer_ids=[1, 3, 5, 6]))
    expect_error(run, r"eagle_aux_hidden_state_layer_ids \[2, 3, 5\] differ from the training summary's aux_layer_ids \[1, 3, 5\]")


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.__setitem__("shared_norm", True), r"norm flag\(s\) \['shared_norm'\] are set but vLLM 0.26.0 ignores"),
    (lambda c: c["transformer_layer_config"].__setitem__("model_type", "mistral"), "vLLM serves EAGLE-3 drafts of type"),
    # Kimi-K2.5's rope as the target has it: transformers trains at attention factor 1.0, vLLM's yarn serves 1.416
    (lambda c: c["transformer_layer_config"].__setitem__("rope_parameters", {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
     r"transformer_layer_config.rope_parameters: yarn attention factor 1 in training \(transformers\) but 1.416 "
     r"when served \(vLLM 0.26.0 ignores mscale, mscale_all_dim and attention_factor\); allowed: rope_type default"),
    (lambda c: c["transformer_layer_config"].__setitem__("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}),
     "rope_type 'dynamic' is not served by vLLM 0.26.0 as transformers trains it"),
])
def test_refuses_train_serve_mismatch(run, edit, match):
    edit_json(ckpt_dir(run) / "config.json", edit)
    expect_error(run, match)


def test_refuses_aux_count_vllm_cannot_serve(run):
    """vLLM 0.26.0 sizes the draft's fc for 3 aux states whatever the config lists (serving_limits.py)."""
    edit_json(ckpt_dir(run) / "config.json", lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [2, 5]))
    edit_json(run / "train" / "summary.json", lambda s: s.update(aux_layer_ids=[2, 5], layer_ids=[2, 5, 6]))
    expect_error(run, r"eagle_aux_hidden_state_layer_ids: 2 aux layer ids \[2, 5\], but vLLM 0.26.0's EAGLE-3 "
                      r"draft reads exactly 3 aux states .*; extract.layer_ids must list 3 aux ids")


def test_refuses_target_embedding_that_does_not_fit(run, tmp_path):
    """--drop-embedding relies on the target's embedding: the round trip proves it fits the draft."""
    import tiny

    small = tiny.make_llama(tmp_path / "small", num_layers=6, hidden=32, tokenizer=False)
    edit_json(run / "train" / "summary.json", lambda s: s.__setitem__("target_model", str(small)))
    expect_error(run, "speculators cannot load it against the target .*size mismatch")


def test_never_overwrites(run):
    (run / "draft").mkdir()
    (run / "draft" / "config.json").write_text("{}")
    with pytest.raises(ex.ExportError, match=r"holds \['config.json'\], no complete draft, and is left as it is: "
                                             "a delivered draft is never overwritten") as e:
        export(run)
    # the message gives the command that clears the way
    assert str(e.value).endswith(f"delete it on purpose (rm -rf {run / 'draft'}) and run again")
    assert (run / "draft" / "config.json").read_text() == "{}" and not list(run.glob(".tmp-*"))


def delivered(run):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (run / "draft").iterdir()
            if p.name != "export.json"}


def test_a_delivered_draft_that_is_this_export_is_kept_as_it_is(run, capsys):
    ex.main(["--summary", str(run / "train" / "summary.json"), "--verifier-name", "org/tiny-target",
             "--num-speculative-tokens", "4", "--out-dir", str(run / "draft")])
    (run / "draft" / "README.md").write_text("the model card")
    before = delivered(run)
    (run / "draft" / "export.json").unlink()  # Snakemake removes the declared output before the job
    capsys.readouterr()
    ex.main(["--summary", str(run / "train" / "summary.json"), "--verifier-name", "org/tiny-target",
             "--num-speculative-tokens", "4", "--out-dir", str(run / "draft")])
    assert capsys.readouterr().out.startswith(f"kept {run / 'draft'}: the delivered draft there is this export of ")
    assert delivered(run) == before and (run / "draft" / "export.json").is_file()
    assert not list(run.glob(".tmp-*"))


def test_a_delivered_draft_of_other_weights_is_left_as_it_is_and_refused(run):
    export(run)
    (run / "draft" / "README.md").write_text("the model card")
    before = delivered(run)
    (run / "draft" / "export.json").unlink()
    with pytest.raises(ex.ExportError, match=r"holds \['README.md', 'config.json', 'model.safetensors'\], a delivered "
                                             r"draft whose config.json differs from this export of .*step-0000004, and "
                                             "is left as it is: a delivered draft is never overwritten"):
        export(run, k=3)
    assert delivered(run) == before and not (run / "draft" / "export.json").exists()
    assert not list(run.glob(".tmp-*"))


def test_cli_error_is_one_sentence(run):
    (ckpt_dir(run) / "COMPLETE").unlink()
    with pytest.raises(SystemExit, match=r"^export_draft: checkpoint .* \(no COMPLETE marker\)$"):
        ex.main(["--summary", str(run / "train" / "summary.json"), "--verifier-name", "x",
                 "--num-speculative-tokens", "3", "--out-dir", str(run / "draft")])
