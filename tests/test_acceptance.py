"""The offline acceptance-length estimator: chain logic on hand-built cases, batch-size invariance,
the TTT/target alignment on real tiny-target shards (an off-by-one cannot reach accuracy 1), and the
strata (labels on hand-built rows, sums back to the overall counts, best-checkpoint selection)."""

from __future__ import annotations

import pytest
import torch
from tiny_stages import Oracle, make_run

from eaglepipe.acceptance import (CHAIN_KEYS, Strata, add_counts, anchor_tensors, chain_counts, check_select_by,
                                  draft_vocab_counts, eval_metrics, evaluate_rows, load_strata, select_value, split_categories,
                                  strata_counts, stratum_labels, summarize, summarize_strata)

B = torch.tensor


def bools(rows):
    return B(rows, dtype=torch.bool)


def test_chain_lengths_on_hand_built_cases():
    hit = bools([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]])
    evaluable = bools([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1]])  # last: cut after step 0
    c = chain_counts(hit, evaluable, torch.ones_like(hit))  # every step scored; anchor 4 left the greedy path
    # accepted per anchor: 3, 1, 0, 2, 1 -> mean 7/5
    s = summarize(c)
    assert s["anchors"] == 5 and s["acceptance_length"] == pytest.approx(1 + 7 / 5)
    assert s["chains_cut"] == 1
    # step 0: 4/5 hit; step 1 reached by anchors 0,1,3 (anchor 4 is not evaluable): 2/3; step 2: anchors 0,3 -> 1/2
    assert s["per_position_acceptance"] == pytest.approx([4 / 5, 2 / 3, 1 / 2])
    # unconditional accuracy over scored positions
    assert s["accuracy_per_position"] == pytest.approx([4 / 5, 4 / 5, 4 / 5])
    assert s["k"] == 3 and "bonus" in s["convention"]


def test_no_anchor_and_non_anchor_rows():
    hit = bools([[1, 1], [1, 1]])
    evaluable = bools([[0, 1], [0, 0]])  # step 0 not evaluable: not an anchor, accepts nothing
    s = summarize(chain_counts(hit, evaluable, evaluable))
    assert s["anchors"] == 0 and s["acceptance_length"] is None


def test_batch_size_invariant():
    g = torch.Generator().manual_seed(0)
    hit = torch.rand(101, 4, generator=g) < 0.7
    evaluable = torch.rand(101, 4, generator=g) < 0.9
    whole = summarize(chain_counts(hit, evaluable, evaluable))
    for size in (1, 7, 50):
        total = None
        for s in range(0, 101, size):
            total = add_counts(total, chain_counts(hit[s:s + size], evaluable[s:s + size], evaluable[s:s + size]))
        assert summarize(total) == whole


def test_anchor_tensors_shift_and_data_off_greedy_path():
    # one document of 6 shifted positions, all scored; A[t] = greedy token predicted at t
    A = B([10, 11, 12, 13, 14, 15])
    x = B([9, 10, 11, 99, 13, 14])  # data follows A except x[3] = 99 != A[2] = 12
    doc = torch.zeros(6, dtype=torch.long)
    mask = torch.ones(6, dtype=torch.long)
    drafts = torch.stack([A, torch.cat([A[1:], B([-5])]), torch.cat([A[2:], B([-5, -5])])])  # perfect draft
    hit, evaluable, valid = anchor_tensors(drafts, A, x, mask, doc)
    assert hit[:4].all()  # draft step k at t equals A[t+k]
    # step k >= 1 at anchor t is faithful only if x[t+m] == A[t+m-1] for m = 1..k: x[3] breaks anchors 1 and 2
    assert evaluable[:, 1].tolist() == [True, True, False, True, True, False]
    assert evaluable[:, 2].tolist() == [True, False, False, True, False, False]
    s = summarize(chain_counts(hit, evaluable, valid))
    # accepted: t0 3, t1 2 (cut before step 2), t2 1 (cut), t3 3, t4 2 (row ends), t5 1 (row ends)
    assert s["acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert s["chains_cut"] == 2  # only the off-path cuts, not the ends of the response


def test_anchor_tensors_respect_documents_and_loss_mask():
    A = B([1, 2, 3, 4])
    x = B([0, 1, 2, 3])
    doc = B([0, 0, 1, 1])
    mask = B([1, 1, 1, 0])
    drafts = torch.stack([A, torch.cat([A[1:], B([0])])])
    _, evaluable, valid = anchor_tensors(drafts, A, x, mask, doc)
    assert valid[:, 0].tolist() == [True, True, True, False]
    assert valid[:, 1].tolist() == [True, False, False, False]  # t1+1 is another document, t2+1 unscored


def test_draft_vocab_coverage_counts_scored_greedy_tokens_the_vocab_holds():
    from types import SimpleNamespace

    greedy = B([0, 1, 2, -1, 3])  # -1: not scored (greedy_tokens leaves it)
    valid = bools([[1, 1], [1, 0], [1, 1], [0, 0], [0, 0]])  # step 0 scored at the first three positions
    mapped = SimpleNamespace(t2d=bools([1, 0, 1, 0]))
    assert {k: int(v) for k, v in draft_vocab_counts(mapped, greedy, valid).items()} == {"vocab_scored": 3,
                                                                                        "vocab_held": 2}
    full = SimpleNamespace(t2d=None)  # no mapping: the draft proposes every target token
    assert int(draft_vocab_counts(full, greedy, valid)["vocab_held"]) == 3


def test_stratum_labels_on_hand_built_row():
    # two documents and a pad; <think> = 7, </think> = 8
    ids = B([1, 7, 2, 3, 8, 4, 5, 7, 6, 1, 2, 0])
    mask = B([0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 1, 0])
    doc = B([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1])
    pos = B([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 0])
    labels = stratum_labels(Strata((2, 4), think_ids=(7, 8), max_turn=3), ids, mask, doc, pos)
    # prefix length <= 2, <= 4, > 4: the edges fall in the lower bucket
    assert labels["context"].tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 0]
    # doc 0: turn 1 at 1-2, turn 2 from 4 on; doc 1 counts again from 1; positions before a turn get the first
    assert labels["turn"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0]  # the pad is no turn's
    # inside from the <think> token up to (not including) </think>; a new document starts outside
    assert labels["thinking"].tolist() == [0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0]


def test_turns_past_max_turn_share_a_label():
    mask = B([1, 0, 1, 0, 1, 0, 1, 0, 1])
    z = torch.zeros(9, dtype=torch.long)
    labels = stratum_labels(Strata((4,), max_turn=3), z, mask, z, torch.arange(1, 10))
    assert labels["turn"].tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert "thinking" not in labels and Strata((4,), max_turn=3).labels()["turn"] == ["1", "2", ">=3"]


def test_strata_sum_back_to_overall():
    g = torch.Generator().manual_seed(1)
    T = 97
    hit, evaluable = torch.rand(T, 3, generator=g) < 0.7, torch.rand(T, 3, generator=g) < 0.9
    valid = evaluable | (torch.rand(T, 3, generator=g) < 0.5)
    strata = Strata((8, 30), think_ids=(5, 6), categories=("chat", "none"))
    ids = torch.randint(0, 10, (T,), generator=g)
    mask = (torch.rand(T, generator=g) < 0.6).long()
    doc = torch.repeat_interleave(torch.arange(3), B([40, 40, 17]))
    pos = torch.cat([torch.arange(1, 41), torch.arange(1, 41), torch.arange(1, 18)])
    overall = chain_counts(hit, evaluable, valid)
    by = strata_counts(hit, evaluable, valid, stratum_labels(strata, ids, mask, doc, pos, ["chat", None, "chat"]),
                       strata)
    assert list(strata.labels()) == ["context", "turn", "thinking", "category"]
    for name, labels in strata.labels().items():
        assert by[f"{name}/anchors"].shape == (len(labels),)
        for key in CHAIN_KEYS:
            assert torch.equal(by[f"{name}/{key}"].sum(0), overall[key]), (name, key)
    summary = summarize_strata(by, strata)
    assert sum(s["anchors"] for s in summary["context"].values()) == int(overall["anchors"]) > 0
    assert set(summary["thinking"]) == {"outside", "inside"}
    assert summary["category"]["none"]["anchors"] == int(evaluable[40:80, 0].sum()) > 0  # the second document's


def test_category_labels_follow_each_document():
    strata = Strata((4,), categories=("coding", "none", "writing"))
    mask = B([1, 1, 1, 1, 1, 1, 0])
    doc = B([0, 0, 1, 1, 2, 2, -1])
    labels = stratum_labels(strata, torch.zeros(7, dtype=torch.long), mask, doc, B([1, 2, 1, 2, 1, 2, 0]),
                            ["writing", None, "coding"])
    assert labels["category"].tolist() == [2, 2, 1, 1, 0, 0, 2]  # the pad: the first document's, never scored
    assert strata.labels()["category"] == ["coding", "none", "writing"]
    assert "category" not in stratum_labels(Strata((4,)), torch.zeros(7, dtype=torch.long), mask, doc,
                                            B([1, 2, 1, 2, 1, 2, 0]))
    assert "category" not in Strata((4,)).labels()


def test_split_categories_from_the_manifest(tmp_path):
    def manifest(*rows):
        return {"_path": str(tmp_path / "manifest.json"), "shard_dir": "shards", "splits": {"eval": {"shards": rows}}}

    plain = {"file": "a", "samples": 2}
    assert split_categories(manifest(plain, plain), "eval") == ()  # no category stratum
    named = {"file": "b", "samples": 2, "categories": ["writing", "coding"]}
    assert split_categories(manifest(named), "eval") == ("coding", "writing")
    mixed = {"file": "c", "samples": 2, "categories": ["math", None]}
    # samples without one are labelled "none", so the labels cover every sample
    assert split_categories(manifest(plain, named, mixed), "eval") == ("coding", "math", "none", "writing")


def test_select_by():
    strata = Strata((512, 2048))
    ev = {"acceptance_length": 2.0, "strata": {"context": {"<=512": {"acceptance_length": 2.5},
                                                           ">2048": {"acceptance_length": None}}}}
    assert select_value(ev, "overall") == 2.0
    assert select_value({**ev, "as_served": {"acceptance_length": 1.8}}, "as_served") == 1.8
    check_select_by("as_served", strata)
    assert select_value(ev, "context:<=512") == 2.5 and select_value(ev, "context:>2048") == 0.0
    check_select_by("context:>2048", strata)
    with pytest.raises(SystemExit, match=r"'thinking:inside'.*one of overall, as_served, context:<=512"):
        check_select_by("thinking:inside", strata)  # no thinking tags in this target
    with pytest.raises(SystemExit, match="'context:<=1024'"):
        check_select_by("context:<=1024", strata)


def test_select_by_category():
    strata = Strata((512,), categories=("coding", "none"))
    check_select_by("category:coding", strata)
    check_select_by("category:none", strata)
    with pytest.raises(SystemExit, match=r"'category:math'.*context:>512, turn:1, .*category:coding, category:none"):
        check_select_by("category:math", strata)
    with pytest.raises(SystemExit, match="'category:coding'"):
        check_select_by("category:coding", Strata((512,)))  # data without categories
    ev = {"acceptance_length": 2.0, "strata": {"category": {"coding": {"acceptance_length": 2.75},
                                                            "none": {"acceptance_length": None}}}}
    assert select_value(ev, "category:coding") == 2.75 and select_value(ev, "category:none") == 0.0


def test_thinking_stratum_from_the_targets_tokenizer(tiny_llama, tmp_path):
    from tiny import FAMILIES, make_tokenizer
    from transformers import AutoTokenizer

    make_tokenizer(tmp_path / "qwen3", **FAMILIES["qwen3"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "qwen3")
    strata = load_strata(str(tmp_path / "qwen3"), [512, 2048])
    assert strata.think_ids == tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    assert list(strata.labels()) == ["context", "turn", "thinking"]
    assert load_strata(str(tiny_llama), [512]).think_ids is None  # plain ChatML tokenizer: no such tokens
    with pytest.raises(SystemExit, match=r"--context-buckets \[512, 512\]: need positive, strictly ascending"):
        load_strata(str(tiny_llama), [512, 512])


def test_ttt_alignment_oracle_reaches_accuracy_one(tiny_llama, tmp_path):
    from speculators.losses import resolve_loss_config

    from eaglepipe.draft_model import build_draft, load_target_head
    from eaglepipe.packed_data import PackedRows
    from eaglepipe.shard_manifest import load_manifest

    run = make_run(tmp_path, tiny_llama)
    manifest = load_manifest(run["manifest"])
    draft = build_draft(tiny_llama, [1, 3, 5], run["vocab"], ttt_steps=3)
    t2d_index = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft index
    head = load_target_head(tiny_llama)
    loss = resolve_loss_config("kl_div", "eager")

    def run_eval(shift, batch_tokens=64, pad_to=None):
        rows = PackedRows(manifest, "eval", batch_tokens, shuffle=False, pad_to=pad_to).once()
        return summarize(evaluate_rows(Oracle(draft, t2d_index, shift), rows, head, 3, loss))

    right = run_eval(shift=1)  # step k at t predicts x_{t+k+2} = input_ids[t+k+1]
    assert right["accuracy_per_position"] == [1.0, 1.0, 1.0]
    assert right["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert right["chains_cut"] == 0  # greedy data: only response ends stop a chain
    assert 3.0 < right["acceptance_length"] <= 4.0
    # as served: every draft vLLM would make accepts all 3 (the span's last positions are tail)
    assert right["as_served"]["acceptance_length"] == 4.0 and right["as_served"]["tail"] > 0
    assert right["as_served"]["accepted_per_position"] == [1.0, 1.0, 1.0]
    assert run_eval(shift=1, batch_tokens=400) == right  # packing does not change the estimate
    assert run_eval(shift=1, pad_to=128) == right  # nor do the pads that GPU rows get
    strata = Strata((8, 16))
    rows = PackedRows(manifest, "eval", 64, shuffle=False).once()
    counts = evaluate_rows(Oracle(draft, t2d_index, 1), rows, head, 3, loss, strata=strata)
    by = eval_metrics(counts, strata)
    assert {k: by[k] for k in right} == right  # the strata leave the overall figures as they were
    assert by["draft_vocab_coverage"] == 1.0  # accuracy 1 at step 0 needs every greedy token in the vocab
    for name in ("context", "turn"):
        assert sum(s["anchors"] for s in by["strata"][name].values()) == right["anchors"]
    assert by["strata"]["context"][">16"]["anchors"] > 0 and by["strata"]["context"]["<=8"]["anchors"] > 0
    for wrong in (0, 2):
        off = run_eval(shift=wrong)
        assert max(off["accuracy_per_position"]) < 0.5, (wrong, off)
