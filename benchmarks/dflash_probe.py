"""DFlash probe: block acceptance length at K of a speculators 0.9.0 DFlash draft, on our shards.

What it measures and why: whether a DFlash draft (one forward proposes a whole block: slot 0 is the
last accepted token, slots 1..K are mask tokens) reaches a K=3 acceptance length comparable to our
one-layer EAGLE-3 draft's on the same hidden-state shards, with the same eval estimator, before we
build DFlash as a second draft kind. It trains ``DFlashDraftModel`` (from_training_args, Qwen3-style
layers, all layers causal sliding-window 2048 as speculators' CLI defaults, block_size = K + 1) with
AdamW (speculators' defaults) or train_draft's Muon on the train split, then scores ALL valid anchors of
the eval split with no grad. Results: benchmarks/README.md, "CPU: a DFlash draft against EAGLE-3".
On a GPU (``--device cuda``) it trains on a pipeline run's shards, and ``--save DIR`` writes the draft
as speculators saves it (``save_pretrained``), which vLLM 0.26.0 serves with ``"method": "dflash"``
(benchmarks/gpu_regenerate_table.sh ``_dflash``). Its mask token must not be one the target emits:
SmolLM2's tokenizer has no free id, so speculators would fall back to pad/eos (id 2, ``<|im_end|>``),
and a served bonus ``<|im_end|>`` would read as a mask; ``--save`` refuses that, and
``--mask-token-id`` names another (SmolLM2: 3, ``<repo_name>``, which no chat holds).

Data: the rows are packed by eaglepipe's PackedRows (same manifest, split, plan, batch_tokens, fp32),
but UNSHIFTED: speculators trains DFlash on unshifted samples (speculators/train/cli.py only shifts
for eagle3/peagle/mtp), and its attention lets a block see base positions strictly before the anchor,
so EAGLE's shift would hide the state of the token before the anchor. Position ids count from 0 in
every sample, as speculators' collate gives them.

Acceptance: eaglepipe.acceptance's estimator, unchanged (anchor_tensors / chain_counts / summarize), on
the SHIFTED row train_draft evaluates (built from the same plan row). EAGLE anchor t of the shifted row
(last known token x_{t+1}) is DFlash anchor a = t+1 of the unshifted sample; EAGLE step k (predicting
x_{t+k+2}) is DFlash slot k+1. So AL = 1 + mean over anchors (every scored position of the eval
split) of the leading steps that hit the target's full-vocabulary greedy token AND are replayable
(the data tokens before that step are themselves the target's greedy tokens). Also printed:
speculators' own ``eal`` on the same anchors (no replayability cut, draft-vocabulary argmax as the
reference, slot validity from the predicted token's loss mask), for reference.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from eaglepipe.acceptance import add_counts, anchor_tensors, chain_counts, greedy_tokens, summarize
from eaglepipe.draft_model import load_target_head
from eaglepipe.packed_data import PackedRows, pad_row
from eaglepipe.shards import load_manifest

KEYS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")


class BothRows(PackedRows):
    """PackedRows whose rows are unshifted (DFlash's convention); ``with_shifted`` also attaches the
    shifted row train_draft builds from the same plan row, under "shifted"."""

    with_shifted = False

    def materialize(self, row):
        parts = []
        for si, b, length in row:
            s = self._sample(si, b)
            hs = s["hidden_states"][:length].to(self.dtype)
            parts.append({"input_ids": s["input_ids"][:length].long(),
                          "hidden_states": hs[:, :-1].reshape(length, -1),
                          "verifier_last_hidden_states": hs[:, -1],
                          "loss_mask": s["loss_mask"][:length].long(),
                          "position_ids": torch.arange(length)})
        lengths = torch.tensor([p["input_ids"].shape[0] for p in parts])
        batch = {k: torch.cat([p[k] for p in parts]).unsqueeze(0) for k in parts[0]}
        batch["lengths"] = lengths
        batch["document_ids"] = torch.repeat_interleave(torch.arange(len(parts)), lengths).unsqueeze(0)
        if self.with_shifted:
            batch["shifted"] = super().materialize(row)
        return batch


def build_model(args):
    from safetensors.torch import load_file
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.utils import resolve_mask_token_id

    tl = create_transformer_layer_config(args.model, num_layers=args.num_layers, draft_arch="qwen3",
                                         hidden_act="silu", sliding_window=2048, full_attention_indices=[],
                                         trust_remote_code=False)
    mask_id = resolve_mask_token_id(args.model, tl.vocab_size, args.mask_token_id)
    if args.save and args.mask_token_id is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        if mask_id in (tok.eos_token_id, tok.pad_token_id):
            raise SystemExit(f"--save: the mask token would be {mask_id} ({tok.convert_ids_to_tokens(mask_id)!r}), "
                             f"which the target emits (eos/pad fallback); pass --mask-token-id with a token no "
                             f"answer holds")
    t2d = d2t = None
    vocab = tl.vocab_size
    if not args.full_vocab:
        m = load_file(args.vocab)
        t2d, d2t = m["t2d"].bool(), m["d2t"].long()
        vocab = int(d2t.numel())
    model = DFlashDraftModel.from_training_args(
        verifier_config=tl, t2d=t2d, d2t=d2t, verifier_name_or_path=args.model, draft_vocab_size=vocab,
        block_size=args.block_size, mask_token_id=mask_id, draft_attn_impl=args.attn,
        target_layer_ids=args.aux_ids)
    return model, mask_id, tl


class AdamWSchedule:
    """AdamW with a warmup then linear or cosine decay, behind train_draft.Optimization's interface."""

    def __init__(self, args, params):
        from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

        self.opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
        decay = get_cosine_schedule_with_warmup if args.schedule == "cosine" else get_linear_schedule_with_warmup
        self.schedule = decay(self.opt, args.warmup_steps, args.max_steps)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.opt.step()
        self.schedule.step()

    def last_lr(self) -> float:
        return self.schedule.get_last_lr()[0]


def make_optimizer(args, model):
    """(trainable parameters, optimizer with zero_grad / step / last_lr)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "muon":  # exactly train_draft's (the EAGLE-3 baseline's): Muon + AdamW, cosine
        from eaglepipe.train_draft import Optimization

        return params, Optimization(argparse.Namespace(optimizer="muon", lr=args.lr, weight_decay=args.weight_decay,
                                                       muon_weight_decay=None, warmup_steps=args.warmup_steps,
                                                       max_steps=args.max_steps), model)
    return params, AdamWSchedule(args, params)


def doc_map(lengths: torch.Tensor) -> torch.Tensor:
    """[Ts] unshifted index of each shifted position (shifted t of a sample = unshifted t + 1)."""
    out, start = [], 0
    for L in lengths.tolist():
        out.append(torch.arange(start + 1, start + L))
        start += L
    return torch.cat(out)


@torch.no_grad()
def evaluate(model, args, manifest, head):
    from speculators.models.metrics import compute_accepted_length_counts

    model.eval()
    device = next(model.parameters()).device
    K, bs = args.block_size - 1, args.block_size
    rows = BothRows(manifest, "eval", args.batch_tokens, shuffle=False)
    rows.with_shifted = True
    d2t = model.d2t.cpu() if model.d2t is not None else None
    t2d = model.t2d.cpu() if model.t2d is not None else None
    total, eal_sum, eal_n = None, 0.0, 0.0
    slot_hit = torch.zeros(K, dtype=torch.long)
    slot_n = torch.zeros(K, dtype=torch.long)
    n_rows = 0
    ref_agree = ref_n = 0
    for batch in rows.once():
        S = batch["shifted"]
        u_of_s = doc_map(batch["lengths"])
        Tu = batch["input_ids"].shape[1]
        lm_u = batch["loss_mask"][0].bool()
        U = pad_row({k: batch[k] for k in (*KEYS, "lengths")}, Tu + bs)  # every anchor selectable
        lm_pad = U["loss_mask"][0].bool()
        s_anchor = S["loss_mask"][0].bool().nonzero().squeeze(1)  # EAGLE's anchors (step 0 scored)
        u_anchor = u_of_s[s_anchor]
        assert bool(lm_u[u_anchor].all())
        draft_ids = torch.full((K, S["input_ids"].shape[1]), -2, dtype=torch.long)
        ref_ids = torch.full_like(draft_ids, -3)
        row = {k: v.to(device) for k, v in U.items() if k != "lengths"}  # once a row: chunks change the mask only
        for c in range(0, u_anchor.numel(), args.eval_chunk):
            ua, sa = u_anchor[c:c + args.eval_chunk], s_anchor[c:c + args.eval_chunk]
            lm = torch.zeros_like(U["loss_mask"])
            lm[0, ua] = 1
            b = dict(row, loss_mask=lm.to(device))
            _, logits, targets, _, abi = model._backbone_forward(**b, max_anchors=ua.numel())
            abi = abi.cpu()
            assert torch.equal(abi[::bs], ua), "select_anchors did not take every anchor"
            pred = logits[0].argmax(-1).view(-1, bs).cpu()  # draft vocabulary
            tgt = targets[0].argmax(-1).view(-1, bs).cpu()
            pred_t = pred + d2t[pred] if d2t is not None else pred
            draft_ids[:, sa] = pred_t[:, 1:].T
            tgt_ids = tgt + d2t[tgt] if d2t is not None else tgt
            ref_ids[:, sa] = tgt_ids[:, 1:].T
            # speculators' eal on these anchors: slot validity = loss mask of the predicted position
            valid = lm_pad[abi].view(-1, bs)[:, 1:]
            es, en = compute_accepted_length_counts((pred == tgt)[:, 1:], valid)
            eal_sum += float(es)
            eal_n += float(en)
        greedy = greedy_tokens(model, S["verifier_last_hidden_states"][0].to(device), head,
                               S["loss_mask"][0].bool().to(device)).cpu()
        # alignment check: speculators' slot-1 target (draft-vocab argmax) vs our greedy A[t], where A[t]
        # is in the draft vocabulary; should be ~1 (ties/rounding aside)
        g0 = greedy[s_anchor]
        inv = g0 >= 0 if t2d is None else t2d[g0.clamp(min=0)]
        ref_agree += int((ref_ids[0, s_anchor] == g0)[inv].sum())
        ref_n += int(inv.sum())
        hit, evaluable, valid = anchor_tensors(draft_ids, greedy, S["input_ids"][0], S["loss_mask"][0],
                                               S["document_ids"][0])
        anchor = valid[:, :1]  # DFlash drafts only at anchors; score per-slot accuracy there
        total = add_counts(total, chain_counts(hit, evaluable & anchor, valid & anchor))
        slot_hit += (hit & valid & anchor).sum(0)
        slot_n += (valid & anchor).sum(0)
        n_rows += 1
    model.train()
    out = {k: v for k, v in summarize(total).items() if k not in ("convention", "reference")}
    out["accuracy_per_slot_at_anchors"] = [round(float(h) / max(1, int(n)), 6) for h, n in zip(slot_hit, slot_n)]
    out["speculators_eal"] = round(eal_sum / eal_n, 6) if eal_n else None
    out["speculators_eal_blocks"] = int(eal_n)
    out["eval_rows"] = n_rows
    out["slot1_reference_agreement"] = round(ref_agree / max(1, ref_n), 6)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", default="results/cpu1k/hidden_states/manifest.json")
    p.add_argument("--vocab", default="results/cpu1k/data/vocab_mapping.safetensors")
    p.add_argument("--model", default="results/models/SmolLM2-135M-Instruct")
    p.add_argument("--full-vocab", action="store_true", help="full target vocabulary instead of --vocab's")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=4, help="K + 1 (slot 0 is the anchor)")
    p.add_argument("--aux-ids", type=int, nargs="+", default=None,
                   help="aux layer ids (default: speculators' [2, n//2, n-3] = the manifest's [2, 15, 27])")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the draft's mask token (default: speculators' resolution, which falls back to pad/eos)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    p.add_argument("--save", default=None, help="write the trained draft here as speculators saves it (vLLM serves it)")
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-anchors", type=int, default=512, help="training anchors per row (speculators' default)")
    p.add_argument("--loss-weight", default="dpace", choices=("dpace", "fixed-exp-decay"),
                   help="per-slot loss weights (speculators' dflash default: dpace with ce)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                   help="adamw (with --schedule), or muon: train_draft's Optimization (Muon on 2-D matrices + AdamW, "
                        "cosine), as the EAGLE-3 baseline ran (--lr 2e-3 --weight-decay 0)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--schedule", default="linear", choices=("linear", "cosine"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-chunk", type=int, default=256, help="anchors per eval forward")
    p.add_argument("--eval-at", type=int, nargs="*", default=[], help="extra steps to evaluate at")
    p.add_argument("--time-only", type=int, default=0, help="run this many steps, print s/step, stop")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    from speculators.losses import resolve_loss_config

    manifest = load_manifest(args.manifest)
    model, mask_id, tl = build_model(args)
    model.to(args.device)
    print(f"draft: {args.num_layers} layer(s) {tl.layer_types}, block {args.block_size} (K={args.block_size - 1}), "
          f"aux ids {model.target_layer_ids}, mask token {mask_id}, draft vocab {model.draft_vocab_size}, "
          f"attn {args.attn}", flush=True)
    params, opt = make_optimizer(args, model)
    decay = "cosine" if args.optimizer == "muon" else args.schedule
    print(f"trainable parameters {sum(q.numel() for q in params):,}; {args.optimizer} lr {args.lr} wd "
          f"{args.weight_decay}, {decay} decay, warmup {args.warmup_steps}", flush=True)
    loss_config = resolve_loss_config("ce", "eager")
    head = load_target_head(args.model).to(args.device)
    rows = BothRows(manifest, "train", args.batch_tokens, seed=args.seed, shuffle=True, shuffle_window=None)
    stream = rows.stream()
    results = {"args": vars(args), "mask_token_id": mask_id, "evals": {}}
    model.train()
    steps = args.time_only or args.max_steps
    t0 = time.perf_counter()
    step_times = []
    for step in range(1, steps + 1):
        ts = time.perf_counter()
        _, batch = next(stream)
        b = {k: batch[k].to(args.device) for k in KEYS}
        _, loss, m = model(**b, loss_config=loss_config, max_anchors=args.max_anchors,
                           per_position_loss_weight=args.loss_weight)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step_times.append(time.perf_counter() - ts)
        if step <= 10 or step % 20 == 0 or step == steps:
            eal = float(m["eal_sum"] / m["eal_total"])
            acc = [round(float(m[f"position_{i}_acc_sum"] / m[f"position_{i}_acc_total"].clamp(min=1)), 3)
                   for i in range(1, args.block_size)]
            print(f"step {step}: loss {float(loss.detach()):.4f} train eal {eal:.3f} slot acc {acc} "
                  f"lr {opt.last_lr():.2e} {step_times[-1]:.2f} s/step "
                  f"(mean {sum(step_times) / len(step_times):.2f})", flush=True)
        if step in args.eval_at and step != steps:
            te = time.perf_counter()
            ev = evaluate(model, args, manifest, head)
            results["evals"][step] = ev
            print(f"eval at step {step} ({time.perf_counter() - te:.0f} s): {json.dumps(ev)}", flush=True)
    train_s = time.perf_counter() - t0
    results["s_per_step"] = round(sum(step_times) / len(step_times), 3)
    results["train_s"] = round(train_s, 1)
    print(f"trained {steps} steps in {train_s:.0f} s, {results['s_per_step']} s/step", flush=True)
    if args.time_only:
        return
    if args.save:  # before the eval: serving needs the draft, not its offline figure
        model.save_pretrained(args.save)
        print(f"saved the draft to {args.save} (K = {args.block_size - 1}, mask token {mask_id})", flush=True)
    te = time.perf_counter()
    ev = evaluate(model, args, manifest, head)
    results["evals"][steps] = ev
    results["eval_s"] = round(time.perf_counter() - te, 1)
    print(f"eval at step {steps} ({results['eval_s']} s): {json.dumps(ev)}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
