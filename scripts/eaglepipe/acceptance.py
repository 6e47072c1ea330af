"""Offline acceptance-length estimate by greedy chain replay on stored hidden states.

Coordinates are those of a shifted packed row (packed_data): position t holds token x_{t+1} and
the target's final state y_{t+1}, whose greedy token A[t] is the target's choice for x_{t+2}.
Draft step k at anchor t predicts A[t+k]. Speculators' TTT feeds the data token x_{t+k+1} as the
step-k input, which is what serving feeds only if it equals the target's greedy token A[t+k-1]:
the chain is replayed while that holds and stops where the data leaves the greedy path (a
conditional estimate; with greedy-regenerated data it never stops early).

The chain logic works on [anchors, K] boolean tensors and returns raw counts, summed over rows
and ranks before any ratio is taken, so the result does not depend on how rows are batched.

The same counts are kept per stratum of the anchor (``Strata``): context length of its prefix,
assistant turn, inside or outside a thinking block, its sample's category when the data has
categories (``split_categories``), and its sample's fixed evaluation set when the split holds the
sets of evaluate.prompts (``split_prompt_sets``; this stratum also counts ``as_served`` per set).
Every position has exactly one label per stratum, so each stratum's counts add up to the overall ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .shard_manifest import row_categories, row_prompt_sets, shard_paths

CONVENTION = ("acceptance_length = 1 + mean number of accepted draft tokens per anchor position "
              "(the target's bonus token counted, as vLLM and SGLang report it); greedy top-1 chain of k draft "
              "tokens; per_position_acceptance[k] = P(step k accepted | steps < k accepted); "
              "accuracy_per_position[k] = P(step k correct) with teacher-forced inputs")
AS_SERVED_KEY = "as_served"
# the keys of summarize() that explain rather than measure (left out of per-step and per-stratum records)
EXPLANATIONS = ("convention", "reference", "as_served_convention", "draft_vocab_coverage_convention")
# Every position is an anchor above: a mean over tokens. Serving drafts only where the previous draft
# ended, so its AL is output tokens per draft: easy stretches (one draft per K+1 tokens) weigh less
# than hard ones (one draft per token), and the mean over tokens is the higher of the two whenever
# easiness varies (e.g. loops beside prose). ``as_served`` replays those positions (``walk_counts``).
AS_SERVED = ("as_served: the anchors vLLM drafts at on this text (the first generated token, then past each "
             "draft's accepted tokens and the bonus token), counted as vLLM's spec-decode counters count: "
             "acceptance_length = 1 + accepted tokens / drafts, accepted_per_position[i] = share of drafts "
             "whose steps 0..i were all accepted; this is the figure to hold against vLLM's AL on the same "
             "prompts")
DRAFT_VOCAB_KEY = "draft_vocab_coverage"
DRAFT_VOCAB_COVERAGE = ("draft_vocab_coverage = share of scored positions whose target greedy token is in the draft "
                        "vocabulary (vocab_mapping's t2d); the draft cannot propose the others, so it bounds "
                        "accuracy_per_position[0]; a low share asks for a larger draft.vocab_size")
REFERENCE = ("target greedy token = argmax over the full target vocabulary of lm_head(final_norm(stored "
             "final-layer state)); a chain stops where the data token differs from it or the assistant "
             "span ends, so the estimate is conditional on the data path")


def chain_counts(hit: torch.Tensor, evaluable: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Raw counts from [N, K] booleans: ``hit`` = draft step k equals the target's greedy token,
    ``evaluable`` = step k can be replayed faithfully, ``valid`` = step k's token is scored at all.

    An anchor is a row whose step 0 is evaluable; its accepted length is the number of leading
    steps that are evaluable and hit. ``chains_cut`` counts anchors whose chain was still accepted
    when it reached a scored step it could not replay (the data left the target's greedy path).
    """
    ok = (hit & evaluable).long()
    alive = torch.cumprod(ok, dim=1)  # [N, K]: steps 0..k all accepted
    before = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], dim=1).bool()  # steps < k accepted
    anchors = evaluable[:, 0]
    reach = before & evaluable
    return {
        "anchors": anchors.sum(),
        "accepted": alive.sum(),
        "chains_cut": (anchors & (before & valid & ~evaluable).any(dim=1)).sum(),
        "reach": reach.sum(dim=0),
        "reach_hit": (reach & hit).sum(dim=0),
        "valid": valid.sum(dim=0),
        "valid_hit": (valid & hit).sum(dim=0),
    }


CHAIN_KEYS = ("anchors", "accepted", "chains_cut", "reach", "reach_hit", "valid", "valid_hit")


def add_counts(total: dict | None, counts: dict) -> dict:
    if total is None:
        return {k: v.detach().clone() for k, v in counts.items()}
    for k, v in counts.items():
        total[k] += v
    return total


def summarize(counts: dict) -> dict:
    """Ratios from summed counts."""
    def ratio(a, b):
        return [round(float(x) / float(y), 6) if float(y) else None for x, y in zip(a, b, strict=True)]

    anchors = int(counts["anchors"])
    out = {
        "acceptance_length": round(1.0 + float(counts["accepted"]) / anchors, 6) if anchors else None,
        "k": int(counts["reach"].numel()),
        "per_position_acceptance": ratio(counts["reach_hit"], counts["reach"]),
        "accuracy_per_position": ratio(counts["valid_hit"], counts["valid"]),
        "anchors": anchors,
        "chains_cut": int(counts["chains_cut"]),
        "convention": CONVENTION,
        "reference": REFERENCE,
    }
    if "walk_drafts" in counts:
        drafts = int(counts["walk_drafts"])
        out[AS_SERVED_KEY] = {
            "acceptance_length": round(1.0 + float(counts["walk_accepted"].sum()) / drafts, 6) if drafts else None,
            "accepted_per_position": [round(float(a) / drafts, 6) if drafts else None
                                      for a in counts["walk_accepted"]],
            "drafts": drafts, "cut": int(counts["walk_cut"]), "tail": int(counts["walk_tail"]),
        }
        out["as_served_convention"] = AS_SERVED
    return out


def anchor_tensors(draft_ids: torch.Tensor, greedy: torch.Tensor, input_ids: torch.Tensor,
                   loss_mask: torch.Tensor, document_ids: torch.Tensor):
    """[T, K] hit / evaluable / valid for one shifted row.

    draft_ids [K, T]: step-k draft token (target vocabulary) at anchor t; greedy [T]: A;
    input_ids, loss_mask, document_ids [T] of the shifted row.
    """
    K, T = draft_ids.shape
    pad = torch.full((K,), -1, dtype=torch.long, device=greedy.device)
    doc = torch.cat([document_ids.long(), pad])
    mask = torch.cat([loss_mask.bool(), torch.zeros(K, dtype=torch.bool, device=greedy.device)])
    A = torch.cat([greedy.long(), pad])
    nxt = torch.cat([input_ids.long(), pad])
    t = torch.arange(T, device=greedy.device)
    # the data token after position j is the target's greedy token: A[j] == x_{j+2} == input_ids[j+1]
    on_path = (nxt[t + 1] == A[t]) & (doc[t + 1] == doc[t])
    on_path = torch.cat([on_path, on_path.new_zeros(K)])
    hit, valid, evaluable = [], [], []
    faithful = torch.ones(T, dtype=torch.bool, device=greedy.device)
    for k in range(K):
        if k:
            faithful = faithful & on_path[t + k - 1]
        v = (doc[t + k] == doc[t]) & mask[t + k]
        hit.append(draft_ids[k] == A[t + k])
        valid.append(v)
        evaluable.append(v & faithful)
    return torch.stack(hit, 1), torch.stack(evaluable, 1), torch.stack(valid, 1)


def greedy_tokens(model, final_states: torch.Tensor, head: torch.Tensor, scored: torch.Tensor,
                  chunk: int = 512) -> torch.Tensor:
    """Target greedy tokens [T] from final pre-norm states [T, H]: the draft's copy of the target's
    final norm, then the full-vocabulary lm_head, in chunks to bound memory. Only scored positions
    are computed (no chain passes through another); the rest are -1, which matches no token."""
    out = torch.full((final_states.shape[0],), -1, dtype=torch.long, device=final_states.device)
    idx = scored.nonzero().squeeze(1)
    for s in range(0, idx.numel(), chunk):
        x = model.verifier_norm(final_states[idx[s:s + chunk]].to(head.dtype))
        out[idx[s:s + chunk]] = (x @ head.T).argmax(dim=-1)
    return out


# the category label of a sample without one where others have one (so the labels add up to the
# whole); a category named "none" in the data shares it (and likewise for the prompt sets)
NO_CATEGORY = "none"
# the stratum of the fixed evaluation sets (evaluate.prompts)
PROMPT_SET = "prompt_set"


@dataclass(frozen=True)
class Strata:
    """How anchors are split. ``context_buckets``: ascending upper bounds (inclusive) of the prefix
    length, one more bucket past the last; ``think_ids``: the target's (open, close) thinking-tag
    token ids, None when its tokenizer has none (no thinking stratum then); ``categories``: the
    category labels of the evaluated split (``split_categories``), empty when it has none (no
    category stratum then); ``prompt_sets``: likewise its fixed evaluation sets (``split_prompt_sets``)."""
    context_buckets: tuple[int, ...] = (512, 2048, 8192)
    think_ids: tuple[int, int] | None = None
    max_turn: int = 4  # turns from this one on share a label (fixed sizes so ranks can all-reduce)
    categories: tuple[str, ...] = ()
    prompt_sets: tuple[str, ...] = ()

    def labels(self) -> dict[str, list[str]]:
        b = self.context_buckets
        out = {"context": [f"<={n}" for n in b] + [f">{b[-1]}"],
               "turn": [str(i + 1) for i in range(self.max_turn - 1)] + [f">={self.max_turn}"]}
        if self.think_ids is not None:
            out["thinking"] = ["outside", "inside"]
        if self.categories:
            out["category"] = list(self.categories)
        if self.prompt_sets:
            out[PROMPT_SET] = list(self.prompt_sets)
        return out


def split_categories(manifest: dict, split: str) -> tuple[str, ...]:
    """The category labels of a split's samples, sorted, from the manifest (the same on every rank,
    so the counts all-reduce); a sample without one is NO_CATEGORY's; empty when no sample has one."""
    labels = sorted({c or NO_CATEGORY for _, row in shard_paths(manifest, split) for c in row_categories(row)})
    return () if labels == [NO_CATEGORY] else tuple(labels)


def split_prompt_sets(manifest: dict, split: str) -> tuple[str, ...]:
    """The fixed evaluation sets of a split's samples (evaluate.prompts), sorted, from the manifest;
    a sample without one is NO_CATEGORY's; empty when no sample has one (no prompt_set stratum)."""
    labels = sorted({p or NO_CATEGORY for _, row in shard_paths(manifest, split) for p in row_prompt_sets(row)})
    return () if labels == [NO_CATEGORY] else tuple(labels)


def load_strata(model_dir: str, context_buckets: list[int], trust_remote_code: bool = False,
                categories: tuple[str, ...] = (), prompt_sets: tuple[str, ...] = ()) -> Strata:
    """Strata for a target: the thinking stratum when its tokenizer has THINK_TAGS as tokens; the
    category stratum with ``categories`` (``split_categories``)."""
    from transformers import AutoTokenizer

    ascending = all(b > a for a, b in zip(context_buckets, context_buckets[1:]))
    if not context_buckets or not ascending or context_buckets[0] < 1:
        raise SystemExit(f"--context-buckets {context_buckets}: need positive, strictly ascending token counts")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return Strata(tuple(context_buckets), think_token_ids(tokenizer), categories=categories, prompt_sets=prompt_sets)


THINK_TAGS = ("<think>", "</think>")  # the reasoning delimiters of Qwen3's and DeepSeek-R1's templates


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """The (open, close) ids of THINK_TAGS when both are single tokens of the tokenizer, else None."""
    vocab = tokenizer.get_vocab()
    return (vocab[THINK_TAGS[0]], vocab[THINK_TAGS[1]]) if all(t in vocab for t in THINK_TAGS) else None


def stratum_labels(strata: Strata, input_ids: torch.Tensor, loss_mask: torch.Tensor, document_ids: torch.Tensor,
                   position_ids: torch.Tensor, categories: list[str | None] = (),
                   prompt_sets: list[str | None] = ()) -> dict[str, torch.Tensor]:
    """[T] label index per stratum for the anchors of one shifted row; ``categories``: each
    document's category (packed_data's ``categories``), None for none; ``prompt_sets`` likewise
    its fixed evaluation set.

    Anchor t drafts x_{t+2} after the prefix x_1..x_{t+1}: its context length is position_ids[t]
    (which counts from 1 in every sample). Its turn is the number of scored runs (assistant turns)
    of its document that started at or before t. It is inside a thinking block when the last
    thinking tag of its document at or before t (input_ids[t] = x_{t+1}) opens one. Its category
    is its document's (a pad, outside every document, gets the first document's; it is never scored).
    """
    T = input_ids.shape[0]
    edges = torch.tensor(strata.context_buckets, dtype=torch.long, device=input_ids.device)
    out = {"context": torch.bucketize(position_ids.long(), edges)}  # <= edge i -> i
    mask, doc = loss_mask.bool(), document_ids.long()
    first = torch.ones(T, dtype=torch.bool, device=input_ids.device)
    first[1:] = doc[1:] != doc[:-1]  # a document's first position
    prev_mask = torch.cat([mask.new_zeros(1), mask[:-1]])
    run_start = (mask & (first | ~prev_mask)).long()
    runs = run_start.cumsum(0)
    # runs started before each document: non-decreasing over documents, so cummax carries it along
    doc_base = torch.cummax(torch.where(first, runs - run_start, 0), 0).values
    out["turn"] = (runs - doc_base - 1).clamp(0, strata.max_turn - 1)
    if strata.think_ids is not None:
        open_id, close_id = strata.think_ids
        tag = torch.where(input_ids == open_id, 1, torch.where(input_ids == close_id, 0, -1))
        tag = torch.where(first & (tag < 0), 0, tag)  # a document starts outside
        idx = torch.where(tag >= 0, torch.arange(T, device=input_ids.device), 0)
        out["thinking"] = tag[torch.cummax(idx, 0).values]
    if strata.categories:
        index = [strata.categories.index(c or NO_CATEGORY) for c in categories]
        per_document = torch.tensor(index, dtype=torch.long, device=input_ids.device)
        out["category"] = per_document[doc.clamp(min=0)]
    if strata.prompt_sets:
        index = [strata.prompt_sets.index(p or NO_CATEGORY) for p in prompt_sets]
        out[PROMPT_SET] = torch.tensor(index, dtype=torch.long, device=input_ids.device)[doc.clamp(min=0)]
    return out


def strata_counts(hit: torch.Tensor, evaluable: torch.Tensor, valid: torch.Tensor, labels: dict[str, torch.Tensor],
                  strata: Strata) -> dict[str, torch.Tensor]:
    """``chain_counts`` per label, flat keys ``"<stratum>/<count>"`` of shape [labels, ...]. A row of
    another label is masked out of ``evaluable`` and ``valid``, which leaves it out of every count
    (no boolean indexing: nothing waits on the GPU)."""
    out = {}
    for name, names in strata.labels().items():
        per = [chain_counts(hit, evaluable & sel, valid & sel)
               for sel in ((labels[name] == i).unsqueeze(1) for i in range(len(names)))]
        for key in per[0]:
            out[f"{name}/{key}"] = torch.stack([c[key] for c in per])
    return out


def summarize_strata(counts: dict, strata: Strata) -> dict:
    """{stratum: {label: summarize() without the convention texts}} from summed counts; the
    prompt_set stratum's labels also hold their ``as_served`` figures (``set_walk_counts``)."""
    out = {}
    for name, names in strata.labels().items():
        out[name] = {}
        keys = CHAIN_KEYS + WALK_KEYS * (f"{name}/walk_drafts" in counts)
        for i, label in enumerate(names):
            s = summarize({key: counts[f"{name}/{key}"][i] for key in keys})
            out[name][label] = {k: v for k, v in s.items() if k not in EXPLANATIONS}
    return out


OVERALL = "overall"


def check_select_by(select_by: str, strata: Strata) -> None:
    """``overall``, ``as_served`` or ``<stratum>:<label>`` naming one of ``strata``'s labels."""
    if select_by in (OVERALL, AS_SERVED_KEY):
        return
    name, _, label = select_by.partition(":")
    if label not in strata.labels().get(name, ()):
        choices = [OVERALL, AS_SERVED_KEY] + [f"{n}:{lab}" for n, labs in strata.labels().items() for lab in labs]
        raise SystemExit(f"--select-by {select_by!r}: not a stratum of this run; one of {', '.join(choices)}")


def select_value(ev: dict, select_by: str) -> float:
    """The eval AL the best checkpoint is chosen by (``check_select_by``); no anchors there counts as 0."""
    if select_by == OVERALL:
        return ev["acceptance_length"] or 0.0
    if select_by == AS_SERVED_KEY:
        return ev[AS_SERVED_KEY]["acceptance_length"] or 0.0
    name, _, label = select_by.partition(":")
    return ev["strata"][name][label]["acceptance_length"] or 0.0


ROW_KEYS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")


def row_chains(model, b: dict, head: torch.Tensor, k: int, loss_config, ttt_step_loss_decay: float = 1.0):
    """One row (tensors on the model's device) through the draft: ([T, K] hit, evaluable, valid as in
    ``anchor_tensors``, speculators' loss, its metrics, [T] greedy target tokens as in ``greedy_tokens``)."""
    draft_tokens, loss, metrics = model(**b, ttt_steps=k, ttt_step_loss_decay=ttt_step_loss_decay,
                                        loss_config=loss_config)
    drafts = torch.cat(draft_tokens, dim=0)  # [K, T] in the draft vocabulary
    if model.d2t is not None:
        drafts = drafts + model.d2t[drafts]
    greedy = greedy_tokens(model, b["verifier_last_hidden_states"][0], head, b["loss_mask"][0].bool())
    hit, evaluable, valid = anchor_tensors(drafts, greedy, b["input_ids"][0], b["loss_mask"][0], b["document_ids"][0])
    return hit, evaluable, valid, loss, metrics, greedy


def draft_vocab_counts(model, greedy: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """How many scored positions (step 0 of ``valid``) have a greedy target token the draft vocabulary
    holds: the draft never proposes the others, so their share bounds step 0's accuracy (DRAFT_VOCAB_COVERAGE)."""
    scored = valid[:, 0]
    held = scored if model.t2d is None else scored & model.t2d[greedy.clamp(min=0)]
    return {"vocab_scored": scored.sum(), "vocab_held": held.sum()}


def walk_counts(hit: torch.Tensor, evaluable: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                document_ids: torch.Tensor) -> dict:
    """The anchors vLLM drafts at, replayed: in each document, the first scored position (the first
    generated token), then after each draft the position past its accepted tokens and the target's
    bonus token (t + accepted + 1), as speculative decoding advances.

    Counts as vLLM's counters do: ``drafts`` and ``accepted_per_pos[i]`` = drafts whose steps 0..i
    were all accepted. Left out and counted: ``tail``, the positions left in a document once a
    draft's K steps would run past the scored span (vLLM drafted there too, at most once per
    position, but the tokens to check are not in the text); ``cut``, drafts whose chain, still
    accepted, reached a step that cannot be replayed because the text left the recomputed greedy
    path (a numerical disagreement between the serving run and the replay)."""
    K = hit.shape[1]
    chain = (hit & evaluable).long().cumprod(dim=1)
    accepted = chain.sum(dim=1)
    # the step after the accepted ones is scored but not replayable: the chain was cut, not rejected
    nxt = accepted.clamp(max=K - 1).unsqueeze(1)
    cut = (accepted < K) & valid.gather(1, nxt)[:, 0] & ~evaluable.gather(1, nxt)[:, 0]
    accepted, cut, full = accepted.tolist(), cut.tolist(), valid.all(dim=1).tolist()
    mask, doc = loss_mask.bool().tolist(), document_ids.tolist()
    counts = {"drafts": 0, "accepted_per_pos": [0] * K, "cut": 0, "tail": 0}
    t, T = 0, len(mask)
    while t < T:
        if not mask[t]:
            t += 1
            continue
        d = doc[t]
        end = t
        while end < T and doc[end] == d and mask[end]:  # this document's scored span is [t, end)
            end += 1
        while t < end:
            if not full[t]:
                counts["tail"] += end - t
                break
            counts["drafts"] += 1
            counts["cut"] += cut[t]
            for i in range(accepted[t]):
                counts["accepted_per_pos"][i] += 1
            t += accepted[t] + 1
        t = end
    return counts


WALK_KEYS = ("walk_drafts", "walk_cut", "walk_tail", "walk_accepted")


def walk_tensors(walk: dict, device) -> dict[str, torch.Tensor]:
    """``walk_counts`` as the tensors ``evaluate_rows`` sums (WALK_KEYS)."""
    out = {f"walk_{key}": torch.tensor(walk[key], dtype=torch.long, device=device) for key in ("drafts", "cut", "tail")}
    out["walk_accepted"] = torch.tensor(walk["accepted_per_pos"], dtype=torch.long, device=device)
    return out


def set_walk_counts(hit: torch.Tensor, evaluable: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                    document_ids: torch.Tensor, labels: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """``walk_counts`` per label (each of the ``n`` fixed evaluation sets: its documents alone, the
    others' masked out), as ``"prompt_set/<walk key>"`` of shape [n, ...]: the as-served AL per set.
    A document is walked within its own set, so the sets' counts add up to the overall walk."""
    per = [walk_tensors(walk_counts(hit, evaluable, valid, loss_mask.bool() & (labels == i), document_ids),
                        hit.device) for i in range(n)]
    return {f"{PROMPT_SET}/{key}": torch.stack([w[key] for w in per]) for key in WALK_KEYS}


@torch.no_grad()
def evaluate_rows(model, rows, head: torch.Tensor, k: int, loss_config, ttt_step_loss_decay: float = 1.0,
                  device: torch.device | str = "cpu", strata: Strata | None = None) -> dict:
    """Summed counts over rows: chain counts (also per stratum with ``strata``), tokens, and
    speculators' loss and per-step accuracy (its ``full_acc_k``: steps 0..k all correct over scored
    tokens, teacher-forced, draft vocabulary)."""
    was_training = model.training
    model.eval()
    total = None
    for batch in rows:
        b = {key: batch[key].to(device) for key in ROW_KEYS}
        hit, evaluable, valid, loss, metrics, greedy = row_chains(model, b, head, k, loss_config, ttt_step_loss_decay)
        counts = chain_counts(hit, evaluable, valid)
        counts.update(draft_vocab_counts(model, greedy, valid))
        walk = walk_counts(hit, evaluable, valid, b["loss_mask"][0], b["document_ids"][0])
        counts.update(walk_tensors(walk, device))
        if strata is not None:
            labels = stratum_labels(strata, b["input_ids"][0], b["loss_mask"][0], b["document_ids"][0],
                                    b["position_ids"][0], batch["categories"], batch.get("prompt_sets", ()))
            counts.update(strata_counts(hit, evaluable, valid, labels, strata))
            if strata.prompt_sets:
                counts.update(set_walk_counts(hit, evaluable, valid, b["loss_mask"][0], b["document_ids"][0],
                                              labels[PROMPT_SET], len(strata.prompt_sets)))
        scored = b["loss_mask"].sum().double()
        counts["tokens"] = torch.tensor(b["input_ids"].shape[1], dtype=torch.long, device=device)
        counts["loss_weighted"] = loss.detach().double() * scored
        counts["loss_weight"] = scored
        counts["acc_correct"] = torch.stack([metrics[f"full_acc_{s}_sum"] for s in range(k)]).double()
        counts["acc_total"] = torch.stack([metrics[f"full_acc_{s}_total"] for s in range(k)]).double()
        total = add_counts(total, counts)
    model.train(was_training)
    if total is None:
        raise SystemExit("evaluation: the split produced no rows")
    return total


def replay_walk(model, rows, head: torch.Tensor, k: int, loss_config, device: torch.device | str = "cpu") -> dict:
    """``walk_counts`` summed over rows (``evaluate_rows`` keeps them): the replay of what vLLM's
    counters count on the same text."""
    counts = evaluate_rows(model, rows, head, k, loss_config, device=device)
    return {"drafts": int(counts["walk_drafts"]), "accepted_per_pos": counts["walk_accepted"].tolist(),
            "cut": int(counts["walk_cut"]), "tail": int(counts["walk_tail"])}


def eval_metrics(counts: dict, strata: Strata | None = None) -> dict:
    """Everything a report needs from summed ``evaluate_rows`` counts."""
    out = summarize(counts)
    if strata is not None:
        out["strata"] = summarize_strata(counts, strata)
    out["tokens_evaluated"] = int(counts["tokens"])
    scored = int(counts["vocab_scored"])
    out[DRAFT_VOCAB_KEY] = round(int(counts["vocab_held"]) / scored, 6) if scored else None
    out["draft_vocab_coverage_convention"] = DRAFT_VOCAB_COVERAGE
    w = float(counts["loss_weight"])
    out["loss"] = round(float(counts["loss_weighted"]) / w, 6) if w else None
    for s, (c, n) in enumerate(zip(counts["acc_correct"], counts["acc_total"], strict=True)):
        out[f"acc_{s}"] = round(float(c) / float(n), 6) if float(n) else None
    return out
