"""Packed rows from shards: packing, shifting, determinism, resumable position, DDP slices."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eaglepipe import packed_data
from eaglepipe.packed_data import ROW_LOADERS, PackedRows, check_row_loader, shuffle_window
from eaglepipe.shard_manifest import load_manifest, write_manifest
from eaglepipe.shards import read_shard, write_shard
from tiny_stages import make_run


def random_manifest(tmp: Path, lengths: list[list[int]], layers: int = 3, hidden: int = 8,
                    storage: str = "model") -> dict:
    """Shards of random states with given per-shard sample lengths; token id = global token counter."""
    rows, counter, sample = [], 0, 0
    for si, lens in enumerate(lengths):
        T = sum(lens)
        rows.append(write_shard(
            tmp / "shards" / f"train-{si:06d}.safetensors", torch.randn(T, layers, hidden),
            torch.arange(counter, counter + T), torch.ones(T), torch.arange(sample, sample + len(lens)),
            torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), {"layer_ids": list(range(1, layers + 1))},
            storage_dtype=storage))
        counter += T
        sample += len(lens)
    m = {"layer_ids": list(range(1, layers + 1)), "shard_dir": "shards", "storage_dtype": storage,
         "target": {"num_hidden_layers": layers, "hidden_size": hidden},
         "splits": {"train": {"shards": rows}}}
    write_manifest(tmp / "manifest.json", m)
    return load_manifest(tmp / "manifest.json")


# a row's plain lists, one entry per sample (packed_data's module docstring), beside its tensors
PER_SAMPLE_LISTS = ("categories", "prompt_sets")


def same_row(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] if k in PER_SAMPLE_LISTS else torch.equal(a[k], b[k])
                                        for k in a)


def row_tokens(batch: dict) -> list[int]:
    return batch["input_ids"][0].tolist()


def test_rows_carry_each_documents_category(tmp_path):
    m = random_manifest(tmp_path, [[5, 3, 4], [6, 2]])
    m["splits"]["train"]["shards"][0]["categories"] = ["a", None, "b"]  # the second shard has none
    rows = list(PackedRows(m, "train", batch_tokens=8, shuffle=False, pad_to=10).once())
    assert [r["categories"] for r in rows] == [["a", None], ["b"], [None, None]]
    assert rows[1]["document_ids"][0].tolist() == [0, 0, 0] + [-1] * 7  # the pads are no document's


def test_rows_pack_whole_samples_shifted_per_sample(tmp_path):
    m = random_manifest(tmp_path, [[5, 3, 4], [6, 2]])
    rows = list(PackedRows(m, "train", batch_tokens=8, shuffle=False).once())
    # samples 5|3 (8 tokens), 4|... 4+6 > 8 so 4 alone, then 6|2
    assert [r["lengths"].tolist() for r in rows] == [[4, 2], [3], [5, 1]]
    first = rows[0]
    assert row_tokens(first) == [1, 2, 3, 4, 6, 7]  # x0 of each sample dropped
    assert first["position_ids"][0].tolist() == [1, 2, 3, 4, 1, 2]
    assert first["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1]
    assert first["hidden_states"].shape == (1, 6, 2 * 8) and first["verifier_last_hidden_states"].shape == (1, 6, 8)
    hs = read_shard(tmp_path / "shards" / "train-000000.safetensors").hidden_states
    # aux g_t beside x_{t+1} and the final state y_{t+1}
    assert torch.equal(first["hidden_states"][0, 0], hs[0, :-1].reshape(-1))
    assert torch.equal(first["verifier_last_hidden_states"][0, 0], hs[1, -1])


def test_long_sample_truncated_and_counted(tmp_path, caplog):
    m = random_manifest(tmp_path, [[3, 20, 1]])
    rows = PackedRows(m, "train", batch_tokens=8, shuffle=False)
    out = list(rows.once())
    assert [r["lengths"].tolist() for r in out] == [[2], [7]]
    assert len(rows.truncated) == 1 and len(rows.too_short) == 1
    assert "1 sample(s) longer than batch_tokens=8 truncated" in caplog.text


def test_shuffle_deterministic_and_resumable(tmp_path):
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3]])
    a = PackedRows(m, "train", batch_tokens=9, seed=1)
    stream = a.stream()
    first = [next(stream) for _ in range(12)]  # crosses epochs
    assert {pos[0] for pos, _ in first} == {0, 1, 2}
    again = PackedRows(m, "train", batch_tokens=9, seed=1).stream()
    assert [row_tokens(b) for _, b in first] == [row_tokens(next(again)[1]) for _ in range(12)]
    other = PackedRows(m, "train", batch_tokens=9, seed=2).stream()
    assert [row_tokens(b) for _, b in first] != [row_tokens(next(other)[1]) for _ in range(12)]
    epoch0 = [row_tokens(b) for pos, b in first if pos[0] == 0]
    epoch1 = [row_tokens(b) for pos, b in first if pos[0] == 1]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) and epoch0 != epoch1
    # resume from a saved position yields exactly the rest of the stream
    pos, _ = first[4]
    resumed = PackedRows(m, "train", batch_tokens=9, seed=1).stream(*pos)
    assert [row_tokens(b) for _, b in first[5:]] == [row_tokens(next(resumed)[1]) for _ in range(7)]


# the plan of [[4, 5, 3], [6, 2, 2], [7, 3]] at batch_tokens 9, seed 1, epochs 0 and 1, as the reader
# made it before shuffle windows existed: a window of one shard must keep it, so runs resume as before
PLAN_BEFORE_WINDOWS = [
    [[(2, 0, 7)], [(2, 1, 3), (1, 0, 6)], [(1, 2, 2), (1, 1, 2), (0, 1, 5)], [(0, 2, 3), (0, 0, 4)]],
    [[(1, 0, 6), (1, 1, 2)], [(1, 2, 2), (0, 2, 3), (0, 0, 4)], [(0, 1, 5), (2, 1, 3)], [(2, 0, 7)]],
]


def test_a_one_shard_window_keeps_the_plan_before_windows(tmp_path):
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3]])
    rows = PackedRows(m, "train", batch_tokens=9, seed=1, shuffle_window=1)
    assert [list(rows.plan(e)) for e in (0, 1)] == PLAN_BEFORE_WINDOWS


def test_a_shuffle_window_mixes_its_shards_samples_and_nothing_else(tmp_path):
    lengths = [[4, 5, 3, 2], [6, 2, 2, 3], [7, 3, 2, 4], [2, 2, 5, 3]]
    m = random_manifest(tmp_path, lengths)
    every = sorted((si, b) for si, lens in enumerate(lengths) for b in range(len(lens)))
    order = PackedRows(m, "train", batch_tokens=9, seed=1).plan  # one-shard windows
    for window in (2, 4):
        rows = PackedRows(m, "train", batch_tokens=9, seed=1, shuffle_window=window)
        plans = [list(rows.plan(e)) for e in (0, 1)]
        assert plans == [list(PackedRows(m, "train", 9, seed=1, shuffle_window=window).plan(e)) for e in (0, 1)]
        for plan in plans:
            samples = [(si, b) for row in plan for si, b, _ in row]
            assert sorted(samples) == every  # each sample once an epoch
            # the window's shards come in the epoch's shard order (windows do not change it), and
            # every sample of one window comes before any of the next
            shards_in_order = list(dict.fromkeys(si for row in order(plans.index(plan)) for si, _, _ in row))
            windows = [set(shards_in_order[w:w + window]) for w in range(0, len(lengths), window)]
            seen = [next(i for i, ws in enumerate(windows) if si in ws) for si, _ in samples]
            assert seen == sorted(seen)
        assert plans[0] != plans[1]
        # one-shard windows change shard 3 times an epoch (4 shards); mixed windows, more often
        for e, plan in enumerate(plans):
            shards = [si for row in plan for si, _, _ in row]
            changes = sum(a != b for a, b in zip(shards, shards[1:]))
            assert changes > len(lengths) - 1 and plan != list(order(e))


def test_rows_of_a_shuffle_window_read_each_sample_and_hold_that_many_shards(tmp_path):
    lengths = [[4, 5, 3], [6, 2, 2], [7, 3], [2, 5]]
    m = random_manifest(tmp_path, lengths)
    starts = {}  # (shard, sample) -> its first token id (ids count tokens across the shards)
    counter = 0
    for si, lens in enumerate(lengths):
        for b, n in enumerate(lens):
            starts[si, b], counter = counter, counter + n
    rows = PackedRows(m, "train", batch_tokens=9, seed=4, shuffle_window=2)
    plan = list(rows.plan(0))
    stream = rows.stream()
    for row in plan:
        _, batch = next(stream)
        ids = row_tokens(batch)
        at = 0
        for si, b, n in row:  # each document is its sample's tokens, shifted by one
            assert ids[at:at + n - 1] == list(range(starts[si, b] + 1, starts[si, b] + n))
            at += n - 1
        assert len(rows._cached) <= 2
    # resumed mid-epoch, the rest of the stream is the same
    pos, _ = next(PackedRows(m, "train", 9, seed=4, shuffle_window=2).stream())
    resumed = PackedRows(m, "train", 9, seed=4, shuffle_window=2).stream(*pos)
    again = PackedRows(m, "train", 9, seed=4, shuffle_window=2).stream()
    next(again)
    assert [row_tokens(next(resumed)[1]) for _ in range(5)] == [row_tokens(next(again)[1]) for _ in range(5)]


def test_the_shuffle_window_is_the_shards_a_memory_budget_holds(tmp_path):
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3], [2, 5]])
    largest = max(row["bytes"] for row in m["splits"]["train"]["shards"])
    gib = [b / 2**30 for b in (0, largest - 1, largest, 3 * largest + 1, 100 * largest)]
    assert [shuffle_window(m, "train", g) for g in gib] == [1, 1, 1, 3, 4]
    m["storage_dtype"] = "fp8"  # read back dequantized: twice the bytes
    assert shuffle_window(m, "train", 3 * largest / 2**30) == 1 and shuffle_window(m, "train", 4 * largest / 2**30) == 2


@pytest.mark.parametrize("storage", ["model", "fp8"])
def test_a_global_shuffle_is_the_every_shard_window_read_sample_by_sample(tmp_path, monkeypatch, storage):
    """shuffle_window None: the plan of a window of every shard, the same rows bit for bit, but no
    whole shard is held: each sample's bytes are read from its memory map, at most OPEN_SHARDS open."""
    monkeypatch.setattr(packed_data, "OPEN_SHARDS", 2)
    lengths = [[4, 5, 3], [6, 2, 2], [7, 3], [2, 5]]
    m = random_manifest(tmp_path, lengths, storage=storage)
    every = PackedRows(m, "train", batch_tokens=9, seed=3, shuffle_window=len(lengths))
    whole = PackedRows(m, "train", batch_tokens=9, seed=3, shuffle_window=None)
    assert shuffle_window(m, "train", "global") is None
    assert [list(whole.plan(e)) for e in (0, 1)] == [list(every.plan(e)) for e in (0, 1)]
    per_epoch = len(list(every.plan(0)))
    a, b = every.stream(), whole.stream()
    for _ in range(per_epoch + 2):  # into the second epoch
        (pos_a, row_a), (pos_b, row_b) = next(a), next(b)
        assert pos_a == pos_b and same_row(row_a, row_b)
        assert not whole._cached and 0 < len(whole._open) <= 2
    resumed = PackedRows(m, "train", batch_tokens=9, seed=3, shuffle_window=None).stream(*pos_b)
    assert torch.equal(next(resumed)[1]["hidden_states"], next(b)[1]["hidden_states"])
    # evaluation rows (no shuffle) read whole shards, one at a time, as before
    assert not PackedRows(m, "train", 9, shuffle=False, shuffle_window=None).sample_reads


def test_a_global_shuffle_checks_each_shard_it_opens(tmp_path):
    m = random_manifest(tmp_path, [[4, 4], [3, 5]])
    m["layer_ids"] = [1, 2, 3, 4]
    with pytest.raises(SystemExit, match="hidden_states has 3 layers, the manifest lists 4"):
        next(PackedRows(m, "train", 8, shuffle_window=None).stream())
    m = random_manifest(tmp_path / "other", [[4, 4]])
    m["settings"] = {"digest": "of-the-manifest"}
    with pytest.raises(SystemExit, match="was made with other settings"):
        next(PackedRows(m, "train", 8, shuffle_window=None).stream())


def test_a_shuffle_window_below_one_is_refused(tmp_path):
    m = random_manifest(tmp_path, [[4, 5]])
    with pytest.raises(ValueError, match="shuffle_window 0"):
        PackedRows(m, "train", 9, shuffle_window=0)


def test_ranks_take_disjoint_rows(tmp_path):
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3]])
    single = [row_tokens(b) for _, (_, b) in zip(range(4), PackedRows(m, "train", 9, seed=3).stream(), strict=False)]
    r0 = PackedRows(m, "train", 9, seed=3, rank=0, world_size=2).stream()
    r1 = PackedRows(m, "train", 9, seed=3, rank=1, world_size=2).stream()
    (p0, b0), (p1, b1) = next(r0), next(r1)
    assert p0 == p1 == (0, 2)
    assert [row_tokens(b0), row_tokens(b1)] == single[:2]
    once = [row_tokens(b) for b in PackedRows(m, "train", 9, shuffle=False).once()]
    halves = [row_tokens(b) for r in (0, 1) for b in PackedRows(m, "train", 9, shuffle=False, rank=r,
                                                                 world_size=2).once()]
    assert sorted(once) == sorted(halves)


@pytest.mark.parametrize("loader", ROW_LOADERS)
def test_rows_packed_ahead_end_at_the_last_step(tmp_path, loader):
    # under a disk budget no shard is made for a row past the training's last step: a rank packing
    # one ahead would wait for it forever
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3]])
    rows = PackedRows(m, "train", 9, seed=3, rank=1, world_size=2)
    ahead = rows.prefetched(loader, 0, 2, steps=3)  # crosses an epoch
    assert [pos for pos, _ in ahead] == [(0, 4), (1, 2), (1, 4)]
    packed = []
    rows.materialize = lambda row: packed.append(row) or {}
    assert len(list(rows.stream(0, 2, steps=3))) == 3 and len(packed) == 3


def test_layer_count_mismatch_is_a_clear_error(tmp_path):
    m = random_manifest(tmp_path, [[4, 4]])
    m["layer_ids"] = [1, 2, 3, 4]
    with pytest.raises(SystemExit, match="hidden_states has 3 layers, the manifest lists 4"):
        list(PackedRows(m, "train", 8).once())


def test_unknown_split_is_a_clear_error(tmp_path):
    m = random_manifest(tmp_path, [[4, 4]])
    with pytest.raises(ValueError, match="no split 'eval'"):
        PackedRows(m, "eval", 8)


def test_gpu_rows_have_one_padded_length(tmp_path, tiny_llama):
    from eaglepipe.draft_model import row_length

    assert row_length("cpu", 1000) is None
    assert row_length("cuda", 1000) == 1024 and row_length("cuda", 8192) == 8192
    run = make_run(tmp_path, tiny_llama)
    manifest = load_manifest(run["manifest"])
    rows = list(PackedRows(manifest, "train", 64, shuffle=False, pad_to=128).once())
    plain = list(PackedRows(manifest, "train", 64, shuffle=False).once())
    assert {r["input_ids"].shape[1] for r in rows} == {128} and len(rows) == len(plain)
    for r, p in zip(rows, plain):
        T = p["input_ids"].shape[1]
        assert all(torch.equal(r[k][:, :T], p[k]) for k in p if k not in ("lengths", *PER_SAMPLE_LISTS))
        assert all(r[k] == p[k] == [None] * len(p["lengths"]) for k in PER_SAMPLE_LISTS)
        assert (r["document_ids"][0, T:] == -1).all() and not r["loss_mask"][0, T:].any()
    with pytest.raises(ValueError, match="pad_to 32"):
        PackedRows(manifest, "train", 64, pad_to=32)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_deleted_or_truncated_shard_stops_training_before_it_starts(tmp_path, damage):
    m = random_manifest(tmp_path, [[4, 4], [3, 5]])
    shard = tmp_path / "shards" / "train-000001.safetensors"
    if damage == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(SystemExit, match=f"shard {shard} (does not exist|has 100 bytes), manifest .* records "
                                         r"\d+ bytes; rerun with --forcerun extract_hidden_states"):
        PackedRows(m, "train", 8)


def test_a_shard_of_other_settings_is_refused(tmp_path):
    m = random_manifest(tmp_path, [[4, 4]])
    m["settings"] = {"digest": "of-the-manifest"}  # the shards record none: made with other settings
    with pytest.raises(SystemExit, match="was made with other settings"):
        list(PackedRows(m, "train", 8).once())


def test_gpu_training_rows_are_bf16_and_train_as_the_fp32_rows_do(tmp_path, tiny_llama):
    """GPU training rows are bf16 (half the packing and the copy) in page-locked memory; under the
    step's bf16 autocast they give the loss the fp32 rows give (autocast casts the states to bf16
    at their first matmul anyway). CPU rows stay fp32."""
    from speculators.losses import resolve_loss_config

    from eaglepipe.draft_model import LOSS_IMPLEMENTATION, build_draft, training_row_options

    assert training_row_options(torch.device("cpu"), 1000) == {"dtype": torch.float32, "pin_memory": False,
                                                               "pad_to": None}
    assert training_row_options(torch.device("cuda"), 1000) == {"dtype": torch.bfloat16, "pin_memory": True,
                                                                "pad_to": 1024}
    run = make_run(tmp_path, tiny_llama)
    manifest = load_manifest(run["manifest"])
    fp32 = list(PackedRows(manifest, "train", 64, shuffle=False).once())
    bf16 = list(PackedRows(manifest, "train", 64, shuffle=False, dtype=torch.bfloat16).once())
    assert bf16[0]["hidden_states"].dtype == bf16[0]["verifier_last_hidden_states"].dtype == torch.bfloat16
    for r, p in zip(bf16, fp32, strict=True):
        assert torch.equal(r["hidden_states"], p["hidden_states"].bfloat16())
        assert all(torch.equal(r[k], p[k]) for k in ("input_ids", "loss_mask", "document_ids", "position_ids"))
    torch.manual_seed(0)
    model = build_draft(tiny_llama, [1, 3, 5], run["vocab"], ttt_steps=3)
    loss_config = resolve_loss_config("kl_div", LOSS_IMPLEMENTATION)
    keys = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")

    def loss(row):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return float(model(**{k: row[k] for k in keys}, ttt_steps=3, loss_config=loss_config)[1])

    for r, p in zip(bf16, fp32):
        assert loss(r) == pytest.approx(loss(p), rel=1e-3)  # measured: within 3e-4


@pytest.mark.parametrize("window", [2, None])
@pytest.mark.parametrize("loader", ROW_LOADERS)
def test_rows_packed_ahead_are_the_streams_rows_from_any_position(tmp_path, loader, window):
    m = random_manifest(tmp_path, [[4, 5, 3], [6, 2, 2], [7, 3]])
    m["splits"]["train"]["shards"][0]["categories"] = ["a", None, "b"]
    expected = list(zip(range(9), PackedRows(m, "train", batch_tokens=9, seed=1, shuffle_window=window,
                                             pad_to=12).stream(0, 2)))
    rows = PackedRows(m, "train", batch_tokens=9, seed=1, shuffle_window=window, pad_to=12)
    next(rows.stream())  # memory maps already open here must not travel to a worker process
    ahead = rows.prefetched(loader, 0, 2)
    got = [next(ahead) for _ in range(9)]
    ahead.close()
    assert [pos for _, (pos, _) in expected] == [pos for pos, _ in got]  # crosses an epoch: resume positions travel
    for (_, (_, want)), (_, row) in zip(expected, got):
        assert same_row(want, row)


def test_a_worker_process_is_refused_where_shared_memory_cannot_hold_its_rows(tmp_path, monkeypatch):
    m = random_manifest(tmp_path, [[4, 5, 3]], layers=4, hidden=576)
    rows = PackedRows(m, "train", batch_tokens=8192, dtype=torch.bfloat16, pad_to=8192)
    assert rows.row_bytes() == 8192 * (4 * 576 * 2 + 32)  # 38 MB: SmolLM2's rows on a GPU
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=64 << 20, used=0, free=64 << 20))
    check_row_loader("thread", rows.row_bytes())  # a thread needs no shared memory
    with pytest.raises(SystemExit, match=r"/dev/shm has 64 MiB free, the worker process needs 145 MiB for 4 rows .*--shm-size"):
        check_row_loader("process", rows.row_bytes())
    with pytest.raises(SystemExit, match="/dev/shm has 64 MiB free"):  # what training asks for
        rows.prefetched("process")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 30, used=0, free=1 << 30))
    check_row_loader("process", rows.row_bytes())
    with pytest.raises(ValueError, match="one of thread, process"):
        check_row_loader("auto", 1)
    with pytest.raises(ValueError, match="one of thread, process"):
        rows.prefetched("auto")
