"""Merging replica part manifests: the happy path against a single run, and every refusal."""

import json
import shutil

import pytest

import tiny
from eaglepipe import extract_hidden_states as ehs
from eaglepipe.gather_manifest import gather, main
from eaglepipe.shard_manifest import load_manifest, shard_paths


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama):
    """Two replicas and one single run over the same 5 train + 2 eval batches (batch size 2)."""
    d = tmp_path_factory.mktemp("gather")
    tiny.make_tokenized(d / "train.jsonl", 9, 400, seed=5, prefix="t")
    tiny.make_tokenized(d / "eval.jsonl", 3, 400, seed=6, prefix="e")
    for name, replicas in (("two", 2), ("one", 1)):
        for i in range(replicas):
            ehs.main(["--train", str(d / "train.jsonl"), "--eval", str(d / "eval.jsonl"),
                      "--model", str(tiny_llama), "--device", "cpu", "--batch-size", "2",
                      "--shard-dir", str(d / name / "shards"), "--replica", str(i), "--replicas", str(replicas),
                      "--out", str(d / name / "parts" / f"replica-{i}-of-{replicas}.json")])
    return d


def parts(d, name="two"):
    return sorted(str(p) for p in (d / name / "parts").glob("*.json"))


def copy_run(run, tmp_path):
    shutil.copytree(run / "two", tmp_path / "two")
    return tmp_path


def test_gather_equals_single_run(run, tmp_path):
    m = gather(parts(run), tmp_path / "hs" / "manifest.json")
    single = json.loads(open(parts(run, "one")[0]).read())
    for split in ("train", "eval"):
        assert [r["batch"] for r in m["splits"][split]["shards"]] == list(range(single["replica"]["batches"][split]))
        for key in ("samples", "tokens"):
            assert m["splits"][split][key] == single["splits"][split][key]
        assert [r["xxh3_128"] for r in m["splits"][split]["shards"]] == \
               [r["xxh3_128"] for r in single["splits"][split]["shards"]]
    assert m["splits"]["train"]["samples"] == 9 and m["replica"]["count"] == 2
    assert m["throughput"]["tokens"] == sum(json.loads(open(p).read())["throughput"]["tokens"] for p in parts(run))
    loaded = load_manifest(tmp_path / "hs" / "manifest.json")
    paths = shard_paths(loaded, "train")
    assert all(p.is_file() for p, _ in paths) and paths[0][0].name == "train-000000.safetensors"


def test_cli_reports_and_writes(run, tmp_path, capsys):
    main(["--out", str(tmp_path / "manifest.json"), *parts(run)])
    err = capsys.readouterr().err
    assert "train: 5 shards, 9 samples" in err and (tmp_path / "manifest.json").is_file()


def edit(path, fn):
    m = json.loads(open(path).read())
    fn(m)
    open(path, "w").write(json.dumps(m))


@pytest.mark.parametrize("case, message", [
    ("missing_replica", r"1 part manifests for 2 replicas; missing replicas \[1\]"),
    ("duplicate_replica", "replica 0 is also"),
    ("other_settings", "settings .* differs from .*; all replicas must run with the same settings"),
    ("other_layer_ids", "layer_ids .* differs"),
    ("overlap", "train batch 1 is also in"),
    ("missing_batch", r"train: batches \[1\] of 5 are in no part manifest"),
    ("missing_file", "shard .*train-000000.safetensors of train batch 0 does not exist"),
    ("wrong_size", "has .* bytes, the manifest records 1"),
    ("other_plan", "replica plan .* differs"),
])
def test_gather_refuses(run, tmp_path, case, message):
    d = copy_run(run, tmp_path)
    p0, p1 = parts(d)
    given = [p0, p1]
    if case == "missing_replica":
        given = [p0]
    elif case == "duplicate_replica":
        edit(p1, lambda m: m["replica"].update(index=0))
    elif case == "other_settings":
        edit(p1, lambda m: m["settings"].update(digest="0" * 16))
    elif case == "other_layer_ids":
        edit(p1, lambda m: m.update(layer_ids=[1, 6]))
    elif case == "overlap":
        edit(p0, lambda m: m["splits"]["train"]["shards"].append(json.loads(open(p1).read())["splits"]["train"]["shards"][0]))
    elif case == "missing_batch":
        edit(p1, lambda m: m["splits"]["train"]["shards"].pop(0))
    elif case == "missing_file":
        (d / "two" / "shards" / "train-000000.safetensors").unlink()
    elif case == "wrong_size":
        edit(p0, lambda m: m["splits"]["train"]["shards"][0].update(bytes=1))
    elif case == "other_plan":
        edit(p1, lambda m: m["replica"]["batches"].update(train=6))
    with pytest.raises(ValueError, match=message):
        gather(given, tmp_path / "manifest.json")
    with pytest.raises(SystemExit, match="gather_manifest: "):
        main(["--out", str(tmp_path / "manifest.json"), *given])
    assert not (tmp_path / "manifest.json").exists()
