"""Training through a disk budget for hidden-state shards (``extract.disk_budget_gib``, issue 45).

Design:
- Off (null) or when the run's projected shards fit, nothing changes: same shards, manifest,
  plan and draft. The budget is RESULT_NEUTRAL for a shard's content, so shards are shared.
- Over the budget ("budgeted"), extraction writes only the held-out eval shards (kept all run)
  and lists every train batch in the manifest as *deferred*: its file, samples, tokens, each
  sample's record index and length, projected bytes, no checksum (``deferred_row``).
- Training (rule train_draft: ONE Snakemake job, so the DAG and `snakemake -n` stay as they are)
  starts the extractor as its child (``python -m eaglepipe.extract_hidden_states ... --schedule``,
  the same stage module and settings) and consumes what it writes: *occurrences*
  ``train-eEEEE-BBBBBB.safetensors``, one per (pass, batch), made in the order training first
  needs them, each only when the occurrences on disk plus it fit the budget's train share (the
  budget minus the eval shards): at most the budget ahead of training, plus the one being written.
- The plan (packed_data) takes the sample lengths from the deferred rows, so it is the unbudgeted
  plan, row for row, for the same shuffle window; the window is capped to what the budget holds
  (``choose_window``), so `global` shuffling becomes a window of shards (other order: logged and
  in the summary). The trainer deletes an occurrence after the step that trained its last row;
  the next pass extracts it again (the pass's shard order follows the seed).
- Resume: the schedule is computed from the checkpoint's data position; stray occurrences are
  removed, intact ones reused (verified as extraction verifies shards, damaged ones rebuilt), only
  what rows from there on need is extracted. The checkpoint's shuffle window is kept where the
  budget holds it, with another world size too (train_draft.resumed_window). The producer dies with the trainer (PDEATHSIG and a
  parent check); a dead producer stops the trainer with one sentence; the trained-sample counts
  are part of every checkpoint, so a resumed run's curve and draft equal an uninterrupted run's.
  The extraction records (train/budget/extracted.jsonl) are kept across resumes: the summary's
  re-extraction seconds, shards made and target loads count what killed jobs made too.
- Refused before any step: a budget that cannot hold what must be on disk at once (the shards of
  the rows in flight: the prefetch depth, the world size, rows that span shards).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from .atomic import write_json
from .process_lifetime import die_with_parent
from .shard_manifest import BUDGET_KEY
from .units import human_bytes

log = logging.getLogger(__name__)

GIB = 1 << 30
SCHEDULE = "schedule.json"
PROGRESS = "trained.json"  # the schedule rows trained so far, for the producer
EXTRACTED = "extracted.jsonl"
POLL_S = 0.05
# a shard's bytes beyond its tensors: the header (metadata, each sample's id), generously
HEADER_BYTES, HEADER_BYTES_PER_SAMPLE = 2048, 256
OCCURRENCE = re.compile(r"^(?:\.tmp-)?train-e\d{4,}-\d{6,}\.safetensors(?:\.checksum)?")


def occurrence_name(epoch: int, batch: int) -> str:
    """The file of train batch ``batch`` as made for pass ``epoch`` under a budget."""
    return f"train-e{epoch:04d}-{batch:06d}.safetensors"


def occurrence_files(shard_dir: Path) -> list[Path]:
    """Every occurrence file in the shard directory, temporaries and checksum records included."""
    try:
        return [p for p in shard_dir.iterdir() if OCCURRENCE.match(p.name)]
    except FileNotFoundError:
        return []


def occurrence_bytes(shard_dir: Path) -> int:
    total = 0
    for p in occurrence_files(shard_dir):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # deleted meanwhile
            pass
    return total


def shard_bytes(tokens: int, samples: int, bytes_per_token: int) -> int:
    """A shard's projected bytes: its tokens, offsets and sample indices, and the header allowance."""
    return tokens * bytes_per_token + 16 * (samples + 1) + HEADER_BYTES + HEADER_BYTES_PER_SAMPLE * samples


# ----------------------------------------------------------------------------- extraction side
def plan(budget_gib: float | None, batch_bytes: dict[str, list[int]], bytes_per_token: int):
    """None when there is no budget or the run's shards (``batch_bytes``: each split's projected
    shard bytes, shard_bytes) fit it; else the manifest's record of the budget. SystemExit when
    the eval shards alone do not fit beside one train shard."""
    if budget_gib is None or not batch_bytes["train"]:  # a parity extraction has no train split
        return None
    budget = int(budget_gib * GIB)
    projected = {split: sum(sizes) for split, sizes in batch_bytes.items()}
    if sum(projected.values()) <= budget:
        return None
    least = projected["eval"] + max(batch_bytes["train"], default=0)
    if least > budget:
        # the least is a lower bound (training checks the rows in flight before its first step);
        # the projection is where the budget stops mattering
        raise SystemExit(f"extract.disk_budget_gib {budget_gib}: the held-out eval shards alone need "
                         f"{human_bytes(projected['eval'])}, and the budget of {human_bytes(budget)} must hold them "
                         f"and train shards beside: give it at least {human_bytes(least)} (the eval shards and "
                         f"the largest train shard; every shard fits in {human_bytes(sum(projected.values()))}), "
                         "or hold out fewer samples, or make smaller shards (extract.batch_size)")
    return {"bytes": budget, "gib": budget_gib, "projected_bytes": sum(projected.values()),
            "eval_bytes": projected["eval"], "train_bytes": budget - projected["eval"],
            "bytes_per_token": bytes_per_token}


def deferred_row(file: str, batch: int, samples, bytes_per_token: int) -> dict:
    """The manifest row of a train batch extracted during training (no file yet)."""
    lengths = [len(s.input_ids) for s in samples]
    return {"file": file, "batch": batch, "samples": len(samples), "tokens": sum(lengths),
            "bytes": shard_bytes(sum(lengths), len(samples), bytes_per_token), "deferred": True,
            "indices": [s.index for s in samples], "ids": [s.id for s in samples], "lengths": lengths}


def is_budgeted(manifest: dict) -> bool:
    return manifest.get(BUDGET_KEY) is not None


def parent_alive(ppid: int) -> bool:
    return os.getppid() == ppid


def trained_rows(progress: Path) -> int:
    """The schedule rows the training has trained (0 before its first step)."""
    try:
        return int(json.loads(progress.read_text())["rows"])
    except (OSError, ValueError, KeyError):
        return 0


def wait_for_room(shard_dir: Path, need: int, budget: int, ppid: int, what: str, still_needed) -> float | None:
    """Block until the occurrences on disk plus ``need`` fit ``budget``; the seconds waited, or None
    when ``still_needed()`` turns false (the training went past it with a copy left by a killed
    run). SystemExit when the trainer that started this producer is gone."""
    t0 = time.perf_counter()
    while occurrence_bytes(shard_dir) + need > budget:
        if not parent_alive(ppid):
            raise SystemExit(f"{what}: the training that started this extractor has ended; stopping")
        if not still_needed():
            return None
        time.sleep(POLL_S)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- training side
def train_rows(manifest: dict) -> list[dict]:
    return manifest["splits"]["train"]["shards"]


def consumed_rows(rows_of_epoch, epoch: int, start: int, world: int):
    """(row index, row) of the rows stream() trains in ``epoch`` from row ``start``: an epoch's last
    rows that cannot fill every rank are dropped (packed_data.PackedRows.stream)."""
    rows = list(rows_of_epoch(epoch))
    usable = len(rows) // world * world
    return [(i, rows[i]) for i in range(start, usable)], usable


class Schedule:
    """The rows training consumes from a data position to the last step, and what they need on
    disk: occurrences in first-use order with their first and last use (an ordinal over the
    consumed rows)."""

    def __init__(self, rows_of_epoch, position: tuple[int, int], steps: int, world: int, sizes: list[int]):
        self.rows: list[tuple[int, int, list]] = []  # (epoch, row index, row)
        epoch, start = position
        need = steps * world
        empty_epochs = 0
        while len(self.rows) < need:
            got, usable = consumed_rows(rows_of_epoch, epoch, start, world)
            if not usable:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise SystemExit("the train split packs into fewer rows than ranks: lower batch_tokens")
            for i, row in got[:need - len(self.rows)]:
                self.rows.append((epoch, i, row))
            epoch, start = epoch + 1, 0
        self.first: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}
        for k, (e, _, row) in enumerate(self.rows):
            for si, _, _ in row:
                self.first.setdefault((e, si), k)
                self.last[(e, si)] = k
        self.order = sorted(self.first, key=lambda o: (self.first[o], o))
        self.sizes = sizes

    def peak_bytes(self, ahead: int) -> int:
        """The most bytes of occurrences that must be on disk at once when rows up to ``ahead``
        past the oldest untrained one are being read (prefetch) and trained ones are deleted."""
        events = Counter()
        for o in self.order:
            events[max(0, self.first[o] - ahead)] += self.sizes[o[1]]
            events[self.last[o] + 1] -= self.sizes[o[1]]
        peak = now = 0
        for k in sorted(events):
            now += events[k]
            peak = max(peak, now)
        return peak


def rows_ahead(world: int, depth: int) -> int:
    """Rows that may be read past the oldest untrained one: each rank's row in the step, the
    ``depth`` rows its prefetch holds and the one it is packing, for every rank."""
    return (depth + 2) * world


def choose_window(make_plan, configured: int | None, n_shards: int, budget: int, sizes: list[int],
                  steps: int, world: int, depth: int) -> int:
    """The widest shuffle window (at most the configured one; None = all shards) whose rows, every
    step's, fit the budget's train share: each pass orders the shards anew, so any pass may need
    the most, and the training checks them all before it starts (Budget.start). SystemExit when not
    even one shard at a time fits."""
    ahead = rows_ahead(world, depth)

    def fits(w: int) -> tuple[bool, int]:
        need = Schedule(make_plan(w), (0, 0), steps, world, sizes).peak_bytes(ahead)
        return need <= budget, need

    hi = min(configured or n_shards, n_shards)
    ok, need = fits(1)
    if not ok:
        raise SystemExit(f"extract.disk_budget_gib: the train share of the budget ({human_bytes(budget)}) cannot hold "
                         f"the {human_bytes(need)} of train shards that must be on disk at once even when each "
                         "shard's samples are shuffled alone (the rows in flight span several shards); raise "
                         f"the budget by at least {human_bytes(need - budget)}")
    lo = 1
    while lo < hi:  # the need grows with the window
        mid = (lo + hi + 1) // 2
        if fits(mid)[0]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ShardWaiter:
    """What the row reader (a thread or a worker process) calls to get an occurrence: waits until
    the producer has written it and its checksum record; stops with a sentence when the producer
    died first. Picklable."""

    def __init__(self, shard_dir: Path, producer_pid: int | None):
        self.shard_dir, self.producer_pid = shard_dir, producer_pid

    def producer_alive(self) -> bool:
        if self.producer_pid is None:
            return True
        try:
            state = Path(f"/proc/{self.producer_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        return state not in ("Z", "X")

    def __call__(self, epoch: int, batch: int) -> Path:
        from .shards import checksum_path

        path = self.shard_dir / occurrence_name(epoch, batch)
        while not (path.is_file() and checksum_path(path).is_file()):
            if not self.producer_alive():
                # it may have finished it just before ending
                if path.is_file() and checksum_path(path).is_file():
                    break
                raise SystemExit(f"shard {path}: the extractor feeding training (process {self.producer_pid}) "
                                 "ended before writing it (its messages are in this log); rerun: training resumes "
                                 "from its last checkpoint and the extractor makes only what is still needed")
            time.sleep(POLL_S)
        return path


class Budget:
    """The trainer's side (rank 0 starts the producer and deletes; every rank reads)."""

    def __init__(self, manifest: dict, out: Path, producer: str | None, seed: int):
        self.record = manifest[BUDGET_KEY]
        self.rows = train_rows(manifest)
        self.shard_dir = Path(manifest["_path"]).parent / manifest["shard_dir"]
        self.out = out
        self.dir = out / "budget"
        self.producer_cmd = producer
        self.seed = seed
        self.sizes = [r["bytes"] for r in self.rows]
        self.budget = int(self.record["train_bytes"])
        self.n_samples = 1 + max((i for r in self.rows for i in r["indices"]), default=-1)
        self.counts = torch.zeros(self.n_samples, dtype=torch.int32)
        self.rows_trained = 0
        self.proc: subprocess.Popen | None = None
        self.schedule: Schedule | None = None
        self.trained = 0  # ordinal of the next schedule row to train
        self.deleted: set[tuple[int, int]] = set()

    # ---------------------------------------------------------------- state (checkpoints)
    def state(self) -> dict:
        return {"counts": self.counts.clone(), "rows_trained": self.rows_trained}

    def load_state(self, state: dict) -> None:
        self.counts = state["counts"].clone()
        self.rows_trained = int(state["rows_trained"])

    def fresh(self) -> None:
        """A training from scratch: the extraction records of an earlier one are not its own."""
        (self.dir / EXTRACTED).unlink(missing_ok=True)

    # ---------------------------------------------------------------- producer
    def start(self, rows_of_epoch, position: tuple[int, int], steps: int, world: int, depth: int) -> ShardWaiter:
        """Compute the schedule from ``position``, clear what it does not need, start the producer."""
        self.schedule = Schedule(rows_of_epoch, position, steps, world, self.sizes)
        need = self.schedule.peak_bytes(rows_ahead(world, depth))
        if need > self.budget:
            raise SystemExit(f"extract.disk_budget_gib: from data position {position} the rows in flight need "
                             f"{human_bytes(need)} of train shards on disk at once, more than the budget's train "
                             f"share of {human_bytes(self.budget)}; raise the budget")
        # keep the shards of a killed run only as far as they are the schedule's first ones: the
        # producer makes the rest in order, and the budget's bound counts on that order
        from .shards import checksum_path

        kept = set()
        for e, b in self.schedule.order:
            path = self.shard_dir / occurrence_name(e, b)
            if not (path.is_file() and checksum_path(path).is_file()):
                break
            kept.add(path.name)
        stray = [p for p in occurrence_files(self.shard_dir)
                 if p.name.removesuffix(".checksum") not in kept or p.name.startswith(".tmp-")]
        for p in stray:
            p.unlink(missing_ok=True)
        if stray:
            log.info("removed %d shard file(s) of train passes this training no longer needs from %s",
                     len(stray), self.shard_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.schedule.order:
            return ShardWaiter(self.shard_dir, None)
        schedule = self.dir / SCHEDULE
        self._progress()
        write_json(schedule, {"occurrences": [[e, b, self.schedule.last[(e, b)]] for e, b in self.schedule.order],
                              "budget_bytes": self.budget, "eval_bytes": self.record["eval_bytes"],
                              "stats": str(self.dir / EXTRACTED), "progress": str(self.dir / PROGRESS)})
        if not self.producer_cmd:
            raise SystemExit(f"manifest: the train shards are extracted during training (extract.disk_budget_gib "
                             f"{self.record['gib']}), and train_draft was given no --producer command to extract them")
        cmd = f"{self.producer_cmd} --schedule {shlex.quote(str(schedule))}"
        log.info("extracting %d train shard(s) for %d rows while training, within %s of train shards "
                 "(the budget's share beside %s of eval shards): %s", len(self.schedule.order),
                 len(self.schedule.rows), human_bytes(self.budget), human_bytes(self.record["eval_bytes"]), cmd)
        self.proc = subprocess.Popen(["bash", "-c", cmd], preexec_fn=die_with_parent, stdout=sys.stderr)
        return ShardWaiter(self.shard_dir, self.proc.pid)

    def step_done(self, rows: int) -> None:
        """``rows`` more schedule rows were trained (one step, every rank): count their samples,
        delete the occurrences whose last use they were."""
        sched = self.schedule
        done = []
        for k in range(self.trained, self.trained + rows):
            e, _, row = sched.rows[k]
            for si, b, _ in row:
                self.counts[self.rows[si]["indices"][b]] += 1
                if sched.last[(e, si)] == k:
                    done.append((e, si))
        self.trained += rows
        self.rows_trained += rows
        self._progress()  # first: the producer must not make again what is deleted now
        for e, si in done:
            self._delete(e, si)

    def _progress(self) -> None:
        tmp = self.dir / f".{PROGRESS}.tmp"
        tmp.write_text(json.dumps({"rows": self.trained}))
        os.replace(tmp, self.dir / PROGRESS)

    def _delete(self, epoch: int, batch: int) -> None:
        from .shards import checksum_path

        path = self.shard_dir / occurrence_name(epoch, batch)
        path.unlink(missing_ok=True)
        checksum_path(path).unlink(missing_ok=True)
        self.deleted.add((epoch, batch))

    def stop(self) -> None:
        """End the producer (its work may be done) and remove what is left of the passes."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in occurrence_files(self.shard_dir):
            p.unlink(missing_ok=True)

    # ---------------------------------------------------------------- summary
    def summary(self, rows_per_epoch: int, train_tokens: int, window: int, configured_window: int | None) -> dict:
        records = []
        stats = self.dir / EXTRACTED
        if stats.is_file():
            for line in stats.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
        # the producer records each shard it made and each load of the target (once per producer
        # that had a shard to make: again after a kill)
        extracted = [r for r in records if "batch" in r]
        times = Counter(int(c) for c in self.counts.tolist())
        return {
            "budget_bytes": self.record["bytes"],
            "train_share_bytes": self.budget,
            "eval_bytes": self.record["eval_bytes"],
            "projected_bytes": self.record["projected_bytes"],
            "passes": round(self.rows_trained / max(1, rows_per_epoch), 4),
            "rows_trained": self.rows_trained,
            "samples_trained": int(self.counts.sum()),
            "distinct_samples_trained": int((self.counts > 0).sum()),
            "times_trained": {str(k): v for k, v in sorted(times.items())},
            "tokens_trained": train_tokens,
            "shuffle_window_shards": window,
            "order": "as without the budget" if configured_window == window else
                     f"shuffled within {window} shard(s) on disk at a time (without the budget: "
                     f"{'all shards' if configured_window is None else f'{configured_window} shard(s)'})",
            "shards_extracted": len(extracted),
            "reextraction_s": round(sum(r.get("seconds", 0.0) for r in extracted), 3),
            "peak_shard_bytes": max((r.get("peak_bytes", 0) for r in extracted), default=self.record["eval_bytes"]),
            "model_loads_s": [r["model_load_s"] for r in records if "model_load_s" in r],
        }
