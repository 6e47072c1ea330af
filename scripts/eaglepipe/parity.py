"""Capture-to-serve parity: the offline replay of the sequences vLLM produced against vLLM's own
spec-decode counters for them (``evaluate --parity``, rule evaluate_parity). Pure counting, no torch.

Both sides count the same thing on the same text: per draft position i, the share of drafts whose
tokens 0..i were all accepted. The tolerance per position (``tolerance``):

- sampling noise: ``z`` standard errors of the difference of two proportions, as if the two sides
  were independent binomial samples of their drafts (they are paired on the same text, so the real
  spread is smaller: the bound is conservative). With ~3,000 drafts at p = 0.5 and z = 3 that is
  0.039; a draft that serves with the wrong layers (p near 0) is far outside it.
- what numerics allow: each draft the replay could not follow (``cut``: the served text left the
  target's recomputed greedy path, a bf16 near-tie between the serving forward and the
  extraction forward) moves the replay's share by at most 1/N; each draft vLLM made where the
  replay cannot (``tail``: the last positions of a sequence, checked against tokens past the
  text) moves vLLM's share by at most 1/N. Both are added in full. Near-ties inside the draft
  (vLLM runs it in the model dtype, the replay in float32) flip single decisions and are covered
  by the sampling term.
"""

from __future__ import annotations

import math

CAUSES_SERVED_LOWER = (
    "vLLM accepts fewer drafts than the replay of the same text, so vLLM does not run the draft as it was "
    "trained and evaluated. Likely causes: the aux layer ids (the export's eagle_aux_hidden_state_layer_ids "
    "against the ids the shards were extracted with; vLLM's id k is the output of k decoder layers and "
    "num_hidden_layers the final layer before the norm), the norm flags in the exported config.json "
    "(e.g. norm_before_residual) read differently by vLLM, the vocabulary mapping (d2t/t2d in "
    "model.safetensors), or a config key vLLM ignored (compare the speculative config in the serving log "
    "with the export)")
CAUSES_SERVED_HIGHER = (
    "vLLM accepts more drafts than the replay of the same text, so the offline estimator underestimates. "
    "Likely causes: the replay's hidden states are not those vLLM serves with (extraction layer ids or "
    "dtype, the final norm applied to the last captured layer), or the draft is loaded differently offline "
    "(norm flags, vocabulary mapping) than vLLM loads it")
CAUSES_CUT = ("the target's greedy tokens recomputed from the extracted states leave the served text at {share:.1%} "
              "of the drafts: the extraction ran another target, revision or dtype, or its last layer id is not "
              "num_hidden_layers")
CUT_WARNING_SHARE = 0.05


def rates(counts: dict) -> list[float]:
    n = counts["drafts"]
    return [a / n for a in counts["accepted_per_pos"]]


def tolerance(x_replay: int, n_replay: int, x_served: int, n_served: int, cut: int, tail: int, z: float) -> float:
    """Largest difference of the two shares of one position that noise explains (module docstring).
    The pooled share has one success and one failure added, so a share of 0 or 1 keeps a nonzero error."""
    pooled = (x_replay + x_served + 1) / (n_replay + n_served + 2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_replay + 1 / n_served))
    return z * se + cut / n_replay + tail / n_served


def compare(replay: dict, served: dict, z: float) -> dict:
    """``replay``: acceptance.walk_counts summed (drafts, accepted_per_pos, cut, tail); ``served``:
    vLLM's counter delta for the same requests (drafts, accepted_per_pos)."""
    k = len(served["accepted_per_pos"])
    if len(replay["accepted_per_pos"]) != k:
        raise ValueError(f"the replay counted {len(replay['accepted_per_pos'])} draft positions, vLLM {k}")
    if not replay["drafts"] or not served["drafts"]:
        return {"agree": False, "k": k, "replay_drafts": replay["drafts"], "served_drafts": served["drafts"],
                "causes": "no drafts to compare (the parity window finished no request, or the replay found no "
                          "generated span in the samples)"}
    positions = []
    for i in range(k):
        x_r, x_s = replay["accepted_per_pos"][i], served["accepted_per_pos"][i]
        p_r, p_s = x_r / replay["drafts"], x_s / served["drafts"]
        tol = tolerance(x_r, replay["drafts"], x_s, served["drafts"], replay["cut"], replay["tail"], z)
        positions.append({"position": i, "replay": round(p_r, 4), "served": round(p_s, 4),
                          "difference": round(p_s - p_r, 4), "tolerance": round(tol, 4),
                          "agree": abs(p_s - p_r) <= tol})
    agree = all(p["agree"] for p in positions)
    result = {
        "agree": agree, "k": k, "z": z,
        "replay_acceptance_length": round(1 + sum(replay["accepted_per_pos"]) / replay["drafts"], 4),
        "served_acceptance_length": round(1 + sum(served["accepted_per_pos"]) / served["drafts"], 4),
        "replay_drafts": replay["drafts"], "served_drafts": served["drafts"],
        "cut": replay["cut"], "tail": replay["tail"], "positions": positions,
    }
    notes = []
    if not agree:
        lower = sum(p["difference"] for p in positions if not p["agree"]) < 0
        notes.append(CAUSES_SERVED_LOWER if lower else CAUSES_SERVED_HIGHER)
    if replay["cut"] > CUT_WARNING_SHARE * replay["drafts"]:
        notes.append(CAUSES_CUT.format(share=replay["cut"] / replay["drafts"]))
    result["causes"] = "; ".join(notes) if notes else None
    return result


def report(result: dict) -> str:
    """Both numbers per position, the verdict and, outside the tolerance, the likely causes."""
    if "positions" not in result:
        return f"parity: cannot compare: {result['causes']}"
    lines = [f"parity at K={result['k']}: acceptance length replay {result['replay_acceptance_length']} "
             f"({result['replay_drafts']} drafts, {result['cut']} cut, {result['tail']} tail positions) against "
             f"vLLM {result['served_acceptance_length']} ({result['served_drafts']} drafts)"]
    for p in result["positions"]:
        lines.append(f"  position {p['position']}: replay {p['replay']:.4f}, vLLM {p['served']:.4f}, difference "
                     f"{p['difference']:+.4f}, tolerance {p['tolerance']:.4f}: "
                     + ("agree" if p["agree"] else "OUTSIDE"))
    lines.append("parity: " + ("agree" if result["agree"] else "DISAGREE"))
    if result["causes"]:
        lines.append(f"likely causes: {result['causes']}")
    return "\n".join(lines)
