"""The evaluation recipe, one for the evaluate stage, train_draft's in-training evaluations and
benchmarks/profile_trainer.py: the target's head, the split's strata, the split's rows packed
unshuffled (each once), ``evaluate_rows`` summed over ranks, and ``eval_metrics`` (eaglepipe.acceptance)."""

from __future__ import annotations

from functools import cached_property

import torch

from .acceptance import Strata, eval_metrics, evaluate_rows, load_strata, split_categories, split_prompt_sets
from .draft_model import load_target_head, row_length
from .packed_data import PackedRows
from .runtime import all_reduce


class Evaluation:
    """One split of a manifest, scored against one target."""

    def __init__(self, manifest: dict, split: str, target: str, context_buckets: list[int],
                 trust_remote_code: bool, device: torch.device):
        self.manifest, self.split, self.target, self.device = manifest, split, target, device
        self.context_buckets, self.trust_remote_code = context_buckets, trust_remote_code
        self.head = load_target_head(target).to(device)

    @cached_property
    def strata(self) -> Strata:
        """Loaded at first use: a parity replay counts no strata (and needs no tokenizer)."""
        return load_strata(self.target, self.context_buckets, self.trust_remote_code,
                           split_categories(self.manifest, self.split), split_prompt_sets(self.manifest, self.split))

    def rows(self, batch_tokens: int, rank: int = 0, world_size: int = 1):
        """The split's rows of this rank, each once, unshuffled, padded as the device pads them."""
        return PackedRows(self.manifest, self.split, batch_tokens, shuffle=False, rank=rank, world_size=world_size,
                          pad_to=row_length(self.device, batch_tokens)).once()

    def __call__(self, draft, k: int, loss_config, batch_tokens: int, ttt_step_loss_decay: float = 1.0,
                 rank: int = 0, world_size: int = 1) -> dict:
        """The metrics of ``draft`` over the whole split (every rank's rows, all-reduced)."""
        counts = evaluate_rows(draft, self.rows(batch_tokens, rank, world_size), self.head, k, loss_config,
                               ttt_step_loss_decay, self.device, self.strata)
        return eval_metrics(all_reduce(counts, world_size), self.strata)
