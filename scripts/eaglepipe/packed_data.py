"""Packed training rows from hidden-state shards, read through the manifest only.

A row holds whole samples packed end to end, at most ``batch_tokens`` tokens (a longer sample gets
a row of its own, truncated, and is counted). Rows come out as speculators' batch dict after its
``shift_batch`` (per sample), so position t holds token x_{t+1}, aux states g_t and the final
state y_{t+1}; position ids restart at 1 in every sample and ``document_ids`` keep samples from
attending to each other. ``categories`` lists each document's category (shard_manifest.row_categories) and
``prompt_sets`` its fixed evaluation set (shard_manifest.row_prompt_sets), for
the evaluation strata; they are plain lists, not row tensors.

Shuffling mixes the samples of ``shuffle_window`` consecutive shards of the epoch's shard order
(1: each shard's own samples, in a shuffled order). A shard holds consecutive records of the data,
often parts of one conversation, so a wider window gives each row less correlated samples, at the
cost of that many shards held in memory (``shuffle_window()`` sizes it to a memory budget).
``shuffle_window=None`` is one permutation of the whole split (speculators' sampler): each sample
is then read on its own from its memory-mapped shard, so memory does not grow with the data
(H200, SmolLM2-135M, 1,000 steps: offline AL 1.793 against 1.776 for 14 of 61 shards at a time,
the same as speculators' trainer; benchmarks/README.md).

Nothing is read at start-up: an epoch's plan (shard order, sample order inside a window, packing)
is computed lazily from the manifest, a shard's ``offsets`` are read only when the plan reaches
it, and its hidden states only when one of this rank's rows needs them. The plan depends on
(seed, epoch) only, never on the world size: the position is the global row index, and each step
consumes ``world_size`` consecutive rows (rank r takes the r-th), so a resumed run may use a
different world size.

Under a disk budget (shard_budget) the train rows of the manifest are *deferred*: their shards do
not exist yet. The plan takes the sample lengths from the manifest rows instead of the shards
(the same plan), and a shard is read when a row needs it, as the file of its pass
(``wait_shard(epoch, batch)`` waits for the producer), into memory: the trainer deletes it after
its last use.
"""

from __future__ import annotations

import argparse
import copy
import functools
import logging
import shutil
from collections import OrderedDict
from collections.abc import Iterator

import torch
from safetensors import safe_open

from .prefetch import prefetch, prefetch_in_process
from .shard_manifest import row_categories, row_prompt_sets, shard_paths
from .shards import Shard, open_shard, read_shard, read_tokens, stored_layers

log = logging.getLogger(__name__)

Row = list[tuple[int, int, int]]  # (shard index, sample index in the shard, tokens used)


GLOBAL = "global"  # train.shuffle_buffer_gib's value for one permutation of the whole split
OPEN_SHARDS = 64  # memory maps kept open by a global shuffle (reopening one costs a header parse)


def shuffle_buffer(text: str) -> float | str:
    """A train.shuffle_buffer_gib given as text (a command-line flag): "global" or GiB >= 0."""
    if text == GLOBAL:
        return text
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # nan too
        raise argparse.ArgumentTypeError(f"{text!r}: {GLOBAL} or a number of GiB >= 0")
    return gib


def shuffle_window(manifest: dict, split: str, buffer_gib: float | str) -> int | None:
    """The shards whose states fit in ``buffer_gib`` of memory at once (at least 1, at most all);
    None for ``"global"``, one permutation of the split read sample by sample."""
    if buffer_gib == GLOBAL:
        return None
    rows = [row for _, row in shard_paths(manifest, split)]
    expand = 2 if manifest.get("storage_dtype") == "fp8" else 1  # fp8 states are read back dequantized
    return max(1, min(len(rows), int(buffer_gib * 2**30) // (max(row["bytes"] for row in rows) * expand)))


ROW_LOADERS = ("thread", "process")
SHARED_MEMORY = "/dev/shm"


def add_row_loader_argument(parser) -> None:
    """--row-loader, which train_draft and benchmarks/profile_trainer.py take (not a setting: the rows
    are the same whichever packs them)."""
    parser.add_argument("--row-loader", default="thread", choices=ROW_LOADERS,
                        help="what packs the next rows during a step: a thread, or a worker process (the GIL "
                             "stays with the step; rows cross in shared memory); the rows are the same")


def check_row_loader(loader: str, row_bytes: int, depth: int = 2) -> None:
    """Refuse a worker process (``process``) where shared memory cannot hold the rows in flight:
    its rows cross in shared memory, and a container's 64 MB /dev/shm would kill it with SIGBUS."""
    if loader not in ROW_LOADERS:
        raise ValueError(f"row loader {loader!r}: one of {', '.join(ROW_LOADERS)}")
    if loader == "thread":
        return
    need = (depth + 2) * row_bytes  # the rows queued, the one being packed and the one in use
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:
        free = 0
    if free < need:
        raise SystemExit(f"--row-loader process: {SHARED_MEMORY} has {free / 2**20:.0f} MiB free, the worker process "
                         f"needs {need / 2**20:.0f} MiB for {depth + 2} rows in flight; raise the container's "
                         "--shm-size or use --row-loader thread")


class PackedRows:
    def __init__(self, manifest: dict, split: str, batch_tokens: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, dtype: torch.dtype = torch.float32, pad_to: int | None = None,
                 pin_memory: bool = False, shuffle_window: int | None = 1, wait_shard=None):
        if batch_tokens < 2:
            raise ValueError(f"batch_tokens {batch_tokens}: need at least 2 (one shifted token)")
        if shuffle_window is not None and shuffle_window < 1:
            raise ValueError(f"shuffle_window {shuffle_window}: need at least 1 shard")
        self.shards = shard_paths(manifest, split)
        if not self.shards:
            raise SystemExit(f"manifest {manifest.get('_path')}: split {split!r} has no shards")
        # a stat per shard: a deleted or truncated shard stops the run here, not when it is reached
        self.deferred = any(row.get("deferred") for _, row in self.shards)
        if self.deferred and (wait_shard is None or shuffle_window is None):
            raise ValueError(f"split {split!r}: deferred shards (a disk budget) need wait_shard and a shuffle window")
        self.wait_shard = wait_shard
        self._epoch = 0
        self._occurrences: OrderedDict[tuple[int, int], tuple[Shard, dict[int, int]]] = OrderedDict()
        for path, row in self.shards:
            if row.get("deferred"):
                continue
            size = path.stat().st_size if path.is_file() else None
            if size != row["bytes"]:
                found = "does not exist" if size is None else f"has {size} bytes"
                raise SystemExit(f"shard {path} {found}, manifest {manifest.get('_path')} records {row['bytes']} "
                                 "bytes; rerun with --forcerun extract_hidden_states (intact shards are reused)")
        self.settings_digest = manifest.get("settings", {}).get("digest")
        self.split = split
        self.num_layers = len(manifest["layer_ids"])
        self.hidden_size = manifest.get("target", {}).get("hidden_size")  # extraction records it
        self.batch_tokens = batch_tokens
        self.seed, self.shuffle = seed, shuffle
        # a global shuffle is one window of every shard, its samples read one at a time
        self.sample_reads = shuffle and shuffle_window is None
        self.window = (len(self.shards) if shuffle_window is None else shuffle_window) if shuffle else 1
        self.rank, self.world_size = rank, world_size
        self.dtype = dtype
        if pad_to is not None and pad_to < batch_tokens:
            raise ValueError(f"pad_to {pad_to}: rows hold up to batch_tokens={batch_tokens} tokens")
        self.pad_to = pad_to
        self.pin_memory = pin_memory
        self._offsets: dict[int, torch.Tensor] = {}
        self._cached: OrderedDict[int, Shard] = OrderedDict()  # the last `window` shards read
        self._open: OrderedDict[int, object] = OrderedDict()  # sample reads: the last OPEN_SHARDS opened
        self.truncated: set[tuple[int, int]] = set()
        self.skipped_non_finite: set[int] = set()  # under a disk budget: found at extraction
        self.too_short: set[tuple[int, int]] = set()

    # ------------------------------------------------------------------ plan
    def _generator(self, *key: int) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(hash((self.seed, *key)) & 0x7FFFFFFF)  # tuple-of-int hash is stable across runs
        return g

    def offsets(self, si: int) -> torch.Tensor:
        if si not in self._offsets and self.shards[si][1].get("deferred"):
            self._offsets[si] = torch.tensor([0, *self.shards[si][1]["lengths"]]).cumsum(0)
        if si not in self._offsets:
            path = self.shards[si][0]
            try:
                with safe_open(str(path), framework="pt") as f:
                    self._offsets[si] = f.get_tensor("offsets")
            except (OSError, ValueError) as e:
                raise SystemExit(f"shard {path}: cannot be read ({e}); rerun extraction") from e
        return self._offsets[si]

    def plan(self, epoch: int) -> Iterator[Row]:
        """The epoch's rows in order (global, the same on every rank)."""
        n = len(self.shards)
        order = (torch.randperm(n, generator=self._generator(epoch)) if self.shuffle else torch.arange(n)).tolist()
        row: Row = []
        used = 0
        for w in range(0, n, self.window):
            window = order[w:w + self.window]
            lengths = {si: self.offsets(si).diff().tolist() for si in window}
            items = [(si, b) for si in window for b in range(len(lengths[si]))]
            if self.shuffle:  # a one-shard window's generator is (epoch, shard), the plan before windows
                items = [items[i] for i in torch.randperm(len(items), generator=self._generator(epoch, *window)).tolist()]
            for si, b in items:
                length = lengths[si][b]
                if length < 2:  # nothing left after the shift
                    self.too_short.add((si, b))
                    continue
                if length > self.batch_tokens:
                    self.truncated.add((si, b))
                    length = self.batch_tokens
                if row and used + length > self.batch_tokens:
                    yield row
                    row, used = [], 0
                row.append((si, b, length))
                used += length
        if row:
            yield row

    # ------------------------------------------------------------------ iteration
    def stream(self, epoch: int = 0, index: int = 0,
               steps: int | None = None) -> Iterator[tuple[tuple[int, int], dict]]:
        """Training stream from position (epoch, index): yields (next position, row), ``steps``
        times (None: endlessly).

        Each yield consumes world_size rows; an epoch's last rows that cannot fill every rank are
        dropped so all ranks step together. No row past the last step is read: under a disk budget
        no shard is made for it, and a rank reading ahead would wait for one forever.
        """
        yielded = 0
        while True:
            group: list[Row] = []
            produced = False
            plan = self.plan(epoch)
            last_use = {}
            if self.deferred:  # the row after which each shard of the pass is needed no more
                plan = list(plan)
                last_use = {si: i for i, row in enumerate(plan) for si, _, _ in row}
            for i, row in enumerate(plan):
                if i < index:
                    continue
                group.append(row)
                if len(group) == self.world_size:
                    if yielded == steps:
                        return
                    produced = True
                    self._epoch = epoch  # the pass whose shard files a disk budget reads
                    batch = self.materialize(group[self.rank])
                    for key in [k for k in self._occurrences if k[0] < epoch or last_use.get(k[1], -1) <= i]:
                        del self._occurrences[key]
                    yield (epoch, i + 1), batch
                    yielded += 1
                    group = []
            if not produced and index == 0:
                raise SystemExit(f"split {self.split!r}: fewer packed rows per epoch than ranks "
                                 f"({self.world_size}); lower batch_tokens or the number of GPUs")
            self.report()
            epoch, index = epoch + 1, 0

    def prefetched(self, loader: str, epoch: int = 0, index: int = 0, depth: int = 2, steps: int | None = None):
        """``stream(epoch, index, steps)`` with the next ``depth`` rows packed ahead, by a thread or a
        worker process (refused where shared memory cannot hold its rows: ``check_row_loader``). The
        worker packs in ordinary memory; page-locking, when asked, happens here, as only this
        process's pages count for its GPU copies."""
        check_row_loader(loader, self.row_bytes() if loader == "process" else 0, depth)
        if loader == "thread":
            return prefetch(self.stream(epoch, index, steps), depth)
        worker = copy.copy(self)
        worker.pin_memory = False
        return prefetch_in_process(functools.partial(worker.stream, epoch, index, steps), depth,
                                   pin_memory=self.pin_memory)

    def row_bytes(self) -> int:
        """The largest row's bytes: its states (every layer) and the few integer tensors."""
        tokens = self.pad_to or self.batch_tokens
        return tokens * (self.num_layers * self.hidden_size * self.dtype.itemsize + 4 * 8)

    def once(self) -> Iterator[dict]:
        """One pass over the split; this rank's share (rows i with i % world_size == rank)."""
        for i, row in enumerate(self.plan(0)):
            if i % self.world_size == self.rank:
                yield self.materialize(row)
        self.report()

    def report(self) -> None:
        if self.truncated or self.too_short:
            log.warning("split %s: %d sample(s) longer than batch_tokens=%d truncated to it, %d sample(s) "
                        "shorter than 2 tokens skipped", self.split, len(self.truncated), self.batch_tokens,
                        len(self.too_short))

    # ------------------------------------------------------------------ tensors
    def __getstate__(self) -> dict:  # a row worker process opens its own memory maps
        return {**self.__dict__, "_open": OrderedDict()}

    def _checked(self, si: int, read, path=None):
        """``read(path)``, with the shard's settings and layers checked against the manifest; a
        shard that cannot be read or was made otherwise stops the run, naming it."""
        path = path or self.shards[si][0]
        try:
            result, meta, layers = read(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"shard {path}: cannot be read ({e}); rerun with --forcerun "
                             "extract_hidden_states (intact shards are reused)") from e
        if self.settings_digest and meta.get("settings_digest") != self.settings_digest:
            raise SystemExit(f"shard {path} was made with other settings (digest "
                             f"{meta.get('settings_digest')}) than the manifest's "
                             f"{self.settings_digest}; rerun with --forcerun extract_hidden_states")
        if layers != self.num_layers:
            raise SystemExit(f"shard {path}: hidden_states has {layers} layers, "
                             f"the manifest lists {self.num_layers} layer ids")
        return result

    def _shard(self, si: int) -> Shard:
        if si in self._cached:
            self._cached.move_to_end(si)
        else:
            def read(path):
                shard = read_shard(path)
                return shard, shard.metadata, shard.hidden_states.shape[1]

            self._cached[si] = self._checked(si, read)
            if len(self._cached) > self.window:
                self._cached.popitem(last=False)
        return self._cached[si]

    def _occurrence(self, si: int, b: int) -> dict | None:
        """Sample b (of the manifest row) of shard si as made for this pass under a disk budget, read
        into memory when first needed; None for a sample extraction skipped (non-finite states)."""
        key = (self._epoch, si)
        row = self.shards[si][1]
        if key in self._occurrences:
            self._occurrences.move_to_end(key)
        else:
            path = self.wait_shard(self._epoch, row["batch"])

            def read(path):
                shard = read_shard(path)
                return shard, shard.metadata, shard.hidden_states.shape[1]

            shard = self._checked(si, read, path)
            at = {int(index): p for p, index in enumerate(shard.sample_index.tolist())}
            planned = dict(zip(row["indices"], row["lengths"]))
            lengths = shard.offsets.diff().tolist()
            if any(planned.get(index) != lengths[p] for index, p in at.items()):
                raise SystemExit(f"shard {path} holds other samples than manifest row {row['file']} plans; rerun "
                                 "with --forcerun extract_hidden_states")
            # kept until the row that uses it last is packed (stream), then unmapped: the trainer
            # deletes the file after that row's step, and a mapped file would keep its disk space
            self._occurrences[key] = (shard, at)
        shard, at = self._occurrences[key]
        index = row["indices"][b]
        if index not in at:
            self.skipped_non_finite.add(index)
            return None
        return shard.sample(at[index])

    def _sample(self, si: int, b: int) -> dict | None:
        """Sample b of shard si: a view of the cached shard, or (global shuffle) its bytes alone."""
        if self.shards[si][1].get("deferred"):
            return self._occurrence(si, b)
        if not self.sample_reads:
            return self._shard(si).sample(b)
        if si in self._open:
            self._open.move_to_end(si)
        else:
            def read(path):
                f, meta = open_shard(path)
                return f, meta, stored_layers(f)

            self._open[si] = self._checked(si, read)
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        offsets = self.offsets(si)
        return read_tokens(self._open[si], int(offsets[b]), int(offsets[b + 1]))

    def materialize(self, row: Row) -> dict:
        from speculators.models.eagle3.data import shift_batch

        parts = []
        kept = []
        for si, b, length in row:
            sample = self._sample(si, b)
            if sample is None:
                continue
            kept.append((si, b, length))
            hs = sample["hidden_states"][:length].to(self.dtype)
            parts.append(shift_batch({
                "input_ids": sample["input_ids"][:length].long(),
                "hidden_states": hs[:, :-1].reshape(length, -1),
                "verifier_last_hidden_states": hs[:, -1],
                "loss_mask": sample["loss_mask"][:length].long(),
                "lengths": torch.tensor([length]),
                "position_ids": torch.arange(length),
            }))
        if not parts:
            raise SystemExit(f"split {self.split!r}: every sample of a row was skipped by extraction "
                             "(non-finite hidden states)")
        lengths = torch.cat([p["lengths"] for p in parts])
        batch = {key: torch.cat([p[key] for p in parts]).unsqueeze(0)
                 for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids")}
        batch["lengths"] = lengths
        batch["document_ids"] = torch.repeat_interleave(torch.arange(len(parts)), lengths).unsqueeze(0)
        if self.pad_to is not None:
            batch = pad_row(batch, self.pad_to)
        if self.pin_memory:  # page-locked: the copy to the GPU runs at full speed and asynchronously
            batch = {k: v.pin_memory() for k, v in batch.items()}
        batch["categories"] = [row_categories(self.shards[si][1])[b] for si, b, _ in kept]
        batch["prompt_sets"] = [row_prompt_sets(self.shards[si][1])[b] for si, b, _ in kept]
        return batch


def pad_row(batch: dict, length: int) -> dict:
    """Pad a row to ``length`` tokens. Pads are outside every document (id -1, as speculators' own
    collate pads) and outside the loss mask, so no loss, metric or AL anchor sees them."""
    T = batch["input_ids"].shape[1]
    extra = length - T
    if not extra:
        return batch
    fill = {"document_ids": -1}
    out = {k: torch.cat([v, v.new_full((1, extra, *v.shape[2:]), fill.get(k, 0))], dim=1)
           for k, v in batch.items() if k != "lengths"}
    out["lengths"] = batch["lengths"]
    return out

