"""Stage outputs built directly, without Snakemake, for the unit tests of the stages that read them.

``make_run``: a tiny-target run (shards from the target's real forward, manifest, vocab mapping);
``categorize``: categories on its eval samples; ``export_like``: a draft saved as the exporter does;
``train_argv``/``metrics_rows``/``weights``: the trainer's command line and what it writes;
``Oracle``: a draft whose proposals are known.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglepipe.shard_manifest import write_manifest

from eaglepipe.shards import write_shard

LAYER_IDS = [1, 3, 5, 6]  # tiny Llama has 6 layers; 6 = final layer before the final norm


@torch.no_grad()
def greedy_samples(model, n: int, seed: int) -> list[dict]:
    """Prompts of random tokens plus the target's greedy continuation. The continuation is cut at
    the first token a full forward would not choose (KV-cache numerics), so data == target argmax
    on every scored position; the last token is unscored (nothing in the data follows it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = torch.tensor([[rng.randrange(3, 400) for _ in range(rng.randint(3, 8))]])
        ids = model.generate(prompt, max_new_tokens=rng.randint(12, 30), do_sample=False,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0)[0]
        pred = model(ids[None]).logits[0].argmax(-1)
        p = prompt.shape[1]
        bad = (ids[p:] != pred[p - 1:-1]).nonzero()
        end = p + (int(bad[0]) if len(bad) else len(ids) - p)
        ids = ids[:end]
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[p:end - 1] = 1
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


@torch.no_grad()
def states(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, L, H]: hidden_states[k] for aux ids, the final norm's input for the last id."""
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    try:
        hs = model(ids[None], output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    layers = [hs[k][0] for k in LAYER_IDS[:-1]] + [captured["x"][0]]
    return torch.stack(layers, dim=1)


def write_split(model, samples: list[dict], shard_dir: Path, split: str, batch: int, start: int) -> list[dict]:
    rows = []
    for i in range(0, len(samples), batch):
        part = samples[i:i + batch]
        lengths = torch.tensor([len(s["input_ids"]) for s in part])
        rows.append(write_shard(
            shard_dir / f"{split}-{i // batch:06d}.safetensors",
            torch.cat([states(model, s["input_ids"]) for s in part]),
            torch.cat([s["input_ids"] for s in part]), torch.cat([s["loss_mask"] for s in part]),
            torch.arange(start + i, start + i + len(part)), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                       lengths.cumsum(0)]),
            {"layer_ids": LAYER_IDS}))
    return rows


_BUILT_RUNS: dict[tuple, tuple[Path, list[dict], list[dict]]] = {}  # make_run's arguments -> a built run


def make_run(tmp: Path, target: Path, n_train: int = 12, n_eval: int = 6, batch: int = 4,
             draft_vocab: int = 256, seed: int = 0) -> dict:
    """Shards of greedy data from the tiny target, manifest, and a vocab mapping holding every data token,
    in ``tmp``. Built once per test process for the same arguments (greedy generation is most of a
    unit test's time), then copied: each caller may change its own."""
    key = (str(target), n_train, n_eval, batch, draft_vocab, seed)
    if key not in _BUILT_RUNS:
        built = Path(tmp).parent / f".make_run-{len(_BUILT_RUNS)}"
        _BUILT_RUNS[key] = (built, *_build_run(built, target, n_train, n_eval, batch, draft_vocab, seed))
    built, train, evals = _BUILT_RUNS[key]
    shutil.copytree(built, tmp, dirs_exist_ok=True)
    return {"manifest": tmp / "hidden_states" / "manifest.json", "vocab": tmp / "vocab_mapping.safetensors",
            "model": target, "train": copy.deepcopy(train), "eval": copy.deepcopy(evals)}


def _build_run(out: Path, target: Path, n_train: int, n_eval: int, batch: int, draft_vocab: int,
               seed: int) -> tuple[list[dict], list[dict]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    train, evals = greedy_samples(model, n_train, seed), greedy_samples(model, n_eval, seed + 1)
    shard_dir = out / "hidden_states" / "shards"
    manifest = {
        "layer_ids": LAYER_IDS, "shard_dir": "shards",
        "target": {"model": str(target), "num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 400},
        "splits": {"train": {"shards": write_split(model, train, shard_dir, "train", batch, 0)},
                   "eval": {"shards": write_split(model, evals, shard_dir, "eval", batch, n_train)}},
    }
    write_manifest(out / "hidden_states" / "manifest.json", manifest)
    used = sorted({int(t) for s in train + evals for t in s["input_ids"]})
    fill = [t for t in range(400) if t not in set(used)]
    chosen = torch.tensor(sorted(used + fill[:max(0, draft_vocab - len(used))]))
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[chosen] = True
    save_file({"d2t": chosen - torch.arange(len(chosen)), "t2d": t2d}, str(out / "vocab_mapping.safetensors"))
    return train, evals


def categorize(manifest_path: Path, names: list) -> None:
    """The eval split's samples get the categories ``names`` in turn (None: none), in the manifest
    rows as extraction records them."""
    m = json.loads(Path(manifest_path).read_text())
    i = 0
    for row in m["splits"]["eval"]["shards"]:
        row["categories"] = [names[(i + j) % len(names)] for j in range(row["samples"])]
        i += row["samples"]
    Path(manifest_path).write_text(json.dumps(m))


def export_like(target: Path, run: dict, out: Path, aux=(1, 3, 5)) -> Path:
    """An untrained draft for ``run`` saved in bfloat16 without the embedding, as the exporter saves it."""
    from eaglepipe.draft_model import build_draft

    model = build_draft(target, list(aux), run["vocab"], ttt_steps=3)
    model.to(torch.bfloat16).save_pretrained(str(out))
    w = load_file(str(out / "model.safetensors"))
    del w["embed_tokens.weight"]
    save_file(w, str(out / "model.safetensors"))
    return out


def train_argv(run: dict, out: Path, **over) -> list[str]:
    """train_draft's command line for ``run``: a few steps of a small batch, ``over`` on top."""
    flags = {"max-steps": 6, "eval-every": 3, "checkpoint-every": 2, "batch-tokens": 64, "warmup-steps": 1,
             "lr": 3e-3, "ttt-steps": 3, "seed": 0}
    flags.update({k.replace("_", "-"): v for k, v in over.items()})
    return ["--manifest", str(run["manifest"]), "--vocab", str(run["vocab"]), "--model", str(run["model"]),
            "--out-dir", str(out), *[x for k, v in flags.items() for x in (f"--{k}", str(v))]]


def metrics_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path, step: int) -> dict:
    return load_file(str(out / "checkpoints" / f"step-{step:07d}" / "model.safetensors"))


class Oracle(torch.nn.Module):
    """Wraps a real draft; its step-k token at anchor t is the data token ``shift`` positions ahead."""

    def __init__(self, draft, t2d_index, shift):
        super().__init__()
        self.draft, self.t2d_index, self.shift = draft, t2d_index, shift
        self.d2t, self.t2d, self.verifier_norm = draft.d2t, draft.t2d, draft.verifier_norm

    def forward(self, input_ids, ttt_steps, **kw):
        _, loss, metrics = self.draft(input_ids=input_ids, ttt_steps=ttt_steps, **kw)
        ids = input_ids[0]
        tokens = []
        for k in range(ttt_steps):
            ahead = torch.cat([ids[k + self.shift:], ids.new_zeros(k + self.shift)])
            tokens.append(self.t2d_index[ahead][None])
        return tokens, loss, metrics
