"""Stage vocab_mapping: draft vocabulary = the most frequent loss-masked train tokens (speculators' rule).

Writes ``vocab_mapping.safetensors``: ``d2t`` int64 [V] (target_id = draft_idx + d2t[draft_idx]) and
``t2d`` bool [target vocab] (True for the V target ids in the draft vocabulary), as speculators'
Eagle3 model and vLLM load them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eaglepipe.atomic import atomic_path
from eaglepipe.settings import add_stage_arguments


def read_token_freq(path: Path) -> tuple[torch.Tensor, dict]:
    try:
        with safe_open(str(path), "pt") as f:
            if "token_freq" not in f.keys():
                raise SystemExit(f"{path}: no tensor 'token_freq' (found {sorted(f.keys())})")
            return f.get_tensor("token_freq"), f.metadata() or {}
    except (OSError, ValueError) as e:  # safetensors reports a missing/corrupt file this way
        raise SystemExit(f"{path}: cannot read token frequencies ({e})") from e


def build(freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    target = freq.numel()
    size = min(draft_vocab_size, target)
    if size < draft_vocab_size:
        print(f"note: draft vocab size {draft_vocab_size} capped at the target vocabulary {target}", file=sys.stderr)
    nonzero = torch.nonzero(freq).flatten()
    counts = dict(zip(nonzero.tolist(), freq[nonzero].tolist()))
    d2t, t2d = build_vocab_mappings_from_distribution(counts, size, target)
    total = int(freq.sum())
    covered = int(freq[t2d].sum())
    info = {
        "draft_vocab_size": size,
        "target_vocab_size": target,
        "requested_draft_vocab_size": draft_vocab_size,
        "distinct_train_tokens": len(counts),
        "loss_masked_train_tokens": total,
        "coverage": covered / total if total else 0.0,
    }
    return d2t, t2d, info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eaglepipe.vocab_mapping", description=__doc__)
    p.add_argument("--token-freq", required=True, type=Path, help="token_freq.safetensors from prepare_data")
    add_stage_arguments(p, "vocab_mapping")
    p.add_argument("--out", required=True, type=Path)
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    freq, meta = read_token_freq(args.token_freq)
    if freq.dim() != 1 or freq.dtype != torch.int64 or (freq < 0).any():
        raise SystemExit(f"{args.token_freq}: token_freq must be a 1-D int64 tensor of counts >= 0, "
                         f"got {freq.dtype} {list(freq.shape)}")
    d2t, t2d, info = build(freq, args.draft_vocab_size)
    info["template_digest"] = meta.get("template_digest", "")
    with atomic_path(args.out) as tmp:
        save_file({"d2t": d2t, "t2d": t2d}, str(tmp), metadata={k: str(v) for k, v in info.items()})
    print(f"draft vocab {info['draft_vocab_size']} of {info['target_vocab_size']} target tokens covers "
          f"{info['coverage']:.2%} of {info['loss_masked_train_tokens']} loss-masked train tokens "
          f"({info['distinct_train_tokens']} distinct)", file=sys.stderr)


if __name__ == "__main__":
    main()
