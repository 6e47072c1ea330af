"""The hf backend against a hand computation, and the extraction CLI's checks and skips."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from eaglepipe import disk_budget, shard_manifest, shards
from eaglepipe import extract_hidden_states as ehs
from eaglepipe.extract_hf import HFExtractor
from eaglepipe.shard_pipeline import all_finite


def reference(model_dir, seq):
    """transformers hidden_states[0..N] plus the last layer's output, run by hand from hidden_states[N-1]."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([seq])
    with torch.no_grad():
        out = m(input_ids=ids, output_hidden_states=True)
        h = out.hidden_states[-2]
        pos = torch.arange(len(seq)).unsqueeze(0)
        last = m.model.layers[-1](h, position_embeddings=m.model.rotary_emb(h, pos), position_ids=pos,
                                  attention_mask=None)
        last = last[0] if isinstance(last, tuple) else last
    return [t[0] for t in out.hidden_states], last[0], m.model.norm


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_dsv3"])
def test_hf_ids_match_hand_computation(arch, request):
    model_dir = request.getfixturevalue(arch)
    N = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    ids = [1, 2, N]
    seqs = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 300, 12], list(range(20, 51))]
    ex = HFExtractor(str(model_dir), ids, N, torch.float32, max_batch_tokens=64)  # one padded forward
    got = ex.extract(seqs)
    for seq, hs in zip(seqs, got):
        ref, prenorm, norm = reference(model_dir, seq)
        assert hs.shape == (len(seq), len(ids), 64)
        for slot, k in enumerate(ids[:-1]):
            torch.testing.assert_close(hs[:, slot], ref[k], rtol=1e-4, atol=1e-5)
        final = hs[:, -1]
        torch.testing.assert_close(final, prenorm, rtol=1e-4, atol=1e-5)
        # id N is the state before the final norm; transformers' hidden_states[N] is after it
        torch.testing.assert_close(norm(final), ref[N], rtol=1e-4, atol=1e-5)
        assert (final - ref[N]).norm() / ref[N].norm() > 0.05
    # padding and grouping do not change the states (one forward per sample here)
    alone = HFExtractor(str(model_dir), ids, N, torch.float32, max_batch_tokens=1).extract(seqs)
    for a, b in zip(alone, got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def cli(tmp_path, model, *extra, n_train=6, n_eval=2, vocab=400):
    train = tmp_path / "train.jsonl"
    if not train.exists():
        tiny.make_tokenized(train, n_train, vocab, seed=1, prefix="t")
        tiny.make_tokenized(tmp_path / "eval.jsonl", n_eval, vocab, seed=2, prefix="e")
    argv = ["--train", str(train), "--eval", str(tmp_path / "eval.jsonl"), "--model", str(model),
            "--device", "cpu", "--batch-size", "4", "--shard-dir", str(tmp_path / "hs" / "shards"),
            "--out", str(tmp_path / "hs" / "parts" / "replica-0-of-1.json"), *extra]
    ehs.main(argv)
    return json.loads((tmp_path / "hs" / "parts" / "replica-0-of-1.json").read_text())


def test_cli_writes_shards_with_bf16_states_and_metadata(tmp_path, tiny_dsv3):
    m = cli(tmp_path, tiny_dsv3, "--layer-ids", "1,2,4")
    assert m["layer_ids"] == [1, 2, 4] and m["target"]["num_hidden_layers"] == 4
    assert m["splits"]["train"]["samples"] == 6 and len(m["splits"]["train"]["shards"]) == 2
    assert m["splits"]["eval"]["samples"] == 2 and m["skipped"] == []
    m["_path"] = str(tmp_path / "hs" / "parts" / "replica-0-of-1.json")
    (path, row), _ = shard_manifest.shard_paths(m, "train")
    assert shards.shard_is_valid(path, row)
    s = shards.read_shard(path)
    assert s.hidden_states.dtype == torch.bfloat16 and s.hidden_states.shape[1:] == (3, 64)
    assert s.metadata["layer_ids"] == [1, 2, 4] and s.metadata["sample_ids"] == ["t0", "t1", "t2", "t3"]
    assert s.metadata["settings_digest"] == m["settings"]["digest"]
    assert s.metadata["tokenizer_digest"] and s.metadata["layer_convention"].startswith("vllm")
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert s.sample(0)["input_ids"].tolist() == first["input_ids"]
    tp = m["throughput"]
    assert tp["tokens"] == m["splits"]["train"]["tokens"] + m["splits"]["eval"]["tokens"]
    # the time split: the hf forward runs in the backend's share, which cannot be zero
    assert tp["backend_s"] > 0 and tp["writers_wait_s"] >= 0 and tp["tail_s"] >= 0
    # the parts lie inside the run; each of the four figures is rounded to the ms (0.5 ms each)
    assert tp["backend_s"] + tp["writers_wait_s"] + tp["tail_s"] <= tp["seconds"] + 4 * 0.0005
    # the writers' own time: writing 4 shards takes time; summed over the writers it fits in the run
    assert tp["writers_write_s"] > 0 and tp["writers_load_s"] >= 0
    assert tp["writers_load_s"] + tp["writers_write_s"] <= tp["writers"] * tp["seconds"] + 3 * 0.0005


@pytest.mark.parametrize("ids, message", [
    ("3,2,6", "strictly ascending"),
    ("2,3,5", "last layer id must be the final layer 6"),
    ("2,3,7", "last layer id must be the final layer 6"),
    ("2,7,6", "strictly ascending"),
])
def test_bad_layer_ids_are_refused(tmp_path, tiny_llama, ids, message):
    with pytest.raises(SystemExit, match=f"--layer-ids {ids}: .*{message}"):
        cli(tmp_path, tiny_llama, "--layer-ids", ids)


def test_layer_ids_that_are_not_integers_are_refused(tmp_path, tiny_llama, capsys):
    with pytest.raises(SystemExit):
        cli(tmp_path, tiny_llama, "--layer-ids", "2,x,6")
    assert "argument --layer-ids: '2,x,6': expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the schema's bound of each id: the embeddings are not a layer
        cli(tmp_path, tiny_llama, "--layer-ids", "0,2,6")
    assert "argument --layer-ids: 0: must be >= 1" in capsys.readouterr().err


def test_non_finite_states_are_skipped_counted_and_listed(tmp_path, tiny_llama, monkeypatch, capsys):
    real = HFExtractor.extract

    def poisoned(self, seqs):
        out = real(self, seqs)
        for s, h in zip(seqs, out):
            if len(s) == poison_len:
                h[len(s) // 2, 0, 3] = float("nan")
        return out

    tiny.make_tokenized(tmp_path / "train.jsonl", 6, 400, seed=1, prefix="t")
    tiny.make_tokenized(tmp_path / "eval.jsonl", 2, 400, seed=2, prefix="e")
    recs = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    poison_len = len(recs[1]["input_ids"])
    assert sum(len(r["input_ids"]) == poison_len for r in recs) == 1
    monkeypatch.setattr(HFExtractor, "extract", poisoned)
    m = cli(tmp_path, tiny_llama)
    assert [(s["id"], s["split"], s["index"]) for s in m["skipped"]] == [("t1", "train", 1)]
    assert m["splits"]["train"]["samples"] == 5
    assert "skipped 1 samples with non-finite hidden states: train/t1" in capsys.readouterr().err
    m["_path"] = str(tmp_path / "hs" / "parts" / "replica-0-of-1.json")
    s = shards.read_shard(shard_manifest.shard_paths(m, "train")[0][0])
    assert s.sample_index.tolist() == [0, 2, 3] and s.metadata["skipped"][0]["id"] == "t1"
    # the skip is part of the shard: a rerun reuses it and still reports the skip
    monkeypatch.setattr(HFExtractor, "extract", real)
    again = cli(tmp_path, tiny_llama)
    assert again["skipped"] == m["skipped"] and "reused 3 shards, wrote 0" in capsys.readouterr().err


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_token_count_mismatch_names_the_sample(tmp_path, tiny_llama, monkeypatch, pool):
    real = HFExtractor.extract
    monkeypatch.setattr(HFExtractor, "extract", lambda self, seqs: [h[:-1] for h in real(self, seqs)])
    # raised in a writer process, the error reaches the caller with its message
    with pytest.raises(SystemExit, match=r"sample 't0' \(train record 0\): hidden states of shape \("):
        cli(tmp_path, tiny_llama, "--writer-pool", pool)


def test_writer_processes_write_the_same_shards_as_threads(tmp_path, tiny_llama):
    def shard_bytes():
        return {p.name: p.read_bytes() for p in sorted((tmp_path / "hs" / "shards").glob("*.safetensors"))}

    m = cli(tmp_path, tiny_llama, "--writer-pool", "threads", "--storage-dtype", "fp8")
    by_threads = shard_bytes()
    shutil.rmtree(tmp_path / "hs")
    again = cli(tmp_path, tiny_llama, "--writer-pool", "processes", "--storage-dtype", "fp8")
    assert (m["throughput"]["writer_pool"], again["throughput"]["writer_pool"]) == ("threads", "processes")
    assert len(by_threads) == 3 and shard_bytes() == by_threads
    assert again["splits"] == m["splits"]


def test_bad_input_records_name_file_and_line(tmp_path, tiny_llama):
    tiny.make_tokenized(tmp_path / "eval.jsonl", 2, 400)
    train = tmp_path / "train.jsonl"
    good = json.dumps({"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]})
    cases = [
        ('{"id": "b", "input_ids": [1, 2]}', "line 2: missing field 'loss_mask'"),
        ('{"id": "b", "input_ids": [1, 2], "loss_mask": [1]}', "line 2: field 'loss_mask' must be .* got 1"),
        ('{"id": "b", "input_ids": [], "loss_mask": []}', "line 2: field 'input_ids' must be a non-empty"),
        ('{"id": "a", "input_ids": [3], "loss_mask": [1]}', "line 2: id 'a' repeats line 1"),
        ('{"id": "b", "input_ids": [400], "loss_mask": [1]}', "sample 'b' has token id 400, .* has 400"),
        ("not json", "line 2: not valid JSON"),
    ]
    for bad, message in cases:
        train.write_text(good + "\n" + bad + "\n")
        with pytest.raises(SystemExit, match=f"{train}.*{message}"):
            cli(tmp_path, tiny_llama)


def test_refuses_to_start_without_disk_space(tmp_path, tiny_llama, monkeypatch):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 100 << 20))
    with pytest.raises(SystemExit, match="not enough disk space in .*100.0 MiB is free"):
        cli(tmp_path, tiny_llama)
    assert not list((tmp_path / "hs" / "shards").glob("*.safetensors"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_all_finite_is_exact(bad):
    x = torch.randn(64, 4, 32).to(torch.bfloat16)
    if bad is None:  # +inf and -inf together: the sum is nan
        x[3, 1, 2], x[9, 0, 0] = float("inf"), float("-inf")
    else:
        x[5, 2, 7] = bad
    assert not all_finite(x)
    assert all_finite(torch.randn(64, 4, 32).to(torch.bfloat16))


def test_all_finite_survives_a_sum_that_overflows():
    x = torch.full((8, 2), 3e38, dtype=torch.bfloat16)  # every element finite, their sum is not
    assert not torch.isfinite(x.sum()) and all_finite(x)


def test_vllm_staging_on_another_filesystem_is_checked_on_its_own(tmp_path, tiny_llama, monkeypatch):
    from collections import namedtuple

    ram = tmp_path / "ram"
    ram.mkdir()
    usage = namedtuple("usage", "total used free")
    free = {ram: 1 << 30}  # the shard disk has room, the RAM disk lacks it for the staged files
    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free.get(p, 1 << 40)))
    monkeypatch.setattr(disk_budget, "same_filesystem", lambda a, b: False)
    with pytest.raises(SystemExit, match=f"not enough disk space in {ram}: vLLM's staged files"):
        cli(tmp_path, tiny_llama, "--backend", "vllm", "--staging-dir", str(ram))
    with pytest.raises(SystemExit):
        ehs.parse_args(["--train", "t", "--eval", "e", "--model", "m", "--shard-dir", "s", "--out", "o",
                        "--staging-dir", str(tmp_path / "absent")])


def test_vllm_staging_auto_takes_the_ram_disk_only_with_room(tmp_path, monkeypatch):
    from collections import namedtuple

    ram, shards_dir = tmp_path / "ram", tmp_path / "shards"
    ram.mkdir()
    monkeypatch.setattr(disk_budget, "RAM_DISK", ram)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(disk_budget.shutil, "disk_usage", lambda p: usage(8 << 30, 0, 4 << 30))

    sub = disk_budget.staging_dir("auto", 1, shards_dir, 1 << 30)
    assert sub.parent == ram and sub.name.endswith("-replica1")  # a subdirectory, never the RAM disk itself
    assert disk_budget.staging_dir("auto", 1, shards_dir, 4 << 30) == shards_dir / ".staging-replica1"
    assert disk_budget.staging_dir("shards", 1, shards_dir, 1) == shards_dir / ".staging-replica1"
    mine = disk_budget.staging_dir(str(ram), 1, shards_dir, 1)
    assert mine.parent == ram and mine != ram


@pytest.mark.parametrize("extra, message", [
    (("--batch-size", "0"), "argument --batch-size: 0: must be >= 1"),  # the schema's bound
    (("--replica", "2", "--replicas", "2"), "need 0 <= replica < replicas"),
    (("--connector-threads", "0"), "--connector-threads 0: must be >= 1"),
    (("--writer-pool", "fibers"), "invalid choice: 'fibers'"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, tiny_llama, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        cli(tmp_path, tiny_llama, *extra)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "hs").exists()
