"""prepare_data CLI on a tiny target: outputs, reconciled counts, stable split, skips and errors."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from eaglepipe.prepare_data import in_eval, main


def run(tmp_path, data, model, *extra, out="out"):
    out_dir = tmp_path / out
    main(["--data", str(data), "--model", str(model), "--out-dir", str(out_dir), *map(str, extra)])
    return out_dir


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_outputs_reconcile_and_match_the_template(tmp_path, tiny_llama, chats):
    out = run(tmp_path, chats, tiny_llama, "--max-length", 4096, "--eval-fraction", 0.25)
    stats = json.loads((out / "stats.json").read_text())
    train, ev = rows(out / "train.jsonl"), rows(out / "eval.jsonl")
    assert stats["read"] == 40 == stats["kept"] + stats["skipped"] and stats["skipped"] == 0
    assert len(train) == stats["splits"]["train"]["samples"] and len(ev) == stats["splits"]["eval"]["samples"]
    assert len(train) + len(ev) == 40 and 0 < len(ev) < 20
    assert {r["id"] for r in ev} == {f"c{i}" for i in range(40) if in_eval(f"c{i}", 0, 0.25)}
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    src = {json.loads(line)["id"]: json.loads(line)["conversations"] for line in chats.read_text().splitlines()}
    for r in train[:5]:
        assert len(r["input_ids"]) == len(r["loss_mask"])
        assert r["input_ids"] == tok.apply_chat_template(src[r["id"]], return_dict=False)
        masked = tok.decode([i for i, m in zip(r["input_ids"], r["loss_mask"]) if m])
        assert masked == "".join(m["content"] + "<|im_end|>" for m in src[r["id"]] if m["role"] == "assistant")
    s = stats["splits"]["train"]
    assert s["tokens"] == sum(len(r["input_ids"]) for r in train)
    assert s["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in train)
    assert s["max_length"] == max(len(r["input_ids"]) for r in train)
    assert sum(s["length_histogram"]) == len(train)
    assert len(stats["template_digest"]) == 64

    with safe_open(str(out / "token_freq.safetensors"), "pt") as f:
        freq = f.get_tensor("token_freq")
        meta = f.metadata()
    assert freq.dtype == torch.int64 and freq.shape == (400,)  # the model config's vocab
    expected = torch.zeros(400, dtype=torch.int64)
    for r in train:  # train split only, loss-masked only
        for i, m in zip(r["input_ids"], r["loss_mask"]):
            expected[i] += m
    assert torch.equal(freq, expected)
    assert meta["vocab_size"] == "400" and meta["loss_masked_tokens"] == str(s["assistant_tokens"])


def test_the_datas_category_reaches_the_samples(tmp_path, tiny_llama):
    data = tmp_path / "chats.jsonl"
    turns = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello to you"}]
    cats = {f"c{i}": ("coding", "writing", None)[i % 3] for i in range(12)}
    data.write_text("".join(json.dumps({"id": i, "messages": turns, **({"category": c} if c else {})}) + "\n"
                            for i, c in cats.items()))
    out = run(tmp_path, data, tiny_llama, "--eval-fraction", 0.4)
    written = rows(out / "train.jsonl") + rows(out / "eval.jsonl")
    assert len(written) == 12 and all(r.get("category") == cats[r["id"]] for r in written)
    # token-exact samples (regenerate_responses' output) keep theirs too
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"id": r["id"], "conversation": r["id"], "input_ids": r["input_ids"],
                                           "loss_mask": r["loss_mask"], **({"category": cats[r["id"]]} if cats[r["id"]]
                                                                           else {})}) + "\n" for r in written))
    out = run(tmp_path, samples, tiny_llama, "--pretokenized", "--eval-fraction", 0.4, out="tokenized")
    again = {r["id"]: r for r in rows(out / "train.jsonl") + rows(out / "eval.jsonl")}
    assert again == {r["id"]: r for r in written}


def test_split_is_stable_when_max_samples_grows(tmp_path, tiny_llama, chats):
    small = run(tmp_path, chats, tiny_llama, "--max-samples", 20, "--eval-fraction", 0.3, out="small")
    big = run(tmp_path, chats, tiny_llama, "--max-samples", 0, "--eval-fraction", 0.3, out="big")
    ids = {name: {r["id"] for r in rows(big / f"{name}.jsonl")} for name in ("train", "eval")}
    for name in ("train", "eval"):
        assert {r["id"] for r in rows(small / f"{name}.jsonl")} <= ids[name]
    assert json.loads((small / "stats.json").read_text())["read"] == 20
    other_seed = run(tmp_path, chats, tiny_llama, "--eval-fraction", 0.3, "--seed", 1, out="seed1")
    assert {r["id"] for r in rows(other_seed / "eval.jsonl")} != ids["eval"]


def test_too_long_truncate_and_drop(tmp_path, tiny_llama, chats):
    lengths = [len(r["input_ids"]) for name in ("train", "eval")
               for r in rows(run(tmp_path, chats, tiny_llama, "--max-length", 4096, out="full") / f"{name}.jsonl")]
    limit = sorted(lengths)[len(lengths) // 2]
    longer = sum(n > limit for n in lengths)
    out = run(tmp_path, chats, tiny_llama, "--max-length", limit, "--eval-fraction", 0.2, out="trunc")
    stats = json.loads((out / "stats.json").read_text())
    no_assistant = stats["skipped_by_reason"].get("no_assistant_token_after_truncation", 0)
    # truncated counts kept samples; a sample left with no assistant token was truncated too
    assert stats["truncated"] == longer - no_assistant and stats["kept"] == 40 - no_assistant
    assert all(len(r["input_ids"]) <= limit and sum(r["loss_mask"]) > 0 for r in rows(out / "train.jsonl"))
    out = run(tmp_path, chats, tiny_llama, "--max-length", limit, "--too-long", "drop", "--eval-fraction", 0.2,
              out="drop")
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped_by_reason"] == {"too_long": longer} and stats["truncated"] == 0
    assert stats["kept"] == 40 - longer


def test_bad_records_are_counted_by_reason_with_examples(tmp_path, tiny_llama):
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    lines = [json.dumps({"id": f"g{i}", **good}) for i in range(12)] + [
        "{oops",
        json.dumps({"id": "g0", **good}),
        json.dumps({"id": "e", "conversations": []}),
        json.dumps({"id": "u", "conversations": [{"from": "human", "value": "only a question"}]}),
        json.dumps({"id": "r", "conversations": [{"from": "robot", "value": "x"}]}),
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(lines) + "\n")
    stats = json.loads((run(tmp_path, data, tiny_llama, "--eval-fraction", 0.3) / "stats.json").read_text())
    assert stats["read"] == 17 and stats["kept"] == 12
    assert stats["skipped_by_reason"] == {"bad_json": 1, "duplicate_id": 1, "empty_conversation": 1,
                                          "no_assistant_turn": 1, "unknown_role": 1}
    assert stats["skip_examples"]["bad_json"][0]["source"] == f"{data}:13"
    assert "'robot'" in stats["skip_examples"]["unknown_role"][0]["detail"]


def test_nothing_kept_is_a_clear_error_and_writes_nothing(tmp_path, tiny_llama):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "a", "conversations": [{"from": "human", "value": "q"}]}\nnot json\n')
    with pytest.raises(SystemExit, match=r"no conversation kept out of 2 read \(skipped: .*no_assistant_turn=1"):
        run(tmp_path, data, tiny_llama)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_empty_eval_split_is_a_clear_error(tmp_path, tiny_llama, chats):
    with pytest.raises(SystemExit, match="the eval split is empty"):
        run(tmp_path, chats, tiny_llama, "--max-samples", 1, "--eval-fraction", 0.01)


def test_eval_data_is_the_eval_split_and_no_fraction_is_drawn(tmp_path, tiny_llama, chats):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # --eval-fraction is not used: the empty eval data is the eval split, however large the fraction
    with pytest.raises(SystemExit, match=f"{empty}: the eval split is empty"):
        run(tmp_path, chats, tiny_llama, "--eval-data", empty, "--eval-fraction", 0.5)


def test_multimodal_wrapper_vocab_from_text_config(tmp_path, tiny_llama, chats):
    """Kimi-K2.5's config wraps the DeepseekV3 text config; the vocab comes from get_text_config()."""
    import shutil

    model = tmp_path / "wrapped"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    text = {k: cfg[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")}
    text["model_type"] = "llama"
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text,
                                                   "vision_config": {"model_type": "clip_vision_model"}}))
    out = run(tmp_path, chats, model)
    with safe_open(str(out / "token_freq.safetensors"), "pt") as f:
        assert f.get_tensor("token_freq").shape == (400,)


# --- template families: every assistant turn trained, reasoning counted, counts reconcile ---------

@pytest.fixture(scope="module")
def family_targets(tmp_path_factory):
    import tiny

    return {family: tiny.make_target(tmp_path_factory.mktemp(family), family) for family in tiny.FAMILIES}


@pytest.fixture
def thinking_chats(tmp_path):
    import tiny

    return tiny.make_thinking_chats(tmp_path / "thinking.jsonl", n=30)


def assistant_reconciles(out, stats):
    """The counts in stats.json against the written files."""
    a = stats["assistant"]
    written = [r for name in ("train", "eval") for r in rows(out / f"{name}.jsonl")]
    assert a["tokens_trained"] == sum(sum(r["loss_mask"]) for r in written)
    assert a["tokens_trained"] == sum(a["tokens_trained_by_kind"].values())
    assert set(a["tokens_trained_by_kind"]) <= {"thinking", "answer"}
    assert a["tokens_in_data"] == a["tokens_trained"] + sum(a["tokens_not_trained_by_reason"].values())
    assert a["turns_in_data"] == a["turns_trained"] + sum(a["turns_not_trained_by_reason"].values())
    # a conversation's samples share its split: no prompt of an eval turn is trained on
    splits = {name: {r["id"].split("#")[0] for r in rows(out / f"{name}.jsonl")} for name in ("train", "eval")}
    assert not splits["train"] & splits["eval"]
    assert len(splits["train"] | splits["eval"]) == stats["kept"] == stats["read"] - stats["skipped"]
    return written


def test_kimi_k25_preset_template_trains_thinking_and_every_turn(tmp_path, family_targets, thinking_chats, capsys):
    import tiny

    out = run(tmp_path, thinking_chats, family_targets["kimi-k2.5"], "--chat-template", tiny.KIMI_TRAIN_TEMPLATE,
              "--eval-fraction", 0.2, "--max-length", 4096)
    stats = json.loads((out / "stats.json").read_text())
    a = stats["assistant"]
    written = assistant_reconciles(out, stats)
    assert stats["kept"] == 30 and stats["prompts_differing_from_tokenizer_template"] == 0
    assert a["turns_trained"] == a["turns_in_data"] and a["tokens_not_trained_by_reason"] == {}
    assert a["tokens_trained_by_kind"]["thinking"] > 0 and a["turns_trained_as_own_sample"] > 0
    assert any("#turn" in r["id"] for r in written)
    tok = AutoTokenizer.from_pretrained(str(family_targets["kimi-k2.5"]))
    assert not any("</think><think>" in tok.decode(r["input_ids"]) for r in written)
    assert stats["chat_template"] == str(tiny.KIMI_TRAIN_TEMPLATE)
    assert "WARNING" not in capsys.readouterr().err
    # Kimi's own template drops the reasoning of a trained answer turn: counted by reason, and a warning line
    own = run(tmp_path, thinking_chats, family_targets["kimi-k2.5"], "--eval-fraction", 0.2, "--max-length", 4096,
              out="own")
    own_stats = json.loads((own / "stats.json").read_text())
    assistant_reconciles(own, own_stats)
    # (Kimi keeps the reasoning of tool-call turns: only theirs is trained)
    assert 0 < own_stats["assistant"]["tokens_trained_by_kind"]["thinking"] < a["tokens_trained_by_kind"]["thinking"]
    assert own_stats["assistant"]["tokens_not_trained_by_reason"]["reasoning_not_rendered"] > 0
    assert own_stats["template_digest"] != stats["template_digest"]
    assert "WARNING: only" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "generation"])
def test_every_family_trains_every_turn_and_reconciles(tmp_path, family_targets, thinking_chats, family):
    out = run(tmp_path, thinking_chats, family_targets[family], "--eval-fraction", 0.2, "--max-length", 4096)
    stats = json.loads((out / "stats.json").read_text())
    a = stats["assistant"]
    assistant_reconciles(out, stats)
    assert stats["kept"] == 30 and a["turns_trained"] == a["turns_in_data"]
    if family == "qwen3":  # renders thinking: all of it is trained
        assert a["tokens_not_trained_by_reason"] == {} and a["tokens_trained_by_kind"]["thinking"] > 0
        assert a["turns_trained_as_own_sample"] > 0
    else:  # these templates have no place for reasoning: the turn is trained, its reasoning counted
        assert set(a["tokens_not_trained_by_reason"]) == {"reasoning_not_rendered"}


def test_kwargs_reach_the_template_and_the_digest(tmp_path, family_targets, thinking_chats):
    default = run(tmp_path, thinking_chats, family_targets["qwen3"], "--eval-fraction", 0.2, out="default")
    off = run(tmp_path, thinking_chats, family_targets["qwen3"], "--eval-fraction", 0.2,
              "--chat-template-kwargs", '{"enable_thinking": false}', out="off")
    stats = [json.loads((o / "stats.json").read_text()) for o in (default, off)]
    assert stats[1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert stats[0]["template_digest"] != stats[1]["template_digest"]
    # with thinking off, turns with reasoning cannot follow the prompt's closed think block
    assert stats[1]["assistant"]["turns_not_trained_by_reason"]["template_prefix_mismatch"] > 0
    with pytest.raises(SystemExit):
        run(tmp_path, thinking_chats, family_targets["qwen3"], "--chat-template-kwargs", "[1]", out="bad")


def test_rerendered_turns_as_context(tmp_path, family_targets, thinking_chats):
    out = run(tmp_path, thinking_chats, family_targets["qwen3"], "--eval-fraction", 0.2, "--rerendered-turns",
              "context")
    stats = json.loads((out / "stats.json").read_text())
    assistant_reconciles(out, stats)
    assert stats["assistant"]["turns_trained_as_own_sample"] == 0
    assert stats["assistant"]["turns_not_trained_by_reason"]["history_rerendered"] > 0
    assert not any("#turn" in r["id"] for r in rows(out / "train.jsonl"))
