"""Atomic, resumable training checkpoints.

Layout under ``<out>/checkpoints/``:
  step-0000080/  config.json + model.safetensors (speculators ``save_pretrained``, servable as is),
                 trainer_state.pt (optimizer, scheduler, data position, RNG states, step, world size,
                 settings digest, eval history), COMPLETE (written last)
  latest -> step-...   best -> step-...   (relative symlinks, replaced atomically)
A checkpoint is assembled in a ``.tmp-*`` directory and renamed into place; one without COMPLETE
is never resumed from. The last ``keep`` checkpoints and the best one are kept.
The state is not sharded (the draft is small and replicated under DDP), so a run resumes with any
world size; the data position is global (packed_data), only the rows per step change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from .atomic import atomic_dir

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "trainer_state.pt"


def step_name(step: int) -> str:
    return f"step-{step:07d}"


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _set_link(root: Path, name: str, target: str) -> None:
    tmp = root / f".tmp-link-{name}"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, root / name)


def complete_checkpoints(out_dir: str | Path) -> list[Path]:
    """COMPLETE checkpoints, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob("step-*") if p.is_dir() and not p.is_symlink() and (p / MARKER).is_file()]
    return sorted(dirs, key=lambda p: p.name)


def save(out_dir: str | Path, step: int, model, state: dict, best: bool = False, keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` (and ``best`` if it is) at it, prune."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    # atomic_dir replaces an older run's directory of the same step (incomplete or superseded)
    with atomic_dir(final) as tmp:
        model.save_pretrained(str(tmp))
        torch.save(state, tmp / STATE)
        (tmp / MARKER).write_text(json.dumps({"step": step, "digest": state["digest"]}) + "\n")
    _set_link(root, "latest", final.name)
    if best:
        _set_link(root, "best", final.name)
    prune(out_dir, keep)
    return final


def prune(out_dir: str | Path, keep: int = 2) -> None:
    """Keep the newest ``keep`` complete checkpoints and ``best``; remove the rest and stale temporaries."""
    root = Path(out_dir) / "checkpoints"
    best = root / "best"
    protected = {p.name for p in complete_checkpoints(out_dir)[-keep:]}
    if best.is_symlink():
        protected.add(os.readlink(best))
    for p in root.iterdir():
        if p.is_symlink() or p.name in protected:
            continue
        if p.name.startswith((".tmp-", "step-")):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()


def find_resume(out_dir: str | Path, digest: str) -> tuple[Path, dict] | None:
    """The newest complete checkpoint written with these settings, with its trainer state.

    Checkpoints from other settings are reported and removed: the run starts fresh.
    """
    ckpts = complete_checkpoints(out_dir)
    for ckpt in reversed(ckpts):
        state = torch.load(ckpt / STATE, weights_only=False)
        if state.get("digest") == digest:
            return ckpt, state
        log.warning("checkpoint %s was written with other settings (digest %s, now %s)",
                    ckpt, state.get("digest"), digest)
    root = Path(out_dir) / "checkpoints"
    if root.is_dir() and any(root.iterdir()):
        log.warning("no checkpoint in %s matches the current settings: starting fresh and removing %d "
                    "old checkpoint(s)", root, len(ckpts))
        shutil.rmtree(root)
    return None


def load_weights(model, ckpt: Path) -> None:
    """Load a checkpoint's draft weights (verifier-owned tensors are not saved and stay as loaded)."""
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("verifier_")]
    if missing or unexpected:
        raise SystemExit(f"checkpoint {ckpt}: weights do not fit the draft (missing {missing}, "
                         f"unexpected {unexpected})")
