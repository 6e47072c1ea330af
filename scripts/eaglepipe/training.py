"""The draft and its optimization as train_draft builds them, shared with the benchmarks that
train or profile the same draft (benchmarks/profile_trainer.py, benchmarks/compare_trainers.py)."""

from __future__ import annotations

from .settings import leaf

OPTIMIZERS = tuple(leaf("train", "optimizer")["enum"])  # speculators 0.9.0's (speculators/train/optimizers.py)
FROZEN, TRAINED = "frozen", "trained"
LM_HEADS = (FROZEN, TRAINED)


def check_training_args(parser, args) -> None:
    """What train_draft's settings cannot say one at a time (its parser and benchmarks/profile_trainer.py's;
    each value's own bounds are the schema's, refused by the parser: settings.bounded)."""
    if args.muon_weight_decay is not None and args.optimizer != "muon":
        parser.error(f"--muon-weight-decay {args.muon_weight_decay}: only with --optimizer muon")


def new_draft(args, aux_ids: list[int], device):
    """The draft train_draft and benchmarks/profile_trainer.py train: speculators' model for the target, its
    lm_head trainable with --lm-head trained (speculators freezes it with the verifier's tensors; its Muon
    split keeps it in the AdamW group)."""
    from .draft_model import build_draft

    model = build_draft(args.model, aux_ids, args.vocab, args.ttt_steps, device, args.trust_remote_code,
                        args.draft_architecture, args.draft_mlp_width, args.draft_layers)
    model.lm_head.weight.requires_grad_(args.lm_head == TRAINED)
    return model


class Optimization:
    """The optimizer(s) and their schedules: speculators' build_optimizers (adamw: one AdamW; muon:
    Muon on the 2-D weight matrices and AdamW on the rest, two optimizers), each with the cosine
    schedule and warm-up; what train_draft and benchmarks/profile_trainer.py step."""

    def __init__(self, args, model):
        from speculators.train.config.schema import OptimizerArgs
        from speculators.train.optimizers import build_optimizers
        from transformers import get_cosine_schedule_with_warmup

        # what we do not set (Muon's momentum, Newton-Schulz steps, RMS matching) stays speculators' default
        given = {"muon_weight_decay": args.muon_weight_decay} if args.muon_weight_decay is not None else {}
        config = OptimizerArgs(optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, muon_lr=args.lr,
                               **given)
        self.optimizers = build_optimizers(model, config)
        self.schedulers = [get_cosine_schedule_with_warmup(o, args.warmup_steps, args.max_steps)
                           for o in self.optimizers]

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()
        for s in self.schedulers:
            s.step()

    def last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def state_dtypes(self) -> dict[str, list[str]]:
        """The dtypes of what each optimizer keeps, by optimizer and state name ("AdamW.param" = the
        master weights it updates, "AdamW.exp_avg_sq" = its second moment): a bf16 moment cannot
        record updates below bf16's resolution, so the run's summary shows they are fp32."""
        import torch

        found: dict[str, set] = {}
        for o in self.optimizers:
            kind = type(o).__name__
            for group in o.param_groups:
                for p in group["params"]:
                    found.setdefault(f"{kind}.param", set()).add(str(p.dtype).removeprefix("torch."))
                    for name, value in o.state.get(p, {}).items():
                        if torch.is_tensor(value):
                            found.setdefault(f"{kind}.{name}", set()).add(str(value.dtype).removeprefix("torch."))
        return {k: sorted(v) for k, v in sorted(found.items())}

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for o, st in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(st)
        for s, st in zip(self.schedulers, state["schedulers"], strict=True):
            s.load_state_dict(st)
