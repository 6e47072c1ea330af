"""Capture-to-serve parity: the anchor walk on hand-made chains, the comparison and its tolerance, and
``evaluate --parity`` on a tiny draft (agree with matching counters, fail naming both numbers)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from speculators.losses import resolve_loss_config
from tiny_stages import export_like, make_run

from eaglepipe import evaluate
from eaglepipe.acceptance import chain_counts, replay_walk, summarize, walk_counts
from eaglepipe.draft_model import LOSS_IMPLEMENTATION, load_draft, load_target_head
from eaglepipe.packed_data import PackedRows
from eaglepipe.parity import compare, report, tolerance
from eaglepipe.shard_manifest import load_manifest


def chains(T: int, K: int, hits: dict[int, list[int]], mask: list[int], doc: list[int], cut_at: dict[int, int] = None):
    """[T, K] hit / evaluable / valid: valid where step k stays in the document's scored span; hit as
    given per anchor (default all missed); evaluable = valid except step ``cut_at[t]`` of anchor t."""
    hit = torch.zeros(T, K, dtype=torch.bool)
    valid = torch.zeros(T, K, dtype=torch.bool)
    for t in range(T):
        for k in range(K):
            valid[t, k] = t + k < T and doc[t + k] == doc[t] and bool(mask[t + k])
        for k, h in enumerate(hits.get(t, [])):
            hit[t, k] = bool(h)
    evaluable = valid.clone()
    for t, k in (cut_at or {}).items():
        evaluable[t, k] = False
    return hit, evaluable, valid, torch.tensor(mask), torch.tensor(doc)


def test_walk_follows_vllm_drafting_positions():
    # document 0: prompt at 0-1, generated span 2..9; document 1: prompt at 10, span 11..14; padding
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0]
    doc = [0] * 10 + [1] * 5 + [-1]
    hits = {2: [1, 1], 5: [1, 0], 7: [0, 1], 8: [1, 1],  # doc 0: 2 -> 5 -> 7 -> 8 -> (10, past the span)
            3: [1, 1], 4: [1, 1],                       # never drafted at: skipped by the walk
            11: [1, 1], 12: [0, 0], 13: [0, 0]}          # doc 1: 11 -> 14: its step 1 is past the span (tail)
    c = walk_counts(*chains(16, 2, hits, mask, doc))
    assert c == {"drafts": 5, "accepted_per_pos": [4, 3], "cut": 0, "tail": 1}


def test_as_served_weighs_stretches_by_drafts_not_tokens():
    """An easy stretch (every draft accepted) beside a hard one (none): the mean over tokens counts
    each token once, serving drafts once per K+1 easy tokens but at every hard one."""
    K, T = 3, 16
    mask, doc = [1] * T, [0] * T
    hits = {t: [1, 1, 1] for t in range(8)}  # tokens 0-7 easy, 8-15 hard
    hit, evaluable, valid, mask_t, doc_t = chains(T, K, hits, mask, doc)
    counts = chain_counts(hit, evaluable, valid)
    walk = walk_counts(hit, evaluable, valid, mask_t, doc_t)
    counts.update({f"walk_{key}": torch.tensor(walk[key]) for key in ("drafts", "cut", "tail")},
                  walk_accepted=torch.tensor(walk["accepted_per_pos"]))
    s = summarize(counts)
    # per token: 16 anchors, the 8 easy ones accepting 3 each
    assert s["acceptance_length"] == pytest.approx(1 + 24 / 16)
    # as served: drafts at 0, 4 (3 accepted each), then 8..13 (none); 14, 15 are tail
    assert walk == {"drafts": 8, "accepted_per_pos": [2, 2, 2], "cut": 0, "tail": 2}
    assert s["as_served"]["acceptance_length"] == pytest.approx(1 + 6 / 8)
    assert s["as_served"]["accepted_per_position"] == pytest.approx([0.25, 0.25, 0.25])


def test_walk_counts_cut_chains():
    mask = [0, 1, 1, 1, 1, 1]
    doc = [0] * 6
    # anchor 1: step 0 accepted, step 1 not replayable (the text left the greedy path): cut after 1
    c = walk_counts(*chains(6, 2, {1: [1, 1], 3: [0, 0], 4: [1, 1]}, mask, doc, cut_at={1: 1}))
    assert c == {"drafts": 3, "accepted_per_pos": [2, 1], "cut": 1, "tail": 0}


def test_tolerance_is_binomial_plus_unfollowed_drafts():
    se = math.sqrt(0.5 * 0.5 * (1 / 1000 + 1 / 1000))  # pooled (500 + 500 + 1) / (2000 + 2) = 0.5
    assert tolerance(500, 1000, 500, 1000, 0, 0, 3.0) == pytest.approx(3 * se)
    assert tolerance(500, 1000, 500, 1000, 10, 20, 3.0) == pytest.approx(3 * se + 10 / 1000 + 20 / 1000)
    assert tolerance(0, 1000, 0, 1000, 0, 0, 3.0) > 0  # a share of 0 keeps a nonzero error


def test_compare_agrees_within_noise():
    replay = {"drafts": 3000, "accepted_per_pos": [2100, 1500, 1000], "cut": 12, "tail": 60}
    served = {"drafts": 3050, "accepted_per_pos": [2150, 1490, 1040], "draft_tokens": 9150, "accepted_tokens": 4680}
    r = compare(replay, served, z=3.0)
    assert r["agree"] and r["causes"] is None
    assert r["replay_acceptance_length"] == round(1 + 4600 / 3000, 4)
    assert [p["agree"] for p in r["positions"]] == [True, True, True]
    assert "parity: agree" in report(r)


def test_compare_fails_with_both_numbers_and_causes():
    # vLLM serving the draft with the wrong layers: AL near 1 where the replay of the same text says 2.5
    replay = {"drafts": 3000, "accepted_per_pos": [2100, 1500, 900], "cut": 5, "tail": 60}
    served = {"drafts": 5800, "accepted_per_pos": [300, 20, 1]}
    r = compare(replay, served, z=3.0)
    assert not r["agree"] and not r["positions"][0]["agree"]
    text = report(r)
    assert "replay 0.7000, vLLM 0.0517" in text and "OUTSIDE" in text and "parity: DISAGREE" in text
    for cause in ("layer ids", "norm", "vocabulary mapping", "ignored"):
        assert cause in text
    # the other direction blames the offline side
    r = compare(served | {"cut": 0, "tail": 0}, {"drafts": 3000, "accepted_per_pos": [2100, 1500, 900]}, z=3.0)
    assert not r["agree"] and "offline estimator underestimates" in r["causes"]


def test_compare_flags_a_replay_off_the_served_text():
    replay = {"drafts": 1000, "accepted_per_pos": [500], "cut": 200, "tail": 0}
    r = compare(replay, {"drafts": 1000, "accepted_per_pos": [500]}, z=3.0)
    assert r["agree"] and "20.0% of the drafts" in r["causes"]


def test_compare_without_drafts_fails():
    r = compare({"drafts": 0, "accepted_per_pos": [0], "cut": 0, "tail": 0},
                {"drafts": 10, "accepted_per_pos": [3]}, 3.0)
    assert not r["agree"] and "no drafts" in report(r)


@pytest.fixture
def parity_run(tiny_llama, tmp_path):
    run = make_run(tmp_path, tiny_llama, n_train=2, n_eval=4)
    draft = export_like(tiny_llama, run, tmp_path / "draft")
    return run, draft


def serving_json(path, k, counts):
    path.write_text(json.dumps({"parity_run": {"k": k, "concurrency": 1, "requests": 4, "counters": counts}}))
    return path


def run_parity(run, draft, tiny_llama, serving, out, k=2):
    evaluate.main(["--draft", str(draft), "--manifest", str(run["manifest"]), "--split", "eval",
                   "--model", str(tiny_llama), "--k", str(k), "--parity", str(serving), "--out", str(out)])


def test_evaluate_parity_agrees_with_matching_counters_and_fails_otherwise(parity_run, tiny_llama, tmp_path):
    run, draft = parity_run
    model = load_draft(str(draft), str(tiny_llama))
    rows = PackedRows(load_manifest(run["manifest"]), "eval", evaluate.EVAL_BATCH_TOKENS, shuffle=False).once()
    walk = replay_walk(model, rows, load_target_head(str(tiny_llama)), 2,
                       resolve_loss_config("kl_div", LOSS_IMPLEMENTATION))
    # the greedy samples: the walk drafts from each sample's first scored position on, never cut
    assert walk["drafts"] > 0 and walk["cut"] == 0
    served = {"drafts": walk["drafts"], "accepted_per_pos": list(walk["accepted_per_pos"])}
    out = tmp_path / "parity.json"
    run_parity(run, draft, tiny_llama, serving_json(tmp_path / "serving.json", 2, served), out)
    res = json.loads(out.read_text())
    assert res["agree"] and res["replay_counts"] == walk and res["k"] == 2 and res["requests"] == 4

    # vLLM accepting every draft: outside any tolerance, no parity.json, both numbers in the error
    everything = {"drafts": walk["drafts"], "accepted_per_pos": [walk["drafts"]] * 2}
    bad = tmp_path / "bad.json"
    with pytest.raises(SystemExit, match=r"(?s)position 0: replay .*vLLM 1\.0000.*OUTSIDE.*likely causes"):
        run_parity(run, draft, tiny_llama, serving_json(tmp_path / "serving2.json", 2, everything), bad)
    assert not bad.exists()


def test_evaluate_parity_needs_the_served_k(parity_run, tiny_llama, tmp_path):
    run, draft = parity_run
    serving = serving_json(tmp_path / "serving.json", 3, {"drafts": 1, "accepted_per_pos": [0, 0, 0]})
    with pytest.raises(SystemExit, match="parity_run.k is 3, --k 2"):
        run_parity(run, draft, tiny_llama, serving, tmp_path / "o.json")
    (tmp_path / "serving.json").write_text("{}")
    with pytest.raises(SystemExit, match="no usable parity_run"):
        run_parity(run, draft, tiny_llama, tmp_path / "serving.json", tmp_path / "o.json")
