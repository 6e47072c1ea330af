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
plain containers, so a planted pickle cannot run code. The last ``keep`` checkpoints of the
current settings and the best one are kept; nothing else is removed before a new checkpoint is
complete on disk (written, checksummed, fsynced): checkpoints of other settings, and the
``superseded-step-*`` ones of a finished training that is being retrained (supersede), stay
until then, so a new run that fails or is killed before its first checkpoint costs nothing.
The state is not sharded (the draft is small and replicated under DDP), so a run resumes with any
world size; the data position is global (packed_data), only the rows per step change.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .atomic import atomic_dir, read_json_object
from .checksum import CHECKSUM, file_checksum
from .units import human_bytes

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE = "trainer_state.pt"
METRICS = "metrics.jsonl"
SUPERSEDED = "superseded-"


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
    writing = "config.json and model.safetensors"
    # atomic_dir replaces an older run's directory of the same step (incomplete or superseded)
    try:
        with atomic_dir(final) as tmp:
            model.save_pretrained(str(tmp))
            writing = STATE
            torch.save(state, tmp / STATE)
            writing = METRICS
            (tmp / METRICS).write_text("".join(json.dumps(row) + "\n" for row in metrics))
            writing = MARKER
            files = {p.name: {"bytes": p.stat().st_size, CHECKSUM: file_checksum(p)}
                     for p in sorted(tmp.iterdir())}
            (tmp / MARKER).write_text(json.dumps({"step": step, "digest": state["digest"], "files": files}) + "\n")
            writing = "its files to disk (fsync)"
    # torch.save reports a full disk as RuntimeError ("unexpected pos"), safetensors as SafetensorError
    except (OSError, RuntimeError, SafetensorError) as e:
        raise SystemExit(write_failure(out_dir, state["digest"], final, writing, e)) from e
    _set_link(root, "latest", final.name)
    if best:
        _set_link(root, "best", final.name)
    prune(out_dir, state["digest"], keep)
    return final


def write_failure(out_dir: str | Path, digest: str, final: Path, writing: str, error: Exception) -> str:
    """One sentence for a checkpoint that could not be written: which, why, and what to do."""
    root = Path(out_dir) / "checkpoints"
    text = str(error)
    if (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)) or "unexpected pos" in text \
            or "os error 28" in text:
        why = "the disk is full"
    else:
        why = error.strerror if isinstance(error, OSError) and error.strerror else " ".join(text.split())[:200]
    resumable = [c for c in complete_checkpoints(out_dir) if marker_digest(c) == digest]
    resumes = f"from {resumable[-1].name}" if resumable else "from the start"
    free = human_bytes(shutil.disk_usage(root).free)
    return (f"cannot write checkpoint {final}: writing {writing} failed ({why}; {free} free there); free space in "
            f"{root} and rerun, training resumes {resumes}")


def prune(out_dir: str | Path, digest: str, keep: int = 2) -> None:
    """Keep the newest ``keep`` complete checkpoints of these settings and ``best``; remove the rest
    (other settings' checkpoints, superseded ones, stale temporaries). Called once a new checkpoint
    is complete on disk, so what it removes has been replaced."""
    root = Path(out_dir) / "checkpoints"
    best = root / "best"
    protected = {p.name for p in [c for c in complete_checkpoints(out_dir) if marker_digest(c) == digest][-keep:]}
    if best.is_symlink():
        protected.add(os.readlink(best))
    for p in root.iterdir():
        if p.is_symlink() or p.name in protected:
            continue
        if p.name.startswith((".tmp-", "step-", SUPERSEDED)):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()


def marker_digest(ckpt: Path) -> str | None:
    try:
        return read_json_object(ckpt / MARKER, "checkpoint marker").get("digest")
    except ValueError:
        return None


def supersede(out_dir: str | Path) -> int:
    """Rename the complete checkpoints out of resume's way (a finished training that is retrained
    from scratch); prune removes them once the new training has its first checkpoint."""
    ckpts = complete_checkpoints(out_dir)
    for ckpt in ckpts:
        ckpt.rename(ckpt.with_name(SUPERSEDED + ckpt.name))
    return len(ckpts)


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
    reported and left where they are (the next save prunes them): when none fits, the run starts fresh.
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
                return ckpt, *load_state(ckpt)
            except ValueError as e:
                problem = str(e)
        log.warning("checkpoint %s is damaged (%s): falling back to the previous complete checkpoint",
                    ckpt, problem)
    if ckpts:
        log.warning("no intact checkpoint in %s matches the current settings: starting fresh; its %d "
                    "checkpoint(s) stay until the first new one is written", Path(out_dir) / "checkpoints", len(ckpts))
    return None


def load_state(ckpt: Path) -> tuple[dict, list[dict]]:
    """The trainer state and metrics rows of ``ckpt``; ValueError says in our words why they cannot be loaded."""
    try:
        state = torch.load(ckpt / STATE, weights_only=True)
    except pickle.UnpicklingError:
        # torch's message carries terminal escapes and advice on loading the file anyway: not ours to pass on
        raise ValueError(f"{STATE} cannot be loaded as plain data: it holds objects other than tensors and "
                         "plain containers, and loading those could run code, so it was not loaded") from None
    except (RuntimeError, EOFError) as e:
        raise ValueError(f"{STATE} is not a readable torch file") from e
    try:
        return state, read_metrics(ckpt)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{METRICS} is not one JSON object per line") from e


def read_metrics(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / METRICS).read_text().splitlines()]


def intact(ckpt: Path) -> str | None:
    """What is wrong with a complete checkpoint's marker and files, or None."""
    try:
        return damage(ckpt, read_json_object(ckpt / MARKER, "checkpoint marker"))
    except ValueError as e:
        return str(e)


def load_weights(model, ckpt: Path) -> None:
    """Load a checkpoint's draft weights (verifier-owned tensors are not saved and stay as loaded)."""
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("verifier_")]
    if missing or unexpected:
        raise SystemExit(f"checkpoint {ckpt}: weights do not fit the draft (missing {missing}, "
                         f"unexpected {unexpected})")
