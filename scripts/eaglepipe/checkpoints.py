"""Atomic, resumable training checkpoints.

Layout under ``<out>/checkpoints/``:
  step-0000080/  config.json + model.safetensors (speculators ``save_pretrained``, servable as is),
                 trainer_state.pt (optimizer, scheduler, data position, RNG states, step, world size,
                 settings digest, eval history), metrics.jsonl (the metrics rows up to this step),
                 COMPLETE (written last: step, settings digest, every file's size and checksum)
  latest -> step-...   best -> step-...   (relative symlinks, replaced atomically)
A checkpoint is assembled in a ``.tmp-*`` directory and renamed into place; one without COMPLETE
is never resumed from, nor one whose files no longer match the sizes and checksums COMPLETE
records (truncated, zeroed, replaced): the previous complete one is taken instead. The trainer
state is read with ``torch.load(weights_only=True)``, which refuses anything but tensors and
plain containers, so a planted pickle cannot run code. The last ``keep`` checkpoints and the best
one are kept.
The state is not sharded (the draft is small and replicated under DDP), so a run resumes with any
world size; the data position is global (packed_data), only the rows per step change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from .atomic import atomic_dir, read_json_object
from .checksum import CHECKSUM, file_checksum

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "trainer_state.pt"
METRICS = "metrics.jsonl"


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


def save(out_dir: str | Path, step: int, model, state: dict, metrics: list[dict], best: bool = False,
         keep: int = 2) -> Path:
    """Write checkpoint ``step`` with the metrics rows so far atomically, point ``latest`` (and
    ``best`` if it is) at it, prune."""
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    # atomic_dir replaces an older run's directory of the same step (incomplete or superseded)
    try:
        with atomic_dir(final) as tmp:
            model.save_pretrained(str(tmp))
            torch.save(state, tmp / STATE)
            (tmp / METRICS).write_text("".join(json.dumps(row) + "\n" for row in metrics))
            files = {p.name: {"bytes": p.stat().st_size, CHECKSUM: file_checksum(p)}
                     for p in sorted(tmp.iterdir())}
            (tmp / MARKER).write_text(json.dumps({"step": step, "digest": state["digest"], "files": files}) + "\n")
    except OSError as e:
        raise SystemExit(f"cannot write checkpoint {final}: {e.strerror or e}; free space in {root} "
                         "and rerun (training resumes from the last complete checkpoint)") from e
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


def damage(ckpt: Path, marker: dict) -> str | None:
    """What is wrong with a checkpoint's files against the sizes and checksums its marker records, or None."""
    recorded = marker.get("files")
    if not isinstance(recorded, dict) or not {STATE, METRICS, "model.safetensors"} <= set(recorded):
        return f"{MARKER} does not list the checksums of its files"
    for name, want in recorded.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if file_checksum(path) != want[CHECKSUM]:
            return f"{name} does not match the checksum recorded when it was written"
    return None


def find_resume(out_dir: str | Path, digest: str) -> tuple[Path, dict, list[dict]] | None:
    """The newest intact complete checkpoint written with these settings: (directory, trainer
    state, metrics rows up to its step).

    Damaged checkpoints are skipped for the previous one; checkpoints from other settings are
    reported and, when none fits, removed: the run starts fresh.
    """
    ckpts = complete_checkpoints(out_dir)
    for ckpt in reversed(ckpts):
        try:
            marker = read_json_object(ckpt / MARKER, "checkpoint marker")
            problem = None
        except ValueError as e:
            marker, problem = {}, str(e)
        if problem is None and marker.get("digest") != digest:
            log.warning("checkpoint %s was written with other settings (digest %s, now %s)",
                        ckpt, marker.get("digest"), digest)
            continue
        problem = problem or damage(ckpt, marker)
        if problem is None:
            try:
                state = torch.load(ckpt / STATE, weights_only=True)
                rows = [json.loads(line) for line in (ckpt / METRICS).read_text().splitlines()]
                return ckpt, state, rows
            except (pickle.UnpicklingError, RuntimeError, json.JSONDecodeError) as e:
                problem = f"cannot be loaded as plain data: {e}".splitlines()[0]
        log.warning("checkpoint %s is damaged (%s): falling back to the previous complete checkpoint",
                    ckpt, problem)
    root = Path(out_dir) / "checkpoints"
    if root.is_dir() and any(root.iterdir()):
        log.warning("no intact checkpoint in %s matches the current settings: starting fresh and removing "
                    "%d old checkpoint(s)", root, len(ckpts))
        remove_all(out_dir)
    return None


def remove_all(out_dir: str | Path) -> None:
    shutil.rmtree(Path(out_dir) / "checkpoints", ignore_errors=True)


def load_weights(model, ckpt: Path) -> None:
    """Load a checkpoint's draft weights (verifier-owned tensors are not saved and stay as loaded)."""
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("verifier_")]
    if missing or unexpected:
        raise SystemExit(f"checkpoint {ckpt}: weights do not fit the draft (missing {missing}, "
                         f"unexpected {unexpected})")
